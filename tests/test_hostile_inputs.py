"""A hostile or careless user of a shared file system: every input a read command takes (traces, manifest,
job.json, clock and metrics files, cache entries, arguments) may be damaged, planted or absurd. Each case:
the bad file is named with the reason, the other ranks are analyzed, no input is modified, and the exit
code says what happened."""

import json
import os
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.cli.main import main
from hostile_runs import (
    alltoall_rank,
    digests,
    edit_manifest,
    good_rank,
    make_recorded_run,
    make_run,
    make_trace_dir,
    moe_line,
    write_moe_records,
)


def _said(report) -> list[str]:
    """Everything the report says in words: notes, window notes and problems."""
    return report.notes + [n for w in report.windows for n in w.notes] + [f"{p.label}: {p.reason}" for p in report.problems]


def _problem(report, fragment: str):
    found = [p for p in report.problems if fragment in p.reason]
    assert found, [(p.label, p.reason) for p in report.problems]
    return found[0]


# --- the manifest is not trusted --------------------------------------------------------------


def test_a_manifest_path_outside_the_run_is_not_read(tmp_path):
    other = make_run(tmp_path / "other-job")
    layout = make_run(tmp_path / "run")
    stolen = os.path.relpath(other.trace_file(0, 1, "node0"), layout.root)
    edit_manifest(layout, lambda m: m["traces"][1].update(path=stolen))
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert not report.complete and report.analyzed_ranks == [0]
    assert "leaves the run directory" in _problem(report, "leaves the run directory").reason


def test_an_absolute_manifest_path_is_not_read(tmp_path):
    other = make_run(tmp_path / "other-job")
    layout = make_run(tmp_path / "run")
    edit_manifest(layout, lambda m: m["traces"][1].update(path=str(other.trace_file(0, 1, "node0"))))
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert not report.complete and report.analyzed_ranks == [0]
    _problem(report, "absolute path")


def test_a_trace_symlinked_out_of_the_run_is_not_read(tmp_path):
    other = make_run(tmp_path / "other-job")
    layout = make_run(tmp_path / "run")
    target = layout.trace_file(0, 1, "node0")
    target.unlink()
    target.symlink_to(other.trace_file(0, 1, "node0"))
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.analyzed_ranks == [0]
    _problem(report, "resolves outside")


def test_a_trace_swapped_after_gather_is_named_not_analyzed(tmp_path):
    layout = make_run(tmp_path / "run")
    path = layout.trace_file(0, 1, "node0")
    swapped = good_rank(1).op("aten::extra", 700, 250)
    swapped.write(path)
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.analyzed_ranks == [0] and not report.complete
    problem = _problem(report, "changed since gather")
    assert problem.label.endswith("rank1.node0.pt.trace.json.gz")


def test_same_size_swap_is_caught_by_the_sha256(tmp_path):
    layout = make_run(tmp_path / "run")
    path = layout.trace_file(0, 1, "node0")
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF  # inside the gzip trailer's CRC: same size, other bytes
    path.write_bytes(bytes(data))
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert "sha256" in _problem(report, "changed since gather").reason


@pytest.mark.parametrize("shape", [
    [1, 2, 3],
    {"version": 1, "run_dir": "x", "created_at": "y", "traces": "not a list"},
    {"version": 1, "traces": [{"path": 7}, None, {"rank": "zero"}]},
    {"version": 1, "world_size": 10**9, "traces": []},
])
def test_a_manifest_of_an_unexpected_shape_never_crashes(tmp_path, shape):
    layout = make_run(tmp_path / "run")
    layout.manifest_file.write_text(json.dumps(shape))
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.analyzed_ranks in ([0, 1], [])
    assert report.problems or any("manifest" in n for n in report.notes)


def test_a_truncated_manifest_falls_back_to_scanning_traces(tmp_path):
    layout = make_run(tmp_path / "run")
    text = layout.manifest_file.read_text()
    layout.manifest_file.write_text(text[: len(text) // 2])
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.complete and report.analyzed_ranks == [0, 1]
    assert any("cannot read manifest" in n and "scanned instead" in n for n in report.notes)


def test_a_deeply_nested_manifest_falls_back(tmp_path):
    layout = make_run(tmp_path / "run")
    layout.manifest_file.write_text("[" * 100_000 + "]" * 100_000)
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.complete and any("scanned instead" in n for n in report.notes)


# --- resource bombs ------------------------------------------------------------------------------


def test_a_deeply_nested_trace_is_only_its_own_problem(tmp_path):
    make_trace_dir(tmp_path, world_size=2)
    (tmp_path / "rank1.json").write_text('{"traceEvents": [' + "[" * 200_000 + "]" * 200_000 + "]}")
    report = analyze(tmp_path, use_hta=False)
    assert report.analyzed_ranks == [0]
    assert "nested too deeply" in _problem(report, "nested").reason


@pytest.mark.parametrize("where", ["trace", "job.json", "manifest"])
def test_a_world_size_of_a_billion_is_not_believed(tmp_path, where):
    if where == "trace":
        root = make_trace_dir(tmp_path / "traces", world_size=2)
        good_rank(1, world_size=10**9).write(root / "rank1.json")
    else:
        layout = make_run(tmp_path / "run", gathered=where == "manifest")
        root = layout.root
        if where == "job.json":
            layout.job_file.write_text(json.dumps({"world_size": 10**9}))
        else:
            edit_manifest(layout, lambda m: m.update(world_size=10**9))
    report = analyze(root, use_hta=False, write_default_outputs=False)
    assert report.analyzed_ranks == [0, 1]
    assert len(report.missing) <= 64
    assert (where == "job.json" and report.complete) or any("1000000000" in n for n in _said(report))


def test_a_large_declared_world_size_lists_the_first_missing_ranks_and_counts_the_rest(tmp_path):
    layout = make_run(tmp_path / "run", 1 << 20, ranks=2)
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert len(report.missing) == 64 and report.missing[0].rank == 2
    assert any(f"{(1 << 20) - 2} rank trace(s) missing in all" in n for n in report.notes)


# --- non-files named like traces -----------------------------------------------------------------


def test_a_fifo_a_directory_and_a_symlink_loop_named_like_traces_are_named(tmp_path):
    root = make_trace_dir(tmp_path / "traces", world_size=2)
    os.mkfifo(root / "rank5.json")
    (root / "rank6.json").mkdir()
    (root / "rank7.json").symlink_to(root / "rank7.json")
    report = analyze(root, use_hta=False)  # never blocks on the FIFO
    assert report.analyzed_ranks == [0, 1] and not report.complete
    reasons = {p.label: p.reason for p in report.problems}
    assert "FIFO" in reasons["rank5.json"] and "directory" in reasons["rank6.json"]
    assert "symlink loop" in reasons["rank7.json"]


def test_traces_of_another_world_size_or_beyond_it_are_named(tmp_path):
    layout = make_run(tmp_path / "run", 2, ranks=1, gathered=False)
    layout.job_file.write_text(json.dumps({"world_size": 2}))
    good_rank(1, world_size=4).write(layout.trace_file(0, 1, "node1"))
    good_rank(3, world_size=2).write(layout.trace_file(0, 3, "node0"))
    from fleetscope.traces.gather import gather

    gather(layout.root)
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.analyzed_ranks == [0] and not report.complete
    _problem(report, "world size 4, the run's is 2")
    _problem(report, "rank 3 is not below the world size 2")


def test_duplicate_ranks_in_a_run_directory_are_named(tmp_path):
    layout = make_run(tmp_path / "run", 2, gathered=False)
    good_rank(1).write(layout.trace_file(0, 1, "node7"))
    from fleetscope.traces.gather import gather

    gather(layout.root)
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.analyzed_ranks == [0, 1] and not report.complete
    assert "rank1.node7" in _problem(report, "duplicate rank 1").label


def test_a_fifo_in_a_run_directory_is_named_by_gather(tmp_path):
    layout = make_run(tmp_path / "run", gathered=False)
    os.mkfifo(layout.window_dir(0) / "rank1.node9.pt.trace.json.gz")
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert "FIFO" in _problem(report, "FIFO").reason


def test_fleetscopes_own_report_among_traces_is_recognized(tmp_path):
    root = make_trace_dir(tmp_path / "traces", world_size=2)
    assert main(["analyze", str(root), "--json", str(root / "report.json"), "--no-hta", "--no-cache"]) == 0
    report = analyze(root, use_hta=False)
    assert report.complete and report.analyzed_ranks == [0, 1]
    assert any("fleetscope output" in n for n in report.notes)


# --- inputs are never modified -----------------------------------------------------------------


def test_inputs_are_byte_for_byte_unchanged(tmp_path):
    layout = make_run(tmp_path / "run")
    before = digests(layout.root)
    analyze(layout.root, use_hta=False)
    assert digests(layout.root) == before


# --- outputs never overwrite inputs ----------------------------------------------------------------


def _cli(*args: str) -> int:
    return main([*map(str, args)])


def test_analyze_refuses_to_write_its_report_over_an_input_trace(tmp_path, capsys):
    root = make_trace_dir(tmp_path / "traces")
    before = digests(root)
    assert _cli("analyze", root, "--json", root / "rank1.json", "--no-hta", "--no-cache") == 2
    assert _cli("analyze", root, "--html", root / "rank0.json", "--no-hta", "--no-cache") == 2
    assert "one of the inputs" in capsys.readouterr().err
    assert digests(root) == before


@pytest.mark.parametrize("victim", ["manifest.json", "job.json", "metrics/rank0.jsonl", "clock/rank0.json"])
def test_analyze_and_merge_refuse_to_overwrite_a_file_they_did_not_write(tmp_path, victim, capsys):
    layout = make_run(tmp_path / "run")
    path = layout.root / victim
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"step": 1}\n')
    before = digests(layout.root)
    assert _cli("analyze", layout.root, "--json", path, "--no-hta", "--no-cache") == 2
    assert _cli("merge", layout.root, "-o", path) == 2
    assert _cli("merge", layout.root, "--json", path) == 2
    assert "is not a fleetscope output" in capsys.readouterr().err or victim == "manifest.json"
    assert digests(layout.root) == before


def test_merge_refuses_an_output_inside_traces_and_a_symlinked_output(tmp_path, capsys):
    layout = make_run(tmp_path / "run")
    before = digests(layout.root)
    assert _cli("merge", layout.root, "-o", layout.traces_dir / "new.perfetto-trace") == 2
    link = tmp_path / "out.perfetto-trace"
    link.symlink_to(layout.trace_file(0, 0, "node0"))
    assert _cli("merge", layout.root, "-o", link) == 2
    assert _cli("analyze", layout.root, "--json", link, "--no-hta", "--no-cache") == 2
    err = capsys.readouterr().err
    assert "inside the analyzed run's traces/" in err and "symlink" in err
    assert digests(layout.root) == before


def test_own_outputs_are_replaced_on_a_second_run(tmp_path):
    layout = make_run(tmp_path / "run")
    out = tmp_path / "elsewhere"
    out.mkdir()
    for _ in range(2):
        assert _cli("analyze", layout.root, "--json", out / "r.json", "--html", out / "r.html", "--no-hta",
                    "--no-cache") == 0
        assert _cli("merge", layout.root, "-o", out / "m.perfetto-trace", "--json", out / "m.json.gz") == 0
    from fleetscope.traces.outputs import is_own_output

    assert all(is_own_output(out / name) for name in ("r.json", "r.html", "m.perfetto-trace", "m.json.gz"))
    assert not is_own_output(layout.manifest_file) and not is_own_output(layout.trace_file(0, 0, "node0"))


# --- exit codes and gates ------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", ["nan", "inf", "-inf", "-5", "0", "five"])
def test_compare_refuses_a_threshold_that_disables_the_gate(tmp_path, threshold, capsys):
    layout = make_run(tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        _cli("compare", layout.root, layout.root, "--threshold", threshold)
    assert exit_info.value.code == 2


def test_compare_api_refuses_a_nan_threshold(tmp_path):
    from fleetscope.analysis.compare import compare
    from fleetscope.traces.validate import UsageError

    with pytest.raises(UsageError):
        compare(tmp_path, tmp_path, threshold_pct=float("nan"))


def test_merge_without_output_for_a_foreign_directory_is_bad_usage(tmp_path):
    assert _cli("merge", make_trace_dir(tmp_path / "traces")) == 2


def test_nothing_analyzed_exits_1_not_3(tmp_path):
    root = tmp_path / "traces"
    root.mkdir()
    (root / "rank0.json").write_bytes(b"{broken")
    (root / "rank1.json").write_bytes(b"")
    assert _cli("analyze", root, "--no-hta", "--no-cache") == 1
    assert _cli("merge", root, "-o", tmp_path / "m.perfetto-trace") in (1, 3)


def _metrics_run(root: Path, tokens: dict[int, float], bad_rank: int | None = None) -> Path:
    layout = make_run(root, len(tokens))
    for rank, tokens_per_s in tokens.items():
        lines = [json.dumps({"step": s, "step_time_ms": 100.0, "tokens_per_s": tokens_per_s}) for s in range(5)]
        if rank == bad_rank:
            lines = ["{not json"] * 5
        layout.metrics_file(rank).parent.mkdir(parents=True, exist_ok=True)
        layout.metrics_file(rank).write_text("\n".join(lines) + "\n")
    return layout.root


def test_compare_names_bad_metric_lines_and_compares_the_ranks_both_sides_have(tmp_path):
    from fleetscope.analysis.compare import EXIT_OK, compare

    base = _metrics_run(tmp_path / "base", {0: 1000.0, 1: 1000.0})
    new = _metrics_run(tmp_path / "new", {0: 1000.0, 1: 1000.0}, bad_rank=1)
    result = compare(base, new)
    assert result.exit_code == EXIT_OK        # not a false 50% throughput regression
    assert any("metrics/rank1.jsonl: 5 bad line(s) skipped" in n for n in result.notes)
    assert any("rank(s) 1 have no counterpart" in n for n in result.notes)
    throughput = next(m for m in result.metrics if m.name == "tokens_per_s")
    assert throughput.base == throughput.new == 1000.0


# --- silent inconsistencies ------------------------------------------------------------------------


def test_foreign_traces_of_another_job_or_beyond_the_world_size_are_named(tmp_path):
    root = make_trace_dir(tmp_path / "traces", world_size=2)
    good_rank(1, world_size=8).write(root / "other_job_rank1.json")
    good_rank(5, world_size=2).write(root / "rank5.json")
    report = analyze(root, use_hta=False)
    assert report.analyzed_ranks == [0, 1] and not report.complete
    assert _problem(report, "world size 8, the run's is 2").label == "other_job_rank1.json"
    assert _problem(report, "rank 5 is not below the world size 2").label == "rank5.json"


def test_foreign_traces_declaring_a_huge_world_size_list_a_bounded_number_of_missing_ranks(tmp_path):
    root = tmp_path / "traces"
    for rank in range(2):
        good_rank(rank, world_size=1 << 20).write(root / f"rank{rank}.json")
    report = analyze(root, use_hta=False)
    assert report.analyzed_ranks == [0, 1] and len(report.missing) == 64
    assert any(f"{(1 << 20) - 2} rank trace(s) missing in all" in n for n in report.notes)


@pytest.mark.parametrize("offset_us", [1e12, -1e12, float("nan")])
def test_an_absurd_clock_offset_is_refused_and_said(tmp_path, offset_us):
    from fleetscope.traces.clock import ClockOffset, read_clock_offsets, write_clock_offset

    layout = make_run(tmp_path / "run")
    for rank, offset in ((0, 0.0), (1, offset_us)):
        write_clock_offset(ClockOffset(rank=rank, offset_us=offset, uncertainty_us=1.0, best_round_trip_us=2.0,
                                       round_trips=4, host="node0", measured_at_ns=1), layout.clock_file(rank))
    offsets, problems = read_clock_offsets(layout)
    assert sorted(offsets) == [0] and problems and problems[0].startswith("clock/rank1.json")
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.complete and any(n.startswith("clock/rank1.json") for n in report.notes)


@pytest.mark.parametrize("content", [b"[1,2]", b'{"version": 1, "rank": "x"}', b"[" * 50_000, b"\xff\xfe"])
def test_a_damaged_clock_file_is_named(tmp_path, content):
    from fleetscope.traces.clock import read_clock_offsets

    layout = make_run(tmp_path / "run")
    layout.clock_dir.mkdir()
    layout.clock_file(1).write_bytes(content)
    os.mkfifo(layout.clock_file(2))
    offsets, problems = read_clock_offsets(layout)
    assert offsets == {} and [p.split(":")[0] for p in problems] == ["clock/rank1.json", "clock/rank2.json"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2**64, -(2**70)])
def test_the_merge_skips_events_with_non_finite_or_huge_times_and_names_the_file(tmp_path, value):
    from fleetscope.analysis.merge.run import merge

    layout = make_run(tmp_path / "run", gathered=False)
    builder = good_rank(1)
    document = builder.document()
    document["traceEvents"] += [
        {"ph": "X", "name": "evil", "cat": "cpu_op", "ts": value, "dur": 5, "pid": 1, "tid": 1},
        {"ph": "X", "name": "evil", "cat": "cpu_op", "ts": 5, "dur": value, "pid": 1, "tid": 1},
        {"ph": "i", "name": "evil", "ts": value, "pid": 1, "tid": 1, "s": "t"},
        {"ph": "C", "name": "evil", "ts": value, "pid": 1, "args": {"a": 1}},
        {"ph": "C", "name": "evil", "ts": 5, "pid": 1, "args": {"a": value}},
    ]
    import gzip

    layout.trace_file(0, 1, "node0").write_bytes(gzip.compress(json.dumps(document).encode()))
    result = merge(layout.root, tmp_path / "m.perfetto-trace")
    assert result.ranks == [0, 1]
    said = [f"{n.path}: {n.reason}" for n in result.notes]
    assert any("rank1.node0" in n and "non-finite time or one beyond int64" in n for n in said), said
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert report.analyzed_ranks == [0, 1]


def test_a_gzip_bomb_is_refused_without_inflating_it(tmp_path):
    import gzip

    from fleetscope.traces.kineto import MIN_INFLATE_LIMIT, decompress

    root = make_trace_dir(tmp_path / "traces", world_size=2)
    bomb = gzip.compress(b'{"traceEvents": [' + b" " * (MIN_INFLATE_LIMIT + 1024) + b"]}", compresslevel=9)
    (root / "rank1.json.gz").write_bytes(bomb)
    (root / "rank1.json").unlink()
    report = analyze(root, use_hta=False)
    assert report.analyzed_ranks == [0]
    assert "decompression bomb" in _problem(report, "bomb").reason
    data = b'{"traceEvents": []}'
    two_members = gzip.compress(data) + b"\0\0" + gzip.compress(data)
    assert decompress(two_members, root) == data + data == gzip.decompress(two_members)


@pytest.mark.parametrize("argv", [
    ["analyze", "/nonexistent/run"],
    ["merge", "/nonexistent/run"],
    ["compare", "/nonexistent/a", "/nonexistent/b"],
    ["merge", "RUN", "--window", "nan:1"],
    ["merge", "RUN", "--window", "5:1"],
    ["merge", "RUN", "--workers", "0"],
])
def test_bad_usage_exits_2(tmp_path, argv):
    layout = make_run(tmp_path / "run")
    argv = [str(layout.root) if a == "RUN" else a for a in argv]
    try:
        rc = main(argv)
    except SystemExit as exit_info:
        rc = exit_info.code
    assert rc == 2


def test_gather_says_how_many_ranks_are_missing_when_it_lists_only_the_first(tmp_path, capsys):
    layout = make_run(tmp_path / "run", 1 << 20, ranks=2, gathered=False)
    assert main(["gather", str(layout.root)]) == 3
    out = capsys.readouterr().out
    assert f"missing in window 0: {(1 << 20) - 2} of {1 << 20} ranks (2-{(1 << 20) - 1})" in out
    assert f"{(1 << 20) - 2} rank trace(s) missing in all" in out and len(out) < 2000
    assert json.loads(layout.manifest_file.read_text())["missing_total"] == (1 << 20) - 2



# --- tune: a job record written by anyone, and the new run directory ----------------------------------


def _spec_edit(path: list[str], value):
    def edit(job: dict) -> None:
        node = job["spec"]
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return edit


_DELETE = object()


@pytest.mark.parametrize("edit, message", [
    (_spec_edit(["train"], _DELETE), "spec.train: missing from job.json"),               # was a TypeError
    (_spec_edit(["train", "run_dir"], _DELETE), "spec.train.run_dir: missing"),          # was a TypeError
    (_spec_edit(["entry"], {}), "spec.entry.program: missing"),                          # was a TypeError
    (_spec_edit(["train", "parallel", "bucket_cap_mb"], 10**400), "expected a finite number"),  # OverflowError
    (_spec_edit(["train", "parallel", "bucket_cap_mb"], float("inf")), "expected a finite number"),  # was used
    (_spec_edit(["nproc_per_node"], 10**30), "beyond 1048576"),                          # was planned
    (_spec_edit(["env"], {"A\n": "1"}), "env"),
])
def test_tune_refuses_a_damaged_job_record_naming_the_file_and_the_field(tmp_path, capsys, edit, message):
    layout = make_recorded_run(tmp_path / "run")
    job = json.loads(layout.job_file.read_text())
    edit(job)
    layout.job_file.write_text(json.dumps(job))
    before = digests(tmp_path)
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert str(layout.job_file) in err and message in err, err
    assert digests(tmp_path) == before and not (tmp_path / "run-tune-data_workers").exists()


@pytest.mark.parametrize("wanted", ["²", "١", "9" * 5000, "data_workers\n"])
def test_tune_apply_is_an_ascii_finding_number_or_a_rule_name(tmp_path, capsys, wanted):
    """str.isdigit() took '²' (then int() failed: exit 1) and Arabic-Indic digits; 5000 digits overflowed
    int()'s limit (exit 1, a message about sys.set_int_max_str_digits)."""
    layout = make_recorded_run(tmp_path / "run")
    assert main(["tune", str(layout.root), "--apply", wanted, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "expected a finding number or a rule name" in err and len(err) < 300


def test_tune_refuses_a_new_run_directory_it_cannot_make_before_anything_runs(tmp_path, capsys):
    layout = make_recorded_run(tmp_path / "run")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "not-there")
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run", "--run-dir", str(dangling)]) == 2
    assert "broken symlink" in capsys.readouterr().err and not (tmp_path / "not-there").exists()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run", "--run-dir", str(a_file / "new")]) == 2
    err = capsys.readouterr().err
    assert f"{a_file} exists and is not a directory" in err and a_file.read_text() == "mine"


# --- the parse fan-out: forged task records, ids, symlinked record and cache directories ----------------


def _fanout_run(tmp_path):
    from fleetscope.traces.fanout import ParseCounts, TaskRecord, write_task_record

    layout = make_run(tmp_path / "run", 3)
    record = TaskRecord(array_job_id="77", task=0, tasks=2, node="n0", ranks=[0, 1], counts=ParseCounts(traces=2, parsed=2),
                        cache_dir=str(tmp_path / "cache"), seconds=1.0)
    return layout, write_task_record(layout, record)


@pytest.mark.parametrize("forge", [
    lambda r: b"[" * 100000,                                        # RecursionError: was a traceback
    lambda r: json.dumps({**r, "ranks": [{}]}).encode(),          # unhashable: was a traceback
    lambda r: json.dumps({**r, "ranks": [[1]]}).encode(),
    lambda r: json.dumps({**r, "ranks": 5}).encode(),             # not iterable: was a traceback
    lambda r: json.dumps({**r, "ranks": [-1, True]}).encode(),
    lambda r: json.dumps({**r, "counts": {"failed": [{"label": 1}]}}).encode(),
    lambda r: json.dumps({**r, "seconds": "x"}).encode(),         # reached an f-string format: ValueError
    lambda r: json.dumps({k: v for k, v in r.items() if k != "node"}).encode(),
])
def test_a_forged_task_record_is_a_task_that_did_not_complete(tmp_path, forge):
    from fleetscope.cli.fanout_commands import incomplete_tasks
    from fleetscope.launcher.fanout import shard_blocks

    layout, path = _fanout_run(tmp_path)
    path.write_bytes(forge(json.loads(path.read_text())))
    incomplete = incomplete_tasks(layout, "77", shard_blocks([0, 1, 2], 2))
    assert [t.task for t in incomplete] == [0, 1]
    assert "unreadable record" in incomplete[0].reason and str(path) in incomplete[0].reason


def test_reduce_shards_with_a_forged_record_parses_that_tasks_ranks_itself(tmp_path, capsys):
    layout, path = _fanout_run(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "ranks": [{"x": 1}]}))
    rc = main(["reduce-shards", str(layout.root), "--of", "2", "--cache-dir", str(tmp_path / "cache"),
               "--array-job", "77"])
    err = capsys.readouterr().err
    assert rc == 3 and "task 0 did not complete" in err and "unreadable record" in err
    assert json.loads(layout.report_json.read_text())["complete"]


@pytest.mark.parametrize("argv", [
    ["parse-shard", "RUN", "--shard", "0", "--of", "2", "--cache-dir", "CACHE", "--array-job", "77\n"],
    ["parse-shard", "RUN", "--shard", "0", "--of", "2", "--cache-dir", "CACHE", "--visible", "deadbeef\n"],
    ["postprocess", "RUN", "--slurm", "--dry-run", "--mem", "16G\n"],
    ["postprocess", "RUN", "--slurm", "--dry-run", "--partition", "gpu\n"],
])
def test_ids_and_names_with_a_trailing_newline_are_refused(tmp_path, capsys, argv):
    """`^...$` matches before a final newline: "77\n" was taken as a job id (a directory fanout-77<newline>
    was created), "16G\n" and "gpu\n" reached sbatch's arguments."""
    layout = make_run(tmp_path / "run", 3)
    argv = [str(layout.root) if a == "RUN" else str(tmp_path / "cache") if a == "CACHE" else a for a in argv]
    assert main(argv) == 2
    assert "not" in capsys.readouterr().err
    assert not [p for p in layout.root.rglob("*") if "\n" in p.name]


def test_a_task_record_is_never_written_through_a_symlinked_fanout_directory(tmp_path, capsys):
    layout = make_run(tmp_path / "run", 3)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "task0.json").write_text("someone else's")
    (layout.logs_dir / "slurm").mkdir(parents=True)
    (layout.logs_dir / "slurm" / "fanout-80").symlink_to(outside)
    assert main(["parse-shard", str(layout.root), "--shard", "0", "--of", "2", "--cache-dir", str(tmp_path / "cache"),
                 "--array-job", "80"]) == 1
    assert "resolves outside" in capsys.readouterr().err
    assert sorted(os.listdir(outside)) == ["task0.json"] and (outside / "task0.json").read_text() == "someone else's"


def test_the_default_fanout_cache_must_stay_inside_the_run(tmp_path, capsys, monkeypatch):
    from fleetscope.analysis.per_rank.cache import CACHE_DIR_ENV

    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    layout = make_run(tmp_path / "run", 3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (layout.root / "cache").symlink_to(elsewhere)
    assert main(["postprocess", str(layout.root), "--slurm", "--dry-run"]) == 2
    assert "resolves outside" in capsys.readouterr().err and not os.listdir(elsewhere)


# --- advise and the MoE records -----------------------------------------------------------------------


@pytest.mark.parametrize("line, why", [
    (moe_line(1, 9, ep="x"), "ep 'x'"),                                   # was a TypeError in advise
    (moe_line(1, 9, ep=10**9), "ep 1000000000"),                          # was a ZeroDivisionError
    (moe_line(1, 9, ep_ranks=[[0], [1]]), "ep_ranks"),                    # unhashable: was a TypeError
    (moe_line(1, 9, tokens_per_expert=["a", "b", "c", "d"]), "tokens_per_expert"),   # numpy error, no file
    (moe_line(1, 9, tokens_per_expert=[float("nan")] * 4), "tokens_per_expert"),
    (moe_line(1, 9, tokens_per_expert=[-5, 1, 1, 10**30]), "tokens_per_expert"),
    (moe_line(1, 9, layer="0"), "layer"),                                  # was a TypeError
    (moe_line(1, 9, send_bytes="xx"), "send_bytes"),                       # was a TypeError
    (moe_line(1, 9, send_bytes=[1, 2, 3]), "send_bytes has 3 entries"),
    (moe_line(1, 9, split_sizes_d2h_ms="x"), "split_sizes_d2h_ms"),        # was a numpy TypeError
    ("[" * 100000, "not JSON"),
    ('{"pad": "' + "x" * (5 << 20) + '"}', "longer than a record"),
])
def test_damaged_moe_records_are_named_and_the_rest_are_used(tmp_path, capsys, line, why):
    layout = make_run(tmp_path / "run", 2)
    write_moe_records(layout, extra={1: [line]})
    before = digests(layout.root)
    assert main(["advise", str(layout.root)]) == 0
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    note = next(n for n in report.notes if "metrics/rank1.moe.jsonl" in n)
    assert "1 bad line(s) skipped (line 5: " in note and why in note, note
    assert report.moe.status == "ok" and report.moe.layers[0].record_steps == 4
    assert digests(layout.root) == before


def test_moe_records_of_another_shape_are_left_out_and_named(tmp_path):
    layout = make_run(tmp_path / "run", 2)
    write_moe_records(layout, extra={1: [moe_line(1, 9, tokens_per_expert=[1])]})   # was a numpy shape error
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert any("rank1.moe.jsonl: 1 record(s) left out" in n for n in report.notes)
    assert report.moe.num_experts == 4


def test_a_moe_record_file_that_is_a_fifo_is_named_not_opened(tmp_path):
    layout = make_run(tmp_path / "run", 2)
    write_moe_records(layout, ranks=(0,))
    os.mkfifo(layout.moe_file(1))
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    assert any("rank1.moe.jsonl: a FIFO" in n for n in report.notes)


@pytest.mark.parametrize("spec", [
    "x", [], {"train": []}, {"train": {"parallel": []}}, {"train": {"model": 3, "parallel": {"mode": 5}}},
    {"train": {"parallel": {"bucket_cap_mb": "x", "mode": "ddp"}, "data": {"num_workers": "z"}}},
    {"train": {"performance": {"compile": 7, "activation_checkpointing": None}, "faults": {"hot_expert": "1"}}},
])
def test_advise_takes_a_job_record_of_any_shape(tmp_path, capsys, spec):
    """Rules read settings from job.json's spec.train: a spec of another shape or type was an
    AttributeError or TypeError (a traceback)."""
    layout = make_recorded_run(tmp_path / "run")
    layout.job_file.write_text(json.dumps({"spec": spec}))
    assert main(["advise", str(layout.root)]) == 0
    assert "data_workers" in capsys.readouterr().out


# --- all-to-all split sizes in a trace ---------------------------------------------------------------


def _alltoall_rows(tmp_path, calls: list[dict]):
    for rank in (0, 1):
        alltoall_rank(rank, calls).write(tmp_path / f"rank{rank}.json")
    report = analyze(tmp_path, use_hta=False, use_cache=False, write_default_outputs=False)
    assert report.analyzed_ranks == [0, 1], [(p.label, p.reason) for p in report.problems]
    return report.windows[0].bandwidth.rows


@pytest.mark.parametrize("group_size", [2**40, 2**62])
def test_an_absurd_group_size_loses_no_rank(tmp_path, group_size):
    """An even split ("[]") of 2^40 peers was a MemoryError (of 10^9 peers: 8 GB per call, the process
    killed by the OOM killer); 2^62 overflowed the int32 group-size column: either way the rank was lost."""
    even = {"Group size": group_size, "In split size": "[]", "Out split size": "[]"}
    (row,) = _alltoall_rows(tmp_path, [even])
    assert row.split_status == {"not recorded": 1} and row.total_bytes == 800 * 16 * 2


def test_a_split_list_beyond_the_world_size_bound_is_not_read(tmp_path):
    from fleetscope.analysis.per_rank.comm_bytes import parse_split
    from fleetscope.traces.validate import MAX_WORLD_SIZE

    assert parse_split("[" + ", ".join(["1"] * (MAX_WORLD_SIZE + 1)) + "]") == (None, False)
    assert parse_split("[" + ", ".join(["1"] * 64) + "]") == ([1] * 64, False)


def test_the_per_peer_entries_of_one_rank_are_bounded(tmp_path, monkeypatch):
    from fleetscope.analysis.per_rank import comm_bytes

    monkeypatch.setattr(comm_bytes, "MAX_PEER_ENTRIES", 8)   # 2 calls x (2 send + 2 recv entries)
    calls = [{"In split size": f"[{300 + k}, {500 - k}]"} for k in range(3)]
    calls.append(dict(calls[0]))                            # the same message as the first: no new entries
    (row,) = _alltoall_rows(tmp_path, calls)
    assert row.split_status == {"trace": 3, "not recorded": 1}


# --- advise over a report.json written by anyone ---------------------------------------------------


@pytest.mark.parametrize("path, value", [
    (["ranks"], None), (["ranks", 0, "rank"], []), (["ranks", 0], None), (["windows", 0], None),
    (["windows", 0, "ranks", 0, "steps", 0], None), (["moe", "layers"], "x"), (["step_time"], [1]),
    (["world_size"], "2"), (["complete"], 1),
])
def test_advise_names_a_report_json_of_the_wrong_shape(tmp_path, capsys, path, value):
    """Report.from_json took any value for any field: None for a list of ranks, a list for a rank number
    (TypeError / AttributeError tracebacks in advise's rules)."""
    layout = make_run(tmp_path / "run", 2)
    write_moe_records(layout)
    analyze(layout.root, use_hta=False)
    report = json.loads(layout.report_json.read_text())
    node = report
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    layout.report_json.write_text(json.dumps(report))
    assert main(["advise", str(layout.root)]) == 1
    err = capsys.readouterr().err
    assert f"{layout.report_json}: cannot read report: TypeError: " in err, err


def test_a_runs_report_json_symlinked_out_of_the_run_is_not_read(tmp_path, capsys):
    """advise and compare read RUN/report/report.json through the safe reader without a bound: a symlink to
    another run's report made that run's findings this run's."""
    from fleetscope.analysis.compare import compare

    other = make_recorded_run(tmp_path / "other")
    analyze(make_run(other.root, 2, gathered=True).root, use_hta=False)
    layout = make_run(tmp_path / "run", 2)
    layout.report_dir.mkdir()
    layout.report_json.symlink_to(other.report_json)
    assert main(["advise", str(layout.root)]) == 1
    assert f"{layout.report_json}: cannot read report: resolves outside" in capsys.readouterr().err
    with pytest.raises(ValueError, match="resolves outside"):
        compare(layout.root, other.root)


@pytest.mark.parametrize("setting, message", [
    ("run_dir=/etc", "set by --run-dir only"),          # was applied after --run-dir's checks: the job went there
    ("run_dir=RUN", "set by --run-dir only"),           # ... or into the tuned run itself
    ("parallel.bucket_cap_mb=inf", "expected a finite number"),
    ("parallel.bucket_cap_mb=1e400", "expected a finite number"),
])
def test_tune_set_cannot_move_the_run_or_set_a_non_finite_number(tmp_path, capsys, setting, message):
    layout = make_recorded_run(tmp_path / "run")
    setting = setting.replace("RUN", str(layout.root))
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run", "--set", setting]) == 2
    assert message in capsys.readouterr().err


def test_step_metrics_symlinked_out_of_the_run_are_not_read(tmp_path, capsys):
    """metrics/rank<R>.jsonl was read through the safe reader without a bound: a symlink to another run's
    metrics became this run's evidence (advise, compare, the report's trainer section)."""
    from fleetscope.analysis.compare import read_steady_metrics
    from fleetscope.analysis.inputs.records import read_run_records

    layout = make_recorded_run(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("".join(json.dumps({"step": s, "rank": 1, "step_time_ms": 1.0}) + "\n" for s in range(6)))
    layout.metrics_file(1).unlink()
    layout.metrics_file(1).symlink_to(elsewhere)
    steady, notes = read_steady_metrics(read_run_records(layout))
    assert list(steady) == [0] and any("rank1.jsonl: not read: resolves outside" in n for n in notes)
    make_run(layout.root, 2)
    report = analyze(layout.root, use_hta=False, write_default_outputs=False)
    (rank1,) = [r for r in report.trainer.ranks if r.rank == 1]
    assert rank1.input is None and rank1.problems == [f"rank1.jsonl: not read: resolves outside {layout.root} "
                                                      "(symlink or path escape): not read"]


@pytest.mark.parametrize("content", [b'{"spec": {', b"[" * 100000])
def test_tune_refuses_an_unreadable_job_record_with_exit_2(tmp_path, capsys, content):
    layout = make_recorded_run(tmp_path / "run")
    layout.job_file.write_bytes(content)
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run"]) == 2
    assert f"{layout.job_file}: unreadable job record" in capsys.readouterr().err
