"""Significance before blame (cross_rank/stragglers.py `significance`): a straggler is named only when its lateness
stands out from the step-to-step spread, with a confidence bounded by the profiled steps and ranks; no node remedy
for CPU ranks or ranks sharing a host with fast ones; a verdict names one rank."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.advise import Evidence, advise, advise_evidence
from fleetscope.analysis.advise.parallelism import CPU_SLOW_CHANGE, SHARED_HOST_SLOW_CHANGE
from fleetscope.analysis.cross_rank.arrivals import arrival_matrix
from fleetscope.analysis.cross_rank.causes import CAUSE_SLOW_DEVICE, StepWhatIf, StragglerCause
from fleetscope.analysis.cross_rank.stragglers import (
    Significance,
    find_stragglers,
    others_median,
    others_median_each,
    straggler_confidence,
    t_quantile,
)
from fleetscope.analysis.inputs.sources import TraceSource
from fleetscope.analysis.invariants import check_advice, check_report
from fleetscope.analysis.per_rank.parse import analyze_trace
from fleetscope.analysis.quantities import JobStraggler
from helpers.kineto import RUNLOOP_TID, KinetoBuilder

STEP_US = 10_000.0
MM_US = 2_000.0
END_US = 8_000.0
"""Every rank's all-reduce ends here after its step's start (the last arrival is before it)."""
SYMMETRIC_JITTER = [(0, 600), (0, 1500), (1200, 0), (0, 300), (0, 900), (700, 0), (0, 200), (400, 0)]
"""Per step, (rank 0's, rank 1's) delay before the all-reduce, us: no fault, rank 1 late in 5 of 8 steps and
causing 60% of the waiting, its lateness swinging from -1.2 to +1.5 ms."""
LATE_US = [3000, 3300, 2800, 3100, 2900, 3200, 3050, 2950]
"""A clear late rank: its delay per step, us, about 3 ms +- 0.2 ms; its peers jitter by 0-100 us."""
PEER_JITTER = [0, 60, 100, 20, 80, 40, 0, 90]
BLAME = re.compile(r"rank (\d+) (?:is the straggler|causes the most waiting|has the slowest steps)|slowest rank: (\d+)")


def _cpu_rank(rank: int, delays: list[float], *, world: int, mm_us: float = MM_US, step_end_us: float = STEP_US,
              host: str = "node0") -> KinetoBuilder:
    """A CPU (gloo) rank: per step a matmul, then `delays[step]` of nothing, then the all-reduce."""
    builder = KinetoBuilder(rank=rank, world_size=world, backend="gloo", host=host)
    for step, delay in enumerate(delays):
        start = step * STEP_US
        builder.step(step + 1, start, step_end_us)
        builder.op("aten::mm", start + 100, mm_us)
        arrival = start + 100 + mm_us + 50 + delay
        builder.op("c10d::allreduce_", arrival - 10, 5.0)
        builder.gloo(arrival, start + END_US - arrival, tid=RUNLOOP_TID)
    return builder


def _write(directory: Path, builders: list[KinetoBuilder]) -> Path:
    for builder in builders:
        builder.write(directory / f"rank{builder.rank}.json")
    return directory


def _results(directory: Path, builders: list[KinetoBuilder]):
    _write(directory, builders)
    return [analyze_trace(TraceSource(path=p, label=p.name, window=None)) for p in sorted(directory.glob("*.json"))]


def _symmetric(directory: Path) -> Path:
    return _write(directory, [_cpu_rank(r, [pair[r] for pair in SYMMETRIC_JITTER], world=2) for r in (0, 1)])


def _late(directory: Path, steps: int, ranks: int = 3) -> Path:
    builders = [_cpu_rank(r, LATE_US[:steps] if r == 1 else [j * (r + 1) / 2 for j in PEER_JITTER[:steps]],
                          world=ranks) for r in range(ranks)]
    return _write(directory, builders)


def test_a_symmetric_pair_with_jitter_only_gets_no_straggler(tmp_path):
    trace_dir = _symmetric(tmp_path / "set")
    report = analyze(trace_dir, use_hta=False, write_default_outputs=False)
    stragglers = report.windows[0].stragglers
    top = stragglers.by_wait[0]
    assert top.rank == 1 and top.score > 0.5                 # it causes most of the waiting: the old verdict's straggler
    assert stragglers.waited_for_rank is None and not stragglers.consistent
    assert stragglers.significance is not None and not stragglers.significance.stands_out
    assert stragglers.significance.steps == len(SYMMETRIC_JITTER)
    assert "nothing stands out" in report.verdict and "is the straggler" not in report.verdict
    assert "varying by" in report.verdict                   # the evidence: its lateness against the spread
    assert report.windows[0].causes.findings == []          # no cause is given for noise
    assert [f for f in advise(trace_dir).findings if f.rule == "straggler"] == []
    assert check_report(report) == []


@pytest.mark.parametrize(("steps", "confidence"), [(3, "low"), (5, "medium"), (8, "high")])
def test_a_clear_late_rank_is_named_with_a_confidence_bounded_by_its_steps(tmp_path, steps, confidence):
    trace_dir = _late(tmp_path / "set", steps)
    report = analyze(trace_dir, use_hta=False, write_default_outputs=False)
    stragglers = report.windows[0].stragglers
    assert stragglers.waited_for_rank == 1 and stragglers.consistent
    sig = stragglers.significance
    assert (sig.rank, sig.steps, sig.ranks, sig.stands_out, sig.confidence) == (1, steps, 3, True, confidence)
    assert sig.lateness_vs_peers_us == pytest.approx(np.mean(LATE_US[:steps]) - np.median(PEER_JITTER[:steps]), rel=0.1)
    assert "rank 1 is the straggler" in report.verdict and "stands out:" in report.verdict
    (finding,) = [f for f in advise(trace_dir).findings if f.rule == "straggler"]
    assert finding.ranks == [1] and finding.confidence == confidence
    assert finding.evidence["profiled_steps"] == steps


def test_two_profiled_steps_of_two_ranks_are_never_high(tmp_path):
    builders = [_cpu_rank(r, LATE_US[:2] if r == 1 else [0.0, 50.0], world=2) for r in (0, 1)]
    report = analyze(_write(tmp_path / "set", builders), use_hta=False, write_default_outputs=False)
    sig = report.windows[0].stragglers.significance
    assert sig.steps == 2 and sig.confidence in ("", "low")
    findings = [f for f in advise(tmp_path / "set").findings if f.rule == "straggler"]
    assert all(f.confidence == "low" for f in findings)


def test_one_step_of_two_ranks_cannot_stand_out(tmp_path):
    builders = [_cpu_rank(r, [3000.0] if r == 1 else [0.0], world=2) for r in (0, 1)]
    results = _results(tmp_path / "set", builders)
    stragglers = find_stragglers(results, arrival_matrix(results))
    assert stragglers.by_wait[0].rank == 1 and stragglers.waited_for_rank is None
    assert stragglers.significance.spread_us is None and "nothing stands out" in stragglers.verdict


def test_cpu_ranks_on_one_host_get_no_node_remedy(tmp_path):
    # rank 1's matmul takes 1.5x as long (the same op, the same count): a "slow device" on a CPU rank
    delays = [0.0] * 6
    builders = [_cpu_rank(r, delays, world=2, mm_us=MM_US * (1.5 if r == 1 else 1.0)) for r in (0, 1)]
    trace_dir = _write(tmp_path / "set", builders)
    report = analyze(trace_dir, use_hta=False, write_default_outputs=False)
    (cause,) = report.windows[0].causes.findings
    assert (cause.rank, cause.cause, cause.has_gpu, cause.host_peers) == (1, CAUSE_SLOW_DEVICE, False, [0])
    assert "less CPU" in cause.explanation
    advice = advise(trace_dir)
    (finding,) = [f for f in advice.findings if f.rule == "straggler"]
    assert finding.change == CPU_SLOW_CHANGE
    assert "--exclude" not in finding.change and "nvidia-smi" not in finding.change
    assert check_advice(advice, report) == []


def _slow_device(**extra) -> StragglerCause:
    fields = dict(rank=3, cause=CAUSE_SLOW_DEVICE, explained_share=0.9, wait_share=0.9, late_instances=8,
                  median_lateness_us=2_000.0, mean_lateness_us=2_000.0, mean_extra_compute_us=2_000.0,
                  mean_extra_idle_us=0.0, mean_carried_us=0.0, op_duration_ratio=1.2, ops_compared=10,
                  expected_slowdown_us=2_000.0, clock_uncertainty_us=0.0, phase="", phase_vs_peers_pct=None,
                  what_if=[StepWhatIf(step=1, step_time_ms=100.0, caused_wait_ms=2.0, projected_step_ms=98.0)],
                  explanation="rank 3 is late", has_gpu=True)
    return StragglerCause(**{**fields, **extra})


def _straggler_finding(cause: StragglerCause, **evidence):
    job = JobStraggler(rank=cause.rank, caused_us=1.0, share=cause.wait_share, times_last=8, collectives=8,
                       consistent=True, windows=(0,))
    findings = advise_evidence(Evidence(**{"step_ms": 100.0, "basis": "gpu", "stragglers": [cause],
                                           "job_straggler": job, **evidence})).findings
    return next(f for f in findings if f.rule == "straggler")


def test_a_gpu_rank_alone_on_its_host_may_have_its_node_excluded_one_sharing_it_not():
    alone = _straggler_finding(_slow_device(), rank_hosts={3: "node3", 2: "node2"})
    assert "--exclude" in alone.change
    shared = _straggler_finding(_slow_device(host_peers=[2]), rank_hosts={3: "node1", 2: "node1"})
    assert shared.change == SHARED_HOST_SLOW_CHANGE and "--exclude" not in shared.change
    by_hosts = _straggler_finding(_slow_device(), rank_hosts={3: "node1", 2: "node1"})
    assert "--exclude" not in by_hosts.change
    cpu = _straggler_finding(_slow_device(has_gpu=None), basis="cpu")
    assert cpu.change == CPU_SLOW_CHANGE


def test_the_advice_confidence_is_the_lower_of_the_cause_and_the_significance():
    low = Significance(rank=3, steps=2, ranks=2, lateness_vs_peers_us=2000.0, spread_us=10.0, t=200.0, needed_t=12.7,
                       stands_out=True, confidence="low")
    assert _straggler_finding(_slow_device(significance=low)).confidence == "low"
    high = dataclasses.replace(low, steps=10, ranks=8, confidence="high")
    assert _straggler_finding(_slow_device(significance=high)).confidence == "high"
    assert _straggler_finding(_slow_device(significance=high, explained_share=0.6)).confidence == "medium"


def test_the_verdict_names_one_rank_when_the_slowest_steps_are_another_ranks(tmp_path):
    # rank 1 keeps the others waiting; rank 0's step range runs 20% longer after the all-reduce (its own tail)
    builders = [_cpu_rank(r, LATE_US if r == 1 else PEER_JITTER, world=2,
                          step_end_us=STEP_US if r == 1 else STEP_US * 1.2) for r in (0, 1)]
    report = analyze(_write(tmp_path / "set", builders), use_hta=False, write_default_outputs=False)
    assert report.windows[0].stragglers.slowest_rank == 0
    assert "rank 1 is the straggler" in report.verdict
    for verdict in (report.verdict, report.windows[0].stragglers.verdict):
        named = {int(next(g for g in m.groups() if g)) for m in BLAME.finditer(verdict)}
        assert named == {1} or named == set(), verdict
    assert "rank 0" not in report.verdict
    assert check_report(report) == []


def test_the_invariants_catch_two_ranks_a_node_remedy_on_a_cpu_rank_and_a_confidence_too_high(tmp_path):
    trace_dir = _late(tmp_path / "set", 3)
    report = analyze(trace_dir, use_hta=False, write_default_outputs=False)
    two = dataclasses.replace(report, verdict="slowest rank: 0 (1.00 ms mean step); rank 1 is the straggler: ...")
    assert any("names ranks [0, 1]" in p for p in check_report(two))
    advice = advise(trace_dir)
    (finding,) = [f for f in advice.findings if f.rule == "straggler"]
    exclude = dataclasses.replace(finding, change="take the rank's GPU or node out of the pool (e.g. sbatch "
                                                  "--exclude=HOST) (nvidia-smi -q -d PERFORMANCE)")
    problems = check_advice(dataclasses.replace(advice, findings=[exclude]), report)
    assert any("a CPU rank" in p for p in problems)
    high = dataclasses.replace(finding, confidence="high")          # 3 steps allow "low"
    assert any("confidence high beyond" in p for p in check_advice(dataclasses.replace(advice, findings=[high]), report))


def test_others_median_each_is_others_median_for_every_row():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(7, 40))
    values[rng.random(values.shape) < 0.2] = np.nan
    each = others_median_each(values)
    for row in range(values.shape[0]):
        expected = others_median(values, np.full(values.shape[1], row))
        present = ~np.isnan(values[row])
        np.testing.assert_allclose(each[row][present], expected[present])
        assert np.isnan(each[row][~present]).all()


@pytest.mark.parametrize(("alpha", "freedom", "table"), [
    (0.025, 1, 12.706), (0.025, 2, 4.303), (0.025, 3, 3.182), (0.025, 7, 2.365), (0.005, 10, 3.169),
    (0.05, 30, 1.697)])
def test_the_t_quantile_matches_the_table(alpha, freedom, table):
    assert t_quantile(alpha, freedom) == pytest.approx(table, rel=0.005)


def test_the_confidence_rule():
    assert straggler_confidence(2, 2, 100.0, 12.7) == "low"
    assert straggler_confidence(8, 2, 100.0, 2.4) == "medium"           # two ranks: one's lateness, the other's lead
    assert straggler_confidence(8, 3, 4.0, 2.4) == "medium"             # too close to the quantile
    assert straggler_confidence(8, 3, 5.0, 2.4) == "high"


def test_a_rank_late_every_other_step_stands_out_by_its_late_steps():
    # rank 1 sleeps 30 ms every other step; in the others rank 0 is a little late (the machine's noise): the
    # mean test averages 30 and -10 ms to 10 +- 21 ms over 8 steps (t 1.4); its late steps against its early
    # ones do stand out, and a rank whose late and early steps are alike does not
    from fleetscope.analysis.cross_rank.stragglers import SPREAD_INTERMITTENT, _intermittent
    import numpy as np
    alternating = np.array([30.0, -9.0, 31.0, -11.0, 29.0, -10.0, 30.5, -8.0]) * 1000
    t, needed, _, source, _ = _intermittent(alternating, ranks=2)
    assert t >= needed and source == SPREAD_INTERMITTENT
    symmetric = np.array([10.0, -9.0, 12.0, -11.0, 9.0, -10.0, 11.0, -12.0]) * 1000
    assert _intermittent(symmetric, ranks=2) is None
    assert _intermittent(np.array([30.0, 31.0, -1.0]) * 1000, ranks=2) is None    # one early step: too few


def test_even_step_times_beside_a_named_straggler_name_no_other_rank(tmp_path):
    # the review's pair: rank 1 sleeps before its all-reduce every step, both ranks' steps end together; the
    # verdict read "step times are even across ranks (..., +1.2% vs rank 0, the fastest); rank 1 is the straggler"
    builders = [_cpu_rank(r, LATE_US if r == 1 else PEER_JITTER, world=2) for r in (0, 1)]
    report = analyze(_write(tmp_path / "set", builders), use_hta=False, write_default_outputs=False)
    assert "rank 1 is the straggler" in report.verdict and "even across ranks" in report.verdict
    for verdict in (report.verdict, report.windows[0].stragglers.verdict):
        assert set(re.findall(r"\brank (\d+)", verdict)) == {"1"}, verdict
    assert check_report(report) == []
    two = dataclasses.replace(report, verdict="step times are even across ranks (42.56 ms mean at most, +1.2% vs "
                                              "rank 0, the fastest); rank 1 is the straggler: ...")
    assert any("names ranks [0, 1]" in p for p in check_report(two))


def test_two_ranks_slowest_steps_are_against_the_other_rank_not_a_second_name():
    from fleetscope.analysis.cross_rank.stragglers import step_time_clause

    clause = step_time_clause({0: 100.0, 1: 130.0}, collectives_name_a_rank=False)
    assert clause.startswith("rank 1 has the slowest steps") and "vs the other rank" in clause
    assert "rank 0" not in clause
