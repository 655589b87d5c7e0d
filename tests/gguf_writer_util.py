"""Test fixtures: tiny mlx-lm models and tokenizers written to GGUF the way llama.cpp's convert_hf_to_gguf.py does
(Q/K rows permuted for llama, Gemma norm weights stored as 1 + w, tokenizer and chat template in the metadata)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts 4 tokens and verifies them in 1 pass.",
    "Hello, world! Numbers like 12345 and 2026 are split per digit.",
    "MLX runs on Apple silicon; this test runs on a CPU.",
    "A tiny model, a tiny tokenizer, and a tiny GGUF file.",
] * 4

BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ATTN_NAMES = {  # HF -> llama.cpp names of a block's attention (shared with the GLM MTP tables)
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
}
_BLOCK = {
    **ATTN_NAMES,
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMA_NAMES = {**_BLOCK, "post_attention_layernorm": "ffn_norm"}
GEMMA3_NAMES = {
    **_BLOCK,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


# ------------------------------------------------------------------------------------------------ tokenizers


def _merges(tok: Tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def train_bpe(vocab_size: int = 300) -> Tokenizer:
    """A SmolLM2-style byte-level BPE: per-digit split + ByteLevel."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def train_spm(vocab_size: int = 400) -> Tokenizer:
    """A Gemma-style SentencePiece BPE (no dummy prefix, byte fallback), as a `tokenizers` BPE."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPM_SPECIALS + byte_tokens, show_progress=False)
    trainer_tok.train_from_iterator(TEXT, trainer)
    tok = Tokenizer(models.BPE(trainer_tok.get_vocab(), _merges(trainer_tok), unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPM_SPECIALS)
    return tok


def _tokens(tok: Tokenizer) -> list[str]:
    return [tok.id_to_token(i) for i in range(tok.get_vocab_size())]


def add_bpe_tokenizer(w: GGUFWriter, tok: Tokenizer, chat_template: str | None = CHAT_TEMPLATE) -> None:
    tokens = _tokens(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in BPE_SPECIALS else TokenType.NORMAL for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in _merges(tok)])
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def add_spm_tokenizer(w: GGUFWriter, tok: Tokenizer) -> None:
    """Scores rank merged tokens in merge order (later merge = lower score), as SentencePiece does."""
    tokens = _tokens(tok)

    def kind(t: str) -> TokenType:
        if t in SPM_SPECIALS:
            return TokenType.CONTROL
        return TokenType.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else TokenType.NORMAL

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types([kind(t) for t in tokens])
    w.add_bos_token_id(tok.token_to_id("<bos>"))
    w.add_eos_token_id(tok.token_to_id("<eos>"))
    w.add_unk_token_id(tok.token_to_id("<unk>"))
    w.add_pad_token_id(tok.token_to_id("<pad>"))
    w.add_eot_token_id(tok.token_to_id("<end_of_turn>"))
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)


# ------------------------------------------------------------------------------------------------ models


def randomize_norms(model, seed: int = 0) -> None:
    """Norm weights are ones at init; make them random so that a wrong mapping or shift shows."""
    rng = np.random.default_rng(seed)
    norms = [(k, mx.array(1 + 0.2 * rng.standard_normal(v.shape), v.dtype))
             for k, v in tree_flatten(model.parameters()) if k.endswith("norm.weight")]  # fmt: skip
    model.load_weights(norms, strict=False)
    mx.eval(model.parameters())


def tiny_llama(vocab_size: int, **overrides):
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=256,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab_size,
                rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    model = llama.Model(llama.ModelArgs.from_dict({**args, **overrides}))
    randomize_norms(model)
    return model


def tiny_gemma3(vocab_size: int):
    from mlx_lm.models import gemma3_text

    mx.random.seed(1)
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                                 num_attention_heads=4, head_dim=16, num_key_value_heads=2, vocab_size=vocab_size,
                                 rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                                 query_pre_attn_scalar=16, sliding_window=4, sliding_window_pattern=2,
                                 max_position_embeddings=256)  # fmt: skip
    model = gemma3_text.Model(args)
    model.sanitize({})  # no lm_head: tied embeddings
    randomize_norms(model, seed=1)
    return model


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, names: dict[str, str]) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    layer, module, suffix = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf).groups()
    return f"blk.{layer}.{names[module]}.{suffix}"


def gguf_tensors(model, arch: str) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (HF name, float32 array as llama.cpp stores it)."""
    args = model.args
    out = {}
    for hf, v in tree_flatten(model.parameters()):
        a = np.array(v.astype(mx.float32))
        if arch == "llama" and ".q_proj." in hf:
            a = permute(a, args.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            a = permute(a, args.num_key_value_heads)
        elif arch == "gemma3" and hf.endswith("norm.weight"):
            a = a + 1
        out[gguf_name(hf, LLAMA_NAMES if arch == "llama" else GEMMA3_NAMES)] = (hf, a)
    return out


def add_llama_metadata(w: GGUFWriter, args) -> None:
    w.add_context_length(args.max_position_embeddings)
    w.add_embedding_length(args.hidden_size)
    w.add_block_count(args.num_hidden_layers)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    w.add_rope_dimension_count(args.hidden_size // args.num_attention_heads)


def add_gemma3_metadata(w: GGUFWriter, args) -> None:
    add_llama_metadata(w, args)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_sliding_window(args.sliding_window)
    w.add_sliding_window_pattern(args.sliding_window_pattern)


def encode(a: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return a.astype(np.float32)
    if qtype == QT.F16:
        return a.astype(np.float16)
    return quantize(a, qtype)


def decode(raw: np.ndarray, qtype: QT) -> np.ndarray:
    return raw.astype(np.float32) if qtype in (QT.F32, QT.F16) else dequantize(raw, qtype)


def random_kquant(rows: int, cols: int, qtype: QT, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks with small, finite fp16 super-block scales (gguf-py cannot quantize K-quants)."""
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale_offsets = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q3_K: (108,), QT.Q2_K: (80, 82)}[qtype]
    for off in scale_offsets:
        raw[..., off : off + 2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray | tuple[np.ndarray, QT]], metadata=(),
               qtype: QT = QT.F32) -> dict[str, tuple[np.ndarray, QT]]:  # fmt: skip
    """Write tensors (float arrays, encoded as `qtype` when 2-D, or (raw, qtype) pairs); return what was written."""
    w = GGUFWriter(str(path), arch)
    for add in metadata:
        add(w)
    written = {}
    for name, value in tensors.items():
        if isinstance(value, tuple):
            raw, qt = value
        else:
            qt = qtype if value.ndim == 2 else QT.F32
            raw = encode(value, qt)
        w.add_tensor(name, raw, raw_dtype=None if qt in (QT.F32, QT.F16) else qt)
        written[name] = (raw, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
