"""The run first: where the run recorded step metrics, the header and the verdict lead with its steady step time,
and a verdict built on profiled steps much slower than the run's says so in its first sentence."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.gate import steady_metrics_at
from fleetscope.analysis.quantities import metrics_step_time_ms
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal
from fleetscope.traces.formats import parse_step_record

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-evidence"


@pytest.fixture()
def report(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return analyze(run, use_hta=False, write_default_outputs=False), run


def test_the_header_leads_with_the_runs_steady_step_time(report):
    report, run = report
    steady_ms = metrics_step_time_ms(steady_metrics_at(run)[0])
    assert report.run_step_time_ms == pytest.approx(steady_ms) and report.run_step_time_basis.startswith("step metrics")
    assert report.step_time.median_ms > 1.5 * steady_ms          # the profiled steps of this H200 run are slower
    header = render_terminal(report).splitlines()[1]
    assert header.index(f"step time {steady_ms:.2f} ms") < header.index("profiled steps median")
    assert f"{100 * (report.step_time.median_ms / steady_ms - 1):+.0f}% over the run's" in header
    assert f"step time {steady_ms:.2f} ms (step metrics" in render_html(report)


def test_a_verdict_on_unrepresentative_profiled_steps_says_so_first(report):
    report, _ = report
    assert report.verdict.startswith(f"The profiled steps ({report.step_time.median_ms:.2f} ms) are ")
    assert "slower than the run's steady steps" in report.verdict.split(". ")[0]


def test_a_folder_of_traces_has_no_run_step_time(tmp_path):
    shutil.copytree(FIXTURE / "traces", tmp_path / "traces")
    report = analyze(tmp_path / "traces", use_hta=False, write_default_outputs=False)
    assert report.run_step_time_ms is None and not report.verdict.startswith("The profiled steps")
    assert "step time median" in render_terminal(report).splitlines()[1]


def test_the_header_carries_the_measured_profiling_cost_beside_the_profiled_steps(report):
    # the review: "profiling cost inside +30% [+19, +56]" was printed 60 lines below a header built on those steps
    report, _ = report
    (records,) = [r for r in report.trainer.ranks if r.profiling is not None]
    cost = records.profiling.inside_vs_before
    shown = f"profiling cost {cost.median_pct:+.1f}% [{cost.low_pct:+.1f}, {cost.high_pct:+.1f}]"
    assert shown in render_terminal(report).splitlines()[1]
    assert shown in render_html(report).split('id="verdict"')[1].split("</p>", 2)[1]


def test_profiled_steps_faster_than_the_run_read_under_it_not_a_negative_over(report):
    import dataclasses

    report, _ = report
    faster = dataclasses.replace(report, run_step_time_ms=report.step_time.median_ms * 1.25)
    header = render_terminal(faster).splitlines()[1]
    assert "20% under the run's" in header and "-20% over" not in header


def test_a_profiling_cost_not_measurable_says_why_not_too_few_of_thousands():
    from fleetscope.analysis.per_rank.profiling_cost import profiling_cost
    from fleetscope.analysis.render.evidence_text import profiling_line

    # the first window is steps 1-3 (profiled), so no steady step lies before it; 2,000 steps after
    records = [{"step": s, "step_time_ms": 50.0 + (s % 7), "profiled": 1 <= s <= 3} for s in range(2004)]
    line = profiling_line(profiling_cost([parse_step_record(r)[0] for r in records]))
    assert "too few steps (2000 steps)" not in line
    assert "no steady step before the first window" in line
