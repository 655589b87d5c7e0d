"""The schema-extraction prompts written for training a drafter on JSON answers (train/make_prompts_json.py)."""

import json

import jsonschema
import pytest

from mlx_engine.train import make_prompts_json


def _walk(schema):
    yield schema
    for sub in (schema.get("properties") or {}).values():
        yield from _walk(sub)
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"])


def _write(out):
    """make_prompts_json.main() writing into `out` instead of the package data."""
    old = make_prompts_json.DATA
    make_prompts_json.DATA = out
    try:
        make_prompts_json.main()
    finally:
        make_prompts_json.DATA = old


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("json_prompts")
    _write(out)
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    return read("prompts_json_train.jsonl"), read("prompts_json_eval.jsonl")


def test_rows_have_the_bench_form_and_valid_bounded_schemas(written):
    train, held = written
    assert len(train) == 420 and len(held) == 12
    for r in train + held:
        assert [m["role"] for m in r["messages"]] == ["system", "user"]
        fmt = r["response_format"]
        if fmt["type"] == "json_object":
            continue
        schema = fmt["json_schema"]["schema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        # bounded like real schemas: an unbounded string or array lets a small model loop to --max-tokens
        for node in _walk(schema):
            types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
            if "string" in types and "enum" not in node and "format" not in node:  # a format (date) is bounded
                assert "maxLength" in node, node
            if "array" in types:
                assert "maxItems" in node, node


def test_held_out_rows_share_no_genre_with_training_and_the_file_is_seeded(written, tmp_path):
    train, held = written
    genre = lambda r: r["response_format"].get("json_schema", {}).get("name", "json_object")  # noqa: E731
    assert not {genre(r) for r in held} & {genre(r) for r in train}
    assert len({genre(r) for r in train}) == len(make_prompts_json.TRAIN_GENRES)
    _write(tmp_path)
    assert (tmp_path / "prompts_json_train.jsonl").read_text().splitlines() == [json.dumps(r) for r in train]
