"""mlx-engine: lossless speculative decoding on MLX.

    from mlx_engine import load, Engine, GenerationConfig, SamplingConfig
    m = load("path/or/repo")
    engine = Engine(m.model, drafter=NgramDrafter())
    for step in engine.generate(prompt_tokens, GenerationConfig(num_draft=4)):
        ...
"""

from ._platform import OPENBLAS  # noqa: F401  must run before mlx is imported
from ._version import __version__  # noqa: F401, E402

from .drafters.base import Draft, Drafter, Verdict  # noqa: E402
from .drafters.draft_model import DraftModelDrafter  # noqa: E402
from .drafters.ngram import NgramDrafter  # noqa: E402
from .core.engine import Engine, GenerationConfig, Step  # noqa: E402
from .models import LoadedModel, ModelLoadError, load  # noqa: E402
from .sampling import SamplingConfig, TokenLogprob  # noqa: E402
from .core.stats import SpecStats  # noqa: E402

__all__ = [
    "Draft", "Drafter", "DraftModelDrafter", "Engine", "GenerationConfig", "LoadedModel", "ModelLoadError",
    "NgramDrafter", "SamplingConfig", "SpecStats", "Step", "TokenLogprob", "Verdict", "load",
]
