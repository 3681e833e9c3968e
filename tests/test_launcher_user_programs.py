"""A user's own training program under `fleetscope launch -- ...`: the exact commands of every scheduler
(golden files), argument pass-through and refusal, the environment contract, the windows API and the
trace handler on a real torch.profiler, and collecting traces a program wrote itself. No torchrun: seconds.

Regenerate the golden files after an intended change with FLEETSCOPE_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import fleetscope

from fleetscope.cli.launch_commands import build_launch_parser
from fleetscope.cli.jobargs import job_spec_from_args
from fleetscope.launcher.schedulers import scheduler_for
from fleetscope.launcher.spec import JobSpec, SlurmOptions, UserEntry
from fleetscope.trainer import user_profiling as fs
from fleetscope.trainer.config import ConfigError, TrainConfig, apply_overrides
from fleetscope.traces import launch_env
from fleetscope.traces.collect import collect_traces
from fleetscope.traces.gather import gather
from fleetscope.traces.kineto import profiler_steps, read_trace
from fleetscope.traces.layout import RunLayout

GOLDEN_DIR = Path(__file__).parent / "golden" / "user"
HOSTILE_ARGS = ("--lr", "1e-3", "--name", "it's $(touch PWNED) `id` ; x", "--empty", "", "-m", "--", "ü ☃")
WORKDIR = "/home/u/my project"


def user_spec(scheduler: str, *, module: bool = False, nodes: int = 2) -> JobSpec:
    train = apply_overrides(TrainConfig(run_dir="/shared/runs/own 1"),
                            ["profiler.wait=2", "profiler.active=3", "profiler.repeat=2"])
    entry = UserEntry(program="my_pkg.train" if module else "/home/u/my project/train.py", module=module,
                      args=HOSTILE_ARGS, workdir=WORKDIR,
                      collect_traces="outputs/profiling/traces/iteration_*/rank*_trace.json.gz")
    return JobSpec(train=train, scheduler=scheduler, nodes=nodes, nproc_per_node=4, python="/opt/venv/bin/python",
                   env={"NCCL_DEBUG": "WARN"}, entry=entry,
                   slurm=SlurmOptions(job_name="own", partition="gpu", time_minutes=30, gpus_per_node=4))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("FLEETSCOPE_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with FLEETSCOPE_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(), f"{name} differs from the golden file (FLEETSCOPE_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("scheduler, module", [("local", False), ("local", True), ("submitit", False),
                                               ("torchx", False), ("torchx", True)])
def test_dry_run_of_a_user_program_matches_golden_file(scheduler, module):
    spec = user_spec(scheduler, module=module, nodes=1 if scheduler == "local" else 2)
    text = scheduler_for(scheduler).plan(spec).render() + "\n"
    check_golden(f"{scheduler}{'_module' if module else ''}.txt", text)


def test_local_command_runs_the_program_with_its_arguments_untouched():
    plan = scheduler_for("local").plan(user_spec("local", nodes=1))
    first_line = plan.render().splitlines()[0]
    words = shlex.split(first_line)
    assert words[:4] == ["cd", "--", WORKDIR, "&&"]
    assert words[-len(HOSTILE_ARGS) - 1:] == ["/home/u/my project/train.py", *HOSTILE_ARGS]
    assert plan.argv[-len(HOSTILE_ARGS) - 1:] == ["/home/u/my project/train.py", *HOSTILE_ARGS]
    assert "fleetscope.trainer" not in plan.argv


def test_the_environment_of_a_user_program_is_the_contract_user_profiling_reads():
    spec = user_spec("local", nodes=1)
    env = spec.rank_environment()
    launched = launch_env.read_launch_environment(env)
    assert launched.run_dir == "/shared/runs/own 1" and launched.scheduler == "local"
    schedule = fs.schedule_of(launched)
    assert (schedule.wait, schedule.active, schedule.repeat) == (2, 3, 2)
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_NVLS_ENABLE"] == "0"
    # fleetscope's own trainer gets none of it (its command lines are unchanged)
    assert not set(launch_env.VARIABLES) & set(JobSpec(train=spec.train).rank_environment())


def test_torchx_node_script_collects_after_torchrun_and_keeps_its_status():
    plan = scheduler_for("torchx").plan(user_spec("torchx"))
    script = plan.app.roles[0].args[1]
    lines = script.splitlines()
    assert lines[-4].split()[-len(HOSTILE_ARGS):] != list(HOSTILE_ARGS)  # quoted, so not split naively
    assert shlex.split(lines[-4])[-len(HOSTILE_ARGS):] == list(HOSTILE_ARGS)
    assert lines[-3:] == ["status=$?", lines[-2], 'exit "$status"']
    assert "collect-traces" in lines[-2] and lines[-2].endswith("|| true")


def test_submitit_task_carries_the_program_pickled_not_through_a_shell():
    plan = scheduler_for("submitit").plan(user_spec("submitit"))
    assert plan.rank_task.argv == ["/home/u/my project/train.py", *HOSTILE_ARGS]
    assert plan.rank_task.workdir == WORKDIR
    assert HOSTILE_ARGS[3] not in plan.sbatch_script


def spec_from_cli(*words: str, cwd: Path) -> JobSpec:
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        return job_spec_from_args(build_launch_parser().parse_args(list(words)))
    finally:
        os.chdir(previous)


@pytest.mark.parametrize("program, expected", [
    (["--", "python", "train.py", "--x", "1"], ["{cwd}/train.py", "--x", "1"]),
    (["--", "python3", "train.py"], ["{cwd}/train.py"]),
    (["--", "train.py", "--", "-m"], ["{cwd}/train.py", "--", "-m"]),
    (["--", "-m", "pkg.train", "--steps", "3"], ["-m", "pkg.train", "--steps", "3"]),
    (["--", "python", "-m", "pkg.train"], ["-m", "pkg.train"]),
])
def test_cli_maps_the_program_after_the_double_dash(tmp_path, program, expected):
    spec = spec_from_cli("--run-dir", str(tmp_path / "run"), *program, cwd=tmp_path)
    assert spec.entry.argv() == [word.format(cwd=tmp_path) for word in expected]
    assert spec.entry.workdir == str(tmp_path)


def test_an_interpreter_path_becomes_the_nodes_python(tmp_path):
    spec = spec_from_cli("--run-dir", str(tmp_path / "r"), "--", "/opt/env/bin/python3.11", "t.py", cwd=tmp_path)
    assert spec.python == "/opt/env/bin/python3.11"
    with pytest.raises(ConfigError, match="differ"):
        spec_from_cli("--python", "/usr/bin/python3", "--", "/opt/env/bin/python", "t.py", cwd=tmp_path)


@pytest.mark.parametrize("words, message", [
    (["--", "python", "t.py", "a\nb"], "entry.args: must not contain control characters"),
    (["--", "python", "t.py", "a\u2028b"], "entry.args: must not contain control characters"),
    (["--", "python"], "nothing to run after `--`"),
    (["--", "-m"], "-m needs a module name"),
    (["--", "-c", "print(1)"], "is an option, not a script or module"),
    (["--collect-traces", "x/*.json"], "--collect-traces needs your program after --"),
    (["--", "python", "missing.py"], "missing.py: no such file (nothing was started)"),
    (["--model", "mixtral", "--", "python", "t.py"], "entry: model.family=mixtral configure fleetscope's own trainer"),
])
def test_bad_programs_exit_2_naming_the_field_and_start_nothing(tmp_path, words, message):
    completed = fleetscope("launch", "--run-dir", str(tmp_path / "run"), *words, cwd=tmp_path)
    assert completed.returncode == 2, completed.stderr
    assert message in completed.stderr
    assert not (tmp_path / "run").exists()


def test_dry_run_of_a_user_program_runs_nothing(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('ran')\n")  # dry-run checks it exists, as launch does
    completed = fleetscope("launch", "--dry-run", "--run-dir", str(tmp_path / "run"), "--", "python", "train.py",
                           "$(touch PWNED)", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert shlex.split(completed.stdout.splitlines()[0])[-2:] == [str(tmp_path / "train.py"), "$(touch PWNED)"]
    assert [path.name for path in tmp_path.iterdir()] == ["train.py"]


# --- the windows API and the trace handler, on a real torch.profiler in this process ------------------------


def launched_here(monkeypatch, run_dir: Path, **schedule) -> None:
    for name, value in launch_env.user_environment(run_dir=str(run_dir), schedule=schedule,
                                                   scheduler="local").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "3")


def work() -> None:
    torch.mm(torch.randn(32, 32), torch.randn(32, 32))


def test_windows_profile_only_the_planned_steps_and_publish_each_window(monkeypatch, tmp_path):
    launched_here(monkeypatch, tmp_path, skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    windows = fs.windows()
    for step in range(12):
        with windows.step(step):
            with windows.phase("forward"):
                work()
    assert windows.published == [RunLayout.at(tmp_path).trace_file(w, 3, socket.gethostname()) for w in (0, 1)]
    steps = [profiler_steps(read_trace(path)["traceEvents"]) for path in windows.published]
    assert steps == [[3, 4], [7, 8]]  # cycle of 4 after 1 skipped: warmup 2 / 6, active 3-4 / 7-8
    names = {event.get("name") for event in read_trace(windows.published[0])["traceEvents"]}
    assert "forward" in names
    manifest = gather(tmp_path)
    assert [(t.rank, t.window, t.steps) for t in manifest.traces] == [(3, 0, [3, 4]), (3, 1, [7, 8])]


def test_step_done_and_open_ended_schedules_plan_window_after_window(monkeypatch, tmp_path):
    launched_here(monkeypatch, tmp_path, wait=0, warmup=1, active=1, repeat=0)
    windows = fs.windows()
    for step in range(140):  # past the first planning horizon (64 cycles of 2 steps)
        work()
        windows.step_done(step)
    windows.close()
    windows_dirs = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert len(windows_dirs) == 70 and windows_dirs[-1] == "window069"
    last = read_trace(next((tmp_path / "traces" / "window069").iterdir()))
    assert profiler_steps(last["traceEvents"]) == [139]


def test_step_done_with_epochs_numbered_from_zero_again_goes_on_profiling(monkeypatch, tmp_path):
    launched_here(monkeypatch, tmp_path, wait=1, warmup=1, active=1, repeat=2)
    windows = fs.windows(start_step=0)
    for step in (0, 1, 2, 0, 1, 2, 0, 1):  # three epochs of a loop counting its steps from 0 each time
        work()
        windows.step_done(step)
    windows.close()
    assert [profiler_steps(read_trace(t)["traceEvents"]) for t in windows.published] == [[2], [5]]


def test_step_done_from_start_step_records_the_first_step(monkeypatch, tmp_path):
    launched_here(monkeypatch, tmp_path, skip_first=5, wait=0, warmup=0, active=2, repeat=1)
    windows = fs.windows(start_step=5)
    for step in range(5, 9):
        work()
        windows.step_done(step)
    [trace] = windows.published
    assert profiler_steps(read_trace(trace)["traceEvents"]) == [5, 6]


def test_not_launched_by_fleetscope_is_a_noop_with_one_notice(monkeypatch, tmp_path, capsys):
    for name in launch_env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    windows = fs.windows()
    for step in windows.steps(range(4)):
        work()
    assert not windows.enabled and windows.published == []
    assert capsys.readouterr().err == fs.NOT_LAUNCHED_NOTICE + "\n"
    assert list(tmp_path.iterdir()) == []


def test_trace_handler_files_each_profiler_cycle_as_the_next_window(monkeypatch, tmp_path):
    launched_here(monkeypatch, tmp_path)
    handler = fs.trace_handler()
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=handler) as prof:
        for _ in range(6):
            work()
            prof.step()
    manifest = gather(tmp_path)
    assert [(t.rank, t.window, t.steps) for t in manifest.traces] == [(3, 0, [2]), (3, 1, [5])]


def test_the_api_module_imports_neither_transformers_nor_scheduler_packages():
    probe = ("import sys; from fleetscope.trainer import user_profiling; "
             "print(' '.join(sorted(m for m in sys.modules if '.' not in m)))")
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    top_level = set(completed.stdout.split())
    assert not top_level & {"transformers", "submitit", "torchx", "hta", "pandas", "perfetto", "msgspec", "orjson"}
    probe = ("import sys; from fleetscope.trainer import user_profiling; "
             "print(' '.join(sorted(m for m in sys.modules if m.startswith('fleetscope.'))))")
    fleetscope_modules = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                        check=True).stdout.split()
    others = [m for m in fleetscope_modules if not m.startswith("fleetscope.traces")]
    assert others == ["fleetscope.trainer", "fleetscope.trainer.config", "fleetscope.trainer.families",
                      "fleetscope.trainer.profiling", "fleetscope.trainer.triggers", "fleetscope.trainer.user_profiling"]


# --- collecting traces a program wrote itself ------------------------------------------------------------------


def write_trace(path: Path, *, step: int, rank: int | None = None) -> None:
    """A real torch.profiler trace of one step, saved at `path` (gzipped for .gz), `distributedInfo` optional."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(f"ProfilerStep#{step}"):
            work()
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_name("plain.json")
    prof.export_chrome_trace(str(plain))
    document = json.loads(plain.read_text())
    plain.unlink()
    if rank is not None:
        document["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": 2}
    data = json.dumps(document).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


def test_collect_infers_rank_and_window_and_publishes_each_file_once(tmp_path):
    dump = tmp_path / "outputs" / "profiling" / "traces"
    for iteration in (10, 20):
        for rank in (0, 1):
            write_trace(dump / f"iteration_{iteration}" / f"rank{rank}_trace.json.gz", step=iteration - 1,
                        rank=rank if rank else None)
    write_trace(dump / "iteration_20" / "rank1_copy_rank0_trace.json", step=19, rank=1)  # name says 0: refused
    (dump / "iteration_20" / "notes.json").write_text("{not json")
    layout = RunLayout.at(tmp_path / "run")
    pattern = str(dump / "iteration_*" / "*.json*")
    first = collect_traces(pattern, layout, host="node7")
    assert sorted((t.rank, t.window, t.iteration) for t in first.collected) == [
        (0, 0, 10), (0, 1, 20), (1, 0, 10), (1, 1, 20)]
    reasons = dict(first.skipped)
    assert "distributedInfo says rank 1" in reasons[str(dump / "iteration_20" / "rank1_copy_rank0_trace.json")]
    assert str(dump / "iteration_20" / "notes.json") in reasons  # unreadable: skipped with its reason
    again = collect_traces(pattern, layout, host="node8")
    assert [t.published for t in again.collected] == [None] * 4
    assert sorted(p.name for p in layout.traces_dir.rglob("*.gz")) == ["rank0.node7.pt.trace.json.gz"] * 2 + [
        "rank1.node7.pt.trace.json.gz"] * 2
    manifest = gather(layout.root)
    assert [(t.rank, t.window, t.steps) for t in manifest.traces] == [(0, 0, [9]), (1, 0, [9]), (0, 1, [19]),
                                                                     (1, 1, [19])]
    assert not manifest.problems and not manifest.missing


def test_collect_only_the_given_ranks_and_number_windows_without_iterations_per_rank(tmp_path):
    for name, step in (("a_rank0.json", 1), ("b_rank0.json", 5), ("a_rank1.json", 1)):  # one rank's: other steps
        write_trace(tmp_path / "dump" / name, step=step)
    collection = collect_traces(str(tmp_path / "dump" / "*.json"), RunLayout.at(tmp_path / "run"), ranks={0})
    assert [(t.rank, t.window, t.source.name) for t in collection.collected] == [
        (0, 0, "a_rank0.json"), (0, 1, "b_rank0.json")]


# --- the plain-sbatch template with a user program, executed under recording stand-ins ------------------------

from test_launcher_injection import HOSTILE, run_script, shims  # noqa: E402,F401  (shims: a fixture)

from fleetscope.launcher.schedulers.slurm import SBATCH_TEMPLATE  # noqa: E402


def test_sbatch_template_runs_the_user_program_then_collects_on_every_node(shims):
    run_dir = str(shims["root"] / f"runs {HOSTILE}" / "own 1")
    program = ["train.py", "--name", HOSTILE, "--", "-m"]
    records = run_script(SBATCH_TEMPLATE.read_text(), shims, run_dir, "--", *program,
                         env={"FLEETSCOPE_PYTHON": shims["python"], "FS_HOSTILE": HOSTILE,
                              "FLEETSCOPE_COLLECT_TRACES": f"out/{HOSTILE}/*.json"})
    sruns = [r["argv"] for r in records if r["name"] == "srun"]
    assert len(sruns) == 2
    assert sruns[0][-len(program):] == program and "fleetscope.trainer" not in sruns[0]
    assert sruns[1][-3:] == ["collect-traces", run_dir, f"out/{HOSTILE}/*.json"]
    assert "--ntasks-per-node=1" in sruns[1]
    pythons = [r["argv"] for r in records if r["name"] == "python"]
    assert pythons[-1] == ["-m", "fleetscope.cli.main", "postprocess", run_dir]


def test_sbatch_template_exports_the_names_of_the_launch_environment():
    text = SBATCH_TEMPLATE.read_text()
    assert f'export {launch_env.RUN_DIR_VAR}="$run_dir" {launch_env.SCHEDULER_VAR}=sbatch' in text
    assert launch_env.PROFILE_VAR in text


# --- what a submitit task runs in-process -------------------------------------------------------------------

from fleetscope.launcher.schedulers.submitit import run_program, run_program_checked  # noqa: E402


def test_submitit_runs_a_script_or_module_in_process_as_python_would(tmp_path, monkeypatch):
    body = ("import sys, json\nif __name__ == '__main__':\n"
            "    open('seen.json', 'w').write(json.dumps(sys.argv[1:]))\n    sys.exit(int(sys.argv[1]))\n")
    (tmp_path / "user_train.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    assert run_program([str(tmp_path / "user_train.py"), "75", "it's ; $(x)"]) == 75
    assert json.loads((tmp_path / "seen.json").read_text()) == ["75", "it's ; $(x)"]
    assert run_program(["-m", "user_train", "0"]) == 0  # -m finds modules in the working directory
    with pytest.raises(RuntimeError, match="exited with status 3"):
        run_program_checked(["-m", "user_train", "3"], allowed=(0, 75))
    assert "user_train" not in sys.argv
