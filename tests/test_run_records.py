"""A run directory is read once, at the edge: the stages in analysis/cross_rank/ and analysis/per_rank/ open no
file (outside the trace decoder and the parsed-trace cache), and one postprocess parses the manifest and reads the
clock files once (analysis/inputs/records.py RunRecords, handed on to analyze and merge)."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

from fleetscope.analysis.inputs import records as records_module
from fleetscope.traces import clock as clock_module
from fleetscope.traces import jobfile as jobfile_module
from fleetscope.traces import manifest as manifest_module
from fleetscope.traces.layout import RunLayout

ROOT = Path(__file__).resolve().parents[1]
DDP_FIXTURE = ROOT / "tests" / "fixtures" / "gpu" / "h200-ddp-gloo-2rank"


def _counted(monkeypatch, module, name: str) -> list[int]:
    """Wrap `module.name` where it is defined and in every loaded module that imported it by name."""
    original, calls = getattr(module, name), []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith("fleetscope") and getattr(loaded, name, None) is original:
            monkeypatch.setattr(loaded, name, counting)
    return calls


def test_one_postprocess_parses_the_manifest_once_and_reads_the_clock_files_once(tmp_path, monkeypatch):
    from fleetscope.cli import pipeline
    import fleetscope.analysis.analyze  # noqa: F401 - every reader loaded before counting
    import fleetscope.analysis.merge.run  # noqa: F401
    from fleetscope.traces.clock import ClockOffset, write_clock_offset
    run = tmp_path / "run"
    shutil.copytree(DDP_FIXTURE, run)
    layout = RunLayout.at(run)
    write_clock_offset(ClockOffset(rank=1, offset_us=12.0, uncertainty_us=5.0, best_round_trip_us=10.0,
                                   round_trips=16, host="h", measured_at_ns=0), layout.clock_file(1))
    pipeline.postprocess(run, echo=False, cache_dir=tmp_path / "cache", use_hta=False)  # gather writes the manifest
    manifests = _counted(monkeypatch, manifest_module, "load_manifest")
    clocks = _counted(monkeypatch, clock_module, "read_clock_offsets")
    step_metrics = _counted(monkeypatch, records_module, "read_step_metrics")
    jobs = _counted(monkeypatch, jobfile_module, "read_job_record")
    result = pipeline.postprocess(run, echo=False, cache_dir=tmp_path / "cache", use_hta=False, gather_traces=False)
    assert result.complete, result.errors
    # the step metrics too: the report's run step time and the advice beside its verdict take the records read
    assert (len(manifests), len(clocks), len(step_metrics), len(jobs)) == (1, 1, 1, 1)


IO_CALLS = {"open", "load", "memmap", "fromfile", "read_text", "read_bytes", "iterdir", "glob", "rglob", "is_file",
            "is_dir", "exists", "lexists", "stat", "lstat", "scandir", "listdir", "pread", "preadv",
            "read_input", "read_metadata", "entry_problem", "load_manifest", "read_clock_offsets", "read_job_record",
            "read_metric_records", "read_moe_file", "read_timeline", "read_dumps", "read_capture_records",
            "read_run_records", "read_moe_files", "step_metrics_files", "timeline_ranks", "ranks_with_records",
            "read_raw", "read_timeline"}
"""Calls that open, list or stat a file (by the called name: `os.open`, `Path.read_text`, `json.load`, `np.load`,
`np.memmap`, the safe reader and each format's reader)."""

IO_ALLOWED = {
    # the trace decoder: reading trace files is what it is for
    "per_rank/parse.py",
    # the parsed-trace caches: their own entries, and the source files their keys hash
    "per_rank/cache.py",
    "per_rank/hta_cache.py",
    # HTA's views of a rank decode its trace file for HTA's own frame (a trace reader, as parse.py is)
    "per_rank/hta_rank.py",
    "per_rank/hta_rank_views.py",
}


def _io_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    relative = path.relative_to(ROOT / "analysis").as_posix()
    found = []
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        if f"{relative}:{function.name}" in IO_ALLOWED:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in IO_CALLS:
                    found.append(f"{relative}:{node.lineno}: {name}() in {function.name}")
    return found


def test_the_per_rank_and_cross_rank_stages_open_no_file():
    """Every stage is a function of RunRecords (analysis/inputs/records.py) and the per-rank results; only the
    trace decoder and the parse caches read files."""
    files = sorted((ROOT / "analysis" / "per_rank").rglob("*.py")) + sorted((ROOT / "analysis" / "cross_rank").rglob("*.py"))
    found = [call for path in files if path.relative_to(ROOT / "analysis").as_posix() not in IO_ALLOWED
             for call in _io_calls(path)]
    assert not found, "\n".join(found)


RECORD_READERS = {"load_manifest", "read_clock_offsets", "read_job_record", "read_metric_records", "read_moe_file",
                  "read_moe_files", "read_dumps", "read_capture_records", "read_run_records", "step_metrics_files",
                  "timeline_ranks", "ranks_with_records", "read_timeline"}
"""The readers of a run's record files (inputs/records.py calls each of them once)."""


def test_the_merge_reads_the_run_s_records_only_through_run_records():
    """merge/ takes MergeInputs.records (read once by inputs.resolve, or handed in by postprocess): none of its
    modules calls a record file's reader."""
    found = [call for path in sorted((ROOT / "analysis" / "merge").rglob("*.py")) for call in _io_calls(path)
             if call.rsplit(": ", 1)[1].split("(")[0] in RECORD_READERS]
    assert not found, "\n".join(found)
