"""What the terminal says on a first run: words that fit the job (CPU or GPU, two ranks or many), notes said
once, whole counts as integers, one unit per quantity, aligned labels, short critical-path lines, launch output
without the profiler's own lines, `hang` on a healthy run, and `query`'s header, times and empty results."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest

from fleetscope.analysis import analyze, render_terminal
from fleetscope.analysis.cross_rank.bandwidth import Bandwidth
from fleetscope.analysis.cross_rank.critical_path import CriticalPaths, PathSegment, StepPath
from fleetscope.analysis.render import cause_terminal, evidence_text
from fleetscope.cli.main import build_parser, main
from fleetscope.cli.render import STATUS_LABEL_WIDTH, render_status
from fleetscope.launcher.failures import RankFailure
from fleetscope.launcher.schedulers.local import RecordedRunStatus, pass_stderr
from fleetscope.traces.jobfile import write_job_record
from fleetscope.traces.layout import RunLayout
from helpers import requires_trace_processor
from helpers.kineto import KinetoBuilder
from test_critical_path import jumping_path_set


def cpu_traces(directory: Path, *, ranks: int = 2, slow_rank: int = 1) -> Path:
    """Gloo CPU traces, two steps per rank; `slow_rank`'s steps take 30% longer."""
    for rank in range(ranks):
        builder = KinetoBuilder(rank=rank, world_size=ranks, backend="gloo")
        work, step = (460.0, 1300.0) if rank == slow_rank else (200.0, 1000.0)
        for index in range(2):
            s = index * 1500.0
            builder.step(index + 1, s, step).annotation("forward", s + 5, 290)
            builder.op("aten::mm", s + 10, work).op("c10d::allreduce_", s + 300, 5)
            builder.gloo(s + 305, 100)
        builder.write(directory / f"rank{rank}.json")
    return directory


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    return analyze(cpu_traces(tmp_path_factory.mktemp("cpu")), use_hta=False, use_cache=False)


# --- analyze's terminal report --------------------------------------------------------------------


def test_a_cpu_job_is_not_described_in_gpu_words(cpu_report):
    text = render_terminal(cpu_report)
    hta = text.split("\nHTA\n")[0]   # HTA's own line says it skipped CPU-only traces (no GPU kernels)
    assert "GPU" not in hta, [line for line in hta.splitlines() if "GPU" in line]
    assert "Where the time went (phases on the host)" in text


def test_two_ranks_are_slowest_and_fastest_not_against_a_median_rank(cpu_report):
    text = render_terminal(cpu_report)
    assert "median rank" not in text
    assert "vs rank 0, the fastest" not in cpu_report.verdict      # a verdict names one rank


def test_many_ranks_still_compare_with_the_median_rank(tmp_path):
    report = analyze(cpu_traces(tmp_path, ranks=3, slow_rank=2), use_hta=False, use_cache=False)
    assert "vs the median rank" in report.verdict and "the fastest" not in report.verdict


def test_whole_counts_print_as_integers():
    assert evidence_text._count(74.0) == "74" and evidence_text._count(2.5) == "2.5"


def test_the_host_stall_line_prints_whole_counts(cpu_report):
    stalls = render_terminal(cpu_report).split("Host stalls")[1].split("\n\n")[0]
    assert "tensor reads" in stalls and ".0 tensor reads" not in stalls and ".0 syncs" not in stalls


def _with_windows(report, count: int, **fields):
    window = dataclasses.replace(report.windows[0], **fields)
    return dataclasses.replace(report, windows=[dataclasses.replace(window, window=w) for w in range(count)])


def test_a_bandwidth_note_that_every_window_shares_is_said_once(cpu_report):
    note = Bandwidth(status="not recorded", reason="collectives come from gloo spans")
    text = render_terminal(_with_windows(cpu_report, 3, bandwidth=note))
    assert text.count("collectives come from gloo spans") == 1
    assert "windows 0, 1, 2: bandwidth not recorded: collectives come from gloo spans" in text


def _segments(count: int) -> list[PathSegment]:
    return [PathSegment(kind="compute" if i % 2 else "data movement", rank=i % 2, collective=f"gloo:all_reduce #{i}",
                        start_us=100.0 * i, duration_us=100.0 + i, share=1.0 / count) for i in range(count)]


def test_a_long_critical_path_shows_its_longest_segments_and_counts_the_rest(cpu_report):
    segments = _segments(13)
    paths = CriticalPaths(steps=[StepPath(step=1, length_us=sum(s.duration_us for s in segments),
                                          segments=segments)])
    text = cause_terminal.critical_path_lines(_with_windows(cpu_report, 1, critical_path=paths))
    line = next(line for line in text.splitlines() if line.strip().startswith("step 1 "))
    assert line.count(" ms") <= cause_terminal.PATH_SEGMENTS_SHOWN + 3 and "->" not in line
    assert "13 segments" in line and "9 more segments" in line
    assert "#12" in line and "#9" in line and "#8" not in line      # the four longest, in path order
    assert line.index("#9") < line.index("#12")


def test_a_short_critical_path_is_shown_whole(tmp_path):
    report = analyze(jumping_path_set(tmp_path / "set"), use_hta=False, use_cache=False)
    text = cause_terminal.critical_path_lines(report)
    assert "6 segments" in text and "2 more segments" in text


def test_each_quantity_has_one_unit_in_the_terminal():
    """Memory in MiB (2^20 bytes, as the allocator counts), file sizes in MB (10^6 bytes)."""
    memory = type("Memory", (), dict(peak_allocated_mb=10.0, peak_reserved_mb=12.0, fragmentation_mb=2.0,
                                     fragmentation_pct=16.0, growth_mb_per_step=0.5, leak_suspected=False,
                                     alloc_retries=0, ooms=0))
    line = evidence_text.memory_line(memory)
    assert line.count("MiB") == 4 and " MB" not in line
    from fleetscope.cli.merge_messages import megabytes
    assert megabytes(3_080_000) == "3.08 MB"
    merge = next(a for a in _subcommand("merge")._actions if "--budget-mb" in a.option_strings)
    assert "10^6 bytes" in merge.help


def _subcommand(name: str):
    import argparse
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


# --- status, launch output, hang --------------------------------------------------------------------


def test_status_values_start_in_one_column(tmp_path):
    failure = RankFailure(rank=1, exitcode=2, message="ConfigError: performance.device: no CUDA device",
                          log_path=str(tmp_path / "logs" / "1" / "stderr.log"))
    status = RecordedRunStatus(run_dir=tmp_path, scheduler="local", recorded_status="failed",
                               failures=[failure, dataclasses.replace(failure, rank=0)],
                               outputs={"report_json": tmp_path / "report.json",
                                        "merged_trace": tmp_path / "merged.perfetto-trace"})
    lines = render_status(status).splitlines()
    assert len(lines) == 8
    for line in lines:
        label, value = line[:STATUS_LABEL_WIDTH], line[STATUS_LABEL_WIDTH:]
        assert label.rstrip().endswith(":") and value[:1] not in (" ", ""), line


def test_launch_passes_rank_lines_on_but_not_the_profilers_own():
    lines = ["[default0]:2026-12-02 13:52:14,889 rank0 INFO step 0 loss 6.2484\n",
             "[default0]:USDT:2026-12-02 13:52:14 7618:7618 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
             "[default0]:STAGE:2024-05-01 10:00:00 1234:1234 ActivityProfilerController.cpp:312] Completed Stage: "
             "Warm Up\n",
             "STAGE:2024-05-01 10:00:01 1234:1234 ActivityProfilerController.cpp:318] Completed Stage: Collection\n",
             "[default0]:a line that mentions USDT: in passing\n",
             "[default0]:STAGE: my program's own stage line\n"]
    out = io.StringIO()
    pass_stderr(lines, out, Path("/nonexistent/summary.log"))
    assert out.getvalue() == lines[0] + lines[4] + lines[5]


def test_torchx_local_names_ranks_that_wrote_no_error_file(tmp_path):
    """A program without @record: the ranks come from torchrun's summary in the log TorchX keeps, as with
    the local scheduler, instead of "no rank left an error file"."""
    from fleetscope.launcher.schedulers.torchx import local_failures
    from fleetscope.traces.layout import torchx_local_logs_dir

    layout = RunLayout.at(tmp_path)
    log = torchx_local_logs_dir(layout) / "torchx" / "app-1" / "fleetscope" / "0" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 60 + "\n"
                   "prog.py FAILED\n" + "-" * 60 + "\nFailures:\n  <NO_OTHER_FAILURES>\n" + "-" * 60 + "\n"
                   "Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-02_13:53:38\n"
                   "  host      : localhost\n  rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: 10700)\n"
                   "  error_file: <N/A>\n  traceback : To enable traceback see: https://pytorch.org\n" + "=" * 60
                   + "\n")
    failures = local_failures(layout)
    assert [(f.rank, f.exitcode) for f in failures] == [(1, 3)]


def test_hang_on_a_healthy_run_says_no_hang_and_exits_0(tmp_path, capsys):
    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    write_job_record(layout, status="succeeded")
    assert main(["hang", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no hang: no rank wrote a Flight Recorder dump") and "the job succeeded" in out
    assert main(["hang", str(tmp_path / "not-a-run")]) == 1


# --- merge's option names -----------------------------------------------------------------------------


def test_merge_names_a_time_range_and_a_json_trace_and_keeps_the_old_spellings_hidden(tmp_path):
    merge = _subcommand("merge")
    text = merge.format_help()
    assert "--time-range START:END" in text and "--json-trace" in text
    assert "--window" not in text and "--json " not in text and "--json\n" not in text
    new = merge.parse_args([str(tmp_path), "--time-range", "1:2", "--json-trace"])
    old = merge.parse_args([str(tmp_path), "--window", "1:2", "--json"])
    assert new.time_range == old.time_range == (1.0, 2.0) and new.json_trace == old.json_trace == ""


@pytest.mark.parametrize(("command", "kind"), [("launch", "a count"), ("demo", "a count"), ("profile", "a count"),
                                               ("merge", "a list")])
def test_every_steps_option_says_whether_it_is_a_count_or_a_list(command, kind):
    steps = next(a for a in _subcommand(command)._actions if "--steps" in a.option_strings)
    assert kind in steps.help
    assert steps.metavar == ("N" if kind == "a count" else "STEP[,STEP...]")


# --- query --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def path_trace(tmp_path_factory):
    from fleetscope.analysis.merge.run import merge

    directory = tmp_path_factory.mktemp("path")
    traces = jumping_path_set(directory / "set")
    report = analyze(traces, use_hta=False, use_cache=False)
    return merge(traces, directory / "merged.perfetto-trace", report=report, use_cache=False).output


def _query(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["query", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


@requires_trace_processor
def test_collective_waits_leave_the_critical_paths_arrows_out(path_trace, capsys):
    code, lines, _ = _query(capsys, str(path_trace), "--named", "collective-waits")
    assert code == 0 and lines[0].split(",")[:3] == ["collective", "ranks", "first_arrival_ms"]
    names = {line.split(",")[0] for line in lines[1:]}
    assert names == {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL"}, names
    assert all(0.0 <= float(line.split(",")[2]) < 10.0 for line in lines[1:])   # ms after the trace's start


@requires_trace_processor
def test_the_critical_path_query_gives_times_in_ms_from_the_trace_start(path_trace, capsys):
    code, lines, _ = _query(capsys, str(path_trace), "--named", "critical-path")
    assert code == 0 and "start_ms" in lines[0].split(",") and "ts" not in lines[0].split(",")
    column = lines[0].split(",").index("start_ms")
    assert all(0.0 <= float(line.split(",")[column]) < 10.0 for line in lines[1:])


@requires_trace_processor
def test_a_query_without_rows_prints_its_header_and_says_why(path_trace, capsys):
    code, lines, err = _query(capsys, str(path_trace), "--named", "top-kernels")
    assert code == 0 and len(lines) > 1                         # GPU kernels: rows
    code, lines, err = _query(capsys, str(path_trace), "SELECT name AS kernel FROM slice WHERE 0")
    assert code == 0 and lines == ["kernel"] and err.strip() == "no rows: the statement selected nothing"


def test_named_queries_say_why_they_can_be_empty():
    from fleetscope.analysis.merge.perfetto.queries import NAMED_QUERIES, NO_ROWS

    assert set(NO_ROWS) == set(NAMED_QUERIES)
    final_selects = [sql.rsplit("\nSELECT ", 1)[-1].split("\nFROM ")[0] for sql in NAMED_QUERIES.values()]
    assert all(not re.search(r"AS \w+_ns\b|s\.ts,", columns) for columns in final_selects), final_selects


def test_write_rows_prints_the_header_without_rows():
    from fleetscope.cli.query_command import write_rows

    out = io.StringIO()
    write_rows([], out, columns=["rank", "total_ms"])
    assert out.getvalue() == "rank,total_ms\n"



def test_the_events_a_merge_left_out_are_one_line_per_reason_over_all_ranks():
    from fleetscope.analysis.merge.run import MergeProblem
    from fleetscope.cli.merge_messages import describe_notes

    notes = [MergeProblem(path=f"/run/traces/rank{rank}.json", rank=rank, reason=f"{count} events: phase 'B' not merged")
             for rank, count in ((0, 3), (1, 4), (2, 1500), (7, 1))]
    notes.append(MergeProblem(reason="whole-run counters: the timeline of rank 3 is truncated"))
    assert describe_notes(notes) == [
        "  note: 1,508 events: phase 'B' not merged (4 rank(s): 0-2, 7)",
        "  note: whole-run counters: the timeline of rank 3 is truncated",
    ]


def test_a_json_trace_without_a_path_goes_beside_o_and_is_named(tmp_path, capsys):
    """`merge RUN --json-trace -o elsewhere/m.perfetto-trace` wrote the JSON into the run's report/ and never said;
    it goes beside -o's trace, and the command prints where."""
    import shutil

    from fleetscope.cli.main import main

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "fixtures" / "gpu" / "h200-ddp-gloo-2rank", run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    out = tmp_path / "elsewhere" / "m.perfetto-trace"
    assert main(["merge", str(run), "--json-trace", "-o", str(out)]) in (0, 3)
    assert (tmp_path / "elsewhere" / "m.trace.json.gz").is_file()
    assert f"the same as Chrome JSON: {tmp_path / 'elsewhere' / 'm.trace.json.gz'}" in capsys.readouterr().out
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


@pytest.mark.parametrize("argv", [["launch", "--nproc_per_node=2", "--standalone", "train.py"],
                                  ["launch", "--nnodes", "2", "--", "python", "t.py"]])
def test_torchruns_flags_given_to_launch_say_what_to_write_instead(argv, capsys):
    """`fleetscope launch --nproc_per_node=2 --standalone train.py` got only argparse's usage line."""
    from fleetscope.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "torchrun's: fleetscope runs torchrun itself" in err and "--nproc-per-node N" in err


def test_torchrun_flags_after_the_double_dash_belong_to_the_program():
    from fleetscope.cli.main import torchrun_words_hint

    assert torchrun_words_hint(["launch", "--nproc-per-node", "2", "--", "python", "t.py", "--nnodes", "3"]) is None
    assert torchrun_words_hint(["analyze", "--standalone"]) is None
