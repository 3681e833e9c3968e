"""Real torchrun/gloo runs of the parallel breadth: gradient accumulation, HSDP, pipeline parallel, each
against the same trainer on one process with the whole global batch of 8 sequences (fp32 on CPU).

Every layout here sees the same 8 sequences per optimizer step (data.py's strided shards), so only the
order of floating-point reductions differs: step-0 loss within 1e-5, a 5-step trajectory within 5e-4
(the tolerances of test_trainer_parallel.py).
"""

from __future__ import annotations

import pytest
from helpers import REPO, mean_losses, torchrun

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_cases.py")
FAMILIES = ("qwen3_moe", "mixtral")
STEPS = 5
STEP0_TOLERANCE = 1e-5
TRAJECTORY_TOLERANCE = 5e-4
# processes -> {case: overrides}; each process count is one torchrun training every case.
CASES = {
    1: {"reference": "parallel.mode=ddp,data.batch_size=8"},
    2: {
        # 2 ranks x 2 micro-batches x 2 sequences = 8 sequences per optimizer step.
        "ddp_accumulation": "parallel.mode=ddp,data.batch_size=2,optim.accumulation_steps=2",
        "fsdp_accumulation": "parallel.mode=fsdp,data.batch_size=2,optim.accumulation_steps=2",
    },
}
NPROC = {case: nproc for nproc, cases in CASES.items() for case in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("breadth")
    for nproc, cases in CASES.items():
        arguments = [f"--case={name}={overrides}" for name, overrides in cases.items()]
        completed = torchrun(nproc, SCRIPT, "--out", str(out), "--steps", str(STEPS),
                             "--families", ",".join(FAMILIES), *arguments, timeout=900)
        assert completed.returncode == 0, f"{nproc} ranks:\n{completed.stderr[-4000:]}"
    return out


def losses(runs, case: str, family: str) -> list[float]:
    return mean_losses(runs / case / family, NPROC[case])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", [c for c in NPROC if c != "reference"])
def test_layout_matches_the_large_batch_step(runs, case, family):
    reference = losses(runs, "reference", family)
    sharded = losses(runs, case, family)
    assert len(reference) == len(sharded) == STEPS
    assert len(set(round(x, 6) for x in reference)) == STEPS, "the reference must learn"
    assert abs(sharded[0] - reference[0]) < STEP0_TOLERANCE, (sharded[0], reference[0])
    worst = max(abs(a - b) for a, b in zip(sharded, reference))
    assert worst < TRAJECTORY_TOLERANCE, (sharded, reference)
