"""The examples of docs/examples/, each launched for real (`fleetscope launch -- python ...`, torchrun, gloo, 2
ranks on CPU) into a run directory that ends with traces, a manifest, a report and a merged trace, and a
report that found both ranks and the profiled steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, fleetscope

EXAMPLES = REPO / "docs" / "examples"
pytestmark = pytest.mark.slow


def report_of(run: Path) -> dict:
    return json.loads((run / "report" / "report.json").read_text())


def check_run(run: Path, *, windows: int, steps: list[int]) -> dict:
    """The run directory a user opens: every output there, each rank in every window, the steps profiled."""
    for relative in ("job.json", "manifest.json", "report/report.json", "report/report.html",
                     "report/merged.perfetto-trace"):
        assert (run / relative).is_file(), relative
    manifest = json.loads((run / "manifest.json").read_text())
    assert not manifest["problems"] and not manifest["missing"]
    assert sorted((t["window"], t["rank"]) for t in manifest["traces"]) == [
        (w, r) for w in range(windows) for r in (0, 1)]
    assert sorted({s for t in manifest["traces"] for s in t["steps"]}) == steps
    report = report_of(run)
    assert report["complete"] is True
    assert sorted(rank["rank"] for rank in report["ranks"]) == [0, 1]
    return manifest


def test_ddp_tutorial_script_with_the_windows_line(tmp_path):
    run = tmp_path / "run"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run), "--profile",
                           "wait=1,warmup=1,active=2,repeat=2",
                           "--", "python", str(EXAMPLES / "ddp_windows.py"), "--steps", "10", cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    check_run(run, windows=2, steps=[2, 3, 6, 7])
    assert sorted(p.name for p in (run / "clock").iterdir()) == ["rank0.json", "rank1.json"]
    assert json.loads((run / "job.json").read_text())["spec"]["entry"]["program"] == str(EXAMPLES / "ddp_windows.py")


def test_script_driving_torch_profiler_with_trace_handler(tmp_path):
    run = tmp_path / "run"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run), "--", "python",
                           str(EXAMPLES / "own_profiler.py"),
                           "--steps", "10", cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    check_run(run, windows=2, steps=[2, 3, 6, 7])
    assert sorted(p.name for p in (run / "clock").iterdir()) == ["rank0.json", "rank1.json"]


def test_torchtitan_layout_collected_with_collect_traces(tmp_path):
    run = tmp_path / "run"
    pattern = "outputs/profiling/traces/iteration_*/rank*_trace.json.gz"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run), "--collect-traces", pattern,
                           "--", "python", str(EXAMPLES / "torchtitan_layout.py"), "--dump-folder", "outputs",
                           "--steps", "10", cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "collected 4 trace(s)" in completed.stdout
    manifest = check_run(run, windows=2, steps=[3, 7])
    assert all(t["path"].startswith("traces/window") for t in manifest["traces"])
    # analyze and merge also read the program's own tree in place
    tree = tmp_path / "outputs" / "profiling" / "traces"
    analyzed = fleetscope("analyze", str(tree), "--json", str(tmp_path / "tree.json"), cwd=tmp_path)
    assert analyzed.returncode == 0, analyzed.stderr[-3000:]
    in_place = json.loads((tmp_path / "tree.json").read_text())
    assert sorted(rank["rank"] for rank in in_place["ranks"]) == [0, 1]
    merged = fleetscope("merge", str(tree), "-o", str(tmp_path / "tree.perfetto-trace"), "--verify", cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr[-3000:]


def test_a_failing_user_module_fails_the_launch_and_its_status(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\n")
    run = tmp_path / "run"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run), "--no-post", "--", "-m", "crash",
                           cwd=tmp_path)
    assert completed.returncode == 1
    status = fleetscope("status", str(run), cwd=tmp_path)
    assert status.returncode == 1 and "failed" in status.stdout


def test_ddp_script_through_torchx_local(tmp_path):
    run = tmp_path / "run"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--scheduler", "torchx_local", "--run-dir", str(run),
                           "--profile", "wait=1,warmup=1,active=2,repeat=2",
                           "--", "python", str(EXAMPLES / "ddp_windows.py"), "--steps", "10", cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    check_run(run, windows=2, steps=[2, 3, 6, 7])
