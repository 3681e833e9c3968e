"""compare(): per-metric deltas and the CI exit decision."""

import json

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.compare import EXIT_OK, EXIT_REGRESSION, compare
from fleetscope.analysis.render.terminal import render_comparison
from fleetscope.traces.layout import RunLayout
from helpers.kineto import KinetoBuilder


def _traces(directory, step_us):
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, backend="gloo")
        for index in range(3):
            s = index * step_us
            builder.step(index, s, step_us).op("aten::mm", s + 10, step_us / 2)
        builder.write(directory / f"rank{rank}.json")


def _report(tmp_path, name, step_us):
    _traces(tmp_path / name, step_us)
    out = tmp_path / f"{name}.json"
    analyze(tmp_path / name, json_out=out, use_hta=False)
    return out


def test_report_jsons_gate_on_trace_step_time(tmp_path):
    base, slower = _report(tmp_path, "base", 1000), _report(tmp_path, "new", 1060)
    result = compare(base, slower)
    assert result.exit_code == EXIT_REGRESSION
    gate = next(m for m in result.metrics if m.name == "trace_step_time_ms")
    assert gate.gated and gate.regression and gate.delta_pct == pytest.approx(6.0)
    assert [r.delta_pct for r in result.ranks] == [pytest.approx(6.0)] * 2
    assert compare(base, slower, threshold_pct=10).exit_code == EXIT_OK
    assert compare(slower, base).exit_code == EXIT_OK           # faster is never a regression
    assert "REGRESSION" in render_comparison(result)


def _run(tmp_path, name, tokens_per_s, step_ms):
    layout = RunLayout.at(tmp_path / name)
    _traces(layout.window_dir(0), 1000)
    for rank in (0, 1):
        lines = [{"step": 0, "rank": rank, "step_time_ms": 9999.0, "tokens_per_s": 1.0}]          # start-up
        lines += [{"step": s, "rank": rank, "step_time_ms": step_ms, "tokens_per_s": tokens_per_s} for s in (1, 2, 3)]
        lines += [{"step": 4, "rank": rank, "step_time_ms": 5000.0, "tokens_per_s": 2.0, "profiled": True}]
        layout.metrics_file(rank).parent.mkdir(parents=True, exist_ok=True)
        layout.metrics_file(rank).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return layout.root


def test_run_directories_gate_on_steady_step_metrics(tmp_path):
    base = _run(tmp_path, "base", tokens_per_s=1000.0, step_ms=100.0)
    worse = _run(tmp_path, "worse", tokens_per_s=940.0, step_ms=100.0)
    result = compare(base, worse)
    throughput = next(m for m in result.metrics if m.name == "tokens_per_s")
    assert (throughput.base, throughput.new) == (2000.0, 1880.0)    # two ranks; start-up/profiled steps left out
    assert throughput.regression and result.exit_code == EXIT_REGRESSION
    trace_gate = next(m for m in result.metrics if m.name == "trace_step_time_ms")
    assert not trace_gate.gated
    better = _run(tmp_path, "better", tokens_per_s=1100.0, step_ms=90.0)
    assert compare(base, better).exit_code == EXIT_OK
    slower = _run(tmp_path, "slower", tokens_per_s=1000.0, step_ms=105.0)
    assert [m.name for m in compare(base, slower).regressions] == ["step_time_ms"]
    assert not (tmp_path / "base" / "report").exists()      # comparing writes nothing into the runs


def test_bad_inputs(tmp_path):
    base = _report(tmp_path, "base", 1000)
    with pytest.raises(FileNotFoundError):
        compare(base, tmp_path / "nope")
    with pytest.raises(ValueError, match="threshold"):
        compare(base, base, threshold_pct=0)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read report"):
        compare(base, tmp_path / "broken.json")
