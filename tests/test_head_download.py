"""The head without the whole model, through a local server posing as the hub (tests/fake_hub.py,
HF_ENDPOINT): `--mtp-weights hub:REPO` (or `hub`: the target's base_model) reads the repository's index and
downloads only the shards that hold the head, counted request by request; the head is extracted into the
cache once and later runs never touch the network; it drafts for a quantized MLX conversion from another
repository with output equal to plain decoding. EAGLE-3 / DFlash / assistant repositories come whole.
"""

import json
import shutil

import pytest

import dflash_util
import gemma4_util
import tiny_models
from eagle3_writer import write_eagle3
from fake_hub import FakeHub
from mlx_engine.__main__ import main
from mlx_engine.convert import convert
from mlx_engine.drafters.registry import DrafterError, DrafterOptions, make_drafter
from real_fixtures import write_real
from test_mtp_helpers import PROMPT
from test_real_drafter_layouts import loaded

ARGS = ["--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", "24", "--ignore-eos", "--json"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("MLX_ENGINE_CACHE", str(tmp_path / "engine-cache"))
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def conversion(tmp_path, original, base: str | None) -> str:
    """An mlx-community style 4-bit conversion: quantized, the head stripped, README naming its base."""
    out = convert(original, tmp_path / "conv", quantize=True, q_bits=4, q_group_size=32)
    for f in ("mtp.safetensors", "mtp.json"):
        (out / f).unlink(missing_ok=True)
    card = f"---\nbase_model: {base}\nlibrary_name: mlx\ntags:\n- mlx\n---\n" if base else "---\ntags:\n- mlx\n---\n"
    (out / "README.md").write_text(card)
    return str(out)


def run(capsys, *args) -> tuple[int, dict | str]:
    code = main(["generate", *args, *ARGS])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]) if code == 0 else err


@pytest.mark.parametrize("key,repo,head_shard", [
    ("deepseek_v3/fp8", "deepseek-ai/DeepSeek-V3", "model-00004-of-00004.safetensors"),
    ("qwen3_5_moe/fp8-per-expert", "Qwen/Qwen3.6-35B-A3B-FP8", "mtp.safetensors"),
])
def test_only_the_head_shards_are_fetched_once(tmp_path, hub, capsys, key, repo, head_shard):
    info = write_real(tmp_path / "orig", key, shards=4)
    assert info["head_file"] == head_shard and len(info["files"]) == 4
    hub.add(repo, tmp_path / "orig")
    hub.add("mlx-community/tiny-4bit", conversion(tmp_path, tmp_path / "orig", repo))

    code, plain = run(capsys, "--model", "mlx-community/tiny-4bit", "--drafter", "none")
    assert code == 0
    assert hub.requests(repo) == 0
    code, spec = run(capsys, "--model", "mlx-community/tiny-4bit", "--drafter", "mtp", "--num-draft", "2",
                     "--mtp-weights", "hub")  # the head of the conversion's base_model
    assert code == 0, spec
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["drafted"] > 0
    assert hub.fetched(repo) == {"config.json": 1, "model.safetensors.index.json": 1, head_shard: 1}

    before = hub.requests(repo)  # extracted once: later runs, by name or found by themselves, stay offline
    for extra in (["--mtp-weights", f"hub:{repo}"], []):
        code, again = run(capsys, "--model", "mlx-community/tiny-4bit", "--drafter", "mtp", "--num-draft", "2", *extra)
        assert code == 0 and again["tokens"] == plain["tokens"], again
    assert hub.requests(repo) == before


def test_a_head_over_several_shards_fetches_them_and_not_a_shard_of_its_copies(tmp_path, hub, capsys):
    """DeepSeek-V3's layer 61 (15.4 GB, 3.7 GB of it the copies of the embedding and output) spans several of
    its shards. Here the head is split over two shards (a weight and its block scales may land apart) and
    its copies (embed_tokens, shared_head.head: the target's own are used) sit in a shard of their own,
    after three target-only shards: the two head shards are fetched, the copies' shard and the target's
    never."""
    from mlx_engine.models.safetensors_file import copy_tensors, read_header

    repo, orig = "deepseek-ai/DeepSeek-V3", tmp_path / "orig"
    info = write_real(orig, "deepseek_v3/fp8", shards=4)
    index = json.loads((orig / "model.safetensors.index.json").read_text())
    wmap = index["weight_map"]
    for i in (1, 2, 3):  # model-0000i-of-00004 -> -of-00006
        old, new = f"model-{i:05d}-of-00004.safetensors", f"model-{i:05d}-of-00006.safetensors"
        (orig / old).rename(orig / new)
        wmap.update({k: new for k, f in wmap.items() if f == old})
    head_file = orig / info["head_file"]
    names = sorted(read_header(head_file)[0])
    copies = [k for k in names if k.endswith((".embed_tokens.weight", ".shared_head.head.weight"))]
    rest = [k for k in names if k not in copies]
    assert len(copies) == 2 and len(rest) > 2
    parts = {"model-00004-of-00006.safetensors": rest[: len(rest) // 2],
             "model-00005-of-00006.safetensors": rest[len(rest) // 2:],
             "model-00006-of-00006.safetensors": copies}
    for f, ks in parts.items():
        copy_tensors([(head_file, ks)], orig / f)
        wmap.update({k: f for k in ks})
    head_file.unlink()
    (orig / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    assert set(wmap.values()) == {p.name for p in orig.glob("*.safetensors")}

    hub.add(repo, orig)
    hub.add("mlx-community/tiny-4bit", conversion(tmp_path, orig, repo))
    code, plain = run(capsys, "--model", "mlx-community/tiny-4bit", "--drafter", "none")
    assert code == 0
    code, spec = run(capsys, "--model", "mlx-community/tiny-4bit", "--drafter", "mtp", "--num-draft", "2",
                     "--mtp-weights", f"hub:{repo}")
    assert code == 0, spec
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["drafted"] > 0
    assert hub.fetched(repo) == {"config.json": 1, "model.safetensors.index.json": 1,
                                 "model-00004-of-00006.safetensors": 1, "model-00005-of-00006.safetensors": 1}


def test_a_repository_holding_a_converted_head_file(tmp_path, hub, capsys):
    """A repository with just the head `convert` writes (mtp.safetensors + mtp.json, no index)."""
    write_real(tmp_path / "orig", "qwen3_5_dense/bf16")
    full = convert(tmp_path / "orig", tmp_path / "full")
    (tmp_path / "head").mkdir()
    for f in ("mtp.safetensors", "mtp.json"):
        shutil.copy(full / f, tmp_path / "head" / f)
    hub.add("me/qwen-head", tmp_path / "head")
    target = conversion(tmp_path, tmp_path / "orig", None)
    code, plain = run(capsys, "--model", target, "--drafter", "none")
    code, spec = run(capsys, "--model", target, "--drafter", "mtp", "--mtp-weights", "hub:me/qwen-head")
    assert code == 0 and spec["tokens"] == plain["tokens"], spec
    assert hub.fetched("me/qwen-head") == {"mtp.safetensors": 1, "mtp.json": 1}


def test_bad_hub_references_are_one_line_errors(tmp_path, hub, capsys):
    write_real(tmp_path / "orig", "deepseek_v3/fp8")
    hub.add("deepseek-ai/DeepSeek-V3", tmp_path / "orig")
    nameless = conversion(tmp_path, tmp_path / "orig", None)
    named = tmp_path / "named"
    shutil.copytree(nameless, named)
    (named / "README.md").write_text("---\nbase_model: deepseek-ai/DeepSeek-V3\n---\n")
    write_real(tmp_path / "glm", "glm4_moe/bf16")
    hub.add("zai-org/GLM-4.5", tmp_path / "glm")
    cases = [
        (["--model", nameless, "--mtp-weights", "hub:nobody/nothing"], "nobody/nothing"),
        (["--model", nameless, "--mtp-weights", "hub"], "base_model"),
        (["--model", nameless, "--mtp-weights", "hub:not a repo"], "hub:OWNER/NAME"),
        (["--model", str(named)], "--mtp-weights hub:deepseek-ai/DeepSeek-V3"),  # not fetched yet: says how
        (["--model", nameless, "--mtp-weights", "hub:zai-org/GLM-4.5"], "zai-org/GLM-4.5"),  # another family
    ]
    for args, words in cases:
        code, err = run(capsys, *args, "--drafter", "mtp")
        assert code == 2 and err.startswith("error: ") and words in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert hub.fetched("zai-org/GLM-4.5") == {"config.json": 1}  # refused before any shard was fetched


def drafter_repo(kind: str, folder):
    if kind == "eagle3":
        model, cfg = tiny_models.build("llama", seed=0, num_hidden_layers=6)
        write_eagle3(folder, cfg)
    elif kind == "dflash":
        model = tiny_models.build("qwen3", seed=2, vocab=64)[0]
        dflash_util.write_dflash(folder, 48, 64, layer_ids=(0, 1))
    else:
        model = gemma4_util.build_target(64, seed=2)
        gemma4_util.write_assistant(folder, 64)
    return model


@pytest.mark.parametrize("kind,field", [("eagle3", "eagle3"), ("dflash", "dflash"),
                                        ("gemma4-assistant", "assistant")])
def test_drafter_repositories_come_whole(tmp_path, hub, kind, field):
    model = drafter_repo(kind, tmp_path / "repo")
    hub.add("someone/drafter", tmp_path / "repo")
    drafter = make_drafter(kind, loaded(model), DrafterOptions(**{field: "hub:someone/drafter"}))
    assert drafter is not None
    assert hub.fetched("someone/drafter") == {"config.json": 1, "model.safetensors": 1}


def test_convert_mtp_from_the_hub_adds_the_head_to_a_conversion(tmp_path, hub, capsys):
    write_real(tmp_path / "orig", "deepseek_v3/fp8", shards=4)
    hub.add("deepseek-ai/DeepSeek-V3", tmp_path / "orig")
    conv = conversion(tmp_path, tmp_path / "orig", None)
    assert main(["convert", "--mlx-path", conv, "--mtp-from", "hub:deepseek-ai/DeepSeek-V3"]) == 0, capsys.readouterr()
    assert hub.fetched("deepseek-ai/DeepSeek-V3") == {"config.json": 1, "model.safetensors.index.json": 1,
                                                      "model-00004-of-00004.safetensors": 1}
    code, plain = run(capsys, "--model", conv, "--drafter", "none")
    code, spec = run(capsys, "--model", conv, "--drafter", "mtp", "--num-draft", "2")  # found beside the model
    assert code == 0 and spec["tokens"] == plain["tokens"] and spec["stats"]["drafted"] > 0


def test_hub_reference_forms(tmp_path, monkeypatch):
    from mlx_engine.models.hub import HubError, HubRef, hub_ref

    monkeypatch.chdir(tmp_path)
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "mine").write_text("")
    assert hub_ref("hub:deepseek-ai/DeepSeek-V3") == HubRef("deepseek-ai/DeepSeek-V3")
    assert hub_ref("hub:Qwen/Qwen3.6-27B@abc123") == HubRef("Qwen/Qwen3.6-27B", "abc123")
    assert hub_ref("XiaomiMiMo/MiMo-7B-RL") == HubRef("XiaomiMiMo/MiMo-7B-RL")  # bare: no such path here
    assert hub_ref("hub") == hub_ref("hub:") == HubRef(None)  # the target's base_model
    for local in ("heads/mine", "missing/mtp.safetensors", str(tmp_path / "x"), "x", None):
        assert hub_ref(local) is None, local  # a path (even a missing file) is never sent to the hub
    with pytest.raises(HubError, match="hub:OWNER/NAME"):
        hub_ref("hub:just-a-name")


def test_a_pickled_drafter_repository_is_refused_without_downloading_it(tmp_path, hub):
    model = drafter_repo("eagle3", tmp_path / "repo")
    (tmp_path / "repo" / "model.safetensors").rename(tmp_path / "repo" / "pytorch_model.bin")
    hub.add("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", tmp_path / "repo")
    with pytest.raises(DrafterError, match="pytorch_model.bin"):
        make_drafter("eagle3", loaded(model), DrafterOptions(eagle3="hub:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"))
    assert "pytorch_model.bin" not in hub.fetched("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
