"""Pipeline stages of repeated layers: which layers each stage runs, and when a pipeline ends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edatalog.solver import layers


@given(count=st.integers(1, 100), stages=st.integers(1, 16))
def test_stage_sizes_count_the_layers_each_stage_runs(count: int, stages: int) -> None:
    sizes = layers.stage_sizes(count, stages)
    assert sum(sizes) == count
    assert sizes == [sum(layers.stage_of(k, count, stages) == s for k in range(count)) for s in range(stages)]
    if count >= stages:
        assert max(sizes) - min(sizes) <= 1  # as even as can be


def _simulated(stage_seconds: list[float], microbatches: int) -> float:
    """A pipeline run microbatch by microbatch: ``j`` enters stage ``s`` when it has left
    ``s - 1`` and ``j - 1`` has left ``s``."""
    done = [0.0] * len(stage_seconds)  # when the previous microbatch left each stage
    for _ in range(microbatches):
        ready = 0.0
        for s, t in enumerate(stage_seconds):
            ready = max(ready, done[s]) + t
            done[s] = ready
    return done[-1]


@settings(max_examples=200)
@given(
    stage_seconds=st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=8),
    microbatches=st.integers(1, 12),
)
def test_pipeline_seconds_equal_a_simulated_pipeline(stage_seconds: list[float], microbatches: int) -> None:
    assert layers.pipeline_seconds(stage_seconds, microbatches) == pytest.approx(
        _simulated(stage_seconds, microbatches), rel=1e-12, abs=1e-12
    )


def test_a_pipeline_of_even_stages_pays_one_bubble() -> None:
    # 4 stages of 1 s, 8 microbatches: the last leaves after 8 + 3 steps.
    assert layers.pipeline_seconds([1.0] * 4, 8) == 11.0
    with pytest.raises(ValueError, match="at least one stage"):
        layers.pipeline_seconds([], 2)
