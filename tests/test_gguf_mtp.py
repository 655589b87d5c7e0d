"""`--mtp-weights head.gguf`: llama.cpp's nextn (MTP) tensors of a GLM-4.x (glm4_moe) target load as its MTP head.

A tiny glm4_moe checkpoint in HF layout gets its MTP layer written to a separate safetensors file; the same
tensors are then written to a GGUF file under llama.cpp's names (gguf.constants TENSOR_NAMES for GLM4_MOE:
blk.N.nextn.{eh_proj,enorm,hnorm,shared_head_norm}, attn_*, ffn_gate_inp, exp_probs_b.bias, experts stacked
[E, out, in] as ffn_{gate,up,down}_exps, ffn_*_shexp, attn_norm, post_attention_norm), with block_count =
num_hidden_layers + 1 and nextn_predict_layers = 1, plus token_embd / output_norm / output as llama.cpp's
MTP-only export keeps them. Encoded F32 and Q8_0 (matrices; norms, biases and the router stay F32 as
convert_hf_to_gguf keeps them).
"""

import json
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFWriter
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten

from gguf_writer_util import ATTN_NAMES
from hf_writer import read_hf, read_safetensors, text_cfg, write_checkpoint, write_safetensors
from mlx_engine import Engine, GenerationConfig
from mlx_engine.__main__ import main
from mlx_engine.drafters.mtp import HeadMismatchError, MissingHeadError, load_head, load_mtp_drafter
from reference import mlx_lm_greedy
from test_mtp_helpers import PROMPT, load_hf

N_TOKENS = 40

# HF module (under model.layers.N.) -> llama.cpp tensor (under blk.N.)
_BLOCK = {
    **ATTN_NAMES,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "eh_proj": "nextn.eh_proj",
    "enorm": "nextn.enorm",
    "hnorm": "nextn.hnorm",
    "shared_head.norm": "nextn.shared_head_norm",
    "embed_tokens": "nextn.embed_tokens",
    "shared_head.head": "nextn.shared_head_head",
}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_COPIES = ("nextn.embed_tokens", "nextn.shared_head_head")
_KEEP_F32 = ("ffn_gate_inp",)  # convert_hf_to_gguf keeps the router in F32


def test_names_are_llama_cpps():
    """Every GGUF name this file writes is one llama.cpp's GLM4_MOE architecture defines."""
    known = {TENSOR_NAMES[t].split(".", 2)[-1] for t in MODEL_TENSORS[MODEL_ARCH.GLM4_MOE]}
    written = {*_BLOCK.values(), *_EXPERTS.values(), "exp_probs_b"}
    assert written <= known, written - known
    assert {"token_embd", "output_norm", "output"} <= known


def _gguf_name(hf_rest: str) -> str:
    """'self_attn.q_proj.bias' -> 'attn_q.bias'."""
    if hf_rest == "mlp.gate.e_score_correction_bias":
        return "exp_probs_b.bias"
    module, suffix = hf_rest.rsplit(".", 1)
    return f"{_BLOCK[module]}.{suffix}"


def llama_cpp_tensors(head_hf: dict, target_hf: dict, n: int, copies: bool) -> dict[str, np.ndarray]:
    """HF-named MTP layer n (per-expert tensors) -> llama.cpp's GGUF tensors (experts stacked [E, out, in])."""
    out = {"token_embd.weight": target_hf["model.embed_tokens.weight"],
           "output_norm.weight": target_hf["model.norm.weight"],
           "output.weight": target_hf["lm_head.weight"]}  # fmt: skip
    experts: dict[str, dict[int, np.ndarray]] = {}
    pre = f"model.layers.{n}."
    for k, v in head_hf.items():
        assert k.startswith(pre), k
        rest = k[len(pre):]
        if m := re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest):
            experts.setdefault(m.group(2), {})[int(m.group(1))] = v
            continue
        name = _gguf_name(rest)
        if name.startswith(_COPIES) and not copies:
            continue  # llama.cpp's MTP export leaves out these copies of the target's matrices
        out[f"blk.{n}.{name}"] = np.asarray(v, np.float32)
    assert set(experts) == set(_EXPERTS)
    for proj, per in experts.items():
        out[f"blk.{n}.{_EXPERTS[proj]}.weight"] = np.stack([per[e] for e in range(len(per))]).astype(np.float32)
    return out


def write_head_gguf(path, tensors: dict[str, np.ndarray], tc: dict, qtype: QT, nextn: bool = True) -> dict:
    """Write a glm4moe GGUF; matrices (2-D, 3-D) as `qtype` unless kept F32. Returns name -> (raw, qtype)."""
    w = GGUFWriter(str(path), "glm4moe")
    n = tc["num_hidden_layers"]
    w.add_block_count(n + 1 if nextn else n)
    w.add_embedding_length(tc["hidden_size"])
    w.add_expert_count(tc["n_routed_experts"])
    if nextn:
        w.add_nextn_predict_layers(1)
    written = {}
    for name, a in tensors.items():
        qt = qtype if a.ndim >= 2 and not any(f".{s}." in name for s in _KEEP_F32) else QT.F32
        raw = a.astype(np.float32) if qt == QT.F32 else quantize(a, qt)
        w.add_tensor(name, raw, raw_dtype=None if qt == QT.F32 else qt)
        written[name] = (raw, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def decoded(written: dict) -> dict[str, np.ndarray]:
    return {k: raw if qt == QT.F32 else dequantize(raw, qt) for k, (raw, qt) in written.items()}


def back_to_hf(gguf: dict[str, np.ndarray], head_hf: dict, n: int) -> dict[str, np.ndarray]:
    """The decoded GGUF values under the head's HF names (per-expert): the expected head file."""
    out = {}
    for k in head_hf:
        rest = k[len(f"model.layers.{n}."):]
        if m := re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest):
            out[k] = np.ascontiguousarray(gguf[f"blk.{n}.{_EXPERTS[m.group(2)]}.weight"][int(m.group(1))])
        elif (name := f"blk.{n}.{_gguf_name(rest)}") in gguf:
            out[k] = np.asarray(gguf[name], np.float32)
    return out


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(folder of a glm4_moe target without its head, the head's HF tensors, a dir for files)."""
    root = tmp_path_factory.mktemp("gguf_mtp")
    head_file = root / "head.safetensors"
    folder = write_checkpoint(root / "glm4_moe", "glm4_moe", seed=5, head_file=head_file)
    head = dict(read_safetensors(head_file))
    rng = np.random.default_rng(5)
    for k, v in head.items():  # mlx-lm initialises the router to zeros: random, so that routing matters
        if k.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
            head[k] = rng.normal(0, 0.5, v.shape).astype(np.float32)
    write_safetensors(head_file, head)
    return folder, head, head_file, root


@pytest.fixture(scope="module")
def target(glm):
    folder = glm[0]
    model, config = load_hf(folder)
    return model, config, mlx_lm_greedy(model, PROMPT, N_TOKENS)


def make_gguf(glm, qtype: QT, copies: bool = False):
    folder, head_hf, _, root = glm
    tc = text_cfg(json.loads((folder / "config.json").read_text()))
    n = tc["num_hidden_layers"]
    path = root / f"head-{qtype.name}{'-copies' if copies else ''}.gguf"
    written = write_head_gguf(path, llama_cpp_tensors(head_hf, read_hf(folder), n, copies), tc, qtype)
    return path, written, n


def params(head) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(head.parameters())}


@pytest.mark.parametrize("qtype,copies", [(QT.F32, False), (QT.F32, True), (QT.Q8_0, False)],
                         ids=["F32", "F32-with-copies", "Q8_0"])
def test_gguf_head_equals_hf_head(glm, target, qtype, copies):
    """Every head parameter from the GGUF equals the one from an HF safetensors head file holding the same
    values: the original head at F32, gguf's own dequantization of what was written at Q8_0."""
    model, config, _ = target
    path, written, n = make_gguf(glm, qtype, copies)
    if qtype == QT.F32:
        hf_file = glm[2]
    else:
        hf_file = glm[3] / f"expected-{qtype.name}.safetensors"
        write_safetensors(hf_file, back_to_hf(decoded(written), glm[1], n))
        assert any(qt == QT.Q8_0 and raw.ndim == 3 for raw, qt in written.values())  # stacked experts quantized
    got, want = params(load_head(model, None, config, mtp_weights=path)), params(
        load_head(model, None, config, mtp_weights=hf_file))
    assert set(got) == set(want) and any(".switch_mlp." in k for k in got) and any("shared_experts" in k for k in got)
    assert any(k.endswith("e_score_correction_bias") for k in got)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0], ids=["F32", "Q8_0"])
def test_greedy_with_gguf_head_is_plain_greedy(glm, target, qtype):
    model, config, plain = target
    path, _, _ = make_gguf(glm, qtype)
    for k in (1, 2):
        drafter = load_mtp_drafter(model, None, config, mtp_weights=path)
        engine = Engine(model, drafter)
        out = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=N_TOKENS, num_draft=k)) for t in s.tokens]
        assert out == plain, f"{qtype.name} k={k}"
        assert engine.stats.drafted > 0


ARGS = ["--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", str(N_TOKENS), "--ignore-eos", "--temp", "0",
        "--json"]


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["generate", *argv, *ARGS])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_mtp_weights_gguf(glm, capsys):
    folder = glm[0]
    path, _, _ = make_gguf(glm, QT.Q8_0)
    rc, out, err = cli(capsys, "--model", str(folder), "--drafter", "none")
    assert rc == 0, err
    plain = json.loads(out)["tokens"]
    rc, out, err = cli(capsys, "--model", str(folder), "--drafter", "mtp", "--num-draft", "2",
                       "--mtp-weights", str(path))
    assert rc == 0, err
    spec = json.loads(out)
    assert spec["tokens"] == plain and spec["stats"]["drafted"] > 0


@pytest.fixture(scope="module")
def no_nextn_gguf(glm):
    """A glm4moe GGUF of the target's own layers only (what llama.cpp writes with --no-mtp)."""
    folder, _, _, root = glm
    tc = text_cfg(json.loads((folder / "config.json").read_text()))
    hf = read_hf(folder)
    tensors = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
               f"blk.0.{_gguf_name('input_layernorm.weight')}": hf["model.layers.0.input_layernorm.weight"]}
    path = root / "no-nextn.gguf"
    write_head_gguf(path, tensors, tc, QT.F32, nextn=False)
    return path


def test_gguf_without_nextn_tensors(target, no_nextn_gguf):
    model, config, _ = target
    with pytest.raises(MissingHeadError, match=rf"glm4_moe: .*{re.escape(no_nextn_gguf.name)}.*no MTP \(nextn\) tensors"):
        load_mtp_drafter(model, None, config, mtp_weights=no_nextn_gguf)


def test_cli_gguf_without_nextn_tensors(glm, no_nextn_gguf, capsys):
    rc, _, err = cli(capsys, "--model", str(glm[0]), "--drafter", "mtp", "--mtp-weights", str(no_nextn_gguf))
    assert rc == 2
    assert err.startswith("error: ") and no_nextn_gguf.name in err and "Traceback" not in err


def test_gguf_head_for_another_family(tmp_path, glm):
    """A glm4moe GGUF given to a deepseek_v3 target: a clear mismatch, not a shape error deep in loading."""
    path, _, _ = make_gguf(glm, QT.F32)
    model, config = load_hf(write_checkpoint(tmp_path / "ds", "deepseek_v3", with_head=False))
    with pytest.raises(HeadMismatchError, match=r"glm4moe.*deepseek_v3"):
        load_head(model, None, config, mtp_weights=path)
