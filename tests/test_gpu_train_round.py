"""scripts/gpu/train_round.py: the corpus that comes back from a GPU round is the corpus that was made.

(The round itself needs a lent GPU; its shell script was dry-run here on the CPU at a tiny scale.)"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def round_files():
    spec = importlib.util.spec_from_file_location("train_round", ROOT / "scripts" / "gpu" / "train_round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(path: Path) -> list[tuple[list[int], list[int]]]:
    return [(r["prompt_ids"], r["response_ids"]) for r in map(json.loads, path.read_text().splitlines())]


def test_pack_then_unpack_gives_every_pass_back_token_for_token(round_files, tmp_path):
    passes = [[([1, 2, 3], [9, 65535, 0]), ([4], [])], [([7, 7], [49151] * 5)], []]
    files = []
    for i, p in enumerate(passes):
        f = tmp_path / f"corpus_{i}.jsonl"
        f.write_text("".join(json.dumps({"prompt_ids": a, "response_ids": b, "response": "text"}) + "\n"
                             for a, b in p))
        files.append(f)
    assert round_files.pack(files, tmp_path / "c.npz") == (3, 8)
    back = round_files.unpack(tmp_path / "c.npz", tmp_path / "back")
    assert [rows(f) for f in back] == passes


def test_an_id_beyond_uint16_is_refused_not_wrapped(round_files, tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1], "response_ids": [65536]}) + "\n")
    with pytest.raises(SystemExit, match="outside uint16"):
        round_files.pack([f], tmp_path / "c.npz")
    assert not (tmp_path / "c.npz").exists()


def test_the_merged_prompts_hold_every_training_prompt_once_and_no_held_out_one(round_files, tmp_path):
    n = round_files.merge_prompts(tmp_path / "p.jsonl")
    merged = [json.loads(line)["prompt"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(merged) == n == len(set(merged))
    data = ROOT / "mlx_engine" / "train" / "data"
    train = {json.loads(line)["prompt"] for name in round_files.PROMPT_FILES
             for line in (data / name).read_text().splitlines() if line.strip()}
    held_out = {json.loads(line)["prompt"] for line in (data / "prompts_eval.jsonl").read_text().splitlines()
                if line.strip()}
    assert set(merged) == train and not set(merged) & held_out
