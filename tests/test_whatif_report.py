"""The report's what-if is the step replayed (analysis/whatif/report_what_if.py, analysis/quantities.py "what-if"):
two gradient buckets in flight together, both waiting for one late rank, against the same job measured without
the delay; and a step the model cannot hold keeps the arithmetic, labelled with why."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.invariants import check_report
from fleetscope.analysis.cross_rank.matching import match_collectives
from fleetscope.analysis.inputs.resolve import resolve_input
from fleetscope.analysis.per_rank.parse import parse_traces
from fleetscope.analysis.quantities import WHAT_IF_ARITHMETIC, WHAT_IF_REPLAYED
from fleetscope.analysis.render.terminal import render_terminal
from fleetscope.analysis.whatif.report_what_if import with_replayed_what_ifs
from fleetscope.analysis.per_rank.names import P2P_SEND
from fleetscope.analysis.per_rank.p2p import P2PCall
from helpers.kineto import RUNLOOP_TID, KinetoBuilder

STEP_START_US = (0.0, 20_000.0)
ARRIVALS_US = (3_000.0, 3_500.0)
"""Each bucket's issue on time, after the step's start: the second is issued while the first is in flight."""
TRANSFER_US = 1_000.0
"""From a bucket's last arrival to its end."""
TAIL_US = 1_300.0
LATE_US = 4_000.0


def _rank(rank: int, late_us: float) -> KinetoBuilder:
    """A rank of a synchronous 2-rank job as it would run: rank 1 starts its compute `late_us` late."""
    builder = KinetoBuilder(rank=rank, backend="gloo")
    own_late = late_us if rank == 1 else 0.0
    for step, start in enumerate(STEP_START_US, start=1):
        ends = [start + arrival + late_us + TRANSFER_US for arrival in ARRIVALS_US]
        builder.step(step, start, ends[-1] + TAIL_US - start)
        builder.op("aten::mm", start + 100 + own_late, 2_800.0)
        for bucket, (arrival, end) in enumerate(zip(ARRIVALS_US, ends)):
            builder.op("c10d::allreduce_", start + arrival + own_late - 10, 5.0)
            builder.gloo(start + arrival + own_late, end - start - arrival - own_late, tid=RUNLOOP_TID + bucket)
    return builder


def _job(directory: Path, late_us: float) -> Path:
    for rank in (0, 1):
        _rank(rank, late_us).write(directory / f"rank{rank}.json")
    return directory


def test_overlapping_buckets_replayed_give_the_job_without_the_delay(tmp_path):
    healthy = analyze(_job(tmp_path / "healthy", 0.0), use_hta=False, write_default_outputs=False)
    straggled = analyze(_job(tmp_path / "straggled", LATE_US), use_hta=False, write_default_outputs=False)
    healthy_ms = healthy.step_time.median_ms
    assert healthy_ms == pytest.approx((ARRIVALS_US[1] + TRANSFER_US + TAIL_US) / 1000)          # 5.8 ms
    (finding,) = straggled.windows[0].causes.findings
    assert finding.rank == 1 and len(finding.what_if) == 2
    for step in finding.what_if:
        assert step.step_time_ms == pytest.approx(healthy_ms + LATE_US / 1000)                   # 9.8 ms
        # the arithmetic: the union of the lateness stretches [3.0, 7.0) and [3.5, 7.5) ms is 4.5 ms, the one
        # 4 ms delay counted again for the second bucket's 0.5 ms stagger: 5.3 ms, below the healthy 5.8
        assert step.caused_wait_ms == pytest.approx((LATE_US + ARRIVALS_US[1] - ARRIVALS_US[0]) / 1000)
        assert step.step_time_ms - step.caused_wait_ms == pytest.approx(healthy_ms - 0.5)
        assert step.basis == WHAT_IF_REPLAYED
        assert step.projected_step_ms == pytest.approx(healthy_ms, abs=1e-9)                     # replayed: 5.8
    assert "replayed without rank 1's extra compute" in finding.explanation
    assert "replayed without rank 1's extra compute" in render_terminal(straggled)
    assert check_report(straggled) == []


def test_a_step_the_model_cannot_hold_keeps_the_arithmetic_and_says_why(tmp_path):
    report = analyze(_job(tmp_path / "straggled", LATE_US), use_hta=False, write_default_outputs=False)
    causes = report.windows[0].causes
    arithmetic = dataclasses.replace(causes, findings=[dataclasses.replace(
        f, what_if=[dataclasses.replace(w, basis=WHAT_IF_ARITHMETIC, projected_step_ms=w.step_time_ms - w.caused_wait_ms)
                    for w in f.what_if]) for f in causes.findings])
    results, _ = match_collectives(sorted(parse_traces(resolve_input(tmp_path / "straggled").sources),
                                          key=lambda r: r.rank))
    # rank 1 as if it also sent a pipeline message without a stage marker: its transfer cannot be matched
    piped = [dataclasses.replace(r, p2p=dataclasses.replace(r.p2p, calls=[
        P2PCall(step=s.step, kind=P2P_SEND, ordinal=0, start_us=s.start_us, end_us=s.start_us + 1.0)
        for s in r.steps])) if r.rank == 1 else r for r in results]
    (finding,) = with_replayed_what_ifs(arithmetic, report.windows[0].window, piped).findings
    for step in finding.what_if:
        assert step.basis == WHAT_IF_ARITHMETIC and "names no peer or micro-batch" in step.not_replayed
        assert step.projected_step_ms == pytest.approx(step.step_time_ms - step.caused_wait_ms)
    assert "not replayed: " in finding.explanation and "its transfer cannot be matched" in finding.explanation
