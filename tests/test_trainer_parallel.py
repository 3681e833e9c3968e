"""Real torchrun/gloo runs of the trainer: every family under DDP, FSDP2, TP and 2-D FSDP x TP starts from
the unsharded model's loss and follows its loss trajectory.

One process group per layout trains all six families (tests/dist_scripts/train_families.py); the
reference is the same trainer on one process with the whole global batch of 8 sequences.
"""

from __future__ import annotations

import pytest
from helpers import REFERENCE_STEPS, REPO, mean_losses, torchrun

from fleetscope.trainer.families import FAMILIES

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_families.py")
STEPS = 5
# (processes, mode, tp degree, sequences per data-parallel rank): a global batch of 8 in every layout.
LAYOUTS = {
    "reference": (1, "ddp", 1, 8),    # conftest.families_reference
    "ddp": (2, "ddp", 1, 4),
    "fsdp": (2, "fsdp", 1, 4),
    "tp": (2, "tp", 2, 8),
    "fsdp_tp": (4, "fsdp_tp", 2, 4),
}
# fp32 on CPU: only the order of reductions differs between layouts.
STEP0_TOLERANCE = 1e-5
TRAJECTORY_TOLERANCE = 5e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, families_reference):
    assert STEPS == REFERENCE_STEPS
    out = tmp_path_factory.mktemp("families")
    (out / "reference").symlink_to(families_reference, target_is_directory=True)
    for name, (nproc, mode, tp, batch) in LAYOUTS.items():
        if name == "reference":
            continue
        completed = torchrun(nproc, SCRIPT, "--out", str(out / name), "--mode", mode, "--tp", str(tp),
                             "--batch", str(batch), "--steps", str(STEPS), timeout=900)
        assert completed.returncode == 0, f"{name}:\n{completed.stderr[-4000:]}"
    return out


def losses(runs, layout: str, family: str) -> list[float]:
    nproc = LAYOUTS[layout][0]
    return mean_losses(runs / layout / family, nproc)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp", "fsdp_tp"])
def test_layout_matches_the_unsharded_model(runs, layout, family):
    reference = losses(runs, "reference", family)
    sharded = losses(runs, layout, family)
    assert len(reference) == len(sharded) == STEPS
    assert abs(sharded[0] - reference[0]) < STEP0_TOLERANCE, (sharded[0], reference[0])
    worst = max(abs(a - b) for a, b in zip(sharded, reference))
    assert worst < TRAJECTORY_TOLERANCE, (sharded, reference)


def test_training_moves_the_loss(runs):
    """The comparison above would pass for a model that never learns; this one would not."""
    for family in FAMILIES:
        reference = losses(runs, "reference", family)
        assert len(set(round(x, 6) for x in reference)) == STEPS
