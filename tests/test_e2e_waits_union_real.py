"""The first-time-user review's case, for real: a plain 2-rank gloo DDP script with two gradient buckets whose
rank 1 sleeps SLEEP_MS before every other step. Both buckets wait for the one late backward; counted once, the
waiting the sleep adds to what that rank causes is about the sleep and the slow-down the sleeping steps show
against the quiet ones (summed, it came out near twice that). Quiet and sleeping steps alternate in one window:
the load of a shared machine, which drifts over seconds and slows a rank's compute too, weighs on both alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import fleetscope

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "dist_scripts" / "two_bucket_ddp.py"
SLEEP_MS = 100.0
"""Large next to a loaded 2-core machine's noise (a step 10-20 ms noisier either way, load average 4-6): with
30 ms, the step-to-step spread of rank 1's lateness under load grew until it no longer stood out (no finding).
Sleeping every other step, its lateness is about SLEEP_MS / 2 with a spread of about SLEEP_MS / 2 from the
alternation itself, so its t over 16 steps tends to 4 (2.1 needed) as the sleep outgrows the load's noise; 8
sleeping steps cost 0.8 s."""
TOLERANCE = 0.3
"""Within 30% of the sleep: the load's 10-20 ms either way; counting both buckets' waits gives about 100% more."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("pair")
    run = work / "runs" / "slow"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run), "--env", "SLOW_RANK=1",
                           "--env", f"SLEEP_MS={SLEEP_MS:g}", "--env", "SLEEP_EVERY=2", "--env", "TRACE_DIR=tb",
                           "--collect-traces", "tb/*.pt.trace.json", "--", "python", str(SCRIPT), cwd=work, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return run


def _steps(run: Path) -> tuple[dict[int, float], dict]:
    """step -> the slowest rank's step time, and rank 1's straggler finding."""
    report = json.loads((run / "report" / "report.json").read_text())
    window = report["windows"][0]
    times: dict[int, float] = {}
    for rank in window["ranks"]:
        for step in rank["steps"]:
            times[step["step"]] = max(times.get(step["step"], 0.0), step["step_time_ms"])
    (finding,) = [f for f in window["causes"]["findings"] if f["rank"] == 1]
    return times, finding


def test_the_caused_waiting_is_the_measured_slow_down_not_twice_it(run_dir):
    times, finding = _steps(run_dir)
    sleeping = [s for s in times if s % 2 == 0]
    quiet = [s for s in times if s % 2 == 1]
    assert len(sleeping) >= 3 and len(quiet) >= 3
    slowdown = float(np.mean([times[s] for s in sleeping]) - np.mean([times[s] for s in quiet]))
    caused = {w["step"]: w["caused_wait_ms"] for w in finding["what_if"]}
    # what the sleep adds to the waiting rank 1 causes (it is late by a little in quiet steps too, under load)
    added = float(np.mean([caused.get(s, 0.0) for s in sleeping]) - np.mean([caused.get(s, 0.0) for s in quiet]))
    assert added == pytest.approx(SLEEP_MS, rel=TOLERANCE)
    # the measured slow-down is the noisier figure (4 steps against 4, each 10-20 ms noisy, and in quiet steps
    # rank 0 loses the CPU as often): bounded by it plus one sleep, which a sum of both buckets' waits exceeds
    assert added <= slowdown + SLEEP_MS


def test_the_straggler_gain_is_not_above_the_sleep_and_every_invariant_holds(run_dir):
    from fleetscope.analysis.advise import advise

    (finding,) = [f for f in advise(run_dir).findings if f.rule == "straggler"]
    assert finding.ranks == [1]
    # over every step it was late in (quiet ones too, by a little): about half the sleep (half the steps sleep)
    # plus that little, so at most the sleep; both buckets' waits summed give the sleep plus twice that little
    assert SLEEP_MS / 4 < finding.expected_gain_ms <= SLEEP_MS, finding.expected_gain_ms
    # --check recomputes each step's waiting, and each what-if's, as the union of the waits the report places
    completed = fleetscope("analyze", "--check", str(run_dir))
    assert completed.returncode == 0 and "every invariant holds" in completed.stdout, completed.stdout[-3000:]
