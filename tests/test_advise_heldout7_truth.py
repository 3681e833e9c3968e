"""The advisor against the seventh held-out set (tests/fixtures/gpu/heldout7: bench/planted/heldout7.py's 11
programs of architectures no earlier set holds, written without reading the advisor's rules, recorded on one
H200). Scored blind: 6 of 6 one-problem programs right first, 3 of 3 two-problem programs with both causes in the
top three, 2 of 2 healthy quiet (bench/planted/CORPUS.md). The ViT's attention gain, 49 ms blind against 119 ms
planted, is held at what the score GEMMs' excess and the walk over the GPU's span of the step make it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_set_score, scored_set

HELDOUT = Path(__file__).parent / "fixtures" / "gpu" / "heldout7"


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return scored_set(HELDOUT)


def test_the_held_out_set_is_scored_as_measured_blind(rows):
    assert_set_score(rows, counts=(6, 3, 2), right=(6, 3, 2))


def test_materialised_scores_cost_their_gemms_memory_traffic_too(rows):
    """The ViT's [64, 6, 789, 789] scores: its QK^T and PV products (head dimension 64) run at 54 TFLOP/s where
    its other GEMMs reach 786, writing and reading the scores; SDPA saved 118.7 ms of the 180.5 ms step. The gain
    counts the passes over the scores and the GEMMs' time beyond their math, walked over the GPU's span of each
    step (the host runs 120 ms ahead of the queue): within 25%."""
    vit = rows["vit_registers_eager_checkpoint"]
    gains = dict((finding[0], finding[1]) for finding in vit["findings"])
    assert gains["eager_attention"] == pytest.approx(118.7, rel=0.25)
