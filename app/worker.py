"""The engine worker: ONE long-lived thread that owns the model (load + generate).

The UI sends it commands through a queue and reads nothing back directly: the worker posts messages
(app/messages.py) to the app. High-rate updates are coalesced here (at most one progress message per
`interval` seconds). Stopping sets a flag the worker checks between engine cycles; the draft length and
speculation on/off are read between cycles too, so they change live.
"""

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_engine import Engine, GenerationConfig, ModelLoadError, NgramDrafter, SamplingConfig
from mlx_engine.core.context import ContextLengthError, check_context
from mlx_engine.core.memory import MemoryBudgetError, plan
from mlx_engine.drafters.base import quantize_kv
from mlx_engine.drafters.registry import DrafterOptions, make_drafter
from mlx_engine.models import load as load_model

from .messages import (
    GenerationFinished, GenerationProgress, GenerationStarted, ModelLoaded, ModelLoadFailed, ModelLoading,
    PrefillProgress, Snapshot, TurnTiming,
)
from .chat_text import PieceDecoder, decode, encode_chat
from .speedup import prompt_key

PREFILL_BAR_MIN = 1024  # prompts at least this long report their prefill chunk by chunk (a progress bar)
PROMPT_CACHE_BYTES = 1 << 30  # the RAM prefix tree in front of the disk tier


class NoModel(Exception):
    """No model could be chosen (no --model and no embedded default)."""


def default_model(progress=None) -> str:
    """The embedded default model's path (mlx_engine.models.default), or NoModel with what to do."""
    try:
        from mlx_engine.models.default import default_model_path
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("mlx_engine.models.default"):
            raise NoModel(
                "No model given and the embedded default model (SmolLM2-135M-Instruct) is not available in "
                "this build yet. Start with `python -m app --model PATH_OR_REPO` (a hub id, a local folder "
                "or a .gguf file), or press ctrl+o to open one."
            ) from None
        raise NoModel(f"The embedded default model needs a package that is missing: {e}. Use --model.") from None
    except ImportError as e:
        raise NoModel(f"The embedded default model could not be imported: {e}. Use --model.") from None
    try:
        return str(default_model_path(progress) if progress else default_model_path())
    except Exception as e:  # a missing wheel, a broken file...
        raise NoModel(f"The embedded default model is not available: {e}. Use --model.") from None


class LivePolicy:
    """The draft-length policy the engine asks each cycle (engines with `Engine.policy`), driven live by
    the UI: speculation off = plain decoding in short stretches (so turning it back on takes effect
    quickly), a fixed k, or "auto" = the engine's adaptive policy, which keeps learning either way."""

    PLAIN_STRETCH = 16

    def __init__(self, worker: "EngineWorker", inner=None, shown: "LivePolicy | None" = None):
        self.worker = worker
        self.inner = inner  # the engine's AdaptivePolicy (or None)
        self.last_k = 0  # k chosen for the cycle that produced the latest step
        self.shown = shown or self  # whose last_k the stats panel reads (a chain member's: its engine's)

    def next_k(self) -> int:
        k = self.worker._live_k(self.inner)
        self.last_k = self.shown.last_k = k
        return k

    def for_member(self, **settings) -> "LivePolicy":
        """A chain member's own adaptive policy (core/members.py) under the same live controls (off, fixed k)."""
        return LivePolicy(self.worker, self.inner and self.inner.for_member(**settings), shown=self.shown)

    def plain_run(self) -> int:
        if self.inner is not None and self.worker._live_mode() == "auto":
            return min(self.inner.plain_run(), 64)
        return self.PLAIN_STRETCH

    def begin(self, regime=None) -> None:
        if self.inner is not None:
            self.inner.begin(regime)

    def observe(self, k: int, n_accepted: int, seconds: float, tokens: int = 1) -> None:
        if self.inner is not None:
            try:
                self.inner.observe(k, n_accepted, seconds, tokens=tokens)
            except Exception:
                pass


def model_name(path_or_repo: str) -> str:
    p = Path(path_or_repo)
    return p.name or path_or_repo


@dataclass
class EngineOptions:
    """How the engine holds its caches, for the whole run (the chat's --kv-bits, --draft-kv-bits, --max-memory)."""

    kv_bits: int | None = None
    kv_group_size: int = 64
    draft_kv_bits: int | None = None
    max_memory: int | None = None  # bytes; None: MLX's memory limit
    prefix_cache_dir: str | None = None  # the prefix cache's disk tier (None: none, and no prefix tree)
    prefix_disk_bytes: int | None = None


@dataclass
class LoadRequest:
    model: str | None  # None = the embedded default
    drafter: str = "ngram"
    draft_model: str | None = None


@dataclass
class GenerateRequest:
    turn: int
    messages: list[dict]
    temperature: float
    max_tokens: int


class EngineWorker:
    """Owns the model in one thread. `post` delivers messages to the UI (App.post_message)."""

    def __init__(self, post: Callable, interval: float = 0.1, profile_every: int = 8,
                 options: EngineOptions | None = None):
        self.post = post
        self.options = options or EngineOptions()
        self.interval = interval
        self.profile_every = profile_every
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._num_draft: int | str = "auto"
        self._speculation = True
        self.loaded = None
        self.engine: Engine | None = None
        self.drafter = None
        self.busy = False  # a generation is running
        self.context_length: int | None = None  # the loaded model's context window (None: it names none)
        self.prefill_step: int | None = None  # prompt tokens per prefill chunk (None: the engine's default)
        self.prefill_bar_min = PREFILL_BAR_MIN
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    # -- called from the UI thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def load(self, request: LoadRequest) -> None:
        self._queue.put(("load", request))

    def generate(self, request: GenerateRequest) -> None:
        self._stop.clear()
        self.busy = True
        self._queue.put(("generate", request))

    def stop(self) -> None:
        """Ask the running generation to stop after the current cycle."""
        self._stop.set()

    def set_live(self, num_draft: int | str, speculation: bool) -> None:
        with self._lock:
            self._num_draft, self._speculation = num_draft, speculation

    def shutdown(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._queue.put(("quit", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if getattr(self, "engine", None) is not None:  # what the disk tier has queued is written before the exit
            self.engine.flush_prefix_disk(timeout=10.0)

    # -- the worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        # MLX streams are per thread: this thread gets its own on the default device and keeps it.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        while True:
            cmd, arg = self._queue.get()
            if cmd == "quit":
                return
            try:
                if cmd == "load":
                    self._load(arg)
                elif cmd == "generate":
                    self._generate(arg)
            except Exception as e:  # never let the thread die; the UI shows the error
                error = f"internal error: {type(e).__name__}: {e}"
                if cmd == "generate":
                    self.post(GenerationFinished(arg.turn, "", "error", Snapshot(), error))
                else:
                    self.post(ModelLoadFailed(error))
            finally:
                if cmd == "generate":
                    self.busy = False

    def _load(self, req: LoadRequest) -> None:
        total = 3 if req.drafter == "none" else 4
        try:
            self.post(ModelLoading("Choosing the model", 0, total))
            # first use downloads and converts the default: its progress goes to the loading screen
            progress = lambda what, frac: self.post(ModelLoading(what if frac is None else f"{what} {frac:.0%}", 0, total))  # noqa: E731
            path = req.model if req.model else default_model(progress)
            self.post(ModelLoading(f"Loading {path}", 1, total))
            loaded = load_model(path)
        except NoModel as e:
            self.post(ModelLoadFailed(str(e)))
            return
        except ModelLoadError as e:
            self.post(ModelLoadFailed(str(e)))
            return
        except Exception as e:  # anything the loaders let through: shown, never a traceback
            self.post(ModelLoadFailed(f"could not load {req.model or 'the default model'}: {type(e).__name__}: {e}"))
            return
        warning = None
        drafter = None
        if req.drafter != "none":
            self.post(ModelLoading(f"Setting up the {req.drafter} drafter", 2, total))
            try:
                drafter = self._make_drafter(req, loaded)
            except Exception as e:  # e.g. a model without MTP heads: fall back to prompt lookup
                warning = f"drafter '{req.drafter}' unavailable, using ngram (prompt lookup) instead: {e}"
                drafter = NgramDrafter()
        self.post(ModelLoading("Warming up", total - 1, total))
        try:
            tokens = encode_chat(loaded.tokenizer, [{"role": "user", "content": "hi"}])[:8] or [0]
            for _ in Engine(loaded.model).generate(tokens, GenerationConfig(max_tokens=2, num_draft=0)):  # no drafter
                pass
        except Exception as e:
            self.post(ModelLoadFailed(f"the model loaded but could not run: {type(e).__name__}: {e}"))
            return
        context = loaded.context_length
        o = self.options
        why_not = quantize_kv(drafter, o.draft_kv_bits, o.kv_group_size)
        if why_not and o.draft_kv_bits is not None:
            warning = (warning + "; " if warning else "") + f"--draft-kv-bits not applied: {why_not}"
        try:  # built with its drafter (the policy gets the drafter's settings), the context window and memory it checks
            disk = dict(prefix_cache_bytes=PROMPT_CACHE_BYTES, prefix_cache_dir=o.prefix_cache_dir,
                        prefix_disk_bytes=o.prefix_disk_bytes) if o.prefix_cache_dir else {}
            engine = Engine(loaded.model, drafter, context_length=context, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size,
                            **disk)
            engine.memory = plan(loaded.model, drafter, engine.target, o.max_memory, what=model_name(str(path)))
            engine.memory.check_load()
        except ValueError as e:  # a KV quantization the model cannot take, weights over the memory budget
            self.post(ModelLoadFailed(str(e)))
            return
        self.loaded, self.engine, self.drafter, self.context_length = loaded, engine, drafter, context
        info = f"{loaded.config.get('model_type', '?')}, vocab {engine.target.vocab_size}" + (
            f", context {context:,} tokens" if context else "")
        name = model_name(str(path))
        self.post(ModelLoaded(name, drafter.name if drafter is not None else "none", info, warning))

    def _make_drafter(self, req: LoadRequest, loaded):
        # one path field: the draft model, the DFlash checkpoint or the Gemma 4 assistant, by kind
        return make_drafter(req.drafter, loaded, DrafterOptions.for_kind(req.drafter, req.draft_model))

    def _live_mode(self) -> str:
        with self._lock:
            num_draft, on = self._num_draft, self._speculation
        if not on or self.engine is None or self.engine.drafter is None:
            return "off"
        return "auto" if num_draft == "auto" else "fixed"

    def _live_k(self, policy) -> int:
        with self._lock:
            num_draft, on = self._num_draft, self._speculation
        if not on or self.engine is None or self.engine.drafter is None:
            return 0
        if num_draft == "auto":
            return max(0, int(policy.next_k()))
        return int(num_draft)

    def _generate(self, req: GenerateRequest) -> None:
        engine, loaded = self.engine, self.loaded
        empty = Snapshot()
        if engine is None:
            self.post(GenerationFinished(req.turn, "", "error", empty, "no model is loaded"))
            return
        tokenizer = loaded.tokenizer
        try:
            prompt = encode_chat(tokenizer, req.messages)
        except Exception as e:
            self.post(GenerationFinished(req.turn, "", "error", empty, f"chat template failed: {e}"))
            return
        try:  # before any work: a prompt the context window or the memory budget cannot hold is never sent
            check_context(len(prompt), req.max_tokens, self.context_length)
            if engine.memory is not None:
                engine.memory.check_sequence(len(prompt) + req.max_tokens)
        except (ContextLengthError, MemoryBudgetError) as e:
            self.post(GenerationFinished(req.turn, "", "context", empty, str(e)))
            return
        eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or [])
        seed = 0 if req.temperature == 0 else time.time_ns() % (2**31)
        # the engine asks LivePolicy for k every cycle, so speculation on/off and k change live
        if not isinstance(engine.policy, LivePolicy):
            engine.policy = LivePolicy(self, engine.policy)
        live = engine.policy

        def on_prefill(done: int, total: int) -> None:  # called between prefill chunks, on this thread
            if total >= self.prefill_bar_min:
                self.post(PrefillProgress(req.turn, done, total))

        chunking = {"prefill_step": self.prefill_step} if self.prefill_step else {}
        cfg = GenerationConfig(
            max_tokens=req.max_tokens, num_draft="auto",
            seed=seed, stop_tokens=eos, sampling=SamplingConfig(temperature=req.temperature),
            profile_every=self.profile_every, on_prefill=on_prefill, should_stop=self._stop.is_set, **chunking,
        )
        self.post(GenerationStarted(req.turn, len(prompt), prompt_key(prompt, req.temperature)))
        decoder = PieceDecoder(tokenizer)
        pieces: list[tuple[str, bool]] = []
        out_tokens: list[int] = []
        timing = TurnTiming()
        last_post = time.perf_counter()
        last_post_tokens = 0
        last_post_time = 0.0
        last_draft = 0
        reason = "max_tokens"
        error = None

        def snapshot() -> Snapshot:
            nonlocal last_post_tokens, last_post_time
            decoded = timing.plain_tokens + timing.spec_tokens
            spent = timing.plain_time + timing.spec_time
            dt = spent - last_post_time
            tps = (decoded - last_post_tokens) / dt if dt > 0 else 0.0
            last_post_tokens, last_post_time = decoded, spent
            return Snapshot(
                stats=engine.stats.to_dict(), k=current_k(), last_draft=last_draft, interval_tps=tps,
                timing=TurnTiming(**vars(timing)), reprefill=len(prompt) - engine.stats.reused_tokens,
            )

        def current_k() -> int:
            return live.last_k

        gen = engine.generate(prompt, cfg)
        first = True
        try:
            while True:
                if self._stop.is_set():
                    reason = "stopped"
                    break
                t0 = time.perf_counter()
                try:
                    step = next(gen)
                except StopIteration:
                    if engine.stats.cancelled:  # Esc while the prompt was read: ended between two chunks
                        reason = "stopped"
                    elif out_tokens and out_tokens[-1] in eos:
                        reason = "eos"
                    break
                dt = time.perf_counter() - t0
                k = current_k()
                if not first:  # decode cycles only: the first step is the prefill
                    if k > 0:
                        timing.spec_tokens += len(step.tokens)
                        timing.spec_time += dt
                    else:
                        timing.plain_tokens += len(step.tokens)
                        timing.plain_time += dt
                first = False
                last_draft = len(step.draft)
                for i, tok in enumerate(step.tokens):
                    out_tokens.append(tok)
                    if tok in eos:
                        continue
                    piece = decoder.add(tok, i < step.n_accepted)
                    if piece:
                        pieces.append(piece)
                now = time.perf_counter()
                if now - last_post >= self.interval:
                    self.post(GenerationProgress(req.turn, pieces, snapshot()))
                    pieces = []
                    last_post = now
        except Exception as e:
            reason, error = "error", f"{type(e).__name__}: {e}"
        finally:
            gen.close()
        piece = decoder.flush()
        if piece:
            pieces.append(piece)
        if out_tokens and out_tokens[-1] in eos and reason == "max_tokens":
            reason = "eos"
        if pieces:
            self.post(GenerationProgress(req.turn, pieces, snapshot()))
        text = decode(tokenizer, [t for t in out_tokens if t not in eos])
        self.post(GenerationFinished(req.turn, text, reason, snapshot(), error))
