"""The target sharded across the group by mlx-lm's own sharded loading, and what each drafter needs there.

`load_sharded(model, mode)` calls mlx-lm's `sharded_load`: it reads the model lazily, asks the family
for `model.model.pipeline(group)` (layers split into stages; rank 0 holds the LAST layers, and mlx-lm
all_gathers the last stage's output, so every rank computes the same final hidden state and logits) or
`model.shard(group)` (every weight matrix split; an all_sum after each attention and MLP block), fetches
from the hub only the files this rank's shard needs, and evaluates only those weights. Each rank holds
only its shard. A GGUF file is refused (convert it to an MLX folder first).

Where the drafter runs: on rank 0 only (core of the argument: its drafts ride in the one control packet
a cycle needs anyway, so they cost no collective; the other ranks hold no drafter memory and need not
draw the same numbers). What it may read there: the final-normed hidden state (MTP heads: every rank has
it), target layers it holds (EAGLE-3 / DFlash: with tensor sharding every rank holds every layer's full
output; with a pipeline only the last stage's layers), never the target's KV cache (split across ranks).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..models import LoadedModel, cast_floats, default_dtype, default_model
from .group import MODES, DistributedError, init


class ShardedModel(LoadedModel):
    """A LoadedModel holding this rank's shard; `group`, `mode` and `leader` say which."""

    group: mx.distributed.Group
    mode: str

    @property
    def leader(self) -> bool:
        return self.group.rank() == 0


def _local_path(model: str) -> Path:
    """The folder a model id names (the hub's cached snapshot for a repo id: configs only)."""
    p = Path(model).expanduser()
    if p.exists():
        return p
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json"]))


def _check_tensor_split(config: dict, size: int) -> None:
    text = config.get("text_config") or config
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = text.get(key)
        if n is not None and n % size:
            raise DistributedError(f"--distributed tensor: this model's {key} ({n}) is not divisible by the "
                                   f"{size} processes; run a number of processes that divides it, or a pipeline")


def load_sharded(model: str | None, mode: str, group: mx.distributed.Group | None = None) -> ShardedModel:
    """This rank's shard of `model` (None: the embedded default), `mode` pipeline or tensor."""
    from mlx_lm.utils import sharded_load

    if mode not in MODES:
        raise DistributedError(f"--distributed must be one of {', '.join(MODES)}, got {mode!r}")
    group = group or init()
    name = model if model is not None else default_model()
    if str(name).endswith(".gguf"):
        raise DistributedError(f"{name}: a GGUF file cannot be sharded here; convert it to an MLX folder first "
                               f"(python -m mlx_engine convert --hf-path ... --mlx-path ...)")
    path = _local_path(str(name))
    import json

    config_file = path / "config.json"
    if not config_file.exists():
        raise DistributedError(f"{path} has no config.json: not a model folder")
    config = json.loads(config_file.read_text())
    if mode == "tensor":
        _check_tensor_split(config, group.size())
    groups = dict(pipeline_group=group) if mode == "pipeline" else dict(tensor_group=group)
    try:
        if mode == "pipeline" and not (path / "model.safetensors.index.json").exists():
            sharded, tokenizer, config = _shard_unindexed(path, group)  # a folder of one weights file
        else:
            sharded, tokenizer, config = sharded_load(str(name), return_config=True, **groups)
    except ValueError as e:  # the family has no pipeline() / shard(), or more stages than layers
        other = "tensor" if mode == "pipeline" else "pipeline"
        raise DistributedError(f"--distributed {mode}: {e} (try --distributed {other})") from None
    dtype = default_dtype()
    if dtype is not None:  # fp32 on the CPU, as models.load does (cast after mlx-lm evaluated the shard)
        cast_floats(sharded, dtype)
        mx.eval(sharded.parameters())
    out = ShardedModel(sharded, tokenizer, config, path)
    out.group, out.mode = group, mode
    return out


def _shard_unindexed(path: Path, group):
    """sharded_load's steps for a local folder without a weight index (which it needs only to pick the
    files of a stage to download): lazy load, mlx-lm's pipeline(), evaluate this stage's weights."""
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(path, lazy=True, strict=False)
    if not hasattr(getattr(model, "model", None), "pipeline"):
        raise ValueError("The model does not support pipelining but a pipeline_group was provided")
    model.model.pipeline(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank loaded
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id")), config


def pipeline_stage(model) -> tuple[int, int, int] | None:
    """(start, end, stages) of the layers this rank holds in a pipeline; None when not pipelined."""
    inner = getattr(getattr(model, "language_model", model), "model", None)
    size = getattr(inner, "pipeline_size", 1)
    if size <= 1:
        return None
    return inner.start_idx, inner.end_idx if inner.end_idx is not None else len(inner.layers), size


def drafter_refusal(drafter, model) -> str | None:
    """Why `drafter` cannot run on rank 0 of this sharded target (None: it can)."""
    if drafter is None:
        return None
    name = getattr(drafter, "name", "this drafter")
    members = getattr(drafter, "members", None) or {name: drafter}
    for member in members.values():
        if getattr(member, "reads_target_cache", False):
            return (f"the {getattr(member, 'name', name)} drafter attends the target's own KV cache, which "
                    f"sharding splits across the ranks")
    stage = pipeline_stage(model)
    if stage is None:
        return None
    from ..drafters.base import hidden_request

    start, end, size = stage
    request = hidden_request(drafter)
    n_layers = end  # rank 0 holds the last stage: its layer list runs to the model's last layer
    for i in request.layers if request is not None else ():
        layer = i % n_layers
        if not start <= layer < end:
            return (f"the {name} drafter reads the output of target layer {layer}, which a pipeline of {size} "
                    f"keeps on another rank (rank 0 holds layers {start}-{end - 1}); use --distributed tensor")
    return None
