"""The job's outcome leads its report: a failed, hung or cancelled job is not "complete", its verdict says how it
ended first (who failed, the exit status's meaning, the hang's collective), and the rest is said to be of the
steps before it."""

from __future__ import annotations

import json

import pytest

from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.cross_rank.outcome import (STATE_CANCELLED, STATE_COMPLETED, STATE_FAILED, STATE_HUNG,
                                                    exit_meaning)
from fleetscope.analysis.cross_rank.outcome import job_outcome as _outcome_of_records
from fleetscope.analysis.inputs.records import read_run_records
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal
from fleetscope.cli.render import failure_text
from fleetscope.launcher.failures import RankFailure
from fleetscope.traces.jobfile import write_job_record
from fleetscope.traces.layout import RunLayout

from helpers.kineto import KinetoBuilder

CRASH = {"rank": 1, "exitcode": None, "message": "InjectedFault: injected crash on rank 1 at step 5\nmore"}
PEER = {"rank": 0, "exitcode": None, "message": "RuntimeError: Connection closed by peer"}



def job_outcome(layout, hang):
    """The outcome of the run in `layout`, its records read first."""
    return _outcome_of_records(read_run_records(layout) if layout is not None else None, hang)


def _run(tmp_path, **record) -> RunLayout:
    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    write_job_record(layout, **record)
    return layout


def _write_trace(builder: KinetoBuilder, layout: RunLayout) -> None:
    """The trace where a run keeps it, gathered into the manifest as after a launch."""
    from fleetscope.traces.gather import gather

    window = layout.traces_dir / "window000"
    window.mkdir(parents=True)
    builder.write(window / "rank0.vm.pt.trace.json.gz")
    gather(layout.root)


def test_a_failed_job_names_the_rank_that_failed_first_and_its_error(tmp_path):
    outcome = job_outcome(_run(tmp_path, status="failed", returncode=1, failures=[CRASH, PEER]), None)
    assert (outcome.state, outcome.failed_first, outcome.then_failed) == (STATE_FAILED, 1, [0])
    assert outcome.sentence == ("The job FAILED: rank 1 failed first: InjectedFault: injected crash on rank 1 at "
                                "step 5; then rank(s) 0 (their peer was gone).")
    assert not outcome.completed


@pytest.mark.parametrize("record, state", [
    ({"status": "failed", "returncode": 1, "failures": [{"rank": 0, "exitcode": 86, "message": "exit code 86"}]},
     STATE_HUNG),
    ({"status": "cancelled"}, STATE_CANCELLED),
    ({"status": "succeeded", "returncode": 0}, STATE_COMPLETED),
])
def test_the_state_comes_from_the_record_and_the_hang_watchdogs_exit_status(tmp_path, record, state):
    assert job_outcome(_run(tmp_path, **record), None).state == state


def test_a_hang_names_the_ranks_the_watchdog_stopped_never_one_as_first(tmp_path):
    """The hang watchdog stops the rank that hung and the ranks waiting for it alike; the exit order named the
    waiting rank 0 "stopped first" while the Flight Recorder said rank 1 never entered the collective."""
    failures = [{"rank": 0, "exitcode": 86, "message": "exit code 86"}, {"rank": 1, "exitcode": 86, "message": "x"}]
    outcome = job_outcome(_run(tmp_path, status="failed", returncode=1, failures=failures), None)
    assert outcome.state == STATE_HUNG
    assert "stopped first" not in outcome.sentence and "rank(s) 0, 1 stopped (exit code 86" in outcome.sentence


def test_no_record_or_a_hostile_one_has_no_outcome(tmp_path):
    assert job_outcome(None, None) is None
    assert job_outcome(_run(tmp_path, status=["failed"], failures="x"), None) is None
    odd = job_outcome(RunLayout.at(tmp_path / "odd"), None) if (tmp_path / "odd").mkdir() is None else None
    assert odd is None
    weird = _run(tmp_path / "w" if (tmp_path / "w").mkdir() is None else tmp_path, status="failed",
                 failures=[{"rank": True, "exitcode": "86", "message": 7}, 3])
    outcome = job_outcome(weird, None)
    assert outcome.state == STATE_FAILED and outcome.failed_first is None and outcome.exit_code is None
    assert outcome.sentence == "The job FAILED: a rank failed first."


def test_exit_statuses_say_what_they_mean():
    assert "hang watchdog" in exit_meaning(86)
    assert "SIGKILL" in exit_meaning(137) and exit_meaning(-15) == "killed by signal 15 (SIGTERM)"
    assert exit_meaning(None) == "" and exit_meaning(3) == ""
    assert failure_text(RankFailure(rank=1, exitcode=86, message="exit code 86")) == \
        "exit code 86: the hang watchdog stopped it: no step finished for observability.hang_timeout_s"
    assert failure_text(RankFailure(rank=0, exitcode=None, message="RuntimeError: boom\nAt:\n  x")) == \
        "RuntimeError: boom (more in its log)"


def test_the_report_of_a_failed_job_leads_with_its_failure(tmp_path):
    layout = _run(tmp_path, status="failed", returncode=1, failures=[CRASH, PEER])
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(2, 0, 1000.0).step(3, 1000.0, 1000.0)
    builder.complete("aten::mm", "cpu_op", 10, 900.0).complete("aten::mm", "cpu_op", 1010, 900.0)
    _write_trace(builder, layout)
    report = analyze(layout.root, use_hta=False, use_cache=False, write_default_outputs=False)
    assert not report.complete and report.state == "FAILED"
    assert report.verdict.startswith("The job FAILED: rank 1 failed first: InjectedFault")
    assert "What follows is of the profiled steps before it: " in report.verdict
    assert report.problems[0].label == "job" and report.problems[0].reason == report.outcome.sentence
    assert render_terminal(report).splitlines()[0].endswith(": FAILED")
    assert '<span class="bad">failed</span>' in render_html(report)
    back = json.loads(json.dumps(report.to_json()))
    assert back["outcome"]["state"] == "failed" and back["complete"] is False
    # advise says the job failed, and never counts the job's outcome as a trace that could not be used
    from fleetscope.analysis.advise.engine import advise
    notes = " ".join(advise(layout.root).notes)
    assert "The job FAILED" in notes and "The advice rests on the profiled steps before it." in notes
    assert "could not be used" not in notes
    # advice shown next to the verdict of a job that did not complete says what it rests on
    from dataclasses import replace

    from fleetscope.analysis.report.model import TopFinding
    advised = replace(report, advice=[TopFinding(rule="gradient_buckets", title="t", gain="g", change="c",
                                                 confidence="low")])
    cut = "this advice rests on the profiled steps before the job FAILED"
    assert f"({cut}: its gains are theirs)" in render_terminal(advised)
    assert cut[1:] in render_html(advised)


def test_a_completed_job_reads_as_before(tmp_path):
    layout = _run(tmp_path, status="succeeded", returncode=0)
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(2, 0, 1000.0).complete("aten::mm", "cpu_op", 10, 900.0)
    _write_trace(builder, layout)
    report = analyze(layout.root, use_hta=False, use_cache=False, write_default_outputs=False)
    assert report.complete and report.state == "complete" and report.outcome.state == STATE_COMPLETED
    assert not report.verdict.startswith("The job")


def test_the_checker_holds_the_outcome_first(tmp_path):
    import dataclasses

    from fleetscope.analysis.invariants import check_report
    layout = _run(tmp_path, status="failed", returncode=1, failures=[CRASH])
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(2, 0, 1000.0).complete("aten::mm", "cpu_op", 10, 900.0)
    _write_trace(builder, layout)
    report = analyze(layout.root, use_hta=False, use_cache=False, write_default_outputs=False)
    assert not [p for p in check_report(report) if p.startswith("outcome")]
    broken = dataclasses.replace(report, complete=True, verdict="rank 1 is the straggler", problems=[])
    assert len([p for p in check_report(broken) if p.startswith("outcome")]) == 3


def test_a_one_rank_job_gets_a_one_rank_verdict(tmp_path):
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0).kernel("gemm", 0, 600.0, launch_ts=0).kernel("gemm", 800, 200.0, launch_ts=700)
    builder.write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False, write_default_outputs=False)
    assert "no collectives matched" not in report.verdict
    assert "one rank (rank 0), so nobody waits for anyone: its GPU is busy 80% and idle 20%" in report.verdict
    assert "most of the idle host busy elsewhere (0.20 ms per profiled step)" in report.verdict


def test_missing_ranks_of_a_merge_read_as_one_line_of_ranges(tmp_path):
    from fleetscope.analysis.merge.sources import find_merge_inputs
    from fleetscope.cli.merge_messages import describe_problems
    for rank in (0, 1):           # two traces of a job that declares 128 ranks
        builder = KinetoBuilder(rank=rank, world_size=128)
        builder.step(1, 0, 1000.0).complete("aten::mm", "cpu_op", 10, 900.0)
        builder.write(tmp_path / f"rank{rank}.json.gz")
    lines = describe_problems(find_merge_inputs(tmp_path).problems)
    assert lines == ["problem: no trace: 126 rank(s) (2-127)"]


def test_a_reader_that_leaves_is_no_error_and_a_misspelled_section_gets_a_suggestion(tmp_path, capsys):
    import subprocess
    import sys
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0).complete("aten::mm", "cpu_op", 10, 900.0)
    builder.write(tmp_path / "rank0.json.gz")
    piped = subprocess.run(f"{sys.executable} -m fleetscope.cli.main analyze {tmp_path} --no-hta --no-cache | head -1",
                           shell=True, capture_output=True, text=True, timeout=300)
    assert "Broken pipe" not in piped.stderr and "Traceback" not in piped.stderr
    from fleetscope.cli.main import main
    assert main(["config", "paralel"]) == 2
    assert "did you mean parallel?" in capsys.readouterr().err


def test_a_first_report_says_nothing_of_the_cache_its_own_gather_filled(tmp_path):
    from fleetscope.cli.pipeline import postprocess
    layout = RunLayout.at(tmp_path / "run")
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=2)
        builder.step(1, 0, 1000.0).complete("aten::mm", "cpu_op", 10, 900.0)
        window = layout.traces_dir / "window000"
        window.mkdir(parents=True, exist_ok=True)
        builder.write(window / f"rank{rank}.vm.pt.trace.json.gz")
    postprocess(layout.root, echo=False, cache_dir=tmp_path / "cache", use_hta=False)
    notes = json.loads(layout.report_json.read_text())["notes"]
    assert not [n for n in notes if "parsed-trace cache" in n], notes
    again = analyze(layout.root, use_hta=False, cache_dir=tmp_path / "cache", write_default_outputs=False)
    assert again.complete


def test_a_merge_of_no_readable_trace_writes_no_file(tmp_path, capsys):
    from fleetscope.cli.main import main
    (tmp_path / "traces").mkdir()
    (tmp_path / "junk.json").write_text("{}")
    out = tmp_path / "merged.perfetto-trace"
    assert main(["merge", str(tmp_path), "-o", str(out), "--verify"]) == 1
    captured = capsys.readouterr()
    assert not out.exists() and "nothing merged" in captured.out and "open it at" not in captured.out


def test_launches_without_recorded_kernels_are_said_to_be_lost_not_a_cpu_job(tmp_path):
    from fleetscope.analysis.inputs.sources import TraceSource
    from fleetscope.analysis.per_rank.parse import analyze_trace
    unrecorded = KinetoBuilder(rank=0, world_size=1)
    unrecorded.step(1, 0, 1000.0)
    for index in range(20):
        unrecorded.complete("cudaLaunchKernel", "cuda_runtime", 10 + 40 * index, 4.0,
                            args={"correlation": 100 + index, "External id": 100 + index})
    unrecorded.write(tmp_path / "a" / "rank0.json.gz")
    (remark,) = analyze_trace(TraceSource(path=tmp_path / "a" / "rank0.json.gz", label="a", window=None)).remarks
    assert remark.startswith("20 CUDA launch calls but no GPU activity recorded") and "not a CPU job" in remark
    partly = KinetoBuilder(rank=0, world_size=1)
    partly.step(1, 0, 5000.0)
    for index in range(40):
        partly.kernel("gemm", 20 + 100 * index, 50.0, launch_ts=10 + 100 * index)   # 40 launched and recorded
    for index in range(12):
        partly.complete("cudaLaunchKernel", "cuda_runtime", 4100 + 10 * index, 4.0, args={"correlation": 9000 + index})
    partly.write(tmp_path / "b" / "rank0.json.gz")
    (remark,) = analyze_trace(TraceSource(path=tmp_path / "b" / "rank0.json.gz", label="b", window=None)).remarks
    assert remark.startswith("12 of 52 launch calls have no GPU activity recorded")
    whole = KinetoBuilder(rank=0, world_size=1)
    whole.step(1, 0, 1000.0).kernel("gemm", 20, 50.0, launch_ts=10)
    whole.write(tmp_path / "c" / "rank0.json.gz")
    assert analyze_trace(TraceSource(path=tmp_path / "c" / "rank0.json.gz", label="c", window=None)).remarks == []


@pytest.mark.parametrize("recorded, codes, words", [
    ("failed", [1, 1], "the job FAILED"),
    ("cancelled", [75, 75], "the job was CANCELLED"),
    ("failed", [86, 86], "the job HUNG (the hang watchdog stopped it)"),
    ("failed", [75, 75], "the job STOPPED on request"),
])
def test_the_launch_names_how_the_job_ended_as_its_report_does(tmp_path, capsys, recorded, codes, words):
    """A cancelled or hung job's launch summary said "the job FAILED" under a report that said CANCELLED / HUNG."""
    from fleetscope.cli.render import print_failed_job
    from fleetscope.launcher.failures import RankFailure
    from fleetscope.launcher.scheduler import Submission
    from fleetscope.traces.layout import RunLayout

    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    layout.job_file.write_text(json.dumps({"status": recorded, "world_size": 2}))
    failures = [RankFailure(rank=rank, exitcode=code, message="") for rank, code in enumerate(codes)]
    submission = Submission(scheduler="local", finished=True, detail="torchrun exit code 1", failures=failures)
    print_failed_job(layout, submission, post_ran=True)
    assert f"fleetscope: {words}" in capsys.readouterr().err
