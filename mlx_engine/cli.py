"""`python -m mlx_engine generate ...`: one generation through the engine, as text or JSON."""

import argparse
import json
import sys

from . import text
from .args import count, finite
from .drafters import registry
from .core.context import ContextLengthError, check_context
from .core.engine import Engine, GenerationConfig
from .core.memory import plan
from .drafters.base import quantize_kv
from .models import ModelLoadError
from .prepare import (UsageError, add_disk_args, add_memory_args, grammar_of, load_within_budget, make_drafter,  # noqa: F401
                      parse_num_draft)
from .sampling import SamplingConfig

DRAFTERS = registry.KINDS


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="hub repo id, local model folder, or .gguf file (default: the embedded "
                                    "SmolLM2-135M-Instruct, whose trained MTP head --drafter mtp finds by itself)")
    p.add_argument("--drafter", default="none", help=f"one of {', '.join(DRAFTERS)} (default: none = plain decoding)")
    p.add_argument("--draft-model", help="draft model for --drafter draft (same tokenizer as --model)")
    p.add_argument("--draft-vocab-subset",
                   help="with --drafter draft: a safetensors file with a 'vocab_subset' array of token ids (e.g. a "
                        "head from train-mtp --vocab-subset N); the draft scores only those tokens (cheaper, lossless)")
    p.add_argument("--mtp-weights",
                   help="the MTP head for --drafter mtp: a safetensors file, a GGUF with llama.cpp's nextn tensors "
                        "(GLM-4.x), a folder with a checkpoint's index and head shards, or hub:OWNER/NAME (only the "
                        "shards holding the head are fetched, once; 'hub': the target's base_model) (default: the "
                        "head next to the model, one fetched before for its base model, or the one shipped for it)")
    p.add_argument("--eagle3", metavar="PATH",
                   help="EAGLE-3 checkpoint folder (config.json + safetensors, Hugging Face layout) or hub:OWNER/NAME "
                        "for --drafter eagle3")
    p.add_argument("--dflash", help="DFlash checkpoint folder (z-lab layout) or hub:OWNER/NAME for --drafter dflash")
    p.add_argument("--assistant", help="Gemma 4 assistant checkpoint folder or hub:OWNER/NAME for --drafter "
                                       "gemma4-assistant (the target must be a Gemma 4 model)")
    p.add_argument("--num-draft", default="auto",
                   help="tokens drafted per cycle: k >= 0, or auto (default): the k that measures fastest, 0 included")
    p.add_argument("--temp", type=finite(0.0), default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=finite(), default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=finite(), default=0.0, help="drop tokens below min-p times the best (0 = off)")
    p.add_argument("--repetition-penalty", type=finite(), default=1.0, help="penalty for recent tokens (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--batch-invariant", nargs="?", const="kernels", default=None, choices=("kernels", "fixed", "off"),
                   metavar="MODE",
                   help="decode plain and verify steps batch invariant, so speculative output equals plain output "
                        "bit for bit on any device: 'kernels' (the flag alone) routes matmuls and attention through "
                        "the batch-invariant kernels; 'fixed' runs every decode and verify pass at 16 token rows "
                        "(MLX's own ops where a check at load finds their rows independent at that shape, else the "
                        "kernels; drafts capped at 15); 'off'. Default: off (on a GPU both are still unmeasured or slower than stock "
                        "decoding, see docs/kernels.md)")
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_const", const="off",
                   help="same as --batch-invariant off")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-tokens", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--no-chat-template", action="store_true", help="encode --prompt as is, without the chat template")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--grammar", metavar="SPEC",
                   help="structured output: json (any JSON object), json:SCHEMA_FILE, regex:PATTERN or lark:FILE; "
                        "every token is one the grammar allows, its forced tokens are drafted "
                        "(docs/structured-output.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, stats")
    p.add_argument("--trace", action="store_true", help="with --json: add one entry per verify cycle")
    p.add_argument("--prefill-step", type=count(1), default=512,
                   help="prompt tokens per prefill pass (default 512): progress and Ctrl-C are seen between passes")
    p.add_argument("--distributed", choices=("pipeline", "tensor"), default=None,
                   help="shard the target across the processes of `mlx.launch -n N -- python -m mlx_engine generate "
                        "...` (mlx-lm's sharded loading): pipeline (stages of layers) or tensor (every matrix split); "
                        "rank 0 drafts, decides and prints")
    add_memory_args(p)
    add_disk_args(p, default_on=False)


def parse_prompt_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-tokens must be comma-separated integers, got {text!r}") from None
    if not tokens:
        raise UsageError("the prompt is empty")
    return tokens


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    if not text.strip():
        raise UsageError("the prompt is empty" if not text else "the prompt is only whitespace")
    if chat_template and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text))


def build(args):
    """Validate arguments, load model and drafter. Returns (loaded, engine, prompt, config)."""
    args.num_draft = parse_num_draft(args.num_draft)
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.drafter not in DRAFTERS:
        raise UsageError(f"unknown drafter {args.drafter!r}; choose one of {', '.join(DRAFTERS)}")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("the prompt is empty" if not args.prompt else "the prompt is only whitespace")
    try:
        sampling = SamplingConfig(
            temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.trace and not args.json:
        raise UsageError("--trace adds the cycles to the --json output: give --json too")
    prompt = parse_prompt_tokens(args.prompt_tokens) if args.prompt_tokens is not None else None
    if getattr(args, "distributed", None):  # this rank's shard only (mlx_engine/distributed)
        from .distributed.command import load_for_command

        loaded = load_for_command(args.model, args.distributed)
    else:
        loaded = load_within_budget(args.model, args.max_memory)  # None: the embedded default model
    if prompt is None:
        prompt = encode_prompt(loaded.tokenizer, args.prompt, not args.no_chat_template)
    try:  # before the drafter loads and anything is prefilled
        check_context(len(prompt), args.max_tokens, loaded.context_length)
    except ContextLengthError as e:
        raise UsageError(f"{e} (--max-tokens {args.max_tokens})") from None
    drafter = make_drafter(args, loaded) if getattr(loaded, "leader", True) else None  # (sharded: rank 0's)
    why_not = quantize_kv(drafter, args.draft_kv_bits, args.kv_group_size)
    if why_not and args.draft_kv_bits is not None:
        raise UsageError(f"--draft-kv-bits: {why_not}")
    stop = frozenset() if args.ignore_eos else frozenset(getattr(loaded.tokenizer, "eos_token_ids", None) or ())
    config = GenerationConfig(
        max_tokens=args.max_tokens, num_draft=args.num_draft, sampling=sampling, seed=args.seed,
        stop_tokens=stop, profile_every=8 if args.json else 0, on_prefill=PrefillBar(), prefill_step=args.prefill_step,
        grammar=grammar_of(args, loaded),
    )
    try:
        make_engine = getattr(loaded, "engine_class", Engine)  # sharded: a DistributedEngine over its group
        disk = dict(prefix_cache_bytes=PROMPT_CACHE_BYTES, prefix_cache_dir=args.prefix_cache_dir,
                    prefix_disk_bytes=args.prefix_cache_disk) if args.prefix_cache_dir else {}
        engine = make_engine(loaded.model, drafter, batch_invariant=args.batch_invariant,
                             context_length=loaded.context_length, kv_bits=args.kv_bits,
                             kv_group_size=args.kv_group_size, **disk)
        engine.memory = plan(loaded.model, drafter, engine.target, args.max_memory, what=loaded.path.name)
        engine.memory.check_load()
        engine.memory.check_sequence(len(prompt) + args.max_tokens)
    except ValueError as e:  # a KV quantization the model cannot take, a budget it does not fit
        raise UsageError(str(e)) from None
    return loaded, engine, prompt, config


class PrefillBar:
    """GenerationConfig.on_prefill for a terminal: a tqdm bar on stderr while a prompt of more than one
    chunk is prefilled (tqdm: rate, elapsed and remaining time as users know them; off when stderr is no
    terminal)."""

    def __init__(self, min_tokens: int = 1024):
        self.min_tokens = min_tokens
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if done == 0:
            self.close()
            if total >= self.min_tokens:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, disable=None,
                                leave=False, dynamic_ncols=True)
            return
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if done >= total:
                self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


PROMPT_CACHE_BYTES = 1 << 30  # generate --prefix-cache-dir: the RAM tree in front of the disk tier


def run_generate(args) -> int:
    loaded, engine, prompt, config = build(args)
    tokenizer = loaded.tokenizer
    special = text.special_ids(tokenizer)  # <|im_end|> and the like: in "tokens", never in the text
    tokens, trace = [], []
    detok = tokenizer.detokenizer
    detok.reset()
    for i, step in enumerate(engine.generate(prompt, config)):
        tokens += step.tokens
        if i > 0:
            trace.append({"draft": step.draft, "accepted": step.n_accepted, "emitted": step.tokens})
        if not args.json:
            for t in text.visible(step.tokens, special):
                detok.add_token(t)
            print(detok.last_segment, end="", flush=True)
    detok.finalize()
    engine.flush_prefix_disk()  # (the prompt's entries written before the process ends)
    stats = engine.stats
    if args.json:
        out = {"tokens": tokens, "text": text.decode(tokenizer, tokens, special), "stats": stats.to_dict()}
        if args.trace:
            out["trace"] = trace
        print(json.dumps(out))
    else:
        print(detok.last_segment, flush=True)
        per_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_per_position)
        drafts = (f"acceptance {stats.acceptance_rate:.2f} ({per_pos}) | {stats.mean_accepted_length:.2f} tokens/verify"
                  if stats.drafted else "no drafts" + (" (plain decoding)" if engine.drafter is None else ""))
        if stats.forced:  # the grammar's drafts (forced text), apart from the drafter's
            drafts += f" | grammar drafted {stats.forced} ({stats.forced_accepted} accepted)"
        print(
            f"\n[{stats.generated} tokens | prompt {stats.prompt_tps:.1f} tok/s | decode {stats.decode_tps:.1f} tok/s | "
            f"{drafts} | peak {stats.peak_memory / 2**20:.0f} MiB]",
            file=sys.stderr,
        )
    return 0


def run_convert(args) -> int:
    """`convert`: every input checked before the work (one `error:` line, exit status 2)."""
    from pathlib import Path

    from .convert import BITS, add_head, check_options, convert
    from .models import resolve
    from .models.hub import repo_of

    mlx_path = Path(args.mlx_path)
    if args.mtp_bits in BITS and args.mtp_bits < 8:  # a bit count convert refuses gets its error alone
        print(f"warning: a {args.mtp_bits}-bit MTP head loses acceptance; 8 bits or more is recommended", file=sys.stderr)
    try:
        if args.hf_path is None and args.mtp_from and mlx_path.exists():  # a head for an existing conversion
            info = add_head(mlx_path, args.mtp_from, args.mtp_bits)
            q = info["quantization"]
            print(f"wrote {mlx_path / 'mtp.safetensors'} ({info['family']} head, "
                  f"{str(q['bits']) + '-bit' if q else 'float'})", file=sys.stderr)
            return 0
        check_options(mlx_path, args.q_bits, args.q_group_size, args.mtp_bits)  # before any download
        src = args.hf_path
        if src is None:
            from .models import default_model

            src = default_model()
        path = resolve(src)
        out = convert(path, mlx_path, quantize=args.quantize, q_bits=args.q_bits, q_group_size=args.q_group_size,
                      mtp_bits=args.mtp_bits, mtp_from=args.mtp_from, require_head=not args.allow_missing_head,
                      base_model=repo_of(src, path))
    except OSError as e:  # a full disk, a folder that became unwritable
        raise UsageError(f"cannot write {mlx_path}: {e}") from None
    head = out / "mtp.safetensors"
    print(f"wrote {out}" + (" (with its MTP head, mtp.safetensors)" if head.exists() else " (no MTP head)"),
          file=sys.stderr)
    return 0


def report_error(e: BaseException) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


ERRORS = (UsageError, ModelLoadError, FileNotFoundError, ValueError)
