"""The run first: where the run recorded step metrics, the header and the verdict lead with its steady step time,
and a verdict built on profiled steps much slower than the run's says so in its first sentence."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.gate import steady_metrics
from fleetscope.analysis.quantities import metrics_step_time_ms
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal
from fleetscope.traces.layout import RunLayout

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-evidence"


@pytest.fixture()
def report(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return analyze(run, use_hta=False, write_default_outputs=False), run


def test_the_header_leads_with_the_runs_steady_step_time(report):
    report, run = report
    steady_ms = metrics_step_time_ms(steady_metrics(RunLayout.at(run)))
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
