"""DFlash (z-lab): a block-diffusion drafter that proposes a whole block in ONE forward pass, conditioned on
hidden features of several target layers. Checkpoint layout and drafting rule as z-lab's `DFlashDraftModel`
(dflash/model.py; the MLX port dflash/model_mlx.py):

- config.json: a Qwen3 config (hidden_size == the target's, head_dim, heads, layers, rope_theta, ...) plus
  `block_size` and `dflash_config: {target_layer_ids, mask_token_id}` (either level is read).
  Tensors: fc.weight [H, len(ids) * H], hidden_norm.weight, layers.i.{self_attn.{q,k,v,o}_proj, q_norm,
  k_norm, mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm}, norm.weight. No embedding
  and no output layer: it uses the target's (raw input embedding * input_embedding_scale; the target's
  lm_head, * output_multiplier, optional softcap).
- Context features: the outputs of decoder layers `target_layer_ids` (transformers' hidden_states[id + 1]),
  concatenated, for every token the target has been fed: c = hidden_norm(fc(features)). Every draft layer
  projects c with its own k_proj (k_norm, RoPE at the token's position) / v_proj; those context K/V are
  appended to the drafter's cache. Only committed tokens' rows are ever appended (the verify pass's rows of
  the kept inputs), so the drafter never rolls back: the target's rollback is the only one.
- The block: [last token, mask x (block_size - 1)] at positions p..p+B-1 (p = the last token's position),
  embedded with the target's embedding. Queries of the block attend the cached context K/V plus the block's
  own K/V (non-causal inside the block for full-attention layers; causal + windowed for sliding layers, as
  the reference's mask). norm -> target lm_head on block rows 1..B-1 gives B-1 drafts at once.
- The engine's k cuts the block: the block always runs at its trained size (its rows attend each other),
  the first k rows are proposed (k <= block_size - 1). Drafts at T > 0 are sampled per row from that row's
  distribution (the rows do not depend on earlier drafts), which the acceptance rule checks as any q.

DFlash2 checkpoints (grouped dynamic convolutions + a candidate selector) are refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .. import host
from ..sampling import SamplingConfig, choose
from ..target_model import prefix_cache as prefix_ops
from ..target_model.hidden import HiddenRequest
from .base import Draft, Verdict


class DFlashError(ValueError):
    pass


def dflash_settings(cfg: dict) -> dict:
    """block_size, target_layer_ids, mask_token_id, scales: from `dflash_config`, else the top level."""
    d = cfg.get("dflash_config") or {}

    def get(name, default=None):
        return d.get(name, cfg.get(name, default))

    ids = get("target_layer_ids")
    if ids is None or get("mask_token_id") is None:
        raise DFlashError("a DFlash config needs dflash_config.target_layer_ids and mask_token_id")
    return dict(
        block_size=int(get("block_size", 16)), target_layer_ids=tuple(int(i) for i in ids),
        mask_token_id=int(get("mask_token_id")), input_embedding_scale=float(get("input_embedding_scale", 1.0)),
        output_multiplier=float(get("output_multiplier", 1.0)), softcap=get("final_logit_softcapping"),
        is_causal=cfg.get("is_causal"),
    )


class Attention(nn.Module):
    def __init__(self, cfg: dict, layer_type: str, is_causal):
        super().__init__()
        H, D = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.nh, self.nkv, self.D = cfg["num_attention_heads"], cfg["num_key_value_heads"], D
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(H, self.nh * D, bias=bias)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.o_proj = nn.Linear(self.nh * D, H, bias=bias)
        self.q_norm = nn.RMSNorm(D, eps=cfg["rms_norm_eps"])
        self.k_norm = nn.RMSNorm(D, eps=cfg["rms_norm_eps"])
        sliding = layer_type == "sliding_attention"
        self.window = cfg.get("sliding_window") if sliding else None
        self.is_causal = sliding if is_causal is None else bool(is_causal)

    def _heads(self, x, n):
        return x.reshape(1, x.shape[0], n, self.D).transpose(0, 2, 1, 3)

    def append_context(self, ctx, rope, cache: KVCache, start: int):
        """ctx [P, H]'s keys and values at positions start..start+P-1 into the cache (each a function of its
        own row: the context does not attend). -> the cache's keys and values."""
        P = ctx.shape[0]
        kc = self.k_norm(self.k_proj(ctx).reshape(1, P, self.nkv, self.D)).transpose(0, 2, 1, 3)
        return cache.update_and_fetch(rope(kc, offset=start), self._heads(self.v_proj(ctx), self.nkv))

    def __call__(self, x, ctx, rope, cache: KVCache, start: int):
        """x [B, H] (the block, normed), ctx [P, H] (new context rows at positions start..start+P-1)."""
        B, P = x.shape[0], ctx.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(1, B, self.nh, self.D)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start + P)
        if P:
            ck, cv = self.append_context(ctx, rope, cache, start)
        else:
            ck, cv = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        kb = self.k_norm(self.k_proj(x).reshape(1, B, self.nkv, self.D)).transpose(0, 2, 1, 3)
        keys = mx.concatenate([ck, rope(kb, offset=start + P)], axis=2)
        values = mx.concatenate([cv, self._heads(self.v_proj(x), self.nkv)], axis=2)
        mask = None
        if self.is_causal or self.window is not None:  # the reference's _attention_mask, by position
            S = keys.shape[2]
            qpos = (S - B + mx.arange(B))[:, None]
            kpos = mx.arange(S)[None]
            mask = mx.ones((B, S), dtype=mx.bool_)
            if self.is_causal:
                mask = mask & (kpos <= qpos)
            if self.window is not None:
                mask = mask & (qpos - kpos < self.window)
                if not self.is_causal:
                    mask = mask & (kpos - qpos < self.window)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.D**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, -1))


class MLP(nn.Module):
    def __init__(self, H: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict, layer_type: str, is_causal):
        super().__init__()
        self.self_attn = Attention(cfg, layer_type, is_causal)
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])

    def __call__(self, h, ctx, rope, cache, start):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope, cache, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The checkpoint's modules under their published names."""

    def __init__(self, cfg: dict):
        super().__init__()
        arch = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
        if arch != "DFlashDraftModel":
            raise DFlashError(f"unsupported DFlash architecture {arch!r} (DFlashDraftModel only; DFlash2's "
                              "convolutions and candidate selector are not implemented)")
        self.settings = dflash_settings(cfg)
        n = cfg["num_hidden_layers"]
        self.layer_types = list(cfg.get("layer_types") or ["full_attention"] * n)
        if len(self.layer_types) != n or set(self.layer_types) - {"full_attention", "sliding_attention"}:
            raise DFlashError(f"bad layer_types {self.layer_types}")
        if "sliding_attention" in self.layer_types and not cfg.get("sliding_window"):
            raise DFlashError("sliding_attention layers need sliding_window")
        H = cfg["hidden_size"]
        self.hidden_size = H
        self.fc = nn.Linear(len(self.settings["target_layer_ids"]) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg["rms_norm_eps"])
        self.layers = [Layer(cfg, t, self.settings["is_causal"]) for t in self.layer_types]
        self.norm = nn.RMSNorm(H, eps=cfg["rms_norm_eps"])
        D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
        rope_cfg = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta", (rope_cfg or {}).get("rope_theta", 10000.0))
        if rope_cfg and rope_cfg.get("rope_type", rope_cfg.get("type")) == "default":
            rope_cfg = None
        self.rope = initialize_rope(D, base=theta, traditional=False, scaling_config=rope_cfg,
                                    max_position_embeddings=cfg.get("max_position_embeddings", 32768))

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def feed_context(self, features: mx.array, cache: list, start: int) -> None:
        """Only the context rows' keys and values (features [P, n_ids * H] at positions start..): what a
        block pass would append, without the block (a long prompt's rows, a piece at a time)."""
        ctx = self.hidden_norm(self.fc(features))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.append_context(ctx, self.rope, c, start)

    def __call__(self, block_emb: mx.array, features: mx.array, cache: list, start: int) -> mx.array:
        """block_emb [B, H]; features [P, n_ids * H] of the new context rows (positions start..start+P-1);
        the block sits at start+P... -> final-normed block hidden [B, H]. Appends the context K/V."""
        ctx = self.hidden_norm(self.fc(features)) if features.shape[0] else features[:, : self.hidden_size]
        h = block_emb
        for layer, c in zip(self.layers, cache):
            h = layer(h, ctx, self.rope, c, start)
        return self.norm(h)


def load_dflash(path) -> DFlashModel:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise DFlashError(f"{path} is not a DFlash checkpoint (no config.json)")
    cfg = json.loads((path / "config.json").read_text())
    model = DFlashModel(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{path} holds no .safetensors file")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights = {k.removeprefix("model."): v for k, v in weights.items() if "rotary_emb" not in k}
    if q := cfg.get("quantization"):
        nn.quantize(model, q["group_size"], q["bits"], class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise DFlashError(f"{path}: {e}") from None
    model.eval()
    host.wait(model.parameters())  # load time, not the loop
    return model


class DFlashDrafter:
    name = "dflash"
    needs_hidden = True

    def __init__(self, model: DFlashModel, target):
        from ..target_model.model import Target

        self.model = model
        self.target = target if isinstance(target, Target) else Target(target)
        s = model.settings
        n = len(self.target.layers)
        for i in s["target_layer_ids"]:
            if not -n <= i < n:
                raise DFlashError(f"the drafter reads target layer {i}; the target has {n} layers")
        if not 0 <= s["mask_token_id"] < self.target.vocab_size:
            raise DFlashError(f"mask token {s['mask_token_id']} is outside the target's vocabulary")
        dtype = self.target.embed_tokens.weight.dtype
        if mx.issubdtype(dtype, mx.floating):  # e.g. a bf16 checkpoint for an fp32 target: one dtype
            model.set_dtype(dtype)
        self.hidden_request = HiddenRequest(layers=s["target_layer_ids"], final=False)
        self.block_size = s["block_size"]
        self.cache: list = []
        self.history: list[int] = []
        self._pending: list[mx.array] = []  # feature rows of committed, fed tokens not yet in the cache

    def begin(self, tokens: list[int], hidden: mx.array | None) -> None:
        if hidden is None or hidden.shape[0] != len(tokens) - 1:
            raise ValueError("the DFlash drafter needs the target's layer features of the prompt")
        self.cache = self.model.make_cache()
        self.history = list(tokens)
        self._pending = [hidden]

    def _context_rows(self) -> mx.array:
        """The pending context rows as one array [P, n_ids * H]."""
        return mx.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]

    def prefill_pending(self, limit: int) -> int:
        """Feed up to `limit` pending context rows (a long prompt's, a piece at a time: the batch engine
        interleaves them with other rows' steps). Returns how many are still pending."""
        feats = self._context_rows()
        n = min(limit, feats.shape[0])
        if n > 0:
            self.model.feed_context(feats[:n], self.cache, self.cache[0].offset)
            host.wait([c.state for c in self.cache])
        self._pending = [feats[n:]]
        return feats.shape[0] - n

    # -- the prefix tree's share (core/drafter_prefix.py) ------------------------------------------------
    def keepable(self) -> bool:
        """Context rows are a function of their own position's features: kept, unless a layer keeps a
        sliding window (its cache may drop rows)."""
        return True

    def prefix_states(self) -> tuple[list, int]:
        """Its context rows, position for position the target's: (per-layer states, positions held)."""
        n = self.cache[0].offset if self.cache else 0
        return (prefix_ops.layer_states(self.cache, n), n) if n else ([], 0)

    def restore(self, states: list, n: int) -> None:
        """After begin(): the first n positions' context rows from the prefix tree, not fed again."""
        feats = self._context_rows()
        n = min(n, feats.shape[0])
        if n <= 0:
            return
        prefix_ops.fill(self.cache, states, n)
        self._pending = [feats[n:]]

    def block_hidden(self) -> mx.array:
        """Feed the pending context rows, run the block: final-normed hidden [block_size, H] (row 0 is the
        last committed token's, rows 1.. are the drafts')."""
        s = self.model.settings
        feats = self._context_rows()
        self._pending = [feats[:0]]
        start = self.cache[0].offset
        if start + feats.shape[0] != len(self.history) - 1:
            raise RuntimeError("DFlash context rows out of step with the committed tokens")
        block = mx.array([self.history[-1]] + [s["mask_token_id"]] * (self.block_size - 1), dtype=mx.int32)
        emb = self.target.embed_tokens(block) * s["input_embedding_scale"]
        return self.model(emb.astype(feats.dtype), feats, self.cache, start)

    def logits(self, h: mx.array) -> mx.array:
        """The target's output layer on draft rows, * output_multiplier, optional softcap (compute_logits)."""
        s = self.model.settings
        logits = self.target.lm_head(h) * s["output_multiplier"]
        if s["softcap"]:
            logits = mx.tanh(logits / s["softcap"]) * s["softcap"]
        return logits

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array) -> Draft:
        """The block in one pass, cut to the first k drafts (the output layer runs on those rows only)."""
        k = min(k, self.block_size - 1)
        logits = self.logits(self.block_hidden()[1 : k + 1])
        window = mx.array(self.history[-sampling.repetition_context :]) if sampling.penalized else None
        if window is None and sampling.greedy:
            return Draft(mx.argmax(logits, axis=-1).astype(mx.int32), None)
        keys = mx.random.split(key, k)
        tokens, probs = [], []
        for i in range(k):  # each row its own distribution (the block's rows do not read earlier drafts)
            context = mx.concatenate([window, *tokens]) if window is not None else None
            tok, p = choose(logits[i : i + 1], context, sampling, keys[i])
            tokens.append(tok.astype(mx.int32))
            probs.append(p)
        return Draft(mx.concatenate(tokens), None if sampling.greedy else mx.concatenate(probs))

    def commit(self, verdict: Verdict, hidden: mx.array | None) -> None:
        n = verdict.n_accepted
        if hidden is None or hidden.shape[0] < n + 1:
            raise ValueError("the DFlash drafter needs the verify pass's layer features")
        self._pending.append(hidden[: n + 1])  # the kept inputs [last, d_1..d_n]: now committed and fed
        self.history += verdict.tokens

    def max_draft(self) -> int | None:
        return self.block_size - 1
