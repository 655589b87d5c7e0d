"""The chat's live policy (app/worker.py LivePolicy) with a drafter chain: under auto each member keeps its
own adaptive policy, as in the engine; the UI's controls (off, a fixed k) still bind every member."""

import mlx_engine  # noqa: F401  (OpenBLAS before mlx)
from app.worker import EngineWorker, LivePolicy
from mlx_engine import Engine, GenerationConfig, NgramDrafter
from mlx_engine.core.policy import AdaptivePolicy
from mlx_engine.drafters.chain import ChainDrafter
from mlx_engine.drafters.draft_model import DraftModelDrafter
from reference import mlx_lm_greedy
from test_greedy_equality import target

PROMPT = [3, 17, 42, 9, 200, 11, 5, 77, 3, 17, 42, 9, 128, 64, 31, 2, 3, 17, 42]


def live_engine():
    model = target("llama")
    chain = ChainDrafter(DraftModelDrafter(model, model.args.vocab_size), NgramDrafter(min_ngram=1))
    worker = EngineWorker(post=lambda message: None)
    worker.engine = engine = Engine(model, chain)
    engine.policy = LivePolicy(worker, engine.policy)
    return model, worker, engine


def run(engine, n=48):
    drafts = []
    out = []
    for step in engine.generate(PROMPT, GenerationConfig(max_tokens=n, num_draft="auto")):
        out += step.tokens
        drafts.append(len(step.draft))
    return out, drafts


def test_each_chain_member_gets_its_own_live_policy_under_auto():
    model, worker, engine = live_engine()
    out, drafts = run(engine)
    assert out == mlx_lm_greedy(model, PROMPT, 48)
    own = engine.member_policies
    assert set(own) == {"ngram", "ngram:long"}
    for p in own.values():
        assert isinstance(p, LivePolicy) and isinstance(p.inner, AdaptivePolicy)
        assert p.inner is not engine.policy.inner and p.inner.max_k == 16
    assert own["ngram"].inner is not own["ngram:long"].inner
    assert max(drafts) > 8  # an n-gram member drafted past the model drafter's longest (8)
    assert engine.policy.last_k == engine.policy.shown.last_k  # the panel reads one k, whoever drafted


def test_off_and_a_fixed_k_bind_every_member():
    model, worker, engine = live_engine()
    run(engine)  # the members' live policies exist now
    worker.set_live("auto", False)
    out, drafts = run(engine)
    assert out == mlx_lm_greedy(model, PROMPT, 48) and max(drafts) == 0
    worker.set_live(3, True)
    out, drafts = run(engine)
    assert out == mlx_lm_greedy(model, PROMPT, 48) and 0 < max(drafts) <= 3


def test_the_chat_engine_gets_its_drafters_policy_settings(tmp_path):
    """The worker warms the model up without a drafter; the engine it keeps has the drafter's own policy
    settings (prompt lookup: up to 16 from a first burst at 16), not a drafterless engine's (8)."""
    import model_dirs
    from app.worker import LoadRequest

    folder = model_dirs.save_tiny(tmp_path / "tiny", seed=1)
    messages = []
    worker = EngineWorker(post=messages.append)
    worker._load(LoadRequest(model=str(folder), drafter="ngram"))
    assert type(messages[-1]).__name__ == "ModelLoaded", messages[-1]
    assert worker.engine.drafter is worker.drafter and worker.drafter.name == "ngram"
    assert (worker.engine.policy.max_k, worker.engine.policy.bootstrap_k) == (16, 16)
