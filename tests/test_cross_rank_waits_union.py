"""Waits of collectives in flight together count once (analysis/quantities.py "waiting"): two DDP-like gradient
buckets that both wait for one late rank are one wait, in the stragglers' figures, the straggler's caused waiting
and the invariants that check them; the what-if and the straggler's gain come from replaying the step
(analysis/whatif: the step less what the replay saves without the late rank's extra compute)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.advise import advise, advise_evidence
from fleetscope.analysis.advise.evidence import gather_evidence
from fleetscope.analysis.invariants import check_report
from fleetscope.analysis.quantities import BASIS_STEP_METRICS, metrics_floor_ms, union_by_step_us, union_us
from fleetscope.traces.layout import RunLayout
from fleetscope.analysis.inputs.records import read_run_records
from helpers.kineto import RUNLOOP_TID, KinetoBuilder

STEP_US = 10_000.0
LATE_US = 4_000.0
"""Rank 1 starts its compute this much later than rank 0 (a host-side delay before forward)."""
BUCKETS = ((3_000.0, 8_000.0), (3_500.0, 8_500.0))
"""Rank 0's arrival and every rank's end of the two all-reduces, after the step's start: both are in flight
from 3500 to 8000 us."""
UNION_US = BUCKETS[1][0] + LATE_US - BUCKETS[0][0]
"""Rank 0 waits [3000, 7000) and [3500, 7500): 4500 us in all, not the 8000 us of the sum."""
ON_TIME_RANK_END_US = 9_800.0
"""Rank 0's step ends here; rank 1's at STEP_US (the slowest rank's is the step's time)."""
REPLAYED_US = BUCKETS[1][0] + (BUCKETS[1][1] - BUCKETS[1][0] - LATE_US) + (ON_TIME_RANK_END_US - BUCKETS[1][1])
"""The what-if: rank 0's own timeline (its second bucket issued at 3.5 ms, transferred in 1.0 ms from the last
arrival, then its 1.3 ms tail): 5.8 ms. The replay chains the buckets (10.5 ms as recorded, 6.3 ms with rank 1's
compute at rank 0's): it saves 4.2 ms of the 10 ms step. The arithmetic's 10 - 4.5 = 5.5 ms went below rank 0's
own work: the union of the two lateness stretches still counts the second bucket's 0.5 ms stagger, the one 4 ms
delay seen again."""


def _rank(rank: int) -> KinetoBuilder:
    builder = KinetoBuilder(rank=rank, backend="gloo")
    late = LATE_US if rank == 1 else 0.0
    for step, start in ((1, 0.0), (2, STEP_US)):
        builder.step(step, start, ON_TIME_RANK_END_US if rank == 0 else STEP_US)
        builder.op("aten::mm", start + 100 + late, 2_800.0)
        for bucket, (arrival, end) in enumerate(BUCKETS):
            builder.op("c10d::allreduce_", start + arrival + late - 10, 5.0)
            builder.gloo(start + arrival + late, end - arrival - late, tid=RUNLOOP_TID + bucket)
    return builder


@pytest.fixture
def trace_dir(tmp_path) -> Path:
    for rank in (0, 1):
        _rank(rank).write(tmp_path / "set" / f"rank{rank}.json")
    return tmp_path / "set"


def test_union_of_intervals_counts_overlap_once():
    assert union_us([0.0, 2.0, 10.0], [5.0, 7.0, 11.0]) == 8.0           # [0, 7) and [10, 11)
    assert union_us([0.0, 1.0], [10.0, 2.0]) == 10.0                     # one inside the other
    assert union_us([0.0, float("nan"), 4.0], [1.0, 3.0, 4.0]) == 1.0    # unknown and empty add nothing
    assert union_by_step_us([1, 1, 2], [0.0, 2.0, 0.0], [3.0, 4.0, 1.0]) == {1: 4.0, 2: 1.0}
    assert metrics_floor_ms(30.0, 12.0) == 18.0 and metrics_floor_ms(30.0, None) is None


def test_two_buckets_waiting_for_one_late_rank_are_one_wait(trace_dir):
    window = analyze(trace_dir, use_hta=False, write_default_outputs=False).windows[0]
    stragglers = window.stragglers
    assert [s.wait_by_rank_us for s in stragglers.by_step] == [{0: UNION_US, 1: 0.0}] * 2
    assert [s.total_wait_us for s in stragglers.by_step] == [UNION_US] * 2
    waits = {w.rank: w for w in stragglers.by_wait}
    assert (waits[1].times_last, waits[1].caused_wait_us, waits[1].score) == (4, 2 * UNION_US, 1.0)
    assert waits[0].waited_us == 2 * UNION_US and waits[0].caused_wait_us == 0.0
    (finding,) = window.causes.findings
    assert finding.rank == 1 and finding.median_lateness_us == LATE_US    # each instance keeps its own lateness
    for step in finding.what_if:
        assert step.step_time_ms == STEP_US / 1000
        assert step.caused_wait_ms == pytest.approx(UNION_US / 1000, abs=1e-9)
        assert step.basis == "replayed" and not step.not_replayed
        assert step.projected_step_ms == pytest.approx(REPLAYED_US / 1000, abs=1e-9)   # 5.8: not 2.0 (sum), 5.5 (union)
        # the floor: rank 0's own work, its step less its waiting (9.8 - 4.5 ms)
        assert step.floor_ms == pytest.approx((ON_TIME_RANK_END_US - UNION_US) / 1000, abs=1e-9)


def test_the_straggler_gain_is_the_replayed_saving_and_stops_at_the_step_metrics_floor(trace_dir):
    advice = advise(trace_dir)
    (finding,) = [f for f in advice.findings if f.rule == "straggler"]
    # 4.2 ms/step: the step less its replayed what-if (the union's 4.5 and the sum's 8.0 counted the stagger)
    assert finding.expected_gain_ms == pytest.approx((STEP_US - REPLAYED_US) / 1000, abs=1e-9)
    assert finding.gain_of_ms == pytest.approx(STEP_US / 1000, abs=1e-9)
    # steady steps of 8 ms with 2 ms of exposed gradient communication: no step goes below 6 ms
    report = analyze(trace_dir, use_hta=False, write_default_outputs=False)
    evidence = dataclasses.replace(gather_evidence(read_run_records(RunLayout.at(trace_dir)), report), step_ms=8.0, comm_exposed_ms=2.0,
                                   step_basis=f"{BASIS_STEP_METRICS}, steady steps 2-9 (8), slowest rank per step")
    (floored,) = [f for f in advise_evidence(evidence).findings if f.rule == "straggler"]
    assert floored.expected_gain_ms == pytest.approx(STEP_US / 1000 - 6.0, abs=1e-9)


def test_the_checker_holds_on_the_union_and_fails_on_summed_waits(trace_dir):
    report = analyze(trace_dir, use_hta=False, write_default_outputs=False)
    assert check_report(report) == []
    window = report.windows[0]
    summed = [dataclasses.replace(s, wait_by_rank_us={0: 2 * LATE_US, 1: 0.0}, total_wait_us=2 * LATE_US)
              for s in window.stragglers.by_step]
    by_wait = [dataclasses.replace(w, caused_wait_us=4 * LATE_US) if w.rank == 1 else w for w in window.stragglers.by_wait]
    (finding,) = window.causes.findings
    what_if = [dataclasses.replace(s, caused_wait_ms=2 * LATE_US / 1000, projected_step_ms=s.step_time_ms - 2 * LATE_US / 1000,
                                   floor_ms=0.0) for s in finding.what_if]
    broken = dataclasses.replace(window, stragglers=dataclasses.replace(window.stragglers, by_step=summed, by_wait=by_wait),
                                 causes=dataclasses.replace(window.causes, findings=[dataclasses.replace(finding, what_if=what_if)]))
    problems = check_report(dataclasses.replace(report, windows=[broken]))
    assert sum("the union of its waits is 4500.0 us" in p for p in problems) == 2        # one per step
    assert sum("more than the union of its lateness 9000.0 us" in p for p in problems) == 1
    assert sum("exceeds the union of rank 1's lateness 4.500 ms" in p for p in problems) == 2
    assert sum("below another rank's own work in the step (its step less its waiting, 5.300 ms)" in p
               for p in problems) == 2
