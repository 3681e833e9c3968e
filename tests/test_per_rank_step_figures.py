"""Every per-step figure is per step, and the merged trace times steps and idle time as the report does.

Hand-built traces (tests/helpers/kineto.py KinetoBuilder) with known steps, a gloo all-reduce between two
ProfilerSteps (outside both, like a trainer's stop-flag agreement) and idle gaps of known length; merged,
read back, compared with the report's numbers exactly.
"""

from __future__ import annotations

import dataclasses

import pytest

from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.verify import verify_merge
from fleetscope.analysis.render.evidence_html import evidence_sections as evidence_sections_html
from fleetscope.analysis.render.evidence_text import evidence_sections
from helpers.kineto import BASE_TIME_NS, RUNLOOP_TID, T0_US, KinetoBuilder


def at_ns(us: float) -> int:
    """A builder time (us after T0_US) on the merged clock (no clock offset)."""
    return BASE_TIME_NS + round((T0_US + us) * 1000)


def cpu_rank(rank: int) -> KinetoBuilder:
    """Two 1000 us ProfilerSteps, 1500 us apart; between them (1000-1500) a gloo all-reduce at 1100-1400.
    Idle (no op, no collective): step 1 400-600 (200 us), step 2 1800-1830 (30 us, under the old 50 us
    drawing threshold): 230 us in all, 115 us per step."""
    builder = KinetoBuilder(rank=rank, backend="gloo")
    builder.step(1, 0, 1000).op("aten::mm", 0, 400).op("aten::add", 600, 400)
    builder.gloo(100, 200)                                   # inside step 1, while aten::mm runs
    builder.gloo(1100, 300, tid=RUNLOOP_TID)                 # between the steps, in no ProfilerStep
    builder.step(2, 1500, 1000).op("aten::mm", 1500, 300).op("aten::add", 1830, 670)
    builder.gloo(1600, 100)
    return builder


@pytest.fixture
def cpu_run(tmp_path):
    for rank in (0, 1):
        cpu_rank(rank).write(tmp_path / "traces" / f"rank{rank}.json")
    report = analyze(tmp_path / "traces", use_hta=False, use_cache=False)
    result = merge(tmp_path / "traces", tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    return report, result, check_trace(result.output)


def analysis_slices(check, category: str, process: str = "rank 0 (node0)") -> list:
    return sorted((s for s in check.slices if s.category == category and check.process_of(s.track_uuid).name == process
                   and check.tracks[s.track_uuid].name.startswith("fleetscope analysis")), key=lambda s: s.start_ns)


def test_the_report_gives_each_step_its_profilerstep_and_the_idle_gaps_we_planted(cpu_run):
    report, _, _ = cpu_run
    rank = report.windows[0].ranks[0]
    assert [(s.step, s.step_time_ms, s.bound) for s in rank.steps] == [(1, 1.0, "host"), (2, 1.0, "host")]
    assert rank.host_stalls.idle_by_cause_us == {"no op running": pytest.approx(230.0)}
    assert rank.host_stalls.idle_gaps_by_cause == {"no op running": 2}


def test_step_slices_and_the_step_time_counter_are_the_reports_steps(cpu_run):
    _, _, check = cpu_run
    steps = analysis_slices(check, "fleetscope.step")
    assert [(s.name, s.start_ns, s.end_ns) for s in steps] == [
        ("step 1", at_ns(0), at_ns(1000)), ("step 2", at_ns(1500), at_ns(2500))]    # was step 1 to 1500
    assert [s.annotations["step_time_ms"] for s in steps] == [1.0, 1.0]
    rank0 = next(p for p in check.processes() if p.name == "rank 0 (node0)")
    counters = {t.name: check.counter_values[t.uuid] for t in check.tracks.values()
                if t.is_counter and t.parent_uuid == rank0.uuid}
    assert counters["step time (ms)"] == [(at_ns(0), 1.0), (at_ns(1500), 1.0)]         # was 1.5 ms, 1.0 ms


def test_time_between_steps_is_its_own_slice_naming_the_collective(cpu_run):
    _, _, check = cpu_run
    between = analysis_slices(check, "fleetscope.between_steps")
    assert [(s.name, s.start_ns, s.end_ns) for s in between] == [
        ("between steps: gloo:all_reduce", at_ns(1000), at_ns(1500))]
    notes = between[0].annotations
    assert (notes["after_step"], notes["before_step"], notes["between_ms"]) == (1, 2, 0.5)
    assert (notes["collectives"], notes["collective_count"], notes["collective_ms"]) == ("gloo:all_reduce", 1, 0.3)


def test_idle_slices_are_the_reports_gaps_every_one(cpu_run):
    report, _, check = cpu_run
    idle = analysis_slices(check, "fleetscope.idle")
    assert [(s.name, s.start_ns, s.end_ns) for s in idle] == [
        ("idle: no op running", at_ns(400), at_ns(600)), ("idle: no op running", at_ns(1800), at_ns(1830))]
    total_us = sum(s.end_ns - s.start_ns for s in idle) / 1000
    assert total_us == 230.0 == pytest.approx(report.windows[0].ranks[0].host_stalls.idle_by_cause_us["no op running"])
    steps = analysis_slices(check, "fleetscope.step")
    assert [s.annotations["idle_ms"] for s in steps] == [0.2, 0.03]


def test_verify_finds_the_merged_trace_agrees_with_the_report(cpu_run):
    _, result, _ = cpu_run
    assert verify_merge(result) == []
    expected = result.per_rank[0].expected
    assert sorted(expected.steps) == [(0, 1, 1.0), (0, 2, 1.0)]
    assert expected.idle_us == (("no op running", pytest.approx(230.0)),)


def _with_expected(result, **changes):
    first = dataclasses.replace(result.per_rank[0], expected=dataclasses.replace(result.per_rank[0].expected, **changes))
    return dataclasses.replace(result, per_rank=[first, *result.per_rank[1:]])


def test_verify_flags_a_step_slice_that_is_not_the_reports_step(cpu_run):
    """The old definition (a step runs to the next one's start) drew step 1 1.5 ms long against the report's 1.0."""
    _, result, _ = cpu_run
    problems = verify_merge(_with_expected(result, steps=((0, 1, 1.5), (0, 2, 1.0))))
    assert problems == ["rank 0 (node0): step 1 of window 0 is drawn 1.000 ms long, the report's step time is 1.500 ms"]
    problems = verify_merge(_with_expected(result, steps=((0, 1, 1.0), (0, 2, 1.0), (0, 3, 1.0))))
    assert problems == ["rank 0 (node0): step 3 of window 0 is in the report, not drawn"]


def test_verify_flags_idle_slices_that_do_not_sum_to_the_reports_idle(cpu_run, tmp_path):
    """The old 50 us drawing threshold left the 30 us gap out: 200 us drawn against the report's 230."""
    report, _, _ = cpu_run
    old = merge(tmp_path / "traces", tmp_path / "threshold.perfetto-trace", report=report, use_cache=False,
                options=MergeOptions(min_idle_gap_us=50.0))
    assert old.per_rank[0].expected.idle_us is None                     # not every gap drawn: not compared
    problems = verify_merge(_with_expected(old, idle_us=(("no op running", 230.0),)))
    assert problems == ["rank 0 (node0): idle slices 'no op running' sum to 0.200 ms over 1 gaps, the report's "
                        "idle by cause is 0.230 ms"]


def gpu_bound_rank() -> KinetoBuilder:
    """Step 1's host range is 0-500 but its kernel runs 100-1400 (the GPU bounds it: 1.3 ms); step 2 is host
    bound (1500-2500), its kernel 1600-2000. GPU idle inside the steps: 1500-1600 and 2000-2500."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 500).op("aten::mm", 10, 60)
    builder.kernel("sm90_xmma_gemm_bf16", 100, 1300, launch_ts=50)
    builder.step(2, 1500, 1000).op("aten::mm", 1510, 60)
    builder.kernel("sm90_xmma_gemm_bf16", 1600, 400, launch_ts=1550)
    return builder


def test_a_gpu_bound_step_is_drawn_over_the_gpus_span(tmp_path):
    gpu_bound_rank().write(tmp_path / "traces" / "rank0.json")
    report = analyze(tmp_path / "traces", use_hta=False, use_cache=False)
    rank = report.windows[0].ranks[0]
    assert [(s.step, s.bound, s.step_time_ms) for s in rank.steps] == [(1, "gpu", 1.3), (2, "host", 1.0)]
    result = merge(tmp_path / "traces", tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    check = check_trace(result.output)
    process = next(p.name for p in check.processes() if p.name.startswith("rank 0"))
    steps = analysis_slices(check, "fleetscope.step", process)
    assert [(s.name, s.start_ns, s.end_ns) for s in steps] == [
        ("step 1", at_ns(100), at_ns(1400)), ("step 2", at_ns(1500), at_ns(2500))]
    assert [(s.name, s.start_ns, s.end_ns) for s in analysis_slices(check, "fleetscope.between_steps", process)] == [
        ("between steps", at_ns(1400), at_ns(1500))]
    idle = analysis_slices(check, "fleetscope.idle", process)
    assert sum(s.end_ns - s.start_ns for s in idle) / 1000 == pytest.approx(sum(rank.host_stalls.idle_by_cause_us.values()))
    assert sum(s.end_ns - s.start_ns for s in idle) == 600_000
    assert verify_merge(result) == []


def test_per_step_host_stall_lines_print_means_per_step(cpu_run):
    report, _, _ = cpu_run
    text = "\n".join(evidence_sections(report))
    line = next(line for line in text.splitlines() if "rank 0: per step" in line)
    assert line.endswith(f"CPU idle by cause: no op running {0.115:.2f} ms")     # 230 us over 2 steps, was 0.23
    html = evidence_sections_html(report)
    assert "idle: no op running ms/step" in html and ">0.115<" in html and ">0.230<" not in html


def test_the_summary_tracks_time_steps_as_the_report_does(tmp_path):
    """A GPU-bound step on the summary's `rank R: steps` track too: its GPU span, not its host range."""
    gpu_bound_rank().write(tmp_path / "traces" / "rank0.json")
    result = merge(tmp_path / "traces", tmp_path / "sharded.perfetto-trace", use_cache=False,
                   options=MergeOptions(shard_ranks=1))                  # the result is the summary file's
    check = check_trace(result.output)
    assert result.summary
    steps = sorted((s for s in check.slices if s.category == "fleetscope.summary.step"), key=lambda s: s.start_ns)
    assert [(s.name, s.start_ns, s.end_ns, s.annotations["step_time_ms"]) for s in steps] == [
        ("step 1", at_ns(100), at_ns(1400), 1.3), ("step 2", at_ns(1500), at_ns(2500), 1.0)]
