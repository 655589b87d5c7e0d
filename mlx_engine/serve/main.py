"""`python -m mlx_engine serve`: load the model and drafter, start the engine thread, run uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from ..args import count, finite
from ..drafters import registry
from ..drafters.base import quantize_kv
from ..drafters.registry import DrafterError, DrafterOptions
from .intake import DEFAULT_MAX_BODY_BYTES
from .keepalive import DEFAULT_SECONDS as KEEPALIVE_SECONDS

BATCHING = ("auto", "continuous", "fair")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="hub repo id, local model folder or .gguf file (default: the embedded "
                                   "SmolLM2-135M-Instruct with its trained MTP head)")
    p.add_argument("--drafter", default=None,
                   help=f"one of {', '.join(registry.KINDS)} (default: mtp for the embedded model, else none)")
    p.add_argument("--draft-model", help="draft model for --drafter draft (same tokenizer as --model)")
    p.add_argument("--draft-vocab-subset", help="with --drafter draft: safetensors with a 'vocab_subset' id array")
    p.add_argument("--mtp-weights", help="MTP head file for --drafter mtp (default: found beside the model)")
    p.add_argument("--dflash", help="DFlash checkpoint folder for --drafter dflash")
    p.add_argument("--assistant", help="Gemma 4 assistant checkpoint folder for --drafter gemma4-assistant")
    p.add_argument("--num-draft", default="auto",
                   help="tokens drafted per cycle: k >= 0, or auto (default): per batch, the k that measures fastest")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=count(0), default=8080, help="port (default 8080; 0 = any free port)")
    p.add_argument("--max-concurrency", type=count(1), default=8,
                   help="requests decoded together in one batch (default 8); more wait in the queue")
    p.add_argument("--prefill-budget", type=float, default=1.0, metavar="SECONDS",
                   help="seconds a prompt chunk may take while no request decodes (default 1.0): lower answers a "
                        "request that arrives during a long prefill sooner, at some cost to that prefill's speed")
    p.add_argument("--max-queue", type=count(1), default=64,
                   help="requests running or waiting before new ones get 503 (default 64)")
    p.add_argument("--max-tokens", type=count(1), default=512,
                   help="default max_tokens of a request (default 512); any max_tokens is cut to the context left")
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request naming another model (default: the one model serves any name, "
                        "as agents send their own model names)")
    p.add_argument("--max-body-bytes", type=count(1), default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body, in bytes (default 8 MiB: a whole 128k-token context fits many times "
                        "over); a larger one gets 413")
    p.add_argument("--api-key", default=os.environ.get("MLX_ENGINE_API_KEY") or None,
                   help="requests must carry 'Authorization: Bearer KEY' (401 otherwise; /health stays open); "
                        "default: the environment variable MLX_ENGINE_API_KEY, else no key")
    p.add_argument("--shutdown-timeout", type=finite(0), default=20.0,
                   help="on Ctrl-C / SIGTERM, seconds running requests get to finish before they are cancelled "
                        "(default 20, under Kubernetes' 30 s grace period)")
    p.add_argument("--keepalive", type=finite(0), default=KEEPALIVE_SECONDS, metavar="SECONDS",
                   help=f"a stream silent this long (queued, prefilling) gets a keepalive: an SSE comment, Anthropic's "
                        f"ping (default {KEEPALIVE_SECONDS:g}; 0 = none), so clients' idle timeouts do not cut a long prefill")
    p.add_argument("--no-generation-config", dest="generation_config", action="store_false",
                   help="ignore the checkpoint's generation_config.json: a request naming no temperature / top_p / "
                        "top_k / penalties gets the server's defaults (greedy) instead of the checkpoint's")
    p.add_argument("--batching", choices=BATCHING, default="auto",
                   help="continuous: batch concurrent requests (KV-cache models); fair: one at a time, first come "
                        "first served (any model); auto (default): continuous where the model allows")
    from ..prepare import add_memory_args

    add_memory_args(p, prefix_cache=True)
    p.add_argument("--distributed", choices=("pipeline", "tensor"), default=None,
                   help="shard the target across the processes of `mlx.launch -n N -- python -m mlx_engine "
                        "serve ...`: rank 0 serves HTTP and drafts, the others follow its steps; one request at a time")
    p.add_argument("--batch-invariant", nargs="?", const="kernels", default=None, choices=("kernels", "fixed", "off"),
                   metavar="MODE",
                   help="every decode step batch invariant, so each request's tokens equal, bit for bit, the same "
                        "request decoded alone (plain or speculative, whatever runs beside it): 'kernels' (the flag "
                        "alone; continuous batching too), 'fixed' (16-row passes, --batching fair only), 'off' "
                        "(default; see the chat command's flag and docs/kernels.md)")


def context_length(config: dict) -> int:
    """The model's context window (models.context_length), 4096 where its config names none."""
    from ..models.config import context_length as named

    return named(config) or 4096


def build_service(args):
    """Load, pick the worker, warm up. -> Service (its worker not yet started)."""
    from ..prepare import UsageError, load_within_budget, parse_num_draft
    from ..core.engine import Engine
    from ..models import load
    from ..models.generation_config import sampling_defaults
    from .app import Service
    from .sampling_defaults import checked
    from .worker import FairQueueWorker

    num_draft = parse_num_draft(args.num_draft)
    if not 0 < getattr(args, "prefill_budget", 1.0) <= 60:
        raise UsageError(f"--prefill-budget must be in (0, 60] seconds, got {args.prefill_budget}")
    invariant = getattr(args, "batch_invariant", None)
    if invariant == "fixed" and args.batching != "fair":
        raise UsageError("--batch-invariant fixed pads one sequence per pass: use it with --batching fair, "
                         "or --batch-invariant kernels with continuous batching")
    distributed = getattr(args, "distributed", None)
    if distributed:  # this rank's shard; rank 0 serves, the others follow its steps (mlx_engine/distributed)
        from ..distributed.command import load_for_command

        loaded = load_for_command(args.model, distributed, serving=True, batching=args.batching)
    else:
        loaded = load_within_budget(args.model, args.max_memory)
    kind = args.drafter or ("mtp" if args.model is None else "none")
    opts = DrafterOptions(draft_model=args.draft_model, draft_vocab_subset=args.draft_vocab_subset,
                          mtp_weights=args.mtp_weights, dflash=getattr(args, "dflash", None),
                          assistant=getattr(args, "assistant", None))
    try:
        drafter = registry.make_drafter(kind, loaded, opts) if getattr(loaded, "leader", True) else None
    except DrafterError as e:
        raise UsageError(str(e)) from None
    why_not = quantize_kv(drafter, args.draft_kv_bits, args.kv_group_size)
    if why_not and args.draft_kv_bits is not None:
        raise UsageError(f"--draft-kv-bits: {why_not}")
    try:
        budget, tree = memory_plan(loaded, drafter, args)
    except ValueError as e:  # a KV quantization the model cannot take, weights over the budget
        raise UsageError(str(e)) from None
    memory = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, context_length=context_length(loaded.config),
                  memory=budget, prefix_cache_bytes=tree, prefix_cache_dir=args.prefix_cache_dir,
                  prefix_disk_bytes=args.prefix_cache_disk)
    common = dict(max_queue=args.max_queue, num_draft=num_draft)
    worker = None
    why = "--batching fair" if args.batching == "fair" else \
        "a sharded target (--distributed) runs one request at a time" if distributed else None
    if args.batching != "fair" and not distributed:
        from ..core.batch_engine import BatchEngine
        from .batch import BatchWorker

        try:
            engine = BatchEngine(loaded.model, drafter, num_draft=num_draft, max_batch=args.max_concurrency,
                                 batch_invariant=invariant, idle_budget=args.prefill_budget, **memory)
        except ValueError as e:  # e.g. batch invariance with a quantized KV cache
            raise UsageError(str(e)) from None
        if engine.supported is None:
            worker = BatchWorker(engine, loaded.tokenizer, drafter.name if drafter is not None else None, **common)
        elif args.batching == "continuous":
            raise UsageError(f"--batching continuous: this model cannot be batched ({engine.supported})")
        else:
            why = f"this model cannot be batched yet: {engine.supported}"
            print(f"note: serving one request at a time (fair queue): {why}", file=sys.stderr)
    if worker is None:
        try:
            make_engine = getattr(loaded, "engine_class", Engine)  # sharded: a DistributedEngine
            engine = make_engine(loaded.model, drafter, batch_invariant=invariant, **memory)
        except ValueError as e:
            raise UsageError(str(e)) from None
        worker = FairQueueWorker(engine, loaded.tokenizer, why=why, **common)
    name = Path(str(loaded.path)).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    service = Service(name, loaded.tokenizer, context_length(loaded.config), loaded.vocab_size, worker, args.max_tokens,
                      max_body_bytes=args.max_body_bytes, api_key=args.api_key, memory=budget,
                      strict_model_name=args.strict_model_name, drafter=kind,
                      keepalive=getattr(args, "keepalive", KEEPALIVE_SECONDS))
    if getattr(args, "generation_config", True):
        service.sampling_defaults, refused = checked(sampling_defaults(loaded.path))
        for line in refused:
            print(f"note: generation_config.json: {line}; the server's default is kept", file=sys.stderr)
    return service, kind


def defaults_line(service) -> str:
    """What the start-up line says of a request's sampling defaults."""
    if not service.sampling_defaults:
        return "sampling defaults: the server's (greedy)"
    values = ", ".join(f"{k} {v:g}" for k, v in service.sampling_defaults.items())
    return f"sampling defaults from generation_config.json: {values}"


def cache_line(status: dict) -> str:
    """What the start-up line says of the caches: the layers' kinds and what the prefix cache keeps."""
    layers = ", ".join(f"{n} {kind}" for kind, n in (status.get("layers") or {}).items())
    tree = status.get("prefix_cache")
    if status["mode"] != "continuous":
        return f"layers {layers}; " * bool(layers) + f"fair queue: {status.get('why_fair_queue')}"
    if tree is None:
        return f"layers {layers}; no prefix cache"
    kept = tree.get("reuse", "entries")
    disk = tree.get("disk")
    on_disk = (f", on disk {disk['folder']} within {disk['budget_bytes'] / 2**30:.1f} GiB ({disk['entries']} entries, "
               f"{disk['bytes'] / 2**30:.2f} GiB now)") if disk else ", RAM only"
    return f"layers {layers}; prefix cache {tree['budget_bytes'] / 2**30:.2f} GiB ({kept}){on_disk}"


def memory_plan(loaded, drafter, args):
    """The memory budget (core/memory.py), checked against the weights and the prefix tree's share (--prefix-cache,
    default a tenth of the budget). -> (budget, bytes for the prefix tree)."""
    from ..core.memory import device_memory, plan
    from ..target_model.cache import check_kv_quantization
    from ..target_model.model import Target

    check_kv_quantization(args.kv_bits, args.kv_group_size)
    limit = args.max_memory or device_memory()
    tree = args.prefix_cache if args.prefix_cache is not None else limit // 10
    target = Target(loaded.model, args.kv_bits, args.kv_group_size)
    target.check_cache()
    budget = plan(loaded.model, drafter, target, limit, reserved=tree, what=Path(str(loaded.path)).name)
    budget.check_load()
    return budget, tree


def make_server(service, args, port: int):
    """The uvicorn server over the app; on shutdown it waits --shutdown-timeout s for running requests."""
    import uvicorn

    from .app import create_app

    config = uvicorn.Config(create_app(service), host=args.host, port=port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    return uvicorn.Server(config)


def request_log() -> None:
    """The app's request log (one line per request, app.RequestLog) on stderr at info level."""
    import logging

    class Stderr(logging.StreamHandler):  # sys.stderr as it is when a line is written (tests swap it)
        stream = property(lambda self: sys.stderr, lambda self, value: None)

    logger = logging.getLogger("mlx_engine.serve")
    if not logger.handlers:
        handler = Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def beyond_loopback(host: str) -> bool:
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return True


def run_serve(args) -> int:
    from ..prepare import UsageError

    if getattr(args, "distributed", None):
        from ..distributed.command import leads

        if not leads():  # a follower serves no HTTP: it runs the generations rank 0 announces
            return build_service(args)[0].worker.engine.follow()
    # bound here, before the load, so a taken port fails at once and --port 0 can say which port it got
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    port = sock.getsockname()[1]
    try:
        service, kind = build_service(args)
    except BaseException:
        sock.close()
        raise
    service.worker.start()
    request_log()
    server = make_server(service, args, port)
    if beyond_loopback(args.host) and not args.api_key:
        print(f"warning: listening on {args.host}, beyond this machine, with no API key: anyone who can reach port "
              f"{port} can use the model (set --api-key or MLX_ENGINE_API_KEY)", file=sys.stderr, flush=True)
    status = service.worker.status()
    print(f"serving {service.model_id} on http://{args.host}:{port}/v1 (drafter {kind}, num-draft "
          f"{args.num_draft}, {service.worker.mode}, up to {args.max_concurrency if status['mode'] == 'continuous' else 1} "
          f"at once{', batch invariant' if status['batch_invariant'] else ''}; {cache_line(status)}; "
          f"context {service.context_length}; {defaults_line(service)})",
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        service.worker.stop()
        sock.close()
    return 0
