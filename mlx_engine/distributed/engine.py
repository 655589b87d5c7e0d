"""Speculative decoding over a target sharded across processes: core/engine.py's cycle on every rank,
the decisions taken once, on rank 0, and shared.

Every rank runs the same Engine loop over its shard (prefill, verify passes, plain steps: each pass issues
the model's own collectives, which tie the ranks together). Rank 0 alone holds the drafter, the draft
policy and the acceptance rule; it reads the cycle's result once (its one host synchronisation), decides
what comes next on the host with everything it knows (as on one machine), and sends the followers ONE
control packet per cycle (packets.py): the verdict they commit and roll back by, the next action, and the
next cycle's drafts. So a cycle costs the model's collectives plus one; a plainly decoded token the same
(its token packet). Followers read each packet once.

The overrides, each a phase of core/engine.py's cycle:
- `_choose` while `_start` runs: the first token, shared (one collective per generation);
- `_draft_length`: rank 0 keeps its k (at most KMAX); a follower reads the control packet (unless the
  verify pass just brought it) and takes rank 0's action;
- `_feed_replay`, `_to_verify`: rank 0 sends the control packet with the draft as cut (before a replay
  pass, if any, so the order of collectives stays the same everywhere); followers take their drafts from it
  (`_propose`);
- `_accept`: rank 0 reads its acceptance result as on one machine and owes the verdict; a follower's
  one read is the next control packet;
- `_plain`: plain.py's pipelined stretch.
A grammar (structured output) is rank 0's alone: its matcher masks rank 0's choices, cuts and drafts rank
0's drafts; the followers, which only take rank 0's drafts and verdicts, run without it.
`generate` wraps the loop: the job for the server's followers, the fault guard, the end of a generation
(rank 0 always tells the followers how it ends unless the end is theirs to see: a stop token, max_tokens).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from contextlib import contextmanager

import mlx.core as mx

from .. import host
from ..core.engine import Engine, GenerationConfig
from ..drafters.base import Draft, Verdict
from . import counting, packets
from .group import EXIT_ERROR, EXIT_FAULT, DistributedError, init, timeout_seconds
from .guard import Guard
from .loading import drafter_refusal
from .packets import CONTROL_WIDTH, KMAX, Control, Ended, control, read_control, share
from .peers import joined
from .plain import Stretch
from .rollback import check_rollback_paths
from .sharded_target import shard_target
from .stats import with_collectives


class _NoTrees:
    off = "token trees are not verified across processes yet (each rank would need the tree mask)"

    def wanted(self, *args) -> bool:
        return False


class DistributedEngine(Engine):
    def __init__(self, model, drafter=None, group: mx.distributed.Group | None = None, serving: bool = False,
                 timeout: float | None = None, **kwargs):
        """`group`: the processes (default: mx.distributed.init()); every rank constructs its engine at
        the same point. `drafter`: rank 0's (the other ranks pass None). `serving`: rank 0 announces each
        generation to the followers, which run `follow()`. `timeout`: seconds one wait for the other ranks
        may last (default MLX_ENGINE_DIST_TIMEOUT, else 120). The prefix tree is off (its byte budget would
        evict differently on each rank) and so is the memory check on followers (rank 0 admits requests)."""
        self.group = group or init()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.leader = self.rank == 0
        if not self.leader and drafter is not None:
            raise ValueError("only rank 0 holds a drafter: pass drafter=None on the other ranks")
        if kwargs.get("batch_invariant") not in (None, False, "off"):
            raise DistributedError("batch-invariant decoding is not available with a sharded target yet (its kernels "
                                   "replace the linear layers that sharding replaced)")
        kwargs["prefix_cache_bytes"], kwargs["prefix_tree"] = 0, None
        if not self.leader:
            kwargs["memory"] = None
        super().__init__(model, drafter, **kwargs)
        shard_target(self.target)  # (HeldCache holds the same object)
        self.trees = _NoTrees()
        self.serving = serving
        self.guard = Guard(self.rank, self.size, timeout or timeout_seconds(), joined(),
                           exit_lost=EXIT_FAULT if serving else EXIT_ERROR)  # as `_fault` ends each
        counting.install()
        self.last_collectives: dict[str, int] = {}  # by kind, over the last generation (this rank's)
        self._reset()
        refusal = drafter_refusal(drafter, model) if self.leader else None
        with self.collective("setup"):
            check_rollback_paths(self, refusal)  # one collective: every rank refuses alike, or none does

    def _reset(self) -> None:
        self._owed: Verdict | None = None  # rank 0: the verdict the followers have not been sent yet
        self._k = 0  # rank 0: this cycle's draft length
        self._drafts_next = False  # the control packet went ahead of a replay pass; the drafts follow
        self._stash: Control | None = None  # a follower: the action rank 0 sent for the coming cycle
        self._expect_replay: int | None = None  # a follower: rank 0's replay count after the last verdict
        self._stretch: Stretch | None = None
        self._first = False  # `_start` is choosing the first token
        self._cycle = 0

    @contextmanager
    def collective(self, kind: str):
        with counting.engine(kind):
            yield

    # -- the generation ---------------------------------------------------------------------------
    def generate(self, prompt: list[int], config: GenerationConfig | None = None):
        cfg = config or GenerationConfig()
        if cfg.logprobs is not None or cfg.sampling.counted:  # before any collective: every rank refuses alike
            raise DistributedError("logprobs and the presence and frequency penalties are not supported with a "
                                   "sharded target yet (a logit bias is)")
        if self.leader:
            self._check_prompt(prompt, cfg.max_tokens)  # a refused request never reaches the followers
        return self._generate(prompt, cfg)

    def _generate(self, prompt, cfg):
        self._reset()
        before = counting.snapshot()
        self.guard.arm()
        inner = None
        ended = False  # the followers know the generation is over (natural end, or told)
        try:
            if self.leader and self.serving:
                from .follow import send_job

                self.guard.beat("announcing the request to the other ranks")
                send_job(self, prompt, cfg)
            cfg = self._local_config(cfg)
            inner = super().generate(prompt, cfg)
            while True:
                try:
                    step = next(inner)
                except (StopIteration, Ended):
                    ended = True
                    if self.leader:
                        self._end(cfg, closed=False)  # the last verdict, if the followers still wait for it
                    return
                try:
                    yield step
                except GeneratorExit:  # rank 0's consumer left: tell the followers, then stop
                    self._end(cfg, closed=True)
                    ended = True
                    return
        except RuntimeError as e:
            ended = True  # nobody can be told anything any more
            self._fault(e)
        finally:
            try:
                if not ended and self.leader and inner is not None:
                    self._end(cfg, closed=False)
            finally:
                if inner is not None:
                    inner.close()
                self.guard.disarm()
                self.last_collectives = counting.since(before)
                self.stats = with_collectives(self.stats, self.size, self.last_collectives)

    def _local_config(self, cfg: GenerationConfig) -> GenerationConfig:
        """The config this rank runs: a should_stop every rank asks alike (rank 0's answer shared between
        prefill chunks), progress that beats the guard, and no profiling waits on followers."""
        stop, progress = cfg.should_stop, cfg.on_prefill
        shared_stop = None
        if stop is not None:  # (a follower's job sets one when rank 0's request has one)
            def shared_stop():
                value = mx.array([int(bool(stop()))], dtype=mx.int32) if self.leader else None
                with self.collective("stop"):
                    flag = share(self.group, value, 1, after=self._ties())
                self.guard.beat("sharing rank 0's stop flag between prefill chunks")
                return bool(host.read(flag)[0])

        def on_prefill(done: int, total: int) -> None:
            self.guard.beat(f"prefilling the prompt ({done} of {total} tokens)")
            if progress is not None and self.leader:
                progress(done, total)

        # a grammar is rank 0's alone: it masks what rank 0 chooses, and the other ranks take its choices
        extra = {} if self.leader else {"profile_every": 0, "grammar": None}
        return dataclasses.replace(cfg, should_stop=shared_stop, on_prefill=on_prefill, **extra)

    def _end(self, cfg, closed: bool) -> None:
        """Rank 0, the loop over: finish what the followers expect, then tell them it is the end (unless
        they see it themselves)."""
        saved = copy.copy(self.stats)
        try:
            if self._owed is not None:  # they wait for the last verdict
                self._send(Control(packets.END))
                return
            if not closed:
                return  # a natural end after a plain token or the prompt: theirs too
            natural = (self.stats.generated >= cfg.max_tokens
                       or bool(self._history and self._history[-1] in cfg.stop_tokens))
            stretch = self._stretch
            if stretch is not None and stretch.live:
                built, natural = stretch.drain()
                if built:
                    return  # its packets said closing
            if not natural:
                self._send(Control(packets.END))
        finally:
            self.stats = saved

    def _fault(self, e: RuntimeError):
        """A failed collective: the connection to a rank is gone. Serving, the whole server stops (the group
        cannot be mended); otherwise the caller gets a DistributedError."""
        text = str(e)
        if "[ring]" not in text and "peer" not in text and "connection" not in text.lower():
            raise e
        error = self.guard.lost(e)
        if self.serving:
            print(f"error: {error}", file=sys.__stderr__, flush=True)
            os._exit(EXIT_FAULT)
        raise error from None

    # -- rank 0 -> followers ----------------------------------------------------------------------
    def _send(self, c: Control, drafts: mx.array | None = None) -> mx.array:
        """Rank 0: the control packet, carrying the owed verdict; started, not read (the last one, END, is
        waited for: the process may exit right after it)."""
        if self._owed is not None:
            c.verdict = (self._owed.n_accepted, self._owed.tokens)
            self._owed = None
        c.replay = len(self._replay)
        with self.collective("decision"):
            shared = share(self.group, control(c, drafts), CONTROL_WIDTH, after=self._ties())
        if c.action == packets.END:
            host.wait(shared)
        else:
            host.start(shared)
        return shared

    def _ties(self) -> list:
        """The latest pass's tie (sharded_target.py): a packet after it follows its collectives."""
        tie = self.target.last_tie
        return [tie] if tie is not None else []

    def _receive(self, logits=None) -> Control:
        """A follower: the next control packet (its one host read of the cycle)."""
        with self.collective("decision"):
            after = ([logits] if logits is not None else []) + self._ties()
            shared = share(self.group, None, CONTROL_WIDTH, after=after)
        self.guard.beat(f"waiting for rank 0's decision after cycle {self._cycle}")
        return read_control(host.read(shared))

    # -- the phases -------------------------------------------------------------------------------
    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        if self.leader:
            super()._check_prompt(prompt, max_tokens)

    def _start(self, prompt, cfg, want_hidden):
        self._first = True
        try:
            self.guard.beat("prefilling the prompt")
            return super()._start(prompt, cfg, want_hidden)
        finally:
            self._first = False

    def _choose(self, logits, context, draft: Draft, cfg, key, masks=None, counts=None) -> mx.array:
        if not self._first:
            return super()._choose(logits, context, draft, cfg, key, masks, counts)
        out = super()._choose(logits, context, draft, cfg, key, masks, counts) if self.leader else None
        with self.collective("first"):
            shared = share(self.group, out, 2, after=[logits])
        self.guard.beat("waiting for the first token")
        return shared

    def _draft_length(self, wanted: int, remaining: int) -> int:
        self._cycle += 1
        if self.leader:
            self._k = min(super()._draft_length(wanted, remaining), KMAX)
            return self._k
        if self._expect_replay is not None and self._expect_replay != len(self._replay):
            raise DistributedError(
                f"rank {self.rank} replays {len(self._replay)} kept tokens after a rollback, rank 0 "
                f"{self._expect_replay}: their caches roll back differently (layers of other kinds)")
        self._expect_replay = None
        if self._stash is None:
            c = self._receive()
            if c.verdict is not None:
                raise DistributedError("a control packet brought a verdict outside a verify cycle")
            self._stash = c
        action = self._stash.action
        if action == packets.END:
            raise Ended
        return 0 if action == packets.PLAIN else max(1, self._stash.arg)

    def _feed_replay(self, want_hidden) -> None:
        if self.leader and self._replay:  # the packet goes ahead of the replay pass's collectives
            self._send(Control(packets.DRAFTS_NEXT, self._k))
            self._drafts_next = True
        super()._feed_replay(want_hidden)

    def _propose(self, k: int, sampling, key, profile: bool) -> Draft:
        if self.leader:
            return super()._propose(k, sampling, key, profile)  # (sent once cut: `_to_verify`)
        c = self._stash
        self._stash = None
        if c.action == packets.DRAFTS_NEXT:
            c = self._receive()
            if c.action != packets.DRAFTS:
                raise DistributedError(f"expected rank 0's drafts, got a {packets.ACTIONS[c.action]} packet")
        return Draft(mx.array(c.drafts, dtype=mx.int32), None, list(c.drafts))

    def _to_verify(self, draft: Draft) -> Draft:
        if not self.leader:
            return draft
        action = packets.DRAFTS if self._drafts_next else packets.CYCLE
        self._drafts_next = False
        shared = self._send(Control(action, draft.tokens.shape[0]), draft.tokens)
        return dataclasses.replace(draft, tokens=mx.depends(draft.tokens, shared))  # verify after it

    def _accept(self, logits, draft: Draft, sampling, profile: bool, masks=None):
        if self.leader:
            self.guard.beat(f"waiting for the verify pass of cycle {self._cycle}")
            verdict, drafted, waited = super()._accept(logits, draft, sampling, profile, masks)
            self._owed = verdict
            return verdict, drafted, waited
        self._next_key()  # rank 0's acceptance drew a key: keep the key sequence in step
        c = self._receive(logits)
        if c.verdict is None:
            raise DistributedError(f"expected the verdict of cycle {self._cycle}, "
                                   f"got a {packets.ACTIONS[c.action]} packet")
        n, tokens = c.verdict
        self._expect_replay = c.replay
        self._stash = c  # the next action (END included: `_draft_length` ends the loop, if it goes on)
        return Verdict(draft.tokens.shape[0], n, tokens), [], 0.0

    def _plain(self, cfg, n_tokens: int, want_hidden, t_decode: float, until=None):
        if self.leader:
            self._send(Control(packets.PLAIN, n_tokens))
        else:
            c, self._stash = self._stash, None
            if c is None or c.action != packets.PLAIN:
                raise DistributedError("a plain stretch without rank 0's word")
            n_tokens, until = c.arg, None
        self._stretch = Stretch(self, cfg, n_tokens, want_hidden, t_decode, until)
        yield from self._stretch.run()

    # -- the server's followers -------------------------------------------------------------------
    def follow(self) -> int:
        """A follower of a serving rank 0: run its generations until it shuts down (follow.py)."""
        from .follow import follow

        return follow(self)
