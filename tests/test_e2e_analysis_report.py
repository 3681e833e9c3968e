"""analyze() end to end on directories of hand-built traces: inputs, bad files, outputs, HTA."""

import gzip
import json
import re
import xml.etree.ElementTree as ElementTree

import pytest

from fleetscope.analysis import SCHEMA_VERSION, Report, analyze, load_report_json, render_html, render_terminal
from fleetscope.traces.gather import gather
from fleetscope.traces.layout import RunLayout
from helpers.kineto import KinetoBuilder, gpu_rank


def _cpu_rank(rank, *, world_size=2, step_ms=1.0, start_us=0.0):
    builder = KinetoBuilder(rank=rank, world_size=world_size, backend="gloo")
    for index in range(2):
        s = start_us + index * step_ms * 1000
        builder.step(index + 1, s, step_ms * 1000).op("aten::mm", s + 10, 200).op("c10d::allreduce_", s + 300, 5)
        builder.gloo(s + 305, 100)
    return builder


def _bad_files(directory):
    good = gzip.compress(json.dumps(_cpu_rank(2, world_size=5).document()).encode())
    (directory / "rank2.json.gz").write_bytes(good[: len(good) // 2])
    (directory / "rank3.json").write_bytes(b'{"traceEvents": [ {"ph": "X",')
    (directory / "rank4.json").write_bytes(b"")


def test_bad_traces_are_named_and_the_rest_analyzed(tmp_path):
    for rank in (0, 1):
        _cpu_rank(rank, world_size=5).write(tmp_path / f"rank{rank}.json.gz")
    _bad_files(tmp_path)
    report = analyze(tmp_path)
    assert not report.complete
    assert report.analyzed_ranks == [0, 1]
    reasons = {p.label: p.reason for p in report.problems}
    assert set(reasons) == {"rank2.json.gz", "rank3.json", "rank4.json"}
    assert "truncated gzip" in reasons["rank2.json.gz"]
    assert "invalid JSON" in reasons["rank3.json"]
    assert reasons["rank4.json"] == "empty file"
    assert [m.rank for m in report.missing] == [2, 3, 4]
    assert "partial" in report.verdict
    text = render_terminal(report)
    assert "PARTIAL" in text and "rank3.json: invalid JSON" in text


def test_foreign_directory_gets_nothing_written(tmp_path):
    for rank in (0, 1):
        _cpu_rank(rank).write(tmp_path / f"rank{rank}.json")
    before = sorted(p.name for p in tmp_path.iterdir())
    report = analyze(tmp_path)
    assert report.complete
    assert report.source_kind == "trace_dir"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_run_directory_writes_report_files_by_default(tmp_path):
    layout = RunLayout.at(tmp_path / "run")
    for rank in (0, 1):
        _cpu_rank(rank).write(layout.trace_file(0, rank, "node0"))
    gather(layout.root)
    report = analyze(layout.root)
    assert report.complete and report.source_kind == "run_dir"
    assert [w.window for w in report.windows] == [0]
    assert load_report_json(layout.report_json).to_json() == report.to_json()
    assert layout.report_html.read_text().startswith("<!DOCTYPE html>")


def test_run_directory_without_manifest_is_verified_in_memory(tmp_path):
    layout = RunLayout.at(tmp_path / "run")
    for window in (0, 1):
        for rank in (0, 1):
            _cpu_rank(rank).write(layout.trace_file(window, rank, "node0"))
    report = analyze(layout.root, write_default_outputs=False)
    assert not layout.manifest_file.exists() and not layout.report_dir.exists()
    assert [w.window for w in report.windows] == [0, 1]
    assert report.ranks[0].windows == 2
    assert any("no manifest.json" in n for n in report.notes)


def test_run_directory_missing_rank_makes_it_partial(tmp_path):
    layout = RunLayout.at(tmp_path / "run")
    _cpu_rank(0, world_size=2).write(layout.trace_file(0, 0, "node0"))
    report = analyze(layout.root, write_default_outputs=False)
    assert not report.complete
    assert [(m.rank, m.window) for m in report.missing] == [(1, 0)]


def test_rank_from_file_name_then_file_order(tmp_path):
    KinetoBuilder(rank=None).step(1, 0, 100).op("aten::mm", 0, 10).write(tmp_path / "worker_rank3.json")
    KinetoBuilder(rank=None).step(1, 0, 100).op("aten::mm", 0, 10).write(tmp_path / "b.json")
    KinetoBuilder(rank=None).step(1, 0, 100).op("aten::mm", 0, 10).write(tmp_path / "a.json")
    report = analyze(tmp_path, use_hta=False)
    ranks = {r.label: (r.rank, r.rank_source) for r in report.windows[0].ranks}
    assert ranks == {"worker_rank3.json": (3, "file name"), "a.json": (0, "file order"),
                     "b.json": (1, "file order")}


def test_successive_traces_of_a_rank_become_windows(tmp_path):
    for rank in (0, 1):
        _cpu_rank(rank, start_us=0).write(tmp_path / f"w{rank}.1000.pt.trace.json")
        _cpu_rank(rank, start_us=50_000).write(tmp_path / f"w{rank}.2000.pt.trace.json")
    report = analyze(tmp_path)
    assert report.complete
    assert [w.window for w in report.windows] == [0, 1]
    assert [r.rank for r in report.windows[1].ranks] == [0, 1]


def test_overlapping_traces_of_one_rank_are_duplicates(tmp_path):
    _cpu_rank(0).write(tmp_path / "a.json")
    _cpu_rank(0).write(tmp_path / "b.json")
    _cpu_rank(1).write(tmp_path / "c.json")
    report = analyze(tmp_path)
    assert not report.complete
    assert [(p.label, p.rank) for p in report.problems] == [("b.json", 0)]
    assert "duplicate rank 0" in report.problems[0].reason


def test_different_step_windows_are_noted(tmp_path):
    _cpu_rank(0).write(tmp_path / "rank0.json")
    KinetoBuilder(rank=1, backend="gloo").step(5, 0, 1000).op("aten::mm", 10, 100).write(tmp_path / "rank1.json")
    report = analyze(tmp_path)
    assert any("different steps" in n for n in report.windows[0].notes)


def test_report_json_round_trips_and_is_strict_json(tmp_path):
    for rank in (0, 1):
        gpu_rank(rank, nccl_start=300 + 200 * rank).write(tmp_path / f"rank{rank}.json.gz")
    out = tmp_path / "out" / "report.json"
    report = analyze(tmp_path, json_out=out, use_hta=False)
    data = json.loads(out.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 2
    assert data["windows"][0]["ranks"][1]["utilization"]["overlap_pct"] == pytest.approx(50.0)  # 500-700 of 500-900
    assert Report.from_json(data).to_json() == report.to_json()
    with pytest.raises(ValueError, match="schema_version"):
        Report.from_json({**data, "schema_version": 99})
    assert Report.from_json({**data, "schema_version": 1}).schema_version == 1    # read: its what-ifs arithmetic


def test_html_is_self_contained_and_its_svg_parses(tmp_path):
    for rank in (0, 1):
        gpu_rank(rank, nccl_start=300 + 200 * rank).write(tmp_path / f"rank{rank}.json.gz")
    html = render_html(analyze(tmp_path, use_hta=False))
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert html.count("<script>") == 1 and not re.search(r"<script[^>]*\bsrc\s*=", html)   # inline only
    svgs = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    assert len(svgs) >= 3
    for chart in svgs:
        ElementTree.fromstring(chart)


def test_hta_runs_on_gpu_traces(tmp_path):
    for rank in (0, 1):
        gpu_rank(rank, nccl_start=600 - 400 * rank).write(tmp_path / f"rank{rank}.json.gz")
    report = analyze(tmp_path)
    hta = report.windows[0].hta
    assert hta.status == "ok", hta.errors
    overlap = {row["rank"]: row["comp_comm_overlap_pctg"] for row in hta.tables["comm_comp_overlap"]}
    ours = {r.rank: r.utilization.overlap_pct for r in report.windows[0].ranks}
    assert overlap == {rank: pytest.approx(ours[rank], abs=0.01) for rank in ours}
    assert {"temporal_breakdown", "idle_time_breakdown", "kernel_breakdown"} <= set(hta.tables)


def test_hta_is_skipped_in_one_line_for_cpu_traces(tmp_path):
    for rank in (0, 1):
        _cpu_rank(rank).write(tmp_path / f"rank{rank}.json")
    report = analyze(tmp_path)
    hta = report.windows[0].hta
    assert hta.status == "skipped" and "CPU-only" in hta.reason
    assert report.ranks[0].basis == "cpu"


def test_path_without_traces_raises(tmp_path):
    with pytest.raises(ValueError, match="no trace files"):
        analyze(tmp_path)
    with pytest.raises(FileNotFoundError):
        analyze(tmp_path / "nope")


def _json_keys(value, path=""):
    """Every key of the report JSON, except inside maps whose keys are data (ranks, phases, tables)."""
    data_maps = {"dropped_events", "phases_ms", "wait_by_rank_us", "tables", "errors", "not_applicable"}
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            if key not in data_maps:
                yield from _json_keys(item)
    elif isinstance(value, list):
        for item in value:
            yield from _json_keys(item)


def test_every_report_field_is_in_the_documented_schema(tmp_path):
    from fleetscope.analysis.report import model as report_module

    for rank in (0, 1):
        gpu_rank(rank, nccl_start=300 + 200 * rank).write(tmp_path / f"rank{rank}.json.gz")
    data = analyze(tmp_path, use_hta=False).to_json()
    undocumented = {key for key in _json_keys(data) if not re.search(rf"\b{key}\b", report_module.__doc__)}
    assert undocumented == set()


def test_top_kernels_sum_over_ranks(tmp_path):
    for rank in (0, 1):
        gpu_rank(rank).write(tmp_path / f"rank{rank}.json.gz")
    report = analyze(tmp_path, use_hta=False)
    top = {k.name: k for k in report.windows[0].top_kernels}
    gemm = top["sm90_xmma_gemm_bf16"]
    assert (gemm.count, gemm.total_us, gemm.ranks) == (4, 1200.0, 2)    # 2 steps x 300 us x 2 ranks
    assert "Top kernels" in render_html(report)
