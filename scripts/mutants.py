"""`make mutants`: put small realistic bugs into a copy of the tree, one at a time, and check that the
tests named for each go red (issue 26: the lossless bugs earlier tests let through).

    .venv/bin/python scripts/mutants.py                # every mutant; exit 1 if one survives
    .venv/bin/python scripts/mutants.py --list         # what the mutants are
    .venv/bin/python scripts/mutants.py --only bonus-row --only top-k

The working tree is never touched: its files (tracked, and untracked ones git does not ignore) are copied
into a temporary folder; each mutant replaces one exact snippet of one file there, runs its tests with the
repository's .venv python from that folder (which imports the copy's packages, checked before anything
runs), and puts the file back. A snippet that is not found exactly once is an error: the code changed and
the mutant needs updating. The tests first run once on the unmutated copy: a red baseline proves nothing.
Mutation-testing tools (mutmut, cosmic-ray) mutate operators at random and take hours on this suite; a
short curated list of the bugs that matter (each a bug that was made or nearly made) runs in minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIST = "tests/test_distribution_positions.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    tests: tuple[str, ...]  # pytest arguments (files, node ids, -k expressions)
    bug: str


MUTANTS = [
    Mutant("bonus-row", "mlx_engine/core/verify.py",
           "last = target_probs[k:] if cut_probs is None",
           "last = target_probs[max(k - 1, 0) : max(k, 1)] if cut_probs is None",
           (DIST, "-k", "engine"), "the bonus token after a full accept is drawn from p[k-1] instead of p[k]"),
    Mutant("top-k", "mlx_engine/sampling.py",
           "kth = mx.sort(x, axis=-1)[:, vocab - cfg.top_k][:, None]",
           "kth = mx.sort(x, axis=-1)[:, vocab - cfg.top_k - 1][:, None]",
           (DIST, "-k", "engine"), "top-k keeps k+1 tokens (caught by the engine's distribution alone)"),
    Mutant("penalty-history", "mlx_engine/sampling.py",
           "ends = mx.arange(c, c + n)[:, None]",
           "ends = mx.full((n, 1), c)",
           ("tests/test_penalty_equality.py",),
           "every verify row is penalised with the committed history only, not the earlier drafts"),
    Mutant("rotating-window", "mlx_engine/target_model/cache.py",
           "return c.offset + n_new < c.max_size",
           "return c.offset < c.max_size",
           ("tests/test_rotating_window.py",),
           "a rotating window counts as trimmable without the pass's own growth"),
    Mutant("replay-first", "mlx_engine/core/engine.py",
           "self._replay = kept[len(kept) - replay :] if replay else []",
           "self._replay = kept[len(kept) - replay + 1 :] if replay else []",
           ("tests/test_replay.py",), "the replay list drops its first kept token"),
    Mutant("ratio-inverted", "mlx_engine/core/verify.py",
           "n = accepted_prefix(uniforms * q_draft < p_draft)",
           "n = accepted_prefix(uniforms * p_draft < q_draft)",
           (DIST,), "a draft is accepted with probability q/p instead of p/q"),
    Mutant("residual-row", "mlx_engine/core/verify.py",
           "residual = mx.maximum(target_probs[:k] - draft_probs, 0.0)",
           "residual = mx.maximum(target_probs[1:] - draft_probs, 0.0)",
           (DIST, "-k", "engine"), "the residual max(0, p - q) is taken at the next row of p"),
    Mutant("top-p-inclusive", "mlx_engine/sampling.py",
           "keep_sorted = before < cfg.top_p",
           "keep_sorted = before + sorted_p < cfg.top_p",
           (DIST,), "top-p drops the token that crosses p (an inclusive cumulative sum)"),
    Mutant("cdf-off-by-one", "mlx_engine/sampling.py",
           "hit = positive & (cdf > uniform * cdf[:, -1:])",
           "hit = positive & (cdf - probs > uniform * cdf[:, -1:])",
           (DIST, "-k", "accept_sampled or engine"), "inverse-CDF sampling returns the token after the drawn one"),
    Mutant("trim-index", "mlx_engine/target_model/cache.py",
           "    if ckpt.exact_trim:\n        for c in caches:\n            c.trim(n_drop)",
           "    if ckpt.exact_trim:\n        for c in caches:\n            c.trim(n_drop - 1)",
           ("tests/test_rollback.py",), "a KV rollback keeps one rejected token"),
    Mutant("draft-rollback", "mlx_engine/drafters/draft_model.py",
           "kept = self.pending + self.history[-1:] + verdict.tokens[:n]",
           "kept = self.pending + self.history[-1:] + verdict.tokens[: max(n - 1, 0)]",
           ("tests/test_rollback.py",), "the draft model's cache drops its last accepted draft"),
    Mutant("plain-after-replay", "mlx_engine/core/engine.py",
           "first = self._replay + [self._last]",
           "first = [self._last]",
           ("tests/test_replay.py",), "a plain stretch after a snapshot rollback forgets the tokens to replay"),
    Mutant("bonus-row-served", "mlx_engine/core/verify.py",
           "last = target_probs[k:] if cut_probs is None",
           "last = target_probs[max(k - 1, 0) : max(k, 1)] if cut_probs is None",
           ("tests/test_serve_sampled.py",), "the bonus-row bug, seen through the server's sampled requests"),
    Mutant("residual-row-mtp", "mlx_engine/core/verify.py",
           "residual = mx.maximum(target_probs[:k] - draft_probs, 0.0)",
           "residual = mx.maximum(target_probs[1:] - draft_probs, 0.0)",
           ("tests/test_mtp_sampled.py",), "the residual-row bug, seen through sampled MTP drafting"),
    Mutant("kernel-bonus-row", "mlx_engine/kernels/acceptance.py",
           "rows = mx.concatenate([residual, p[k:]], axis=0)",
           "rows = mx.concatenate([residual, p[k - 1 : k]], axis=0)",
           ("tests/test_kernels_reference.py", "-k", "accept_reference"),
           "the fused kernels' reference draws the bonus from p[k-1] (its corrected token checked)"),
    Mutant("tree-bonus-row", "mlx_engine/core/tree_verify.py",
           "emitted = [tokens[r - 1] for r in path] + [choices[path[-1] if path else 0]]",
           "emitted = [tokens[r - 1] for r in path] + [choices[path[-2] if len(path) > 1 else 0]]",
           ("tests/test_tree.py", "-k", "greedy_equals_plain"),
           "a tree cycle's last token is the target's pick at the path's second-to-last row"),
    Mutant("tree-compact-row", "mlx_engine/target_model/tree_cache.py",
           "idx = mx.array([start + r for r in rows], dtype=mx.int32)",
           "idx = mx.array([start + max(r - 1, 0) for r in rows], dtype=mx.int32)",
           ("tests/test_tree.py", "-k", "compact"),
           "compaction keeps each accepted node's parent row instead of its own"),
    Mutant("tree-position", "mlx_engine/drafters/tree_draft.py",
           "out.append(out[p + 1] + 1)",
           "out.append(out[p + 1] + 1 if p < 0 else out[p] + 1)",
           ("tests/test_tree.py", "-k", "own_path or greedy_equals_plain"),
           "a tree node's RoPE position is its grandparent's depth + 1"),
    Mutant("kv-quant-attention", "mlx_engine/target_model/invariant_attention.py",
           'if hasattr(cache, "bits") and simple:',
           'if hasattr(cache, "bits") and simple and False:',
           ("tests/test_kv_quant.py", "-k", "mixes_rows"),
           "invariant passes over a quantized KV cache run mlx-lm's attention over all rows at once"),
    Mutant("kv-prefill-cap", "mlx_engine/core/held_cache.py",
           "step = min(cfg.prefill_step, self.largest_chunk or cfg.prefill_step)",
           "step = cfg.prefill_step",
           ("tests/test_kv_quant_real.py", "-k", "entries"),
           "a quantized cache's prompt fed in stock passes of prefill_step tokens (its codes follow the chunking)"),
    Mutant("kv-batch-prefill-cap", "mlx_engine/core/batch_engine.py",
           "prefill_step = min(prefill_step, rows)",
           "prefill_step = prefill_step",
           ("tests/test_kv_quant_real.py", "-k", "batched"),
           "the batch engine feeds a quantized cache's prompt in chunks past the contract's rows"),
    Mutant("suffix-count", "mlx_engine/drafters/suffix_cache.py",
           "            c.count += 1\n",
           "            c.count += 1 if length else 2\n",
           ("tests/test_suffix.py", "-k", "brute_force"),
           "a suffix trie's one-token strings are counted twice"),
    Mutant("span-garbage", "mlx_engine/core/batch_plan.py",
           "return self.fed[i] if span is None or span.start <= layer < span.end else 0",
           "return self.fed[i]",
           ("tests/test_layer_span.py", "-k", "tokens_of_one"),
           "a token crossing some layers keeps the entries it wrote in the layers outside its span"),
    Mutant("span-carry", "mlx_engine/target_model/layer_span.py",
           "            if i == s.start and s.carried is not None:",
           "            if i == s.start + 1 and s.carried is not None:",
           ("tests/test_layer_span.py", "-k", "three_passes"),
           "the carried hidden state enters one layer late (the layer it should enter gets the dummy token)"),
    Mutant("span-first-token", "mlx_engine/core/batch_accept.py",
           "if f.done + fed == f.total and (i not in plan.spans or plan.spans[i].end == self.layer_count):",
           "if f.done + fed == f.total:",
           ("tests/test_layer_span.py", "-k", "tokens_of_one"),
           "a prompt's first token is sampled from a pass its last token has not crossed yet"),
    Mutant("tree-chain-positions", "mlx_engine/core/tree_verify.py",
           "depths = None if tree.is_chain else mx.array(host_depths(tree.parents), dtype=mx.int32)",
           "depths = None",
           ("tests/test_tree.py",),
           "every host tree is verified as if it were a chain: its branches' rows at the wrong positions"),
    Mutant("ceiling-cross-texts", "mlx_engine/bench/ceiling.py",
           "        text += list(t) + [SEPARATOR]",
           "        text += list(t)",
           ("tests/test_bench_ceiling.py",),
           "the copy oracle runs a copy on from one earlier text into the next"),
    Mutant("ceiling-overdraft", "mlx_engine/bench/ceiling.py",
           "for m in range(0, min(lengths[i], n - 1 - i) + 1):",
           "for m in range(0, min(lengths[i] + 1, n - 1 - i) + 1):",
           ("tests/test_bench_ceiling.py",),
           "the oracle's schedule drafts one token more than the text holds, every draft still accepted"),
    Mutant("guard-blind-to-peers", "mlx_engine/distributed/guard.py",
           "gone = self.peers.closed() if stuck else []",
           "gone = []",
           ("tests/test_distributed_faults.py", "-k", "sockets"),
           "the watchdog trusts MLX to raise for a dead rank: collectives queued after the ring gave up wait "
           "for the timeout"),
    Mutant("peek-consumes", "mlx_engine/distributed/peers.py",
           "s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)",
           "s.recv(1, socket.MSG_DONTWAIT)",
           ("tests/test_distributed_peers.py",),
           "the look at a peer's socket takes a byte the ring's worker should have read"),
    Mutant("refit-keeps-compiled", "mlx_engine/train/mtp.py",
           "self.opt, self._compiled = opt, None  # the compiled step holds the old schedule",
           "self.opt = opt",
           ("tests/test_train_mtp.py", "-k", "fit_minutes_ends"),
           "--fit-minutes swaps the schedule but the compiled train step keeps updating with the old one"),
    Mutant("tree-hit-whole-prompt", "mlx_engine/core/held_cache.py",
           "hit = tree.lookup(prompt[:-1])",
           "hit = tree.lookup(prompt)",
           ("tests/test_long_prompt.py", "-k", "whole"),
           "a prompt the prefix tree holds whole is taken from it whole: its last token is fed again on top of "
           "its own entry"),
    Mutant("row-evidence-position", "mlx_engine/core/batch_engine.py",
           "[self.seqs[i].evidence for i in decoding], timed=not reshaped",
           "[self.seqs[i].evidence for i in range(len(decoding))], timed=not reshaped",
           ("tests/test_batch_engine.py", "-k", "evidence"),
           "a decoding row's verdicts go to the acceptance evidence of the batch row at its place among the "
           "decoding rows (a row feeding its prompt before it gets them)"),
    Mutant("stop-token-keeps-row", "mlx_engine/core/batch_settle.py",
           "        if reason:\n            finished.append(i)",
           "        if reason == \"length\":\n            finished.append(i)",
           ("tests/test_batch_engine.py", "-k", "stop_token"),
           "a row ended by a stop token stays in the batch and decodes on"),
    Mutant("stop-string-keeps-row", "mlx_engine/serve/batch.py",
           "end it now\n                self.engine.cancel(result.seq_id)\n",
           "end it now\n",
           ("tests/test_serve_batch.py", "-k", "frees_its_row"),
           "a stop string ends the client's text but its row is not cancelled: it decodes on to max_tokens unseen"),
    # structured output (issue 37): the grammar under speculation
    Mutant("grammar-mask-row-late", "mlx_engine/core/engine.py",
           "            logits = apply_bitmask(logits, masks)",
           "            logits = apply_bitmask(logits, masks[[0] + list(range(len(masks) - 1))])",
           ("tests/test_grammar_engine.py", "-k", "constrained_greedy and (guess or draft-self)"),
           "each verify row masked with the row before's mask (the mask applied one row late)"),
    Mutant("grammar-rejected-draft-kept", "mlx_engine/core/engine.py",
           "matcher.settle(k, verdict.n_accepted, verdict.tokens[verdict.n_accepted])",
           "matcher.settle(k, k, verdict.tokens[verdict.n_accepted])",
           ("tests/test_grammar_engine.py", "-k", "constrained_greedy and guess"),
           "the matcher keeps a rejected draft (advanced by drafts, not by the emitted tokens)"),
    Mutant("grammar-forced-past-run", "mlx_engine/grammar/matcher.py",
           "            run = list(whole)\n",
           "            run = list(whole) + whole[-1:]\n",
           ("tests/test_grammar_matcher.py", "-k", "forced"),
           "a forced draft runs one token past the forced text"),
    Mutant("grammar-forced-last-held-back", "mlx_engine/grammar/matcher.py",
           "            run = list(whole)\n",
           "            pass\n",
           ("tests/test_grammar_matcher.py", "-k", "forced"),
           "the forced text's last token is held back (llguidance's fast-forward tokens alone)"),
    Mutant("grammar-plain-unmasked", "mlx_engine/core/engine.py",
           "            masks = matcher.mask() if matcher is not None else None\n",
           "            masks = None\n",
           ("tests/test_grammar_engine.py", "-k", "constrained_greedy and none"),
           "a plain stretch samples without the grammar's mask (a fast path that skips it)"),
    Mutant("batch-spare-row-write", "mlx_engine/target_model/batch_cache.py",
           "stored[b : b + 1, :, :n] = row.astype(stored.dtype)",
           "stored[b - 1 : b, :, :n] = row.astype(stored.dtype)",
           ("tests/test_batch_engine.py", "-k", "spare"),
           "a row joining into a spare row writes its entries over the row before it"),
    Mutant("span-features-of-the-last-pass", "mlx_engine/core/batch_prefill.py",
           "        if not p.kept:\n            return hidden\n",
           "        if True:\n            return hidden\n",
           ("tests/test_layer_span.py", "-k", "eagle3"),
           "a prompt crossing the layers in steps hands EAGLE-3 its inner layers' outputs from the last pass only"),
    Mutant("grammar-plain-in-flight", "mlx_engine/core/engine.py",
           "serial = until is not None and isinstance(drafter, GrammarDrafter)",
           "serial = False",
           ("tests/test_grammar_engine.py", "-k", "no_plain_step"),
           "a plain stretch under a drafting grammar keeps a step in flight: a forced run's first token costs a pass"),
    Mutant("grammar-batch-greedy-unmasked", "mlx_engine/core/batch_accept.py",
           "                                   masks.get(i), draft.cut_probs",
           "                                   None if s.sampling.greedy else masks.get(i), draft.cut_probs",
           ("tests/test_grammar_batch.py", "-k", "own_schema and (draft-self or ngram)"),
           "the batch's greedy rows skip their grammar's masks"),
    Mutant("grammar-cut-next-from-p", "mlx_engine/core/verify.py",
           "last = target_probs[k:] if cut_probs is None else mx.maximum(target_probs[k:] - cut_probs, 0.0)",
           "last = target_probs[k:]",
           ("tests/test_grammar_distribution.py", "-k", "cut_draft"),
           "after a draft cut at an illegal token, the next token drawn from p, not the residual against its q"),
    # logprobs and the OpenAI penalties (issue 38)
    Mutant("logprobs-row", "mlx_engine/core/engine.py",
           "values, rows = host.read_all(out, logprob_rows(logits, out[1 : logits.shape[0] + 1], n))",
           "values, rows = host.read_all(out, logprob_rows(mx.concatenate([logits[1:], logits[-1:]]), "
           "out[1 : logits.shape[0] + 1], n))",
           ("tests/test_logprobs.py", "-k", "greedy_logprobs_equal"),
           "the logprobs of a verified token read from the next row of the verify pass (row n + 1 for token n)"),
    Mutant("count-draft-prefix", "mlx_engine/sampling.py",
           "return mx.concatenate([counts[None], counts[None] + prefix], axis=0)",
           "return mx.concatenate([counts[None], counts[None] + 0 * prefix], axis=0)",
           ("tests/test_openai_penalties.py", "-k", "oracle_deep_rows"),
           "the presence / frequency counts of every verify row leave out the drafts before it (row i without "
           "drafts 1..i)"),
    # an agent's prompt and the batch engine (issue 39)
    Mutant("prompt-pass-left-lazy", "mlx_engine/core/batch_accept.py",
           "        host.wait([a for bc in self.cache for a in bc.state] + carried + ([hidden] if hidden is not None else []))",
           "        pass",
           ("tests/test_agent_prefill.py", "-k", "evaluated_in_its_step"),
           "a step that only feeds a prompt chunk never evaluates its pass: the graph piles up until a token is read"),
    Mutant("newcomer-waits-its-turn", "mlx_engine/core/batch_turn.py",
           "        if turn:\n            turn = [min(turn, key=lambda i: (feeding[i].left(), i))]",
           "        if turn and decoding:\n            turn = [min(turn, key=lambda i: (feeding[i].left(), i))]",
           ("tests/test_agent_prefill.py", "-k", "not_starved and none"),
           "while nothing decodes every prompt is fed each step: a short one waits beside the long one's chunks"),
    Mutant("drafter-stage-first-come", "mlx_engine/core/batch_rows.py",
           "p = min(begun, key=lambda p: p.drafter_left)",
           "p = begun[0]",
           ("tests/test_agent_prefill.py", "-k", "not_starved and mtp and not suffix"),
           "the drafters' prompts fed first come first served: a short request's waits for a long one's"),
    Mutant("drafter-state-not-restored", "mlx_engine/core/batch_rows.py",
           "            p.drafter.restore(*p.drafter_prefix)\n",
           "",
           ("tests/test_agent_prefill.py", "-k", "refeeds_neither and mtp and not suffix"),
           "a prefix-tree hit hands the drafter no entries: it is fed the whole prompt again"),
    Mutant("mtp-restore-off-by-one", "mlx_engine/drafters/mtp/drafter.py",
           "prefix_ops.fill(self.cache, states, slots, start=1)",
           "prefix_ops.fill(self.cache, states, slots, start=0)",
           ("tests/test_agent_prefill.py", "-k", "refeeds_neither and eagle3"),
           "the head's restored entries read one position early (the tree's frame has slot p at p + 1)"),
    Mutant("idle-share-not-skipped", "mlx_engine/target_model/layer_span.py",
           "if len(idle() | resting) == x.shape[0] and hasattr(cache, \"skip\"):",
           "if False:",
           ("tests/test_agent_prefill.py", "-k", "shares"),
           "a prompt fed alone crossing some layers still computes every layer: each share costs a whole pass"),
    Mutant("ragged-keys-uncut", "mlx_engine/target_model/batch_sequences.py",
           "tuple(cut(k, b, n - (L - r)) for k in keyed), n - (L - r), r)",
           "tuple(cut(k, b, n) for k in keyed), n - (L - r), r)",
           ("tests/test_ragged_queries.py",),
           "a decoding row's real queries attend over its padding's keys too (beside a wider prompt chunk)"),
    Mutant("spare-row-not-kept", "mlx_engine/target_model/batch_cache.py",
           "        rows = b + self.spare\n",
           "        rows = b\n",
           ("tests/test_batch_engine.py", "-k", "spare"),
           "a cache grown ahead of a long prompt drops the spare row asked for (the next join copies the long row)"),
    Mutant("unread-last-share-timed", "mlx_engine/core/batch_turn.py",
           "        elif not any(0 < sp.start and sp.end == self.layer_count and not plan.firsts for sp in spans.values()):\n",
           "        elif True:\n",
           ("tests/test_agent_prefill.py", "-k", "unread_last_share"),
           "a chunk's last share, whose output nobody reads, is timed as a whole pass (the next chunk ~2x too large)"),
    Mutant("shares-not-resized", "mlx_engine/core/batch_prefill.py",
           "            p.share = max(1, int(IDLE_STEP * (span.end - span.start) / seconds))\n",
           "            pass\n",
           ("tests/test_agent_prefill.py", "-k", "unread_last_share"),
           "a share's measured time does not size the next shares (steps 2x the aim: a request arriving waits for them)"),
    Mutant("short-prompt-waits-remeasure", "mlx_engine/core/batch_turn.py",
           "        if turn and (not remeasure or small):\n",
           "        if turn and not remeasure:\n",
           ("tests/test_agent_prefill.py", "-k", "spare_row"),
           "a short prompt waits a step for the measurement that sizes long prompts' chunks"),
    Mutant("short-prompt-in-two-chunks", "mlx_engine/core/batch_turn.py",
           "                chunk = min(max(chunk, feeding[turn[0]].left()), cap or 1 << 30, self.prefills.prefill_step)\n",
           "                pass\n",
           ("tests/test_agent_prefill.py", "-k", "spare_row"),
           "a short prompt beside a decoding row goes in the sizer's first chunk, then the rest: its first token a step later"),
    Mutant("join-in-place-waits-a-step", "mlx_engine/core/batch_rows.py",
           "        p.fresh = fresh  #",
           "        p.fresh = True  #",
           ("tests/test_agent_prefill.py", "-k", "spare_row"),
           "a row that joined into a spare row (nothing copied) still waits a step before its prompt is fed"),
    Mutant("mtp-last-slot-in-its-piece", "mlx_engine/drafters/mtp/drafter.py",
           "        bounds = [(s, min(s + self.prefill_step, n - 1)) for s in range(0, n - 1, self.prefill_step)] + [(n - 1, n)]\n",
           "        bounds = [(s, min(s + self.prefill_step, n)) for s in range(0, n, self.prefill_step)]\n",
           ("tests/test_agent_prefill.py", "-k", "last_slot"),
           "the MTP head's last prompt slot fed with its piece: its output costs the piece's whole attention and MLP"),
    Mutant("unsure-cut-takes-cut-probs", "mlx_engine/core/engine.py",
           "        cut = probs is not None and n < len(sure_tokens)  # the grammar's cut: the forbidden token's q\n",
           "        cut = probs is not None and n < len(tokens)  # the grammar's cut: the forbidden token's q\n",
           ("tests/test_grammar_distribution.py", "-k", "unsure"),
           "a position dropped for the drafter's low confidence treated as a grammar cut: the next token drawn from "
           "the residual against a token never verified"),
    Mutant("unsure-positions-verified", "mlx_engine/core/engine.py",
           "        n = self._matcher.legal(sure_tokens)\n",
           "        n = self._matcher.legal(tokens)\n",
           ("tests/test_grammar_engine.py", "-k", "unsure"),
           "draft positions below the confidence threshold verified anyway"),
    Mutant("first-draft-unmasked", "mlx_engine/drafters/mtp/drafter.py",
           "            allowed = first_allowed if i == 0 else None\n",
           "            allowed = first_allowed if i == 1 else None\n",
           ("tests/test_grammar_engine.py", "-k", "first_token_among"),
           "the grammar's mask applied to the head's second draft position instead of its first"),
    Mutant("batched-first-draft-unmasked", "mlx_engine/drafters/mtp/batched.py",
           "            allowed = first_allowed if step == 0 else None\n",
           "            allowed = first_allowed if step == 1 else None\n",
           ("tests/test_grammar_batch.py", "-k", "first_legal"),
           "the batched head's first draft step not held to each row's grammar"),
    Mutant("batch-unsure-positions-verified", "mlx_engine/core/batch_grammar.py",
           "            ks[i] = seqs[i].matcher.legal(tokens[:sure])\n",
           "            ks[i] = seqs[i].matcher.legal(tokens)\n",
           ("tests/test_grammar_batch.py", "-k", "first_legal"),
           "a constrained batch row's draft positions below the confidence threshold verified anyway"),
    Mutant("kept-mask-outlives-a-rollback", "mlx_engine/grammar/matcher.py",
           "        self._here = None\n        fed = sum(self._fed[-n:])\n",
           "        fed = sum(self._fed[-n:])\n",
           ("tests/test_grammar_matcher.py", "-k", "kept_for_a_state"),
           "the matcher's kept mask not forgotten on a rollback: the next mask is the state's it left"),
    Mutant("kept-mask-outlives-a-consume", "mlx_engine/grammar/matcher.py",
           "        for t in tokens:\n            self._here = None\n",
           "        for t in tokens:\n",
           ("tests/test_grammar_matcher.py", "-k", "kept_for_a_state"),
           "the matcher's kept mask not forgotten when it consumes: a verify row masked by the state before it"),
    Mutant("free-text-may-open-a-call", "mlx_engine/toolcalls/lark_items.py",
           '    return f"{terminal}: /(?s:.+)/ & ~/(?s:.*){regex_text(marker)}(?s:.*)/\\n"\n',
           '    return f"{terminal}: /(?s:.+)/\\n"\n',
           ("tests/test_toolcalls.py", "-k", "optional"),
           "tool_choice auto's free text allowed to hold the call opener: a call written there is never held to "
           "its schema"),
    Mutant("xml-required-parameters-optional", "mlx_engine/toolcalls/xml_grammars.py",
           '        parts.append(one if key in required else one + "?")\n',
           '        parts.append(one + "?")\n',
           ("tests/test_toolcalls.py", "-k", "xml"),
           "a qwen3_coder / glm47 call may leave out a required parameter"),
    Mutant("xml-enum-as-free-text", "mlx_engine/toolcalls/xml_grammars.py",
           '    if options and all(isinstance(o, str) for o in options):\n',
           '    if options and all(isinstance(o, str) for o in options) and False:\n',
           ("tests/test_toolcalls.py", "-k", "xml"),
           "an enum of strings in an XML-like call not written as one of its strings"),
    Mutant("llama3-auto-text-may-begin-a-call", "mlx_engine/toolcalls/grammars.py",
           '        lead = "{" if tag.startswith("<[") else "{<"  # text may not begin like a call\n',
           '        lead = ""\n',
           ("tests/test_toolcalls.py", "-k", "llama3_auto"),
           "Llama 3 under auto: free text may begin with `{`, so a call there is read as text and never held"),
    Mutant("sharded-plain-token-unmasked", "mlx_engine/distributed/plain.py",
           "            masks = e._matcher.mask() if e._matcher is not None else None  # (it has every token before)\n",
           "            masks = None\n",
           ("tests/test_distributed.py", "-k", "grammar_holds"),
           "a sharded target's plain tokens chosen by rank 0 without the grammar's mask"),
    Mutant("deepseek-calls-without-their-newline", "mlx_engine/toolcalls/json_grammars.py",
           """    many = 'call ("\\\\n"? call)*' if parallel else "call"  # (V3's template puts a newline between calls)\n""",
           """    many = "call+" if parallel else "call"\n""",
           ("tests/test_toolcalls.py", "-k", "published_calls"),
           "DeepSeek-V3's parallel calls refused where its template writes a newline between them"),
    Mutant("separated-required-left-out", "mlx_engine/toolcalls/lark_items.py",
           '        return (f"{one} " if required[i] else f"({one})? ") + after(i + 1)\n',
           '        return f"({one})? " + after(i + 1)\n',
           ("tests/test_toolcalls.py", "-k", "xml_calls"),
           "a Gemma 4 / pythonic call may leave out a required argument after the first"),
    Mutant("pythonic-names-unchecked", "mlx_engine/toolcalls/pythonic_grammar.py",
           "        if not _identifier(name, dotted=True):\n",
           "        if False:\n",
           ("tests/test_toolcalls.py", "-k", "pythonic"),
           "an LFM2 call constrained to a tool name its parser cannot read back"),
    Mutant("subset-argmax-position-as-token", "mlx_engine/drafters/mtp/drafter.py",
           "        return self._subset.ids[best], sureness(scores, None)\n",
           "        return best.astype(mx.int32), sureness(scores, None)\n",
           ("tests/test_tree_drafters.py", "-k", "scattered"),
           "the head's greedy draft on its reduced vocabulary takes a subset position for a token id"),
    Mutant("declared-parser-ignored", "mlx_engine/toolcalls/detect.py",
           "    name = _declared_parser(tokenizer)\n",
           "    name = None\n",
           ("tests/test_toolcalls.py", "-k", "checkpoint_names"),
           "the parser a checkpoint names in its tokenizer_config.json is ignored for the template's"),
    Mutant("kimi-result-id-not-renamed", "mlx_engine/toolcalls/render.py",
           '        elif m.get("role") == "tool" and m.get("tool_call_id") in renamed:\n',
           '        elif False:\n',
           ("tests/test_toolcalls.py", "-k", "kimi"),
           "Kimi K2's prompt names a result by the client's id while its call has the model's form"),
    Mutant("lfm2-history-calls-dropped", "mlx_engine/toolcalls/render.py",
           "        messages = _calls_into_content(messages, fmt)\n",
           "        pass\n",
           ("tests/test_toolcalls.py", "-k", "lfm2"),
           "an LFM2 history's calls never reach its template, which renders content only"),
    Mutant("call-arguments-lose-their-defs", "mlx_engine/toolcalls/json_grammars.py",
           "    return [(name, json_item(params)) for name, params in map(tool_parts, tools)]\n",
           '    return [(name, json_item({k: v for k, v in params.items() if k != "$defs"})) '
           "for name, params in map(tool_parts, tools)]\n",
           ("tests/test_toolcalls.py", "-k", "own_defs"),
           "a JSON-form call's arguments held to a schema whose local $refs name nothing"),
    Mutant("function-gemma-keys-sorted", "mlx_engine/toolcalls/gemma4_grammar.py",
           "        keys = sorted(props) if self.sort else list(props)\n",
           "        keys = sorted(props)\n",
           ("tests/test_toolcalls.py", "-k", "xml_calls"),
           "FunctionGemma's arguments held to sorted order, not the order its template writes"),
    Mutant("gemma4-keys-in-declared-order", "mlx_engine/toolcalls/gemma4_grammar.py",
           "        keys = sorted(props) if self.sort else list(props)\n",
           "        keys = list(props)\n",
           ("tests/test_toolcalls.py", "-k", "xml_calls"),
           "Gemma 4's arguments held to the schema's key order, where its template writes them sorted"),
    Mutant("model-call-id-repeated", "mlx_engine/toolcalls/reader.py",
           "        self.calls.append(own_id if own_id and own_id not in self.calls else call_id())\n",
           "        self.calls.append(own_id if own_id else call_id())\n",
           ("tests/test_toolcalls.py", "-k", "own_call_ids"),
           "a call id the model wrote twice in one answer given to the client twice"),
    Mutant("auto-holds-loose-tools", "mlx_engine/serve/turn.py",
           '        return self.tool_choice == "auto" and any(t.get("function", t).get("strict") is True for t in self.tools)\n',
           '        return self.tool_choice == "auto" and bool(self.tools)\n',
           ("tests/test_toolcalls.py", "-k", "strict_tool"),
           "tool_choice auto constrained for tools no one marked strict (every agent request pays the grammar)"),
    Mutant("recurrent-row-takes-another-row-s-length", "mlx_engine/target_model/batch_recurrent.py",
           "        idx = mx.array(picks, dtype=mx.int32)",
           "        idx = mx.array(picks[::-1], dtype=mx.int32)",
           ("tests/test_batch_agent_models.py", "-k", "eight_concurrent and qwen3"),
           "a recurrent row rolled back to another row's kept length (its state after another row's accepted drafts)"),
    Mutant("recurrent-padding-enters-the-state", "mlx_engine/target_model/gdn_rows.py",
           "        mask = mx.arange(S - P)[None, :] < (ends - P)[:, None]",
           "        mask = mx.arange(S - P)[None, :] <= (ends - P)[:, None]",
           ("tests/test_batch_agent_models.py", "-k", "eight_concurrent and qwen3"),
           "a GatedDeltaNet row's recurrence runs one padding token past its last real one"),
    Mutant("checkpoint-one-position-off", "mlx_engine/core/drafter_prefix.py",
           "    tree.insert(fed, layers, hidden, checkpoint=checkpoint)",
           "    tree.insert(fed, layers, hidden)\n    tree.insert(fed[:-1], layers, hidden, checkpoint=checkpoint)",
           ("tests/test_batch_agent_models.py", "-k", "prefix_hit and qwen3_next"),
           "a recurrent checkpoint keyed one token short of the tokens it holds the states after"),
    Mutant("window-one-key-short", "mlx_engine/target_model/batch_sequences.py",
           "    start = max(0, n - lq - window + 1)",
           "    start = max(0, n - lq - window + 2)",
           ("tests/test_batch_agent_models.py", "-k", "eight_concurrent and (gpt_oss or gemma4)"),
           "a sliding-window row attends one key fewer than its window"),
    Mutant("disk-block-key-without-parent", "mlx_engine/target_model/disk_tier.py",
           "        parent = _hash(parent, tokens[i * block : (i + 1) * block])",
           "        parent = _hash(root, tokens[i * block : (i + 1) * block])",
           ("tests/test_prefix_disk.py", "-k", "covers_its_parent"),
           "a disk block's key covers its own tokens only: another prompt's block read after other tokens"),
    Mutant("disk-fingerprint-without-weights", "mlx_engine/target_model/fingerprint.py",
           "    h.update(weights_digest(model).encode())\n",
           "",
           ("tests/test_prefix_disk.py", "-k", "weights_change"),
           "the disk tier's fingerprint leaves out the weights: an updated checkpoint reads the old entries"),
    Mutant("disk-checksum-not-checked", "mlx_engine/target_model/disk_files.py",
           "    if zlib.crc32(data) != crc:",
           "    if False:",
           ("tests/test_prefix_disk.py", "-k", "damaged and flipped"),
           "a disk entry's checksum not checked on load: a flipped byte is served"),
    # issue 53: tool calls exactly as each family writes them (canitoolcall's fixtures through the server's path)
    Mutant("special-marker-dropped", "mlx_engine/serve/turn.py",
           "*answer.fmt.markers, DS_CALL_BEGIN", "DS_CALL_BEGIN",
           ("tests/test_toolcall_conformance.py", "-k", "kimi"),
           "a format's inner markers (Kimi K2's <|tool_call_begin|>) dropped as special tokens before the reader"),
    Mutant("truncated-call-returned-whole", "mlx_engine/serve/jobs.py",
           'truncated=reason == "length")', "truncated=False)",
           ("tests/test_toolcall_conformance.py", "-k", "truncated"),
           "an answer cut at max_tokens inside a call still returns the call, completed by the parser"),
    Mutant("value-whitespace-stripped", "mlx_engine/toolcalls/glm.py",
           '    if allowed == {"string"}:\n        return text\n',
           '    if allowed == {"string"}:\n        return text.strip()\n',
           ("tests/test_toolcall_conformance.py", "-k", "glm"),
           "GLM's string values stripped of their whitespace (the bug the suite filed against Ollama)"),
    # issue 54: what an agent reads from the server, and `launch`
    Mutant("cached-tokens-zero", "mlx_engine/serve/batch.py",
           'out.finish(spec, reason, s.get("reused_prompt_tokens", 0))', "out.finish(spec, reason, 0)",
           ("tests/test_serve_agent_reads.py", "-k", "cached_tokens"),
           "usage's cached tokens reported as 0 whatever the prefix cache saved"),
    Mutant("keepalive-never-sent", "mlx_engine/serve/runner.py",
           "await asyncio.wait_for(job.events.get(), keepalive) if keepalive else await job.events.get()",
           "await job.events.get()",
           ("tests/test_serve_agent_reads.py", "-k", "keepalive"),
           "a stream stays silent while its prompt is prefilled: no keepalive, a client's idle timeout cuts it"),
    Mutant("generation-config-ignored", "mlx_engine/serve/runner.py",
           'turn.sampling = sampling_defaults.apply(turn.sampling, turn.named, getattr(service, "sampling_defaults", {}))',
           "pass",
           ("tests/test_serve_agent_reads.py", "-k", "checkpoint_sampling"),
           "the checkpoint's generation_config.json sampling never applied: a request naming none gets greedy"),
    Mutant("launch-window-unchecked", "mlx_engine/launch/agents.py",
           "if agent.first_prompt <= window:", "if True:",
           ("tests/test_launch.py", "-k", "smaller"),
           "an agent started on a model whose window cannot hold its first request"),
]


def copy_tree(dest: Path) -> int:
    """The working tree's files (tracked + untracked, not ignored) into dest. -> files copied."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    n = 0
    for name in filter(None, names):
        src = REPO / name
        if not src.exists() or src.is_dir():  # deleted in the working tree, or a submodule
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name, follow_symlinks=False)
        n += 1
    return n


def environment(copy: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports(python: str, copy: Path) -> None:
    code = "import app, metal_kernels, mlx_engine; print(mlx_engine.__file__, metal_kernels.__file__, app.__file__)"
    out = subprocess.run([python, "-c", code], cwd=copy, env=environment(copy), capture_output=True, text=True)
    paths = out.stdout.split()
    if out.returncode != 0 or not paths or not all(Path(p).resolve().is_relative_to(copy.resolve()) for p in paths):
        got = out.stdout.strip() or out.stderr.strip()
        raise SystemExit(f"error: the copy's packages are not the ones imported: {got}")


def run_tests(python: str, copy: Path, args: tuple[str, ...], timeout: float, stop_first: bool):
    """-> (outcome, seconds, output tail); outcome 'passed', 'failed', 'timeout' or 'error: ...'."""
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if stop_first else []), *args]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=copy, env=environment(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", time.perf_counter() - t, out[-2000:]
    seconds = time.perf_counter() - t
    outcome = {0: "passed", 1: "failed", 2: "failed"}.get(
        proc.returncode, f"error: pytest exit status {proc.returncode}")
    return outcome, seconds, out[-2000:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this mutant (repeatable)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"), help="the interpreter (default .venv)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per test run (default 900)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run of the tests on the unmutated copy")
    p.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:20} {m.file}: {m.bug}\n{'':20} tests: {' '.join(m.tests)}")
        return 0
    unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
    if unknown:
        print(f"error: --only {unknown[0]}: no such mutant (see --list)", file=sys.stderr)
        return 2
    if not Path(args.python).exists():
        print(f"error: --python {args.python}: not found (run `make setup`)", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    copy = Path(tempfile.mkdtemp(prefix="mlx-engine-mutants-"))
    try:
        n = copy_tree(copy)
        print(f"copied {n} files to {copy}", flush=True)
        check_imports(args.python, copy)
        if not args.no_baseline:
            files = tuple(dict.fromkeys(a for m in chosen for a in m.tests if a.endswith(".py")))
            outcome, seconds, tail = run_tests(args.python, copy, files, args.timeout, stop_first=False)
            print(f"baseline (no mutation): {outcome} in {seconds:.0f} s", flush=True)
            if outcome != "passed":
                print(tail, file=sys.stderr)
                print("error: the tests fail without a mutation; fix them first", file=sys.stderr)
                return 2
        rows = [run_mutant(m, copy, args) for m in chosen]
    finally:
        if args.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)
    print_table(rows)
    bad = [r for r in rows if not r[2].startswith("caught")]
    missed = f"; not caught: {', '.join(r[0] for r in bad)}" if bad else ""
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutants caught{missed}")
    return 1 if bad else 0


def run_mutant(m: Mutant, copy: Path, args) -> tuple[str, str, str, float]:
    path = copy / m.file
    text = path.read_text()
    found = text.count(m.original)
    if found != 1:
        why = "snippet not found (the code changed)" if found == 0 else f"snippet found {found} times"
        print(f"{m.name}: error: {m.file}: {why}", flush=True)
        return (m.name, " ".join(m.tests), f"error: {why}", 0.0)
    path.write_text(text.replace(m.original, m.mutated))
    try:
        outcome, seconds, tail = run_tests(args.python, copy, m.tests, args.timeout, stop_first=True)
    finally:
        path.write_text(text)
    result = {"failed": "caught", "timeout": "caught (timeout)", "passed": "SURVIVED"}.get(outcome, outcome)
    print(f"{m.name}: {result} in {seconds:.0f} s", flush=True)
    if result == "SURVIVED" or result.startswith("error"):
        print(tail, flush=True)
    return (m.name, " ".join(m.tests), result, seconds)


def print_table(rows) -> None:
    head = ("mutation", "tests", "result", "seconds")
    body = [(name, tests, result, f"{s:.0f}") for name, tests, result, s in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print()
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in body:
        print(line(r))


if __name__ == "__main__":
    sys.exit(main())
