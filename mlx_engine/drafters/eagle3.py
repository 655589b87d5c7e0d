"""EAGLE-3 drafters: one decoder layer over the fused low/mid/high hidden states of the target.

The published Hugging Face layout (SafeAILab/EAGLE `cnets.py`, vLLM and SGLang `llama_eagle3.py`):

    fc.weight                      [H, 3 * H_target]  fuses the three target features (no bias)
    midlayer.input_layernorm       RMSNorm on the token embedding
    midlayer.hidden_norm           RMSNorm on the hidden state
    midlayer.self_attn.{q,k,v}_proj  input 2H = cat[input_layernorm(Emb(tok)), hidden_norm(g)]
    midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight                    final norm before the output layer
    lm_head.weight                 [draft_vocab, H] over a reduced draft vocabulary
    d2t                            [draft_vocab] int: target id = draft id + d2t[draft id]
    t2d                            [vocab] bool (unused here)
    embed_tokens.weight            optional; otherwise the target's embedding is shared

The layer (vLLM `_norm_after_residual`): residual = g (hidden_norm(g) when `norm_before_residual`);
h = residual + attn(cat[...]); y = h + mlp(post_attention_layernorm(h)). Logits = lm_head(norm(y)).

Features: three residual-stream boundaries of the target, by default (2, L // 2, L - 3) as vLLM, SGLang and
the EAGLE repo pick them (boundary j = the input of layer j = the output of layer j - 1; 0 = the embedding).
Checkpoints name them in `eagle_aux_hidden_state_layer_ids` under two conventions (SGLang PR 25454): ids
that start at 1 are layer OUTPUTS (SpecForge's (1, L//2 - 1, L - 4): boundary = id + 1, SGLang's historic
+1), any other first id is a boundary as vLLM reads it. The target captures the outputs of layers
boundary - 1 in its own forward pass (HiddenRequest).

Drafting rule (as MTP, mtp-heads.md §0): slot p takes (Emb(t_{p+1}), fc(features_p)) at RoPE position p
and predicts t_{p+2}. Later draft steps chain the layer's own PRE-norm output y as the next hidden state
(vLLM returns `hidden_prenorm` for that; EAGLE trains on it). Accepted slots are re-fed with the true
target features at commit, so the KV cache holds no draft-time approximation (MTPDrafter does that).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .. import host
from ..target_model.hidden import HiddenRequest
from .mtp.drafter import MTPDrafter

AUX_KEY = "eagle_aux_hidden_state_layer_ids"


class Eagle3Error(ValueError):
    """An EAGLE-3 checkpoint that cannot be used with this target (reported as `error: ...`)."""


def default_aux_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's, SGLang's and EAGLE's choice, as boundaries (id j = input of layer j = output of layer j - 1)."""
    return (2, num_layers // 2, num_layers - 3)


def boundaries(config_ids) -> tuple[int, ...]:
    """Checkpoint ids -> residual boundaries (module doc): output-of-layer ids (first id 1) shift by one."""
    ids = tuple(int(j) for j in config_ids)
    return tuple(j + 1 for j in ids) if ids and ids[0] == 1 else ids


def aux_request(aux_ids, num_layers: int) -> HiddenRequest:
    """The target layers whose outputs are the features (`aux_ids`: boundaries, see the module doc)."""
    for j in aux_ids:
        if not 1 <= j <= num_layers:
            raise Eagle3Error(f"aux hidden state id {j} is outside 1..{num_layers} (the target has {num_layers} "
                              "layers; id 0, the embedding, is not supported)")
    return HiddenRequest(layers=tuple(j - 1 for j in aux_ids), final=False)


class Eagle3Layer(nn.Module):
    """The midlayer: attention over cat[Emb(tok), hidden] (2H), the target family's llama MLP."""

    def __init__(self, args: llama.ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        h = args.hidden_size
        self.self_attn = attn = llama.Attention(args)
        bias = bool(args.attention_bias)
        attn.q_proj = nn.Linear(2 * h, attn.n_heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * h, attn.n_kv_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * h, attn.n_kv_heads * attn.head_dim, bias=bias)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def __call__(self, e: mx.array, g: mx.array, cache, window: int | None = None) -> mx.array:
        """e (embeddings), g (hidden) [L, H] for L consecutive slots -> pre-norm output y [L, H]."""
        gn = self.hidden_norm(g)
        x = mx.concatenate([self.input_layernorm(e), gn], axis=-1)[None]
        mask = create_attention_mask(x, cache, return_array=True)
        h = (gn if self.norm_before_residual else g)[None] + self.self_attn(x, mask, cache)
        y = h + self.mlp(self.post_attention_layernorm(h))
        return y[0]


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + lm_head (+ embed_tokens). `layers`/`windows`/`make_cache` are what
    MTPDrafter drives; `d2t` and the feature ids live outside the parameter tree."""

    family = "eagle3"

    def __init__(self, args: llama.ModelArgs, target_hidden: int, draft_vocab: int, own_embed: bool = False,
                 norm_before_residual: bool = False):
        super().__init__()
        h = args.hidden_size
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = Eagle3Layer(args, norm_before_residual)
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, h)
        object.__setattr__(self, "_d2t", None)
        object.__setattr__(self, "_request", None)

    @property
    def layers(self) -> list:
        return [self.midlayer]

    @property
    def windows(self) -> list:
        return [None]

    @property
    def vocab_subset(self):
        return None  # the draft vocabulary is the head's own lm_head + d2t

    def make_cache(self) -> list:
        return [KVCache()]

    @property
    def d2t(self) -> mx.array | None:
        return self.__dict__.get("_d2t")

    @property
    def request(self) -> HiddenRequest:
        return self.__dict__["_request"]

    def set_mapping(self, d2t: mx.array | None, request: HiddenRequest) -> None:
        object.__setattr__(self, "_d2t", None if d2t is None else d2t.astype(mx.int32))
        object.__setattr__(self, "_request", request)

    def target_ids(self) -> mx.array:
        """Target token id of each draft id."""
        base = mx.arange(self.lm_head.weight.shape[0], dtype=mx.int32)
        return base if self.d2t is None else base + self.d2t


class Eagle3Drafter(MTPDrafter):
    """MTPDrafter's slot bookkeeping (pending slots, one batch feed, trimmed draft-time entries) with the
    EAGLE-3 rules: features pass through fc once, later steps chain the pre-norm output, logits come from
    the head's own norm + lm_head over the draft vocabulary, scattered to target ids (-inf elsewhere)."""

    name = "eagle3"
    needs_hidden = True

    def __init__(self, head: Eagle3Head, target, prefill_step: int = 2048):
        super().__init__(head, target, prefill_step)
        self.hidden_request = head.request
        self.vocab_size = self.target.vocab_size
        ids = head.target_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise Eagle3Error(f"d2t maps draft ids outside the target's vocabulary [0, {self.vocab_size})")
        self._ids = ids
        host.wait([ids])

    def _embed(self, tokens: mx.array) -> mx.array:
        if "embed_tokens" in self.head:
            return self.head.embed_tokens(tokens)
        return self.target.embed_tokens(tokens)

    def _float_dtype(self):
        return self.head.norm.weight.dtype

    def _logits(self, i: int, y: mx.array, drafted: list) -> mx.array:
        small = self.head.lm_head(self.head.norm(y))  # [n, draft_vocab]
        if small.shape[-1] == self.vocab_size and self.head.d2t is None:
            return small
        full = mx.full((y.shape[0], self.vocab_size), -mx.inf, dtype=small.dtype)
        full[:, self._ids] = small
        return full

    def begin(self, tokens: list[int], hidden: mx.array | None) -> None:
        super().begin(tokens, None if hidden is None else self.head.fc(hidden))

    def commit(self, verdict, hidden: mx.array | None) -> None:
        n = verdict.n_accepted
        super().commit(verdict, None if hidden is None else self.head.fc(hidden[: n + 1]))


# -- loading ---------------------------------------------------------------------------------------------

def _rename(key: str) -> str | None:
    """HF names -> ours (None: not used). Speculators checkpoints name the midlayer `layers.0`."""
    for prefix in ("model.",):
        if key.startswith(prefix) and not key.startswith("model.lm_head"):
            key = key[len(prefix):]
    if key.startswith("layers.0."):
        key = "midlayer." + key[len("layers.0."):]
    if key == "t2d":
        return None
    return key


def _read_tensors(folder: Path) -> dict:
    # the weights are model*.safetensors (HF); other safetensors in the folder (a trainer's corpus) are not read
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise Eagle3Error(f"{folder}: no *.safetensors file (EAGLE-3 checkpoints must be in safetensors)")
    out = {}
    for f in files:
        try:
            out.update(mx.load(str(f)))
        except Exception as e:
            raise Eagle3Error(f"{f}: cannot read it as safetensors ({e})") from None
    return out


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise Eagle3Error(f"{folder}: no config.json (an EAGLE-3 checkpoint folder holds config.json and "
                          "*.safetensors)")
    cfg = json.loads(path.read_text())
    # speculators layout: the layer's config under transformer_layer_config
    return {**cfg.get("transformer_layer_config", {}), **{k: v for k, v in cfg.items()
                                                          if k != "transformer_layer_config"}}


def aux_ids_of(cfg: dict, num_layers: int) -> tuple[int, ...]:
    ids = cfg.get(AUX_KEY) or (cfg.get("eagle_config") or {}).get(AUX_KEY)
    ids = boundaries(ids) if ids else default_aux_ids(num_layers)
    if len(ids) != 3:
        raise Eagle3Error(f"{AUX_KEY} must name 3 layers, got {list(ids)}")
    return ids


def load_eagle3_head(path, target) -> Eagle3Head:
    """The head of an EAGLE-3 checkpoint folder, checked against `target` (a Target)."""
    folder = Path(path)
    if not folder.is_dir():
        raise Eagle3Error(f"EAGLE-3 checkpoint {folder} is not a folder")
    cfg = read_config(folder)
    tensors = {}
    for k, v in _read_tensors(folder).items():
        name = _rename(k)
        if name is not None:
            tensors[name] = v
    for need in ("fc.weight", "lm_head.weight", "norm.weight", "midlayer.self_attn.q_proj.weight"):
        if need not in tensors:
            raise Eagle3Error(f"{folder}: tensor {need!r} missing (not an EAGLE-3 checkpoint?)")
    target_hidden = int(getattr(getattr(target.text, "args", None), "hidden_size", 0)) or None
    n_layers = len(target.layers)
    h = int(tensors["fc.weight"].shape[0])
    fc_in = int(tensors["fc.weight"].shape[1])
    th = int(cfg.get("target_hidden_size") or fc_in // 3)
    if fc_in != 3 * th or (target_hidden is not None and th != target_hidden):
        raise Eagle3Error(f"{folder}: fc takes {fc_in} features; the target's hidden size is {target_hidden} "
                          f"(3 x {target_hidden} = {3 * (target_hidden or 0)} expected)")
    fields = {f: cfg[f] for f in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
                                  "head_dim", "rope_theta", "rope_scaling", "max_position_embeddings",
                                  "attention_bias", "mlp_bias", "rope_traditional") if cfg.get(f) is not None}
    for f in ("num_attention_heads", "intermediate_size"):
        if f not in fields:
            raise Eagle3Error(f"{folder}/config.json: {f!r} missing")
    fields.setdefault("rms_norm_eps", 1e-6)
    args = llama.ModelArgs(model_type="llama", hidden_size=h, num_hidden_layers=1,
                           vocab_size=int(cfg.get("vocab_size") or target.vocab_size), **fields)
    draft_vocab = int(tensors["lm_head.weight"].shape[0])
    head = Eagle3Head(args, th, draft_vocab, own_embed="embed_tokens.weight" in tensors,
                      norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    d2t = tensors.pop("d2t", None)
    if d2t is not None and d2t.shape != (draft_vocab,):
        raise Eagle3Error(f"{folder}: d2t has shape {tuple(d2t.shape)}, the draft vocabulary is {draft_vocab}")
    if d2t is None and draft_vocab != target.vocab_size:
        raise Eagle3Error(f"{folder}: lm_head scores {draft_vocab} tokens, the target {target.vocab_size}, "
                          "and there is no d2t map")
    try:
        head.load_weights(list(tensors.items()), strict=True)
    except ValueError as e:
        raise Eagle3Error(f"{folder}: tensors do not fit the EAGLE-3 layout ({e})") from None
    norm = getattr(target.inner, "norm", None)
    head.set_dtype(norm.weight.dtype if norm is not None and "weight" in norm else mx.float32)
    head.set_mapping(d2t, aux_request(aux_ids_of(cfg, n_layers), n_layers))
    head.eval()
    host.wait([v for _, v in tree_flatten(head.parameters())])
    return head


def load_eagle3_drafter(path, model, prefill_step: int = 2048) -> Eagle3Drafter:
    from ..target_model.model import Target

    target = model if isinstance(model, Target) else Target(model)
    return Eagle3Drafter(load_eagle3_head(path, target), target, prefill_step)
