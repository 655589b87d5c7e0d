"""The structured-output suites (bench/prompts/json.jsonl, tools.jsonl): well-formed rows, numbered in order,
every schema valid JSON Schema (draft 2020-12) that llguidance compiles, tools in OpenAI's function format with
object parameters, and a tool_choice that names an offered tool."""

import json
import re
from pathlib import Path

import pytest

PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema and function names


def rows(suite):
    return [json.loads(line) for line in (PROMPTS / f"{suite}.jsonl").read_text().splitlines() if line.strip()]


def schemas(suite):
    """(id, schema) for every schema in a suite: json_schema response formats, tool parameters."""
    for r in rows(suite):
        fmt = r.get("response_format", {})
        if fmt.get("type") == "json_schema":
            yield r["id"], fmt["json_schema"]["schema"]
        for tool in r.get("tools", []):
            yield f"{r['id']} {tool['function']['name']}", tool["function"]["parameters"]


@pytest.mark.parametrize("suite", ["json", "tools"])
def test_ids_are_unique_and_sequential_and_messages_end_with_the_user(suite):
    rs = rows(suite)
    assert len(rs) >= 20
    assert [r["id"] for r in rs] == [f"{suite}-{i:03d}" for i in range(1, len(rs) + 1)]
    for r in rs:
        roles = [m["role"] for m in r["messages"]]
        assert roles[-1] == "user" and set(roles) <= {"system", "user"}, r["id"]
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in r["messages"]), r["id"]


def test_json_rows_ask_for_a_schema_or_a_json_object():
    kinds = []
    for r in rows("json"):
        fmt = r["response_format"]
        kinds.append(fmt["type"])
        if fmt["type"] == "json_schema":
            js = fmt["json_schema"]
            assert NAME.match(js["name"]) and js["strict"] is True, r["id"]
            assert js["schema"]["type"] == "object" and js["schema"]["additionalProperties"] is False, r["id"]
        else:
            assert fmt == {"type": "json_object"}, r["id"]
            assert "json" in r["messages"][-1]["content"].lower(), r["id"]  # json_object asks in words
    assert set(kinds) == {"json_schema", "json_object"}


def test_tools_are_functions_with_object_parameters_and_tool_choice_names_an_offered_one():
    choices = set()
    for r in rows("tools"):
        assert 1 <= len(r["tools"]) <= 4, r["id"]
        names = [t["function"]["name"] for t in r["tools"]]
        assert len(set(names)) == len(names) and all(NAME.match(n) for n in names), r["id"]
        for t in r["tools"]:
            assert t["type"] == "function" and t["function"]["description"], r["id"]
            assert t["function"]["parameters"]["type"] == "object", r["id"]
        choice = r["tool_choice"]
        if isinstance(choice, dict):
            assert choice["type"] == "function" and choice["function"]["name"] in names, r["id"]
            choices.add("named")
        else:
            assert choice in ("required", "auto"), r["id"]
            choices.add(choice)
        assert "Apache-2.0" in r["source"], r["id"]
    assert choices == {"required", "auto", "named"}


@pytest.mark.parametrize("suite", ["json", "tools"])
def test_every_schema_is_valid_json_schema(suite):
    jsonschema = pytest.importorskip("jsonschema")
    for where, schema in schemas(suite):
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            pytest.fail(f"{where}: {e.message}")


@pytest.mark.parametrize("suite", ["json", "tools"])
def test_every_schema_compiles_with_llguidance(suite):
    llguidance = pytest.importorskip("llguidance")
    for where, schema in schemas(suite):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        assert llguidance.LLMatcher.validate_grammar(grammar) == "", where
