"""The tokenizer and chat template a GGUF file carries in its metadata -> a Hugging Face tokenizer."""

from __future__ import annotations

import warnings
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
from gguf import TokenType

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _LLAMA3_TAIL
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _LLAMA3_TAIL
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (llama-vocab.cpp).
_PRE_REGEXES = {
    "default": [_GPT2_REGEX],
    "gpt-2": [_GPT2_REGEX],
    **{pre: [r"\p{N}", _GPT2_REGEX] for pre in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{pre: [_LLAMA3_REGEX] for pre in ("llama-bpe", "llama3", "smaug-bpe", "falcon3", "pixtral")},
    **{pre: [_QWEN2_REGEX] for pre in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _bpe_model(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_REGEXES:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}: using GPT-2's split")
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_REGEXES.get(pre, [_GPT2_REGEX])]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = Tokenizer(models.BPE(_vocab(tokens), merges, ignore_merges=pre in ("llama-bpe", "llama3")))
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list:
    """llama.cpp's SentencePiece BPE merges the adjacent pair whose concatenation is the highest-scoring
    token: the same as BPE with one merge per (left, right) split of each token, ranked by that token's score."""
    ranked = []
    for token, score, kind in zip(tokens, scores, types):
        if kind != TokenType.NORMAL:
            continue
        for i in range(1, len(token)):
            left, right = vocab.get(token[:i]), vocab.get(token[i:])
            if left is not None and right is not None:
                ranked.append((-score, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def _spm_model(meta: dict, tokens: list[str], types: list[int], add_space_prefix: bool):
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = _vocab(tokens)
    scores = np.asarray(meta.get("tokenizer.ggml.scores", np.zeros(len(tokens))), dtype=np.float32).tolist()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    merges = _spm_merges(tokens, scores, types, vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _add_special_tokens(tok, tokens: list[str], types: list[int], spm: bool) -> None:
    """Control tokens become special added tokens; user-defined ones plain added tokens (matched before BPE)."""
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TokenType.CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=spm) for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED])


def _add_bos_eos(tok, meta: dict, tokens: list[str], default_bos: bool) -> None:
    from tokenizers import processors

    added = {}
    for which, default in (("bos", default_bos), ("eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
        if token_id is not None and meta.get(f"tokenizer.ggml.add_{which}_token", default):
            added[which] = (tokens[token_id], token_id)
    if not added:
        return
    bos = [added["bos"][0]] if "bos" in added else []
    eos = [added["eos"][0]] if "eos" in added else []
    tok.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=list(added.values()),
    )


def gguf_tokenizer(meta: dict) -> TokenizerWrapper:
    """An mlx_lm TokenizerWrapper rebuilt from GGUF tokenizer metadata ("gpt2" byte-level BPE or "llama" SPM)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.full(len(tokens), TokenType.NORMAL))).tolist()
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if kind == "gpt2":
        tok, detokenizer = _bpe_model(meta, tokens), BPEStreamingDetokenizer
    elif kind == "llama":
        tok = _spm_model(meta, tokens, types, add_space_prefix)
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=add_space_prefix)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}")
    _add_special_tokens(tok, tokens, types, spm=kind == "llama")
    _add_bos_eos(tok, meta, tokens, default_bos=kind == "llama")

    def token(which: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )
    end_ids = {meta.get(f"tokenizer.ggml.{which}_token_id") for which in ("eos", "eot", "eom")} - {None}
    return TokenizerWrapper(hf, detokenizer_class=detokenizer, eos_token_ids=sorted(end_ids))
