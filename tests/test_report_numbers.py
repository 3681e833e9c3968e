"""One set of numbers (analysis/quantities.py, analysis/invariants.py): each quantity has one definition, the
arithmetic cannot go wrong, advise agrees with the report, and compare/gate/history compare like with like.
Each case is one a new user met: a negative what-if, a gain over its own step, advice naming another rank
than the verdict, data workers advised against its own evidence, a fsdp run compared with a ddp one."""

import dataclasses
import json
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.advise import Evidence, advise_evidence
from fleetscope.analysis.compare import compare
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, StepWhatIf, StragglerCause
from fleetscope.analysis.gate import MetricGate, direction, gate
from fleetscope.analysis.history import history
from fleetscope.analysis.invariants import check_advice, check_report
from fleetscope.analysis.job_identity import DifferentJobs
from fleetscope.analysis.quantities import (
    JobStraggler,
    bounded_gain,
    clamp_caused_wait_ms,
    metrics_step_time_ms,
    step_ranges,
    trace_step_times,
)
from fleetscope.analysis.render.advice_terminal import render_advice
from fleetscope.analysis.render.terminal import render_comparison, render_terminal
from fleetscope.cli.main import main
from fleetscope.analysis.inputs.records import read_run_records
from helpers.kineto import KinetoBuilder

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _late_at_every_collective(directory: Path, *, late_us: float, host_step_us: float) -> Path:
    """3 ranks, 2 steps of 4 all-reduces 1 ms apart; rank 2 arrives `late_us` late at each, the others wait
    for it. The host's step range is `host_step_us` long: the GPU finishes after the host moved on."""
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        for step, s in enumerate((0.0, 5000.0)):
            builder.step(step, s, host_step_us)
            for k in range(4):
                start = s + 1000 * k
                arrival = start + 300 + (late_us if rank == 2 else 0.0)
                builder.kernel("gemm", start + 50, 200, launch_ts=start + 10)
                builder.kernel(NCCL, arrival, start + 400 + late_us - arrival, launch_ts=start + 20, stream=20)
        builder.write(directory / f"rank{rank}.json")
    return directory


def test_a_what_if_is_never_negative_nor_below_the_peers_compute(tmp_path):
    # Rank 2 is 0.6 ms late at 4 collectives of a step whose host range is 2 ms: 2.4 ms of caused waiting in a
    # 2 ms step read "-0.4 ms were it on time" before the clamp.
    report = analyze(_late_at_every_collective(tmp_path, late_us=600.0, host_step_us=2000.0), use_hta=False)
    (finding,) = report.windows[0].causes.findings
    assert finding.rank == 2 and finding.what_if
    for step in finding.what_if:
        assert 0.0 <= step.caused_wait_ms <= step.step_time_ms - step.floor_ms + 1e-9
        assert step.projected_step_ms >= step.floor_ms > 0.0                   # the peers' gemms stay
        # the peers' own work: their 2 ms step less their waiting at the 2 collectives in its host range
        assert step.floor_ms == pytest.approx(2.0 - 2 * 0.6, abs=1e-9)
    assert "-" not in finding.explanation.split("would take ")[1].split(" ms")[0]
    assert check_report(report) == []


def test_the_report_step_time_is_the_slowest_rank_of_each_profiled_step_and_says_so(tmp_path):
    directory = tmp_path / "set"
    for rank, extra in enumerate((0.0, 300.0)):
        builder = KinetoBuilder(rank=rank, world_size=2)
        for step, s in enumerate((0.0, 5000.0, 10000.0)):
            builder.step(step + 7, s, 1000 + extra + 100 * step)
            builder.kernel("gemm", s + 50, 200, launch_ts=s + 10)
        builder.write(directory / f"rank{rank}.json")
    report = analyze(directory, use_hta=False)
    assert trace_step_times(report.windows) == {(None, 7): 1.3, (None, 8): 1.4, (None, 9): 1.5}
    assert (report.step_time.count, report.step_time.median_ms) == (3, pytest.approx(1.4))
    assert report.step_time_basis == "trace, profiled steps 7-9, slowest rank per step"
    assert "step time median 1.40 ms, mean 1.40 ms over 3 steps (trace, profiled steps 7-9, slowest rank per step)" \
        in render_terminal(report)
    assert check_report(report) == []


def _cause(rank: int, share: float, **extra) -> StragglerCause:
    fields = dict(rank=rank, cause=CAUSE_HOST, explained_share=0.9, wait_share=share, late_instances=4,
                  median_lateness_us=20_000.0, mean_lateness_us=20_000.0, mean_extra_compute_us=0.0,
                  mean_extra_idle_us=20_000.0, mean_carried_us=0.0, op_duration_ratio=1.0, ops_compared=10,
                  expected_slowdown_us=0.0, clock_uncertainty_us=0.0, phase="", phase_vs_peers_pct=None,
                  what_if=[StepWhatIf(step=1, step_time_ms=100.0, caused_wait_ms=20.0, projected_step_ms=80.0)],
                  explanation=f"rank {rank} is late")
    return StragglerCause(**{**fields, **extra})


CONFIG = {"parallel": {"mode": "ddp", "bucket_cap_mb": 25.0}, "data": {"num_workers": 0},
          "performance": {"compile": "none"}}


def _evidence(**changes) -> Evidence:
    base = dict(step_ms=150.0, step_basis="step metrics, steady steps 4-9 (6), slowest rank per step", data_ms=1.0,
                basis="cpu", idle_pct=5.0, exposed_comm_pct=2.0, overlap_pct=80.0, config=CONFIG)
    return Evidence(**{**base, **changes})


def test_the_straggler_finding_names_the_verdicts_rank_and_every_window_it_is_late_in():
    # Window 0: rank 1 causes 90% of a little waiting; over both windows rank 0 causes the most (the verdict's).
    job = JobStraggler(rank=0, caused_us=9e4, share=0.6, times_last=30, collectives=60, consistent=True,
                       windows=(1,))
    evidence = _evidence(stragglers=[_cause(1, 0.9), _cause(0, 0.8)], straggler_windows=[0, 1], job_straggler=job)
    (finding,) = [f for f in advise_evidence(evidence).findings if f.rule == "straggler"]
    assert finding.ranks == [0] and finding.title.startswith("rank 0 holds the others back")
    assert finding.windows == [1] and finding.evidence["windows"] == "1"
    # "no single straggler" in the verdict (the demo: each of 2 ranks causes half the waiting): no straggler advice
    undecided = dataclasses.replace(job, consistent=False, share=0.5)
    evidence = dataclasses.replace(evidence, job_straggler=undecided)
    assert [f.rule for f in advise_evidence(evidence).findings if f.rule == "straggler"] == []


def test_no_data_worker_advice_when_its_dataloader_is_no_slower_than_its_peers():
    job = JobStraggler(rank=1, caused_us=1.0, share=0.56, times_last=3, collectives=6, consistent=True, windows=(0,))
    evidence = _evidence(stragglers=[_cause(1, 0.56, data_loader_excess_ms=0.0)], straggler_windows=[0],
                         job_straggler=job)
    (finding,) = advise_evidence(evidence).findings
    assert "data worker" not in finding.change and "num_workers" not in finding.change


def test_a_gain_is_a_share_of_the_step_printed_beside_it_and_never_more_than_that_step():
    advice = advise_evidence(_evidence(data_ms=40.0))
    (finding,) = advice.findings
    assert (finding.gain_of_ms, finding.expected_gain_pct) == (150.0, pytest.approx(100 * 40 / 150))
    assert "(27% of 150.00 ms, step metrics, steady steps 4-9 (6), slowest rank per step)" in render_advice(advice)
    assert bounded_gain(250.0, 100.0, "x").ms == 100.0 and bounded_gain(-5.0, 100.0, "x").ms == 0.0
    assert clamp_caused_wait_ms(118.49, 96.88, 10.0) == pytest.approx(86.88)
    assert check_advice(advice, None) == []


def test_findings_recovering_the_same_time_overlap_and_count_once():
    # Rank 1's DataLoader is its delay, and data loading is over 10% of the step: two findings, one time.
    job = JobStraggler(rank=1, caused_us=1.0, share=0.9, times_last=3, collectives=6, consistent=True, windows=(0,))
    cause = _cause(1, 0.9, data_loader_excess_ms=30.0,
                   what_if=[StepWhatIf(step=1, step_time_ms=160.0, caused_wait_ms=29.87, projected_step_ms=130.13)])
    advice = advise_evidence(_evidence(data_ms=31.17, stragglers=[cause], straggler_windows=[0], job_straggler=job))
    by_rule = {f.rule: f for f in advice.findings}
    assert by_rule["straggler"].overlaps == ["data_workers"] and by_rule["data_workers"].overlaps == ["straggler"]
    assert advice.combined_gain_ms == pytest.approx(31.17)        # the larger share of the two, not their sum
    assert "overlaps: straggler (the same input wait: not additive)" in render_advice(advice)
    assert check_advice(advice, None) == []


def test_the_checker_finds_each_broken_rule(tmp_path):
    report = analyze(_late_at_every_collective(tmp_path, late_us=300.0, host_step_us=4500.0), use_hta=False)
    assert check_report(report) == []
    window = report.windows[0]
    finding = window.causes.findings[0]
    negative = dataclasses.replace(finding.what_if[0], caused_wait_ms=9999.0, projected_step_ms=-9990.0)
    broken = dataclasses.replace(window, causes=dataclasses.replace(
        window.causes, findings=[dataclasses.replace(finding, what_if=[negative])]))
    report.windows[0] = broken
    report.verdict = "rank 0 is the straggler: ..."
    problems = "\n".join(check_report(report))
    assert "caused wait 9999.000 ms outside" in problems and "below its floor" in problems
    assert "verdict names rank 0, the waiting points at rank 2" in problems
    assert "projected_step_ms: -9990.0" in problems


def test_analyze_check_runs_the_checker_for_users(tmp_path, capsys):
    directory = _late_at_every_collective(tmp_path / "set", late_us=300.0, host_step_us=4500.0)
    assert main(["analyze", str(directory), "--no-hta", "--check"]) == 0
    assert "check: every invariant holds" in capsys.readouterr().out


def _run(root: Path, name: str, *, mode: str, batch: int, step_ms: list[float], pct: float = 10.0) -> Path:
    run = root / name
    (run / "metrics").mkdir(parents=True)
    train = {"model": {"family": "qwen3_moe", "preset": "tiny"}, "parallel": {"mode": mode, "tp": 1},
             "data": {"batch_size": batch, "seq_len": 32}, "performance": {"precision": "bf16"}}
    (run / "job.json").write_text(json.dumps({"spec": {"train": train}, "world_size": 2,
                                              "started_at": f"2026-12-01T00:00:0{len(list(root.iterdir()))}+00:00"}))
    for rank in (0, 1):
        lines = [json.dumps({"step": s, "rank": rank, "step_time_ms": t, "tokens_per_s": 64e3 / t, "mfu_pct": pct,
                             "profiled": False}) for s, t in enumerate(step_ms)]
        (run / "metrics" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return run


def _trace_dir_of(run: Path) -> None:
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=2)
        builder.step(3, 0.0, 1000).kernel("gemm", 50, 200, launch_ts=10)
        builder.write(run / "traces" / "window000" / f"rank{rank}.host.pt.trace.json")


def test_compare_refuses_runs_of_different_jobs_naming_what_differs(tmp_path, capsys):
    base = _run(tmp_path, "fsdp", mode="fsdp", batch=4, step_ms=[500.0] + [100.0] * 6)
    new = _run(tmp_path, "ddp", mode="ddp", batch=2, step_ms=[500.0] + [100.0] * 6)
    for run in (base, new):
        _trace_dir_of(run)
    with pytest.raises(DifferentJobs, match=r"data.batch_size: 4 vs 2; parallel.mode: fsdp vs ddp"):
        compare(base, new)
    assert main(["compare", str(base), str(new)]) == 2
    assert "different jobs" in capsys.readouterr().err
    assert compare(base, new, allow_different_jobs=True).notes[-2].startswith("different jobs compared")
    with pytest.raises(DifferentJobs):
        gate([base], [new])


def test_percentage_metrics_change_in_points_and_every_column_has_a_title(tmp_path):
    base = _run(tmp_path, "a", mode="ddp", batch=2, step_ms=[500.0] + [100.0] * 6, pct=0.04)
    new = _run(tmp_path, "b", mode="ddp", batch=2, step_ms=[500.0] + [100.0] * 6, pct=16.71)
    for run in (base, new):
        _trace_dir_of(run)
    comparison = compare(base, new)
    mfu = next(m for m in comparison.metrics if m.name == "mfu_pct")
    assert mfu.delta_pct is None and mfu.delta_points == pytest.approx(16.67)
    text = render_comparison(comparison)
    assert "+16.7 pt" in text and "+41675" not in text
    assert text.splitlines()[1].split() == ["metric", "base", "new", "change", "gated"]


def test_step_time_means_the_same_in_compare_gate_and_advise(tmp_path):
    # Rank 1 is 20% slower at every step: the run's step time is the slowest rank's, everywhere.
    run = _run(tmp_path, "a", mode="ddp", batch=2, step_ms=[500.0] + [100.0] * 6)
    (run / "metrics" / "rank1.jsonl").write_text("\n".join(
        json.dumps({"step": s, "rank": 1, "step_time_ms": t * 1.2, "tokens_per_s": 1.0, "profiled": False})
        for s, t in enumerate([500.0] + [100.0] * 6)) + "\n")
    _trace_dir_of(run)
    from fleetscope.analysis.compare import read_steady_metrics
    from fleetscope.traces.layout import RunLayout

    steady = read_steady_metrics(read_run_records(RunLayout.at(run)))[0]
    assert metrics_step_time_ms(steady) == pytest.approx(120.0)
    step_time = next(m for m in compare(run, run).metrics if m.name == "step_time_ms")
    assert step_time.base == pytest.approx(120.0)
    gated = next(m for m in gate([run], [run]).metrics if m.name == "step_time_ms")
    assert gated.base_median == pytest.approx(120.0)


def test_a_change_below_a_percent_is_within_the_noise_whatever_its_interval():
    tiny = MetricGate(name="step_time_ms", higher_is_better=False, base_median=100.0, new_median=99.7, base_steps=50,
                      new_steps=50, change_pct=-0.3, interval_pct=(-0.5, -0.01), gated=True)
    assert direction(tiny) == "unclear"
    assert direction(dataclasses.replace(tiny, change_pct=-3.0, interval_pct=(-4.0, -2.0))) == "gain"


def test_history_gates_a_run_only_against_runs_of_its_job(tmp_path):
    _run(tmp_path, "a", mode="ddp", batch=2, step_ms=[500.0] + [100.0] * 6)
    _run(tmp_path, "b", mode="fsdp", batch=4, step_ms=[500.0] + [300.0] * 6)
    result = history(tmp_path)
    slow = next(r for r in result.runs if r.path.endswith("b"))
    assert slow.regressions == [] and "parallel.mode: ddp vs fsdp" in slow.job_note


def test_step_ranges_read_as_a_person_writes_them():
    assert step_ranges([9, 2, 3, 4, 7, 10, 3]) == "2-4, 7, 9-10"
    assert step_ranges([]) == "none"


def test_the_examples_under_a_stragglers_headline_show_the_rank_it_names(tmp_path):
    # Rank 2 is 0.4 ms late at each of 4 collectives a step (most of the waiting); rank 0 once 0.9 ms late.
    # Four steps: against rank 0's hiccup, two would be too few for rank 2 to stand out (stragglers.py significance).
    for rank in range(3):
        builder = KinetoBuilder(rank=rank, world_size=3)
        for step, s in enumerate((0.0, 5000.0, 10000.0, 15000.0)):
            builder.step(step, s, 4800)
            for k in range(4):
                start = s + 1000 * k
                late = 400.0 if rank == 2 else (900.0 if rank == 0 and k == 1 and step == 0 else 0.0)
                end = start + 300 + (900.0 if k == 1 and step == 0 else 400.0) + 100
                builder.kernel("gemm", start + 50, 200, launch_ts=start + 10)
                builder.kernel(NCCL, start + 300 + late, end - (start + 300 + late), launch_ts=start + 20, stream=20)
        builder.write(tmp_path / "set" / f"rank{rank}.json")
    report = analyze(tmp_path / "set", use_hta=False)
    assert report.windows[0].stragglers.waited_for_rank == 2
    lines = render_terminal(report).split("Stragglers\n")[1].split("\n\n")[0].splitlines()
    assert "the others wait for rank 2" in lines[0]
    examples = [line for line in lines[1:] if "arrived" in line]
    assert "rank 2 arrived" in examples[0]              # the headline's rank first, not the single worst instance


def test_the_verdict_counts_every_missing_rank_not_only_the_listed_ones(tmp_path):
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=128)
        builder.step(3, 0.0, 1000).kernel("gemm", 50, 200, launch_ts=10)
        builder.write(tmp_path / "set" / f"rank{rank}.json")
    report = analyze(tmp_path / "set", use_hta=False)
    assert report.missing_total == 126 and len(report.missing) < 126
    assert "126 missing rank trace(s)" in report.verdict


def test_signed_differences_inside_a_comparison_are_not_taken_for_negative_times():
    from fleetscope.analysis.invariants import _non_negative

    data = {"trainer": {"ranks": [{"profiling": {"after_vs_before": {"median_pct": -3.0, "low_pct": -38.3}},
                                   "wait_us": -1.0}]}}
    assert list(_non_negative(data)) == ["trainer.ranks[0].wait_us: -1.0 (a time or share cannot be negative or "
                                         "infinite)"]
