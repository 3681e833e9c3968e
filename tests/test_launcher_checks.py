"""What `launch` and its neighbours check before anything starts, and the spellings they accept (torchrun's,
sbatch's, the older ones)."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from fleetscope.cli.launch_commands import build_launch_parser
from fleetscope.cli.jobargs import job_spec_from_args, slurm_minutes
from fleetscope.cli.main import build_parser, main


def spec_of(*argv: str):
    return job_spec_from_args(build_launch_parser().parse_args(list(argv)))


@pytest.mark.parametrize("text, minutes", [
    ("90", 90), ("5:30", 6), ("01:30:00", 90), ("2-0", 2880), ("1-02:30", 1590), ("1-00:00:01", 1441), ("0:0:59", 1),
])
def test_time_takes_sbatch_formats(text, minutes):
    assert slurm_minutes(text) == minutes


@pytest.mark.parametrize("text", ["1h", "1:2:3:4", "-5", "1-", ""])
def test_time_refuses_what_sbatch_would(text):
    with pytest.raises(argparse.ArgumentTypeError):
        slurm_minutes(text)


def test_torchrun_spellings_and_one_process_per_node_by_default(tmp_path):
    assert spec_of("--run-dir", str(tmp_path / "r")).nproc_per_node == 1
    spec = spec_of("--scheduler", "submitit", "--nnodes", "2", "--nproc_per_node", "4", "--time", "1-00:00",
                   "--run-dir", str(tmp_path / "r"))
    assert (spec.nodes, spec.nproc_per_node, spec.slurm.time_minutes) == (2, 4, 1440)


@pytest.mark.parametrize("scheduler", ["submitit", "torchx"])
def test_slurm_refuses_to_guess_the_processes_per_node(scheduler, tmp_path, capsys):
    assert main(["launch", "--scheduler", scheduler, "--run-dir", str(tmp_path / "r"), "--dry-run"]) == 2
    assert "nproc_per_node" in capsys.readouterr().err


@pytest.mark.parametrize("argv, field", [
    (["--set", "faults.crash_rank=1"], "faults.crash_rank"),
    (["--nproc-per-node", "2", "--set", "faults.straggle_rank=2"], "faults.straggle_rank"),
    (["--set", "faults.hang_rank=3"], "faults.hang_rank"),
    (["--set", "data.source=text", "--set", "data.path=absent.txt"], "data.path"),
    (["--set", "model.path=absent-model"], "model.path"),
    (["--set", "parallel.bucket_cap=5"], "did you mean parallel.bucket_cap_mb?"),
])
def test_what_cannot_work_exits_2_naming_the_field_and_starts_nothing(argv, field, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--run-dir", str(tmp_path / "run"), "--device", "cpu", *argv]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_both_spellings_of_no_postprocess_and_of_ranks():
    parser = build_parser()
    for flag in ("--no-post", "--no-postprocess"):
        assert parser.parse_args(["launch", flag]).no_post is True
    for argv in (["--rank", "3", "--rank", "1"], ["--ranks", "1,3"]):
        assert sorted(parser.parse_args(["collect-traces", "RUN", "GLOB", *argv]).ranks) == [1, 3]


def test_postprocess_takes_its_stages_options_and_refuses_them_with_slurm(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["postprocess", "RUN", "--no-cache", "--no-hta", "--link-peak", "400", "--ranks", "0,1",
                              "--budget-mb", "50"])
    assert (args.no_cache, args.no_hta, args.link_peak, args.ranks, args.budget_mb) == (
        True, True, 400.0, frozenset({0, 1}), 50.0)
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    (run / "traces" / "rank0.json").write_text("{}")
    assert main(["postprocess", str(run), "--slurm", "--no-hta", "--dry-run"]) == 2
    assert "--no-hta: not with --slurm" in capsys.readouterr().err


def test_torchx_local_dry_run_prints_paste_able_commands_named_after_the_run(tmp_path, capsys):
    pytest.importorskip("torchx")
    run = tmp_path / "my-run"
    assert main(["launch", "--scheduler", "torchx_local", "--run-dir", str(run), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    header, *commands = out.strip().split("\ncd -- ")
    app_id = header.split("app ", 1)[1].split(",")[0]
    assert app_id.startswith("my-run-")
    [command] = commands
    words = shlex.split("cd -- " + command)
    assert words[-3:-1] == ["bash", "-c"]
    torchrun = shlex.split(words[-1].splitlines()[-1])  # the node script's last line: exec torchrun ...
    assert torchrun[torchrun.index("--rdzv-id") + 1] == app_id
    assert f"TORCHX_JOB_ID=local_cwd://torchx/{app_id}" in words
    assert "CUDA_VISIBLE_DEVICES" not in err and "{" not in header  # no TorchX GPU banner, no pprint'd dict
    assert not run.exists()


TORCHRUN_FAILURE = """[default0]:fleetscope trainer: bad configuration: faults.hot_expert: 99 is not an expert
E1202 failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fleetscope.trainer FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
============================================================
after
"""


def test_torchruns_own_traceback_goes_to_a_log_and_the_ranks_lines_pass(tmp_path):
    import io

    from fleetscope.launcher.schedulers.local import pass_stderr

    out, summary = io.StringIO(), tmp_path / "logs" / "torchrun.stderr.log"
    pass_stderr(io.StringIO(TORCHRUN_FAILURE), out, summary)
    shown = out.getvalue().splitlines()
    assert shown[:2] == TORCHRUN_FAILURE.splitlines()[:2]
    assert shown[2] == f"fleetscope: torchrun's traceback and failure summary: {summary}" and shown[3:] == ["after"]
    assert summary.read_text().startswith("Traceback") and "Root Cause" in summary.read_text()
    unfinished = "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n"
    out = io.StringIO()
    pass_stderr(io.StringIO(unfinished), out, tmp_path / "other.log")
    assert out.getvalue() == unfinished and not (tmp_path / "other.log").exists()


def test_a_failed_run_that_recorded_nothing_is_not_post_processed(tmp_path):
    from fleetscope.launcher.runs import recorded_anything
    from fleetscope.traces.layout import RunLayout

    layout = RunLayout.at(tmp_path)
    assert not recorded_anything(layout)
    layout.metrics_dir.mkdir()
    layout.metrics_file(0).write_text("")
    assert not recorded_anything(layout)
    layout.metrics_file(0).write_text('{"step": 0}\n')
    assert recorded_anything(layout)


@pytest.mark.slow
def test_a_rank_refusing_its_configuration_is_named_in_one_line_without_torchruns_traceback(tmp_path):
    from helpers import fleetscope

    run = tmp_path / "run"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run), "--device", "cpu", "--steps", "2",
                           "--set", "faults.hot_expert=99", cwd=tmp_path)   # checked where the model is built
    assert completed.returncode == 1
    assert re.search(r"rank [01]( \[failed first\])?: ConfigError: faults.hot_expert: 99 is not an expert of "
                     r"qwen3_moe", completed.stderr), completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr and "ChildFailedError" not in completed.stderr
    assert "nothing to gather, analyze or merge" in completed.stderr
    assert not (run / "manifest.json").exists() and not (run / "report").exists()


def test_a_torchx_local_dry_run_leaves_the_callers_signal_handlers_as_they_were(tmp_path, capsys):
    # TorchX's local scheduler installs SIGTERM/SIGINT handlers where it is created; fleetscope's own process
    # keeps its own (a stray one outlived HTA's Pool.terminate and hung an analysis)
    import signal
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert main(["launch", "--scheduler", "torchx_local", "--run-dir", str(tmp_path / "run"), "--dry-run"]) == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before
