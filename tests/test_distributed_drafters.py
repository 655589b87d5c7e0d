"""Every drafter across 2 processes, or its refusal: MTP heads (the head on rank 0, the pipeline's last
stage) on a hybrid qwen3_5 (GatedDeltaNet layers roll back per rank), a draft model with partial accepts
there, EAGLE-3 and DFlash features on a tensor-sharded llama (every rank holds every layer's output);
drafters a sharding cannot serve are refused with the reason."""

import json

import pytest

import tiny_models
from dflash_util import write_dflash
from dist_util import save_noisy_copy
from eagle3_writer import write_eagle3
from hf_writer import write_checkpoint
from model_dirs import save_tiny
from test_distributed import PROMPT, check_ok, run_spec


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_qwen35")
    model = write_checkpoint(root / "q35", "qwen3_5", seed=3, shards=2)  # HF layout, MTP head, weight index
    draft = save_noisy_copy(model, root / "q35-draft", scale=0.05)
    common = {"prompt": PROMPT, "max_tokens": 24, "one_process": True}
    spec = {"model": str(model), "mode": "pipeline", "draft_model": str(draft), "timeout": 30, "runs": [
        {"name": "plain", "drafter": "none", "num_draft": 0, **common},
        {"name": "mtp", "drafter": "mtp", "num_draft": 2, **common},
        {"name": "draft", "drafter": "draft", "num_draft": 3, **common},
        {"name": "ngram+mtp", "drafter": "ngram+mtp", "num_draft": "auto", **common},
        {"name": "mtp_sampled", "drafter": "mtp", "num_draft": 2, "temp": 0.9, "seed": 3, "prompt": [5, 6, 7, 8, 9],
         "max_tokens": 20, "one_process": True},
    ]}
    ranks, out = run_spec(root / "out", spec)
    check_ok(ranks)
    return out


@pytest.fixture(scope="module")
def hybrid_tensor_run(tmp_path_factory):
    """qwen3_5 under tensor sharding: its GatedDeltaNet layers, sharded, keep no per-token states, so a
    rejected draft rolls them back to a snapshot and the kept tokens are replayed in a pass of their own."""
    root = tmp_path_factory.mktemp("dist_qwen35_tensor")
    model = write_checkpoint(root / "q35", "qwen3_5", seed=3)
    draft = save_noisy_copy(model, root / "q35-draft", scale=0.05)
    common = {"prompt": PROMPT, "max_tokens": 24, "one_process": True}
    spec = {"model": str(model), "mode": "tensor", "draft_model": str(draft), "timeout": 30, "runs": [
        {"name": "plain", "drafter": "none", "num_draft": 0, **common},
        {"name": "draft", "drafter": "draft", "num_draft": 3, **common},
    ]}
    ranks, out = run_spec(root / "out", spec)
    check_ok(ranks)
    return out


@pytest.fixture(scope="module")
def features_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_features")
    model = save_tiny(root / "llama6", "llama", seed=0, num_hidden_layers=6)
    cfg = json.loads((model / "config.json").read_text())
    write_eagle3(root / "eagle3", cfg, seed=6, draft_vocab=100)
    write_dflash(root / "dflash", cfg["hidden_size"], cfg["vocab_size"], layer_ids=(1, 4),
                 mask_token_id=cfg["vocab_size"] - 1)
    common = {"prompt": PROMPT, "max_tokens": 20, "one_process": True}
    spec = {"model": str(model), "mode": "tensor", "eagle3": str(root / "eagle3"), "dflash": str(root / "dflash"),
            "timeout": 30, "runs": [
                {"name": "plain", "drafter": "none", "num_draft": 0, **common},
                {"name": "eagle3", "drafter": "eagle3", "num_draft": 3, **common},
                {"name": "ngram+eagle3", "drafter": "ngram+eagle3", "num_draft": "auto", **common},
                {"name": "dflash", "drafter": "dflash", "num_draft": 3, **common},
            ]}
    ranks, out = run_spec(root / "out", spec)
    check_ok(ranks)
    return out


@pytest.mark.cpu_exact
def test_mtp_and_a_draft_model_on_a_hybrid_pipeline_equal_one_process(hybrid_run):
    r0, r1 = hybrid_run
    assert r0["logits"]["max_abs_diff"] == 0.0
    plain = r0["runs"]["plain"]["tokens"]
    for name, entry in r0["runs"].items():
        assert entry["tokens"] == r1["runs"][name]["tokens"], name
        assert entry["tokens"] == entry["one_process"], name
        if name != "mtp_sampled":
            assert entry["tokens"] == plain, name
    assert r0["runs"]["mtp"]["drafted"] > 0
    draft = r0["runs"]["draft"]
    assert 0 < draft["accepted"] < draft["drafted"]  # recurrent states rolled back per rank after partial accepts
    assert r0["runs"]["mtp_sampled"]["accepted"] > 0


def test_replayed_rollbacks_under_tensor_sharding(hybrid_tensor_run):
    """The control packet goes ahead of each replay pass (its drafts in a second packet): every rank replays
    the same kept tokens, and the output is plain decoding's."""
    r0, r1 = hybrid_tensor_run
    plain, draft = r0["runs"]["plain"], r0["runs"]["draft"]
    assert draft["tokens"] == plain["tokens"] == r1["runs"]["draft"]["tokens"]
    assert 0 < draft["accepted"] < draft["drafted"]
    assert draft["collectives"]["decision"] > draft["cycles"] + 1  # the replay cycles' second packets
    for entry in (plain, draft):
        if entry["tokens"] != entry["one_process"]:
            assert entry["gap"]["gap"] < 1e-4, entry["gap"]


def test_feature_drafters_on_a_tensor_sharded_target(features_run):
    r0, r1 = features_run
    plain = r0["runs"]["plain"]["tokens"]
    for name, entry in r0["runs"].items():
        assert entry["tokens"] == r1["runs"][name]["tokens"], name
        assert entry["tokens"] == plain, name  # greedy speculative == plain decoding of the same sharding
        if entry["tokens"] != entry["one_process"]:
            assert entry["gap"]["gap"] < 1e-4, (name, entry["gap"])  # only a float tie may differ
        if name != "plain":
            assert entry["drafted"] > 0, name


class FakeGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class FakeDrafter:
    name = "eagle3"
    needs_hidden = True

    def __init__(self, layers=(), reads_cache=False):
        from mlx_engine.target_model.hidden import HiddenRequest

        self.hidden_request = HiddenRequest(layers=tuple(layers), final=False)
        self.reads_target_cache = reads_cache


def test_drafters_a_sharding_cannot_serve_are_refused_with_the_reason():
    from mlx_engine.distributed import drafter_refusal

    model, _ = tiny_models.build("deepseek_v3", seed=0, num_hidden_layers=4)
    model.model.pipeline(FakeGroup(0, 2))  # rank 0 of a 2-stage pipeline: layers 2-3
    why = drafter_refusal(FakeDrafter(layers=(0, 2, 3)), model)
    assert "layer 0" in why and "rank 0 holds layers 2-3" in why and "--distributed tensor" in why
    assert drafter_refusal(FakeDrafter(layers=(2, -1)), model) is None  # the last stage's own layers
    assert drafter_refusal(None, model) is None
    tensor, _ = tiny_models.build("llama", seed=0)
    assert drafter_refusal(FakeDrafter(layers=(0, 1)), tensor) is None  # every rank holds every layer
    why = drafter_refusal(FakeDrafter(reads_cache=True), tensor)
    assert "KV cache" in why and "splits" in why


def test_a_rollback_that_replays_on_some_stages_only_is_refused():
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mlx_engine.distributed.rollback import may_replay

    assert not may_replay([KVCache(), KVCache()], 0)
    assert not may_replay([ArraysCache(2), KVCache()], 2)  # GatedDeltaNet with per-token states: by index
    assert may_replay([ArraysCache(2), KVCache()], 0)
    assert may_replay([KVCache(), RotatingKVCache(max_size=8)], 0)


def test_tensor_split_that_does_not_divide_the_heads_is_refused():
    from mlx_engine.distributed import DistributedError
    from mlx_engine.distributed.loading import _check_tensor_split

    _check_tensor_split({"num_attention_heads": 4, "num_key_value_heads": 2}, 2)
    with pytest.raises(DistributedError, match="num_attention_heads \\(9\\) is not divisible by the 2"):
        _check_tensor_split({"num_attention_heads": 9, "num_key_value_heads": 3}, 2)
