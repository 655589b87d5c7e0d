"""What device the tests run on, and how a test makes its target decode as the engine does there."""

import mlx.core as mx

ON_GPU = bool(mx.metal.is_available() or (getattr(mx, "cuda", None) is not None and mx.cuda.is_available()))


def as_engine_decodes(model):
    """The model as the engine decodes with it on this device: on a GPU the engine runs the
    batch-invariant path (mlx_engine/batch_invariant.py), so a reference decode must run it too; on the
    CPU the model as it is."""
    if ON_GPU:
        from mlx_engine.target_model.batch_invariant import make_batch_invariant

        make_batch_invariant(model)
    return model
