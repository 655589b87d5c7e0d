"""Gemma 4's assistant drafter (transformers' Gemma4AssistantForCausalLM, `google/gemma-4-*-assistant`).

The assistant has no KV cache of its own: every one of its layers is a KV-*shared* Gemma 4 layer (q_proj,
q_norm, o_proj and the MLP only) whose keys and values are the TARGET's, taken from the target's last
non-shared layer of the same type (sliding / full attention), post-RoPE K and normed V exactly as the
target's cache holds them. Per drafted token (transformers' SinglePositionMultiTokenCandidateGenerator):

    x = pre_projection(cat[target_embed(tok) * sqrt(H_target), h])       # [2 H_target] -> [H]
    y = norm(layers(x))  at ONE fixed RoPE position p                   # cross-attends the target KV
    logits = lm_head(y) (tied to its own embed_tokens; or the centroid-masked head)
    h = post_projection(y)                                               # [H] -> [H_target], next step

The first step takes the last committed token and the target's final-normed hidden state of the token
before it (the row the target scored it from); p is that last token's position (= tokens the target's
cache holds). Later steps feed the previous draft and the assistant's own projected state, at the same p,
against the same KV: the verified prefix. So nothing of the drafter needs rolling back: the target's
rollback (the engine's one place) is the only one; `commit` just keeps the new last token and its hidden
row. Full-attention layers see the whole prefix, sliding layers its last `sliding_window` keys.

Where transformers' generator slices the shared KV to `len(input_ids)` after a partial accept (which
includes the rejected draft's entry), we read the target cache after rollback: exactly the verified
prefix (as llama.cpp's integration does).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text as g4
from mlx_lm.models.cache import RotatingKVCache

from .. import host
from ..sampling import SamplingConfig, choose
from ..target_model.hidden import FINAL_HIDDEN
from .base import Draft, Verdict


class MaskedEmbedder(nn.Module):
    """`use_ordered_embeddings`: score only the tokens of the top-k centroid clusters; every other token
    gets (the smallest selected logit - 1), as transformers' Gemma4AssistantMaskedEmbedder."""

    def __init__(self, hidden: int, vocab: int, num_centroids: int, top_k: int):
        super().__init__()
        self.vocab, self.num_centroids, self.top_k = vocab, num_centroids, top_k
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)

    def __call__(self, h: mx.array, embed: nn.Module) -> mx.array:
        """h [L, H] -> logits [L, V]; `embed` holds the output rows (the tied lm_head)."""
        L = h.shape[0]
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[:, : self.top_k]  # the top-k clusters
        per = self.vocab // self.num_centroids
        canon = self.token_ordering.reshape(self.num_centroids, per)[top].reshape(L, -1)  # [L, top_k * per]
        sel = (embed(canon) @ h[:, :, None])[..., 0]
        out = mx.full((L, self.vocab), sel.min() - 1.0, dtype=sel.dtype)
        return mx.put_along_axis(out, canon, sel, axis=-1)


class _Inner(nn.Module):
    def __init__(self, args: g4.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [g4.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4Assistant(nn.Module):
    """The checkpoint's modules under their published names (model.*, pre_projection, post_projection,
    lm_head when untied, masked_embedding.*). Layers are mlx-lm's Gemma 4 decoder layers, all KV-shared."""

    def __init__(self, config: dict):
        super().__init__()
        text = dict(config["text_config"])
        text["num_kv_shared_layers"] = text["num_hidden_layers"]  # every layer reads the target's KV
        text.setdefault("hidden_size_per_layer_input", 0)
        text.setdefault("use_double_wide_mlp", False)
        self.args = g4.ModelArgs.from_dict(text)
        if self.args.hidden_size_per_layer_input or self.args.enable_moe_block:
            raise ValueError("a Gemma 4 assistant has no per-layer inputs and no MoE block")
        self.backbone_hidden_size = int(config.get("backbone_hidden_size", 1536))
        self.tie = bool(config.get("tie_word_embeddings", True))
        H, Hb, V = self.args.hidden_size, self.backbone_hidden_size, self.args.vocab_size
        self.model = _Inner(self.args)
        self.pre_projection = nn.Linear(2 * Hb, H, bias=False)
        self.post_projection = nn.Linear(H, Hb, bias=False)
        if not self.tie:
            self.lm_head = nn.Linear(H, V, bias=False)
        if config.get("use_ordered_embeddings", False):
            self.masked_embedding = MaskedEmbedder(H, V, int(config.get("num_centroids", 2048)),
                                                   int(config.get("centroid_intermediate_top_k", 32)))

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self.model.layers]

    def _head(self, y: mx.array) -> mx.array:
        if "masked_embedding" in self:
            return self.masked_embedding(y, self.lm_head if not self.tie else self.model.embed_tokens)
        return self.lm_head(y) if not self.tie else self.model.embed_tokens.as_linear(y)

    def __call__(self, x: mx.array, shared_kv: dict, position: int) -> tuple[mx.array, mx.array]:
        """x [L, 2 H_target] at RoPE position `position`; shared_kv: layer type -> (K, V) [1, Hkv, S, D].
        -> (logits [L, V], projected state [L, H_target])."""
        h = self.pre_projection(x)[None]
        for layer in self.model.layers:
            h, _, _ = layer(h, None, None, shared_kv=shared_kv[layer.layer_type], offset=position)
        y = self.model.norm(h)[0]
        return self._head(y), self.post_projection(y)


def _weights(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path} holds no .safetensors file")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def load_assistant(path) -> Gemma4Assistant:
    """A Gemma 4 assistant checkpoint folder (config.json with model_type gemma4_assistant + safetensors)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} is not a Gemma 4 assistant checkpoint (no config.json)")
    config = json.loads(cfg_file.read_text())
    if config.get("model_type") != "gemma4_assistant" or "text_config" not in config:
        raise ValueError(f"{path}: model_type {config.get('model_type')!r}, expected 'gemma4_assistant'")
    model = Gemma4Assistant(config)
    weights = {}
    for k, v in _weights(path).items():
        k = k.replace("model.language_model.", "model.")
        if "rotary_emb" in k or (model.tie and k == "lm_head.weight"):
            continue
        if k.endswith("token_ordering"):
            v = v.astype(mx.int32)
        weights[k] = v
    if q := config.get("quantization"):
        nn.quantize(model, q["group_size"], q["bits"], class_predicate=lambda p, m: f"{p}.scales" in weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    host.wait(model.parameters())  # load time, not the loop
    return model


def store_layers(args) -> dict[str, int]:
    """Target layer whose KV each layer type shares: the last non-shared layer of that type."""
    n_own = args.num_hidden_layers - (args.num_kv_shared_layers or 0)
    return {t: i for i, t in enumerate(args.layer_types[:n_own])}  # later layers overwrite earlier ones


def read_kv(cache, window: int | None) -> tuple[mx.array, mx.array]:
    """(K, V) the target's cache layer holds, in temporal order; a rotating window's last `window` keys.
    A read-only view: nothing of the cache is changed."""
    if isinstance(cache, RotatingKVCache):
        k, v = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        k, v = k[..., : cache.offset, :], v[..., : cache.offset, :]
        return (k[..., -window:, :], v[..., -window:, :]) if window else (k, v)
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


class Gemma4AssistantDrafter:
    name = "gemma4-assistant"
    needs_hidden = True
    hidden_request = FINAL_HIDDEN
    reads_target_cache = True  # the engine hands it the target's cache (attach_target_cache)

    def __init__(self, assistant: Gemma4Assistant, target):
        from ..target_model.model import Target

        self.assistant = assistant
        self.target = target if isinstance(target, Target) else Target(target)
        args = getattr(self.target.text, "args", None)
        if args is None or not hasattr(args, "layer_types") or not str(args.model_type).startswith("gemma4"):
            raise ValueError("the Gemma 4 assistant drafts for a Gemma 4 target only")
        if args.hidden_size != assistant.backbone_hidden_size:
            raise ValueError(f"the assistant was trained for hidden size {assistant.backbone_hidden_size}; "
                             f"the target has {args.hidden_size}")
        self.store = store_layers(args)
        missing = set(assistant.layer_types) - set(self.store)
        if missing:
            raise ValueError(f"the target has no {', '.join(sorted(missing))} layer for the assistant to read")
        self.window = args.sliding_window
        self.embed_scale = args.hidden_size**0.5
        self.cache: list | None = None
        self.history: list[int] = []
        self._h: mx.array | None = None

    def attach_target_cache(self, cache: list) -> None:
        """The target's cache list (the engine's own; read only, between verify passes)."""
        self.cache = cache

    def shared_kv(self) -> dict:
        """Layer type -> (K, V) of the verified prefix, from the target's cache as it stands."""
        if self.cache is None:
            raise ValueError("the Gemma 4 assistant needs the target's cache (attach_target_cache)")
        return {t: read_kv(self.cache[i], self.window if t == "sliding_attention" else None)
                for t, i in self.store.items()}

    def begin(self, tokens: list[int], hidden: mx.array | None) -> None:
        if hidden is None or hidden.shape[0] != len(tokens) - 1:
            raise ValueError("the Gemma 4 assistant needs the target's hidden states of the prompt")
        self.history = list(tokens)
        self._h = hidden[-1:]

    def step(self, token: mx.array, h: mx.array, kv: dict, position: int):
        """One draft step: (logits [1, V], next state [1, H_target])."""
        e = self.target.embed_tokens(token) * self.embed_scale
        return self.assistant(mx.concatenate([e.astype(h.dtype), h], axis=-1), kv, position)

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array) -> Draft:
        kv = self.shared_kv()
        position = len(self.history) - 1  # the last token's position: the target cache holds the ones before
        keys = mx.random.split(key, k)
        window = mx.array(self.history[-sampling.repetition_context :]) if sampling.penalized else None
        tok, h = mx.array(self.history[-1:], dtype=mx.int32), self._h
        tokens, probs = [], []
        for i in range(k):
            logits, h = self.step(tok, h, kv, position)
            context = mx.concatenate([window, *tokens]) if window is not None else None
            tok, p = choose(logits, context, sampling, keys[i])
            tok = tok.astype(mx.int32)
            tokens.append(tok)
            probs.append(p)
        return Draft(mx.concatenate(tokens), None if sampling.greedy else mx.concatenate(probs))

    def commit(self, verdict: Verdict, hidden: mx.array | None) -> None:
        n = verdict.n_accepted
        if hidden is None or hidden.shape[0] < n + 1:
            raise ValueError("the Gemma 4 assistant needs the verify pass's hidden states")
        self._h = hidden[n : n + 1]  # the last kept input's row: it scored the new last token
        self.history += verdict.tokens

    def max_draft(self) -> int | None:
        return None
