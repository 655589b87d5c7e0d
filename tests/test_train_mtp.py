"""train-mtp on a tiny llama target: loss goes down, checkpoint + resume is exact, the written head loads
through load_mtp_drafter and is lossless (full and reduced draft vocabulary, greedy and sampled)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import model_dirs
from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.mtp import load_mtp_drafter
from mlx_engine.models import load
from mlx_engine.target_model.model import Target
from mlx_engine.train.corpus import generate_corpus, read_corpus, save_corpus
from mlx_engine.train.mtp import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_mtp")
    folder = model_dirs.save_tiny(root / "model", "llama", seed=3, vocab=320)
    m = load(str(folder))
    target = Target(m.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, size=int(rng.integers(4, 12))).tolist() for _ in range(24)]
    seqs = generate_corpus(target, prompts[:12], max_tokens=40, temperature=0.0, batch=12)
    seqs += generate_corpus(target, prompts[12:], max_tokens=40, temperature=1.0, batch=12, seed=1)
    corpus = root / "corpus.safetensors"
    save_corpus(corpus, seqs)
    return root, folder, m, corpus


def _train(root, folder, corpus, name, *extra):
    out = root / name
    args = ["--model", str(folder), "--out", str(out), "--corpus", str(corpus), "--seq-len", "16",
            "--batch", "4", "--lr", "3e-3", "--warmup", "2", "--log-every", "2", "--ckpt-every", "4", *extra]
    assert main(args) == 0
    return out


def _greedy(model, drafter, prompt, k, n=24, sampling=SamplingConfig()):
    eng = Engine(model, drafter)
    steps = list(eng.generate(prompt, GenerationConfig(max_tokens=n, num_draft=k, sampling=sampling, seed=5)))
    return [t for s in steps for t in s.tokens], steps


def test_corpus_roundtrip(setup):
    root, _, m, corpus = setup
    seqs = read_corpus(corpus)
    assert len(seqs) == 24
    tokens, hidden = seqs[0]
    assert hidden.shape == (len(tokens), m.config["hidden_size"]) and hidden.dtype == np.float16
    # hidden[i] is the state after feeding tokens[i]: greedy answers continue with argmax(lm_head(hidden[i]))
    logits = Target(m.model).lm_head(mx.array(hidden[:-1]).astype(mx.float32))
    assert (np.array(mx.argmax(logits, axis=-1)) == tokens[1:]).mean() > 0.9


def test_loss_decreases_and_resume_is_exact(setup):
    root, folder, m, corpus = setup
    full = _train(root, folder, corpus, "full", "--steps", "24")
    hist = json.loads((full / "checkpoint" / "state.json").read_text())["history"]
    assert hist[-1][1] < hist[0][1] * 0.9, hist
    # 12 steps, stop, resume to 24: same state as the uninterrupted run
    part = _train(root, folder, corpus, "part", "--steps", "24", "--stop-after", "12")
    assert json.loads((part / "checkpoint" / "state.json").read_text())["step"] == 12
    part = _train(root, folder, corpus, "part", "--steps", "24", "--resume")
    assert json.loads((part / "checkpoint" / "state.json").read_text())["step"] == 24
    assert_same_checkpoint(full, part)
    meta = json.loads((full / "mtp.json").read_text())
    assert meta["family"] == "trained" and meta["target"] == "llama" and meta["steps"] == 24
    # the head is lossless through the engine, loaded from --mtp-weights
    drafter = load_mtp_drafter(m.model, folder, m.config, mtp_weights=full / "mtp.safetensors")
    assert drafter.family == "trained" and drafter.vocab_subset is None
    prompt = [5, 17, 33, 90, 41]
    plain, _ = _greedy(m.model, None, prompt, 0)
    for k in (1, 3):
        got, _ = _greedy(m.model, drafter, prompt, k)
        assert got == plain


def test_reduced_vocabulary_head(setup, tmp_path):
    root, folder, m, corpus = setup
    out = _train(root, folder, corpus, "subset", "--steps", "8", "--vocab-subset", "48")
    # found next to the model (mtp.json says it is a trained head)
    model_dir = tmp_path / "model"
    shutil.copytree(folder, model_dir)
    shutil.copyfile(out / "mtp.safetensors", model_dir / "mtp.safetensors")
    shutil.copyfile(out / "mtp.json", model_dir / "mtp.json")
    drafter = load_mtp_drafter(m.model, model_dir, m.config)
    subset = set(np.array(drafter.vocab_subset).tolist())
    assert len(subset) <= 49 and drafter.vocab_subset.dtype == mx.int32
    prompt = [7, 8, 9, 100, 200, 31]
    plain, _ = _greedy(m.model, None, prompt, 0, n=32)
    for k in (1, 2, 4):
        got, steps = _greedy(m.model, drafter, prompt, k, n=32)
        assert got == plain
        drafts = [t for s in steps for t in s.draft]
        assert drafts and set(drafts) <= subset
    # sampled: runs, draft probabilities are zero outside the subset
    sampling = SamplingConfig(temperature=0.8)
    got, steps = _greedy(m.model, drafter, prompt, 3, n=24, sampling=sampling)
    assert len(got) == 24 and all(0 <= t < 320 for t in got)
    d = drafter.propose(2, sampling, mx.random.key(0))
    outside = np.setdiff1d(np.arange(320), np.array(sorted(subset)))
    assert float(mx.abs(d.probs[:, mx.array(outside)]).max()) == 0.0
    assert np.allclose(np.array(d.probs.sum(-1)), 1.0, atol=1e-5)


def test_init_from_starts_at_the_given_head_and_keeps_its_draft_vocabulary(setup, tmp_path, capsys):
    root, folder, m, corpus = setup
    first = _train(root, folder, corpus, "first", "--steps", "8", "--vocab-subset", "48", "--dtype", "float32")
    start = mx.load(str(first / "mtp.safetensors"))
    # lr 0: the fine-tune starts exactly at the given head (a fresh --init head would not be equal to it)
    same = _train(root, folder, corpus, "same", "--steps", "2", "--lr", "0", "--dtype", "float32",
                  "--init-from", str(first / "mtp.safetensors"))
    got = mx.load(str(same / "mtp.safetensors"))
    assert set(got) == set(start)
    for k in start:
        assert mx.array_equal(got[k], start[k]), k
    fresh = _train(root, folder, corpus, "fresh", "--steps", "2", "--lr", "0", "--dtype", "float32")
    assert not mx.array_equal(mx.load(str(fresh / "mtp.safetensors"))["layers.0.eh_proj.weight"],
                              start["layers.0.eh_proj.weight"])
    # trained on from there: it moves, and it still drafts losslessly
    tuned = _train(root, folder, corpus, "tuned", "--steps", "4", "--init-from", str(first / "mtp.safetensors"))
    drafter = load_mtp_drafter(m.model, folder, m.config, mtp_weights=tuned / "mtp.safetensors")
    assert np.array_equal(np.array(drafter.vocab_subset), np.array(start["vocab_subset"]))
    prompt = [5, 17, 33, 90, 41]
    assert _greedy(m.model, drafter, prompt, 2)[0] == _greedy(m.model, None, prompt, 0)[0]
    # a file that is not a head: one error line before the model loads
    bad = tmp_path / "corpus_as_head.safetensors"
    shutil.copyfile(corpus, bad)
    assert main(["--out", str(tmp_path / "o"), "--corpus", str(corpus), "--init-from", str(bad)]) == 2
    assert "--init-from" in capsys.readouterr().err


def test_help_explains_every_flag_with_its_default():
    from mlx_engine.train.mtp import _parser

    parser = _parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        if action.default not in (None, False):
            assert f"(default: {action.default})" in text, action.option_strings


def test_steps_0_does_nothing_expensive(tmp_path, monkeypatch):
    import mlx_engine.models.default as dm
    import mlx_engine.train.corpus as tc

    def expensive(*a, **k):
        raise AssertionError("--steps 0 must not load a model or generate a corpus")

    monkeypatch.setattr(dm, "default_model_path", expensive)
    monkeypatch.setattr(tc, "generate_corpus", expensive)
    assert main(["--out", str(tmp_path / "out"), "--steps", "0"]) == 0
    assert not (tmp_path / "out").exists()


def test_an_interrupted_run_leaves_a_resumable_state(setup, tmp_path, monkeypatch):
    """Ctrl-C while the corpus is generated keeps the answers made so far; Ctrl-C while training keeps a
    checkpoint; the same command with --resume finishes the run."""
    import mlx_engine.train.corpus as tc
    import mlx_engine.train.mtp as tm

    root, folder, m, _ = setup
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i} about foxes"}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    argv = ["--model", str(folder), "--out", str(out), "--prompts", str(prompts), "--gen-tokens", "24",
            "--gen-batch", "2", "--steps", "6", "--seq-len", "8", "--batch", "2", "--ckpt-every", "100", "--log-every", "1"]
    real_generate, calls, interrupt_at = tc.generate_corpus, [], [2]

    def generate_then_interrupt(target, batch_prompts, *a, **k):
        calls.append(len(batch_prompts))
        if len(calls) in interrupt_at:
            raise KeyboardInterrupt
        return real_generate(target, batch_prompts, *a, **k)

    monkeypatch.setattr(tc, "generate_corpus", generate_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert len(read_corpus(out / tc.GENERATED_PART)) == 2  # the first batch of answers is kept

    real_step, steps = tm.Trainer.train_step, []

    def step_then_interrupt(self):
        if self.step == 3:
            raise KeyboardInterrupt
        steps.append(self.step)
        return real_step(self)

    monkeypatch.setattr(tm.Trainer, "train_step", step_then_interrupt)
    calls.clear()
    interrupt_at.clear()
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert calls == [2, 2]  # only the prompts left were answered
    assert len(read_corpus(out / tc.GENERATED)) == 6 and not (out / tc.GENERATED_PART).exists()
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3
    assert not (out / "mtp.safetensors").exists()

    monkeypatch.setattr(tm.Trainer, "train_step", real_step)
    calls.clear()
    assert main(argv + ["--resume"]) == 0
    assert calls == []  # the corpus is complete: nothing generated again
    assert json.loads((out / "mtp.json").read_text())["steps"] == 6


def assert_same_checkpoint(a_run, b_run):
    """Two training runs' checkpoints (head and optimizer state) hold the same arrays."""
    for name in ("head.safetensors", "optimizer.safetensors"):
        a, b = mx.load(str(a_run / "checkpoint" / name)), mx.load(str(b_run / "checkpoint" / name))
        assert set(a) == set(b)
        for k in a:
            assert mx.allclose(a[k], b[k], atol=1e-6).item(), (name, k)


def test_fitted_steps_fill_what_the_budget_holds_and_never_lengthen():
    from mlx_engine.train.loop import fitted_steps

    assert fitted_steps(21, 10_000, per_step=0.1, seconds_left=10.0) == 21 + 95  # 95% of 100 steps
    assert fitted_steps(21, 50, per_step=0.1, seconds_left=10.0) == 50  # it fits already: unchanged
    assert fitted_steps(21, 10_000, per_step=0.1, seconds_left=-3.0) == 22  # over budget: one more step


def test_fit_minutes_ends_the_schedule_inside_the_budget(setup, monkeypatch):
    """--minutes alone cuts the run where the clock says, the learning rate still high; with --fit-minutes
    the schedule is shortened after the first steps to what the budget holds and the run ends at its
    decayed end. The clock is a fake one that moves 1/16 s per train step (the loop reads nothing else), so
    what is asserted is the fit, not the machine's speed: a busy machine once stopped the fitted run at the
    1.5x overrun before its schedule ended."""
    import types

    from mlx_engine.train import loop, mtp
    from mlx_engine.train.batches import schedule

    tick, now = 1 / 16, [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(mtp, "time", clock)
    step = mtp.Trainer.train_step

    def timed_step(self):
        out = step(self)
        now[0] += tick
        return out

    monkeypatch.setattr(mtp.Trainer, "train_step", timed_step)
    root, folder, _, corpus = setup
    lr = 3e-3
    # 0.05 min = 3 s = 48 steps of 1/16 s. Cut: the first step past 3 s is step 49. Fit: steps 2-21 timed
    # at 1/16 s, 3 - 21/16 s left hold 27 steps, 95% of them 25: the schedule ends at step 21 + 25 = 46,
    # inside the budget (and far from the 1.5x overrun, 72 steps, that stops a run that slowed down).
    for name, extra, want in (("cut", [], 49), ("fit", ["--fit-minutes"], 46)):
        now[0] = 0.0
        out = _train(root, folder, corpus, name, "--steps", "100000", "--minutes", "0.05", "--ckpt-every",
                     "100000", *extra)
        steps = json.loads((out / "mtp.json").read_text())["steps"]
        final_lr = mx.load(str(out / "checkpoint" / "optimizer.safetensors"))["learning_rate"].item()
        assert steps == want, name
        if extra:  # the last update used the fitted schedule's last value, ~lr/10
            assert final_lr == pytest.approx(schedule(lr, steps, 2)(steps - 1).item(), rel=1e-5)
            assert final_lr < 0.15 * lr
        else:
            assert final_lr > 0.9 * lr


@pytest.mark.parametrize("extra, error", [
    (["--fit-minutes"], "--fit-minutes needs --minutes"),
    (["--fit-minutes", "--minutes", "1", "--resume"], "--fit-minutes with --resume")])
def test_fit_minutes_refuses_what_it_cannot_fit(tmp_path, capsys, extra, error):
    assert main(["--out", str(tmp_path / "out"), "--steps", "10", *extra]) == 2
    assert error in capsys.readouterr().err
