"""core/confidence.py: the leading draft positions at or above the threshold."""

import math

from mlx_engine.core.confidence import confident_prefix


def test_the_prefix_ends_at_the_first_unsure_position():
    assert confident_prefix([0.9, 0.5, 0.1, 0.9], 0.3) == 2
    assert confident_prefix([0.3, 0.3], 0.3) == 2  # at the threshold: verified
    assert confident_prefix([0.1, 0.9], 0.3) == 0
    assert confident_prefix([], 0.3) == 0
    assert confident_prefix([0.2, 0.2], 0.0) == 2


def test_a_nan_confidence_is_not_sure():
    assert confident_prefix([0.9, math.nan, 0.9], 0.3) == 1
