"""A target sharded across 2 local processes (ring backend over loopback): speculative decoding stays
lossless, every rank commits the same tokens, the collectives are the model's plus one per cycle.

Each launch runs several generations in one pair of processes (tests/dist_driver.py) and the tests read
what each rank wrote. Pipeline family: deepseek_v3 (MLX folder); tensor family: llama.
"""

import json
from pathlib import Path

import pytest

from dist_util import launch, save_noisy_copy
from model_dirs import save_tiny

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 10, 11, 12]


def run_spec(folder: Path, spec: dict, timeout: float = 150, **kw):
    """Launch dist_driver.py on 2 ranks. -> (per-rank process results, per-rank JSON results)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec))
    ranks = launch(["tests/dist_driver.py", str(folder / "spec.json"), str(folder)], 2, timeout=timeout, **kw)
    out = []
    for r in range(2):
        f = folder / f"rank{r}.json"
        out.append(json.loads(f.read_text()) if f.exists() else None)
    return ranks, out


def check_ok(ranks):
    for r, rank in enumerate(ranks):
        assert rank.returncode == 0, f"rank {r} exited {rank.returncode}: {rank.stderr[-3000:]}"


SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}, "s": {"type": "string", "maxLength": 8},
                                         "n": {"type": "integer", "maximum": 999}},
          "required": ["c", "s", "n"], "additionalProperties": False}
GRAMMAR_TOKENS = 64


def runs(prompt=PROMPT, extra=()):
    grammar = {"prompt": prompt, "max_tokens": GRAMMAR_TOKENS, "one_process": True}
    base = [
        {"name": "plain", "drafter": "none", "num_draft": 0, "prompt": prompt, "max_tokens": 24, "one_process": True},
        {"name": "draft", "drafter": "draft", "num_draft": 3, "prompt": prompt, "max_tokens": 24, "one_process": True},
        {"name": "draft_auto", "drafter": "draft", "num_draft": "auto", "prompt": prompt, "max_tokens": 40},
        {"name": "ngram", "drafter": "ngram", "num_draft": 4, "prompt": prompt, "max_tokens": 24},
        # suffix trees: drafted as trees on one machine, verified here as the best chain (trees.off says why)
        {"name": "suffix", "drafter": "suffix", "num_draft": 4, "prompt": prompt, "max_tokens": 24},
        {"name": "sampled", "drafter": "draft", "num_draft": 3, "temp": 0.8, "seed": 7, "prompt": [5, 6, 7, 8, 9],
         "max_tokens": 24, "one_process": True},
        {"name": "sampled_again", "drafter": "draft", "num_draft": 2, "temp": 0.8, "seed": 7,
         "prompt": [5, 6, 7, 8, 9], "max_tokens": 24},
        {"name": "penalty", "drafter": "draft", "num_draft": 2, "repetition_penalty": 1.3, "prompt": prompt,
         "max_tokens": 16, "one_process": True},
        # rank 0 stops reading mid-generation (a server's client leaving): the ranks must still agree after
        {"name": "closed_cycle", "drafter": "draft", "num_draft": 3, "prompt": prompt, "max_tokens": 30,
         "close_after": 3},
        {"name": "closed_plain", "drafter": "none", "num_draft": 0, "prompt": prompt, "max_tokens": 30,
         "close_after": 4},
        {"name": "closed_first", "drafter": "draft", "num_draft": 3, "prompt": prompt, "max_tokens": 30,
         "close_after": 1},
        {"name": "after_close", "drafter": "draft", "num_draft": 3, "prompt": prompt + [3, 4], "max_tokens": 16,
         "one_process": True},
        # structured output: rank 0's grammar masks, cuts and drafts; the other ranks take its choices
        {"name": "grammar_plain", "drafter": "none", "num_draft": 0, "schema": SCHEMA, **grammar},
        {"name": "grammar_draft", "drafter": "draft", "num_draft": 3, "schema": SCHEMA, **grammar},
        {"name": "grammar_sampled", "drafter": "draft", "num_draft": 3, "schema": SCHEMA, "temp": 0.8, "seed": 5,
         **grammar},
    ]
    return base + list(extra)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_pipeline")
    model = save_tiny(root / "ds3", "deepseek_v3", seed=1, num_hidden_layers=4)
    draft = save_noisy_copy(model, root / "ds3-draft", scale=0.05)
    spec = {"model": str(model), "mode": "pipeline", "draft_model": str(draft), "timeout": 30, "runs": runs()}
    ranks, out = run_spec(root / "out", spec)
    check_ok(ranks)
    return out


@pytest.fixture(scope="module")
def tensor_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_tensor")
    model = save_tiny(root / "llama", "llama", seed=1)
    draft = save_noisy_copy(model, root / "llama-draft", scale=0.05)
    spec = {"model": str(model), "mode": "tensor", "draft_model": str(draft), "timeout": 30, "runs": runs()}
    ranks, out = run_spec(root / "out", spec)
    check_ok(ranks)
    return out


@pytest.fixture(params=["pipeline", "tensor"])
def result(request):
    return request.getfixturevalue(f"{request.param}_run"), request.param


def test_every_rank_commits_the_same_tokens(result):
    (r0, r1), _ = result
    assert r0["size"] == r1["size"] == 2
    for name, entry in r0["runs"].items():
        if not name.startswith("closed"):  # (those: test_a_generation_closed_early_leaves_the_ranks_in_step)
            assert entry["tokens"] == r1["runs"][name]["tokens"], name
            assert len(entry["tokens"]) > 1, name


def test_greedy_speculative_equals_plain_decoding_of_the_same_sharding(result):
    (r0, _), _ = result
    runs_ = r0["runs"]
    plain = runs_["plain"]["tokens"]
    for name in ("draft", "ngram", "suffix"):
        assert runs_[name]["tokens"] == plain, name
    assert runs_["draft_auto"]["tokens"][: len(plain)] == plain
    assert runs_["draft"]["drafted"] > 0 and runs_["ngram"]["drafted"] > 0


def test_a_grammar_holds_on_every_rank(result):
    """Under a JSON schema, rank 0's matcher decides: greedy with a draft model (its drafts cut and the grammar's
    forced runs drafted) equals plain constrained decoding; every run's text is a prefix of JSON the schema
    allows, whole where the model ended it."""
    import jsonschema

    (r0, _), _ = result
    runs_ = r0["runs"]
    assert runs_["grammar_draft"]["tokens"] == runs_["grammar_plain"]["tokens"]
    assert runs_["grammar_draft"]["forced"] > 0 and runs_["grammar_draft"]["drafted"] > 0  # both drafters ran
    for name in ("grammar_plain", "grammar_draft", "grammar_sampled"):
        text = runs_[name]["text"]
        assert text.startswith('{"c": "'), (name, text)
        if len(runs_[name]["tokens"]) < GRAMMAR_TOKENS:  # ended by the model: the grammar let it end only when complete
            jsonschema.validate(json.loads(text), SCHEMA)


def test_rollback_after_partial_accepts(result):
    """The noisy draft is right often but not always: every rank rolled back to the same prefix."""
    (r0, _), _ = result
    d = r0["runs"]["draft"]
    assert 0 < d["accepted"] < d["drafted"]


@pytest.mark.cpu_exact
def test_pipeline_equals_one_process_bit_for_bit(pipeline_run):
    """A pipeline changes no arithmetic (each layer on one rank, the hidden state passed whole): the logits
    are bit-equal and every generation equals the model in one process, sampled ones included."""
    r0, _ = pipeline_run
    assert r0["logits"]["max_abs_diff"] == 0.0
    for name, entry in r0["runs"].items():
        if "one_process" in entry:
            assert entry["tokens"] == entry["one_process"], name


def test_tensor_sharding_differs_from_one_process_only_at_a_float_tie(tensor_run):
    """all_sum reorders the sums of each sharded matmul: logits move by float error, and a greedy token may
    differ only where the one-process top-2 gap is a tie."""
    r0, _ = tensor_run
    assert r0["logits"]["max_abs_diff"] < 1e-4
    for name, entry in r0["runs"].items():
        if "one_process" in entry and entry["tokens"] != entry["one_process"]:
            assert name != "sampled" or entry["gap"] is not None
            assert entry["gap"]["gap"] < 1e-4, (name, entry["gap"])


def test_temperature_draws_the_same_numbers_on_every_rank(result):
    """Same seed, same sampled output: across the ranks, across two runs with another k (the target's keys do
    not depend on the draft), and (pipeline) equal to one process."""
    (r0, r1), mode = result
    a, b = r0["runs"]["sampled"], r0["runs"]["sampled_again"]
    assert a["tokens"] == r1["runs"]["sampled"]["tokens"]
    for name in ("sampled", "sampled_again", "draft"):  # every rank's key sequence went as far as rank 0's
        assert r0["runs"][name]["target_key"] == r1["runs"][name]["target_key"], name
    assert a["drafted"] > 0 and a["tokens"] != r0["runs"]["plain"]["tokens"][: len(a["tokens"])]
    if mode == "pipeline":
        assert a["tokens"] == a["one_process"]


def test_one_host_read_per_cycle_on_rank_0(result):
    """Rank 0 reads the device once per cycle (a verify cycle or a plain token) and once for the first
    token; the control packets it sends are never read back. Under a grammar a cycle whose draft was made on
    the device also reads the draft, to cut it before it is sent (as on one machine): two at most."""
    (r0, _), _ = result
    for name, entry in r0["runs"].items():
        if "close_after" in name or name.startswith("closed"):
            continue
        if name.startswith("grammar"):
            assert entry["cycles"] + 1 <= entry["reads"] <= 2 * entry["cycles"] + 1, name
        else:
            assert entry["reads"] == entry["cycles"] + 1, name


def test_collectives_are_the_models_plus_one_per_cycle(result):
    (r0, r1), _ = result
    plain, draft = r0["runs"]["plain"], r0["runs"]["draft"]
    for entry in (plain, draft):
        c = entry["collectives"]
        engine_own = sum(v for k, v in c.items() if k != "model")
        # one packet per cycle (decision or plain token), + the first token, + at most two announcements
        assert engine_own <= entry["cycles"] + 3, c
        assert c["first"] == 1
    # passes: two for the prompt (its body, then its last token), then one per cycle (verify or plain step)
    per_pass, rest = divmod(plain["collectives"]["model"], plain["cycles"] + 2)
    assert rest == 0 and per_pass > 0
    assert draft["collectives"]["model"] == per_pass * (draft["cycles"] + 2)
    assert draft["cycles"] < plain["cycles"]  # fewer passes (and collectives) for as many tokens
    assert r1["runs"]["draft"]["collectives"]["decision"] == draft["collectives"]["decision"]


def test_a_generation_closed_early_leaves_the_ranks_in_step(result):
    (r0, r1), _ = result
    for name, steps in (("closed_cycle", 3), ("closed_plain", 4), ("closed_first", 1)):
        assert r0["runs"][name]["steps"] == steps
        assert r1["runs"][name]["tokens"][: len(r0["runs"][name]["tokens"])] == r0["runs"][name]["tokens"]
    after = r0["runs"]["after_close"]
    assert after["tokens"] == r1["runs"]["after_close"]["tokens"]
    if result[1] == "pipeline":
        assert after["tokens"] == after["one_process"]
