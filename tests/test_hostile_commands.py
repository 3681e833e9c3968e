"""Hardening, round 2: the newer surfaces (tune, advise, profile, hang, collect-traces, postprocess, fan-out,
query) tried as a hostile user would. Each case is a file planted or damaged in a run directory, or an
argument, and the test says what must hold: no input overwritten, nothing read or written outside the run,
nothing printed raw to the terminal, bounded work, a right answer or a named refusal, the right exit code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fleetscope.cli.main import main
from fleetscope.traces.layout import RunLayout
from hostile_runs import digests, make_recorded_run, make_run

from helpers import REPO

HANG_FIXTURE = REPO / "tests" / "fixtures" / "flight_recorder_hang"


def _hang_run(root: Path) -> RunLayout:
    layout = RunLayout.at(root)
    shutil.copytree(HANG_FIXTURE, layout.flight_recorder_dir)
    return layout


# --- data loss: every output goes through the one guard ---------------------------------------------------


def test_advise_json_refuses_to_overwrite_the_runs_job_json(tmp_path, capsys):
    layout = make_recorded_run(tmp_path / "run")
    before = layout.job_file.read_bytes()
    assert main(["advise", str(layout.root), "--json", str(layout.job_file)]) == 2
    assert "refusing to write" in capsys.readouterr().err
    assert layout.job_file.read_bytes() == before
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run"]) in (0, 3)


def test_advise_json_rewrites_its_own_output(tmp_path):
    layout = make_recorded_run(tmp_path / "run")
    out = tmp_path / "advice.json"
    assert main(["advise", str(layout.root), "--json", str(out)]) == 0
    assert main(["advise", str(layout.root), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["run"]


@pytest.mark.parametrize("target", ["flight_recorder/rank0.json", "flight_recorder/hang.rank1.json",
                                    "traces/window000/new.json"])
def test_hang_json_refuses_a_dump_a_marker_or_a_path_among_the_traces(tmp_path, capsys, target):
    layout = _hang_run(tmp_path / "run")
    layout.traces_dir.joinpath("window000").mkdir(parents=True)
    (layout.root / "job.json").write_text("{}")
    before = digests(layout.root)
    assert main(["hang", str(layout.root), "--json", str(layout.root / target)]) == 2
    assert "refusing to write" in capsys.readouterr().err
    assert digests(layout.root) == before and not (layout.root / "traces/window000/new.json").exists()


def test_hang_json_is_strict_json_and_rewrites_its_own_output(tmp_path):
    layout = _hang_run(tmp_path / "run")
    dump = json.loads(layout.flight_recorder_file(0).read_text())
    marker = json.loads(layout.hang_marker(0).read_text())
    marker["seconds"] = 1e999
    layout.hang_marker(0).write_text(json.dumps(marker))
    out = tmp_path / "hang.json"
    assert main(["hang", str(layout.root), "--json", str(out)]) == 0
    assert main(["hang", str(layout.root), "--json", str(out)]) == 0
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    assert dump["rank"] == 0


def test_history_html_refuses_a_metrics_file(tmp_path, capsys):
    layout = make_recorded_run(tmp_path / "runs" / "a")
    before = layout.metrics_file(0).read_bytes()
    assert main(["history", str(tmp_path / "runs"), "--html", str(layout.metrics_file(0))]) == 2
    assert "refusing to write" in capsys.readouterr().err
    assert layout.metrics_file(0).read_bytes() == before


@pytest.mark.parametrize("threshold", ["inf", "nan", "-1"])
def test_history_threshold_must_be_finite(tmp_path, threshold):
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit) as exit_info:        # refused by the argument's type, as compare's
        main(["history", str(tmp_path / "runs"), "--threshold", threshold])
    assert exit_info.value.code == 2
    assert not (tmp_path / "runs" / "history.html").exists()


# --- escapes: nothing written where it does not belong ----------------------------------------------------


@pytest.mark.parametrize("where", ["any_folder", "a_runs_window"])
def test_gather_writes_a_manifest_only_into_a_run_directory(tmp_path, capsys, where):
    layout = make_run(tmp_path / "run")
    target = tmp_path / "folder" if where == "any_folder" else layout.traces_dir / "window0"
    target.mkdir(exist_ok=True)
    before = digests(target)
    assert main(["gather", str(target)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert digests(target) == before and not (target / "manifest.json").exists()


@pytest.mark.parametrize("kind", ["empty", "home_like", "traceless_run"])
def test_postprocess_writes_nothing_into_a_directory_without_traces(tmp_path, capsys, kind):
    target = tmp_path / "target"
    target.mkdir()
    if kind == "home_like":
        (target / "notes.txt").write_text("mine")
        (target / "data.json").write_text("{}")
    if kind == "traceless_run":
        (target / "job.json").write_text("{}")
        (target / "traces").mkdir()
    before = sorted(p.name for p in target.rglob("*"))
    assert main(["postprocess", str(target)]) == 1
    err = capsys.readouterr().err
    assert "no traces" in err and "Traceback" not in err
    assert sorted(p.name for p in target.rglob("*")) == before


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_postprocess_of_a_missing_path_or_a_file_is_one_line_and_exit_2(tmp_path, capfd, kind):
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("x")
    assert main(["postprocess", str(target)]) == 2
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1


def test_collect_traces_creates_no_run_directory(tmp_path):
    from helpers.kineto import KinetoBuilder

    KinetoBuilder(rank=0, world_size=1).write(tmp_path / "prog" / "rank0_trace.json")
    assert main(["collect-traces", str(tmp_path / "nowhere"), str(tmp_path / "prog" / "*.json")]) == 2
    assert not (tmp_path / "nowhere").exists()


def test_collect_traces_does_not_follow_symlinked_directories(tmp_path):
    import subprocess
    import sys

    from helpers.kineto import KinetoBuilder

    prog = tmp_path / "prog"
    KinetoBuilder(rank=0, world_size=1).write(prog / "iteration_1" / "rank0_trace.json.gz")
    (prog / "up1").symlink_to("..")
    (prog / "iteration_1" / "up2").symlink_to("..")
    (prog / "iteration_1" / "again").symlink_to(".")
    run = tmp_path / "run"
    run.mkdir()
    done = subprocess.run([sys.executable, "-m", "fleetscope.cli.main", "collect-traces", str(run),
                           f"{prog}/**/*.json.gz"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "collected 1 trace(s)" in done.stdout
    assert len(list(RunLayout.at(run).traces_dir.rglob("*.json.gz"))) == 1


def test_collect_traces_skips_fleetscope_traces_of_other_runs(tmp_path, capsys, monkeypatch):
    other = make_run(tmp_path / "work" / "other-run")
    (other.root / "job.json").write_text("{}")
    run = tmp_path / "new-run"
    run.mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert main(["collect-traces", str(run), "**/*.json.gz"]) == 3
    out = capsys.readouterr().out
    assert "collected 0 trace(s)" in out and "inside the traces/ of the run" in out
    assert not RunLayout.at(run).traces_dir.exists()


def test_collect_traces_never_replaces_a_runs_own_window(tmp_path, capsys):
    from helpers.kineto import KinetoBuilder

    layout = make_run(tmp_path / "run")
    before = digests(layout.traces_dir)
    KinetoBuilder(rank=0, world_size=2).write(tmp_path / "prog" / "rank0_trace.json")
    assert main(["collect-traces", str(layout.root), str(tmp_path / "prog" / "*.json")]) == 3
    assert "already holds rank 0's trace" in capsys.readouterr().out
    assert digests(layout.traces_dir) == before


def _running_job(root: Path, world_size: int = 2) -> RunLayout:
    layout = RunLayout.at(root)
    root.mkdir(parents=True)
    layout.job_file.write_text(json.dumps({"status": "running", "world_size": world_size}))
    layout.metrics_dir.mkdir()
    return layout


def test_profile_writes_no_request_through_a_symlinked_requests_folder(tmp_path, capsys):
    layout = _running_job(tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    layout.requests_dir.symlink_to(outside)
    assert main(["profile", str(layout.root)]) == 2
    assert "symlink" in capsys.readouterr().err
    assert list(outside.iterdir()) == []


def test_profile_writes_no_request_through_a_planted_staging_link(tmp_path):
    import os

    layout = _running_job(tmp_path / "run")
    layout.requests_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (layout.requests_dir / f".request.{os.getpid()}.tmp").symlink_to(victim)
    assert main(["profile", str(layout.root)]) == 0
    assert victim.read_text() == "keep" and layout.request_file(1).is_file()


def test_request_numbers_beyond_float32_are_not_requests_and_block_nothing(tmp_path):
    from fleetscope.traces.capture import MAX_REQUEST_NUMBER, request_numbers, submit_request
    from fleetscope.trainer.capture import RequestPoller

    layout = _running_job(tmp_path / "run")
    layout.requests_dir.mkdir()
    layout.request_file(999_999_999).write_text(json.dumps({"steps": 1}))
    layout.request_file(MAX_REQUEST_NUMBER + 1).write_text(json.dumps({"steps": 1}))
    poller = RequestPoller(layout, every_steps=1, every_s=0.0)
    assert poller.poll(1) == []
    request = submit_request(layout, steps=1, warmup=0, ranks=None)
    assert request.number == 1 and request_numbers(layout) == [1]
    assert poller.poll(2, force=True) == [1]


@pytest.mark.parametrize("argv", [["--steps", "1001"], ["--warmup", "5000"], ["--timeout", "nan"],
                                  ["--timeout", "inf"], ["--timeout", "-1"], ["--ranks", "0,99999999"]])
def test_profile_refuses_bad_arguments_with_exit_2(tmp_path, argv):
    layout = _running_job(tmp_path / "run")
    with pytest.raises(SystemExit) as stopped:
        code = main(["profile", str(layout.root), "--wait", *argv])
        raise SystemExit(code)
    assert stopped.value.code == 2
    assert not layout.requests_dir.exists() or not any(layout.requests_dir.glob("request*.json"))


# --- hang: every run file through the safe reader, bounded, damaged fields named --------------------------


def test_a_hang_marker_with_an_absurd_rank_does_not_grow_the_report(tmp_path, capsys):
    layout = _hang_run(tmp_path / "run")
    layout.hang_marker(10**12).write_text(json.dumps({"rank": 10**12, "step": 1, "seconds": 5.0, "at": "x"}))
    layout.hang_marker(7).write_text(json.dumps({"rank": 3, "step": 1, "seconds": 5.0, "at": "x"}))
    layout.hang_marker(100000).write_text(json.dumps({"rank": 100000, "step": 1, "seconds": 5.0, "at": "x"}))
    assert main(["hang", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert "does not match the file name" in out and len(out) < 100_000
    assert max(len(line) for line in out.splitlines()) < 2000
    assert "99999 of 100001 ranks have no dump" in out


def _fifo(path: Path) -> None:
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)


def test_hang_reads_no_log_through_a_symlink_out_of_the_run_and_never_blocks_on_a_fifo(tmp_path, capsys):
    import subprocess
    import sys

    layout = _hang_run(tmp_path / "run")
    secret = tmp_path / "secret.log"
    secret.write_text("2026 rank1 INFO the secret line\n2026 rank0 INFO the secret line\n")
    layout.logs_dir.mkdir()
    (layout.logs_dir / "stolen.log").symlink_to(secret)
    _fifo(layout.logs_dir / "blocked.log")
    done = subprocess.run([sys.executable, "-m", "fleetscope.cli.main", "hang", str(layout.root)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "secret line" not in done.stdout


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_window_that_is_a_symlink_or_a_file_is_named_not_listed(tmp_path, capsys, kind):
    layout = _hang_run(tmp_path / "run")
    layout.traces_dir.mkdir()
    if kind == "symlink":
        layout.window_dir(0).symlink_to("/etc")
    else:
        layout.window_dir(0).write_text("x")
    assert main(["hang", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert "not a window folder" in out and "window000:" not in out.replace("traces/window000:", "")


@pytest.mark.parametrize("damage", [
    {"step": float("inf")}, {"pg_status": ["x"]}, {"pg_config": {"0": {"ranks": "[1e999]"}}},
    {"entries.process_group": 5}, {"entries.frames": 3}, {"entries.input_sizes": 9},
])
def test_damaged_flight_recorder_fields_do_not_crash_hang(tmp_path, capsys, damage):
    layout = _hang_run(tmp_path / "run")
    dump = json.loads(layout.flight_recorder_file(1).read_text())
    for key, value in damage.items():
        if key.startswith("entries."):
            for entry in dump["entries"]:
                entry[key.split(".", 1)[1]] = value
        else:
            dump[key] = value
    layout.flight_recorder_file(1).write_text(json.dumps(dump))
    assert main(["hang", str(layout.root), "--json", str(tmp_path / "hang.json")]) == 0
    json.loads((tmp_path / "hang.json").read_text())
    assert "Traceback" not in capsys.readouterr().err


def test_control_characters_from_a_dump_are_escaped(tmp_path, capsys):
    layout = _hang_run(tmp_path / "run")
    dump = json.loads(layout.flight_recorder_file(0).read_text())
    for entry in dump["entries"]:
        entry["profiling_name"] = "\x1b]0;owned\x07\x1b[2J\rforged line"
    layout.flight_recorder_file(0).write_text(json.dumps(dump))
    assert main(["hang", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\\x1b]0;owned" in out


# --- injection: the checked binary is the one run; text from run files is escaped --------------------------


def test_query_runs_exactly_the_checked_relative_trace_processor(tmp_path, monkeypatch, capsys):
    import os

    here, decoy = tmp_path / "here", tmp_path / "bin"
    here.mkdir(), decoy.mkdir()
    (here / "tp").write_text("#!/bin/sh\necho 'name'\necho checked\n")
    (decoy / "tp").write_text("#!/bin/sh\necho 'name'\necho decoy\n")
    for script in (here / "tp", decoy / "tp"):
        script.chmod(0o755)
    (here / "t.perfetto-trace").write_bytes(b"\x0a\x00")
    monkeypatch.chdir(here)
    monkeypatch.setenv("PATH", f"{decoy}{os.pathsep}{os.environ['PATH']}")
    assert main(["query", "t.perfetto-trace", "select 1", "--trace-processor", "tp"]) == 0
    out = capsys.readouterr().out
    assert "checked" in out and "decoy" not in out


def test_query_of_a_fifo_trace_is_refused_not_waited_on(tmp_path, capsys):
    import os

    (tmp_path / "tp").write_text("#!/bin/sh\ncat \"$3\" >/dev/null\necho name\necho x\n")
    (tmp_path / "tp").chmod(0o755)
    os.mkfifo(tmp_path / "t.perfetto-trace")
    assert main(["query", str(tmp_path / "t.perfetto-trace"), "select 1", "--trace-processor",
                 str(tmp_path / "tp")]) == 1
    assert "FIFO" in capsys.readouterr().err


def test_a_query_past_the_engines_timeout_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    from fleetscope.analysis.merge.perfetto import sql

    monkeypatch.setattr(sql, "QUERY_TIMEOUT_S", 0.5)
    (tmp_path / "tp").write_text("#!/bin/sh\nsleep 30\n")
    (tmp_path / "tp").chmod(0o755)
    (tmp_path / "t.perfetto-trace").write_bytes(b"\x0a\x00")
    assert main(["query", str(tmp_path / "t.perfetto-trace"), "select 1", "--trace-processor",
                 str(tmp_path / "tp")]) == 1
    assert "did not finish" in capsys.readouterr().err


def test_parse_shard_writes_no_cache_among_the_traces(tmp_path, capsys):
    layout = make_run(tmp_path / "run")
    before = sorted(p.name for p in layout.traces_dir.rglob("*"))
    cache = layout.traces_dir / "cache"
    assert main(["parse-shard", str(layout.root), "--shard", "0", "--of", "1", "--cache-dir", str(cache)]) == 2
    assert "among" in capsys.readouterr().err
    assert sorted(p.name for p in layout.traces_dir.rglob("*")) == before


# --- first round, still failing: missing ranks as one line, no Python reprs ------------------------------


def test_gather_and_merge_say_missing_ranks_in_one_line_without_reprs(tmp_path, capsys):
    layout = make_run(tmp_path / "run", world_size=128, ranks=2)
    assert main(["gather", str(layout.root)]) == 3
    out = capsys.readouterr().out
    assert "missing in window 0: 126 of 128 ranks (2-127)" in out and "None" not in out
    assert main(["merge", str(layout.root)]) in (0, 3)
    captured = capsys.readouterr()
    assert "MergeProblem(" not in captured.out + captured.err and "window None" not in captured.out + captured.err


# --- launch: the record says how it ended, with the program's own status --------------------------------


def _launch(tmp_path: Path, *argv: str):
    import subprocess
    import sys

    program = tmp_path / "prog.py"
    program.write_text("import sys\nsys.exit(7)\n")
    return subprocess.run([sys.executable, "-m", "fleetscope.cli.main", "launch", "--run-dir", str(tmp_path / "run"), *argv,
                           "--", str(program)], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_launch_whose_interpreter_cannot_start_is_recorded_failed(tmp_path):
    done = _launch(tmp_path, "--python", str(tmp_path / "no-such-python"), "--nproc-per-node", "1")
    record = json.loads((tmp_path / "run" / "job.json").read_text())
    assert done.returncode != 0 and record["status"] == "failed"
    (failure,) = record["failures"]
    assert failure["exitcode"] == 127 and "no-such-python" in failure["message"]
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.slow
def test_a_user_programs_own_exit_status_reaches_the_failures(tmp_path):
    # sys.exit(7) writes no torchrun error file: the status comes from torchrun's failure summary
    done = _launch(tmp_path, "--nproc-per-node", "2")
    record = json.loads((tmp_path / "run" / "job.json").read_text())
    assert record["status"] == "failed"
    assert sorted((f["rank"], f["exitcode"]) for f in record["failures"]) == [(0, 7), (1, 7)]
    assert "exit code 7" in done.stderr + done.stdout


@pytest.mark.parametrize("size", ["one argument", "all together"])
def test_a_command_exec_would_refuse_is_refused_at_plan_time(tmp_path, capsys, size):
    # in process: this test's own exec could not pass the argument; a config file or a script can
    program = tmp_path / "prog.py"
    program.write_text("pass\n")
    extra = (["--", str(program), "x" * 200_000] if size == "one argument" else
             [*[f"--env=BIG{i}={'y' * 100_000}" for i in range(12)], "--", str(program)])
    assert main(["launch", "--run-dir", str(tmp_path / "run"), "--dry-run", *extra]) == 2
    err = capsys.readouterr().err
    assert ("exec refuses" if size == "one argument" else "at most 1,048,576") in err
    assert not (tmp_path / "run").exists()


# --- forged metrics lines: refused as bad lines, named, never compared ------------------------------------


@pytest.mark.parametrize("forged, why", [
    ({"tokens_per_s": -1e308}, "tokens_per_s = -1e+308 is outside [0, 1e+12]"),
    ({"data_ms": 1e308}, "data_ms = 1e+308 is outside [0, 1e+10]"),
    ({"max_memory_allocated_mb": -5.0}, "max_memory_allocated_mb = -5.0 is outside"),
    ({"step_time_ms": "fast"}, "step_time_ms 'fast' is not a number"),
    ({"rank": "one"}, "rank 'one' is not a rank"),
    ({"rank": -1}, "rank -1 is not a rank"),
    ({"rank": True}, "rank True is not a rank"),
])
def test_a_forged_metrics_line_is_a_bad_line_with_its_reason(tmp_path, forged, why):
    from fleetscope.traces.formats import metric_line, read_metric_records

    good = {"step": 1, "rank": 0, "loss": -0.5, "step_time_ms": 100.0, "data_ms": 3.0, "tokens_per_s": 200.0}
    path = tmp_path / "rank0.jsonl"
    path.write_text(metric_line(good) + json.dumps({**good, "step": 2, **forged}) + "\n")
    read = read_metric_records(path)
    assert [r.step for r in read.records] == [1] and read.bad_line_count == 1
    assert why in read.bad_lines[0][1]


def test_compare_skips_forged_metrics_lines_and_says_so(tmp_path, capsys):
    from hostile_runs import make_recorded_run

    runs = []
    for name in ("base", "new"):
        make_recorded_run(tmp_path / name)
        runs.append(make_run(tmp_path / name))
    metrics = sorted(runs[1].step_metrics_files())[0]
    line = json.loads(metrics.read_text().splitlines()[3])
    with metrics.open("a") as handle:
        for step, forged in enumerate(({"tokens_per_s": -1e308}, {"data_ms": 1e308}, {"rank": "one"}), start=100):
            handle.write(json.dumps({**line, "step": step, **forged}) + "\n")
    assert main(["compare", str(runs[0].root), str(runs[1].root)]) == 0
    out = capsys.readouterr().out
    assert "new: metrics/rank0.jsonl: 3 bad line(s) skipped" in out and "no sustained regression" in out
    assert "tokens_per_s    200.00  200.00" in out      # `compare BASE NEW` is the gate (one run a side)


def test_run_files_are_strict_json(tmp_path):
    from fleetscope.traces.formats import metric_line

    assert "NaN" not in metric_line({"step": 1, "loss": float("nan"), "data_ms": float("inf")})


# --- tune and launch: a run directory reached through a loop or a broken symlink is named, never a traceback


@pytest.mark.parametrize("where, why", [("loop", "is a symlink loop"), ("loop/inside", "is a symlink loop"),
                                        ("broken/new", "is a broken symlink"), ("file/new", "is not a directory")])
def test_a_run_directory_under_a_bad_link_is_refused_by_tune_and_launch(tmp_path, capsys, where, why):
    import os

    from hostile_runs import make_recorded_run

    layout = make_recorded_run(tmp_path / "run")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    os.symlink(tmp_path / "missing", tmp_path / "broken")
    (tmp_path / "file").write_text("")
    target = str(tmp_path / where)
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run", "--run-dir", target]) == 2
    assert why in capsys.readouterr().err
    assert main(["launch", "--run-dir", target, "--dry-run", "--device", "cpu"]) == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


def test_rank_0_writes_no_request_status_through_a_symlinked_requests_folder(tmp_path):
    from fleetscope.traces.capture import RequestError, RequestStatus, write_status

    layout = _running_job(tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    layout.requests_dir.symlink_to(outside)
    with pytest.raises(RequestError, match="symlink"):
        write_status(layout, 1, RequestStatus(state="published", at="now"))
    assert list(outside.iterdir()) == []


# --- fan-out records: counts that add up, the reduce's word, one id pattern, escaped text -----------------


def _fanout_records(tmp_path: Path):
    from fleetscope.traces.fanout import IncompleteTask, ParseCounts, ReduceRecord, TaskRecord, write_reduce_record, \
        write_task_record

    layout = make_run(tmp_path / "run", 2)
    layout.job_file.write_text(json.dumps({"scheduler": "local", "status": "succeeded"}))
    for task in (0, 1):
        write_task_record(layout, TaskRecord(array_job_id="77", task=task, tasks=2, node="n0", ranks=[task],
                                             counts=ParseCounts(traces=1, parsed=1), cache_dir="/c", seconds=1.0))
    write_reduce_record(layout, ReduceRecord(
        array_job_id="77", tasks=2, counts=ParseCounts(traces=2, hits=1, parsed=1),
        incomplete=[IncompleteTask(task=1, ranks=[1], log_path="log", reason="its traces changed")], outputs={},
        errors=["stage merge failed: \x1b[2J\x1b]0;owned\x07"], seconds={}, complete=False))
    return layout


def test_forged_fanout_counts_that_do_not_add_up_are_an_unreadable_record(tmp_path):
    from fleetscope.traces.fanout import fanout_states
    from fleetscope.traces.layout import fanout_task_record

    layout = _fanout_records(tmp_path)
    path = fanout_task_record(layout, "77", 0)
    record = json.loads(path.read_text())
    record["counts"] = {"traces": 10**6, "hits": 5, "parsed": 5, "failed": []}
    path.write_text(json.dumps(record))
    (state,) = fanout_states(layout)
    assert [r.task for r in state.finished] == []          # task 0 forged, task 1 incomplete by the reduce
    assert any("is not its 1000000 trace(s)" in why for why in state.unreadable)
    assert any("task 1: the reduce found it incomplete (its traces changed)" in why for why in state.unreadable)


def test_status_escapes_text_from_fanout_records(tmp_path, capsys):
    layout = _fanout_records(tmp_path)
    assert main(["status", str(layout.root)]) in (0, 1, 3)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out


@pytest.mark.parametrize("job_id", ["0", "007", "1" * 21, "12a"])
def test_an_array_job_id_the_reader_refuses_is_refused_by_the_writer(job_id):
    from fleetscope.launcher.fanout import _job_id

    with pytest.raises(ValueError):
        _job_id(job_id)


def test_compare_prints_no_control_sequence_from_run_files(tmp_path, capsys):
    # a run directory named with a terminal escape: compare names it escaped
    base = make_recorded_run(tmp_path / "base")
    new = make_recorded_run(tmp_path / "new").root.rename(tmp_path / "new\x1b[2J\x1b]0;owned\x07")
    main(["compare", str(base.root), str(new)])
    out = capsys.readouterr()
    assert "\x1b" not in out.out + out.err and "\x07" not in out.out + out.err
    assert "\\x1b[2J" in out.out + out.err


def test_advise_of_traces_it_cannot_read_says_so_and_exits_3(tmp_path, capsys):
    (tmp_path / "rank0.pt.trace.json").write_text("garbage")
    assert main(["advise", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "1 trace(s) could not be used" in out and "nothing to advise from the traces" in out


def test_a_merge_selection_that_keeps_nothing_writes_nothing(tmp_path, capsys):
    traces = REPO / "tests" / "fixtures" / "gpu" / "planted_pairs" / "slow_device" / "traces"
    assert main(["merge", str(traces), "-o", str(tmp_path / "merged.pftrace"), "--steps", "999"]) == 1
    assert "keeps no event of any rank: nothing written" in capsys.readouterr().err
    assert not (tmp_path / "merged.pftrace").exists() and list(tmp_path.iterdir()) == []


def test_profile_of_a_user_programs_run_is_refused_with_what_to_do(tmp_path, capsys):
    """A user's program reads no on-demand request (its windows follow the launch's schedule): a request would
    never be served, so none is written and the relaunch with --profile is named (exit 2)."""
    layout = _running_job(tmp_path / "run")
    layout.job_file.write_text(json.dumps({"status": "running", "world_size": 2,
                                           "program": {"argv": ["python", "train.py", "--lr", "\x1b[31m1e-3"]}}))
    assert main(["profile", str(layout.root)]) == 2
    err = capsys.readouterr().err
    assert "python train.py" in err and "--profile" in err and "\x1b" not in err
    assert not layout.requests_dir.exists() or not any(layout.requests_dir.iterdir())
