"""Advice in the program's own terms: a user's program (launch -- python train.py) or a folder of traces gets
code changes, never fleetscope trainer settings it did not run, and nothing `tune` could apply."""

import dataclasses
from pathlib import Path
import json

import pytest

from fleetscope.analysis.advise import Evidence, advise, advise_evidence, gather_evidence
from fleetscope.cli.main import main
from fleetscope.launcher.spec import JobSpec, UserEntry, spec_record
from fleetscope.trainer.config import TrainConfig, apply_overrides
from fleetscope.traces.jobfile import write_job_record
from fleetscope.traces.layout import RunLayout
from fleetscope.analysis.inputs.records import read_run_records
from helpers.kineto import KinetoBuilder


def _user_run(root, *, compile_setting="none"):
    """A user program's run whose job.json also holds (as older records did) a full trainer configuration."""
    layout = RunLayout.at(root)
    layout.root.mkdir(parents=True)
    train = apply_overrides(TrainConfig(run_dir=str(root)), [f"performance.compile={compile_setting}"])
    record = spec_record(JobSpec(train=train, entry=UserEntry(program="/opt/train.py", workdir="/opt")))
    record["spec"]["train"] = dataclasses.asdict(train)   # as older records held it
    write_job_record(layout, **record)
    (layout.root / "metrics").mkdir()
    lines = [json.dumps({"step": s, "rank": 0, "step_time_ms": 100.0, "data_ms": 40.0, "profiled": False})
             for s in range(8)]
    (layout.root / "metrics" / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    return layout


def test_a_user_programs_advice_is_a_code_change_and_reads_no_trainer_setting(tmp_path):
    layout = _user_run(tmp_path / "run", compile_setting="default")
    evidence = gather_evidence(read_run_records(layout), None)
    assert evidence.config == {} and evidence.program == "/opt/train.py"
    (finding,) = advise_evidence(evidence).findings
    assert finding.rule == "data_workers" and finding.apply is None
    assert finding.change.startswith("DataLoader(..., num_workers=8, pin_memory=True")
    assert "--set" not in finding.change and "num_workers" not in finding.evidence


def test_gpu_idle_of_a_user_program_is_advised_as_torch_compile_not_a_flag():
    evidence = Evidence(step_ms=100.0, step_basis="step metrics", basis="gpu", idle_pct=60.0, launch_ms=30.0,
                        program="train.py")
    (finding,) = [f for f in advise_evidence(evidence).findings if f.rule == "cuda_graphs"]
    assert finding.change.startswith("torch.compile(model, mode='reduce-overhead')")
    assert "compile" not in finding.evidence and finding.apply is None


def test_tune_refuses_a_users_program_finding_and_says_what_to_change(tmp_path, capsys):
    layout = _user_run(tmp_path / "run")
    assert main(["tune", str(layout.root), "--apply", "data_workers", "--dry-run"]) == 2
    assert "DataLoader(..., num_workers=8" in capsys.readouterr().err


def test_a_folder_of_traces_gets_advice_without_a_run_directory(tmp_path):
    # the slow rank's DataLoader fetch is what the other waits for at every step
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=2)
        for step, s in enumerate((0.0, 40000.0, 80000.0)):
            builder.step(step, s, 35000)
            fetch = 30000.0 if rank == 1 else 100.0
            builder.annotation("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", s + 10, fetch)
            arrival = s + 20 + fetch + 100
            builder.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", arrival if rank == 1 else s + 300,
                           (s + 30300 - (arrival if rank == 1 else s + 300)), launch_ts=arrival - 50, stream=20)
        builder.write(tmp_path / "traces" / f"rank{rank}.json")
    advice = advise(tmp_path / "traces")
    (finding,) = [f for f in advice.findings if f.rule == "straggler"]
    assert finding.ranks == [1] and finding.apply is None
    assert finding.change.startswith("DataLoader(") and "--set" not in finding.change


def _gpu_rank(directory, rank, *, kernels_per_step, kernel_us, gap_us):
    """One GPU rank: each 10 ms step runs `kernels_per_step` kernels, each launched just before it, `gap_us`
    of host time between them (the host's own work, or nothing but the launches)."""
    builder = KinetoBuilder(rank=rank, world_size=1)
    for step in range(3):
        start = step * 10_000.0
        builder.step(step, start, 10_000)
        t = start + 10
        for _ in range(kernels_per_step):
            builder.kernel("void gemm_kernel<float>(float*)", t + 5, kernel_us, launch_ts=t)
            t += gap_us
    builder.write(directory / f"rank{rank}.json")
    return directory


def test_launches_are_counted_per_step_from_the_trace(tmp_path):
    from fleetscope.analysis import analyze

    report = analyze(_gpu_rank(tmp_path / "t", 0, kernels_per_step=20, kernel_us=50.0, gap_us=400.0), use_hta=False)
    stalls = report.windows[0].ranks[0].host_stalls
    assert [s.launch_count for s in stalls.steps] == [20, 20, 20]
    assert [s.launch_us for s in stalls.steps] == [pytest.approx(80.0)] * 3          # 20 launches of 4 us


def test_a_host_bound_program_is_told_what_the_host_does_not_to_use_cuda_graphs(tmp_path):
    # 20 kernels of 50 us in a 10 ms step, the host 400 us between launches: the GPU idles ~90% of the step
    # while the host spends 0.08 ms in launch calls: host work, not launch overhead.
    advice = advise(_gpu_rank(tmp_path / "t", 0, kernels_per_step=20, kernel_us=50.0, gap_us=400.0))
    rules = {f.rule: f for f in advice.findings}
    assert "cuda_graphs" not in rules and "host_work" in rules
    assert rules["host_work"].evidence["launch_ms_per_step"] == pytest.approx(0.08)


def test_eager_pytorch_on_the_h200_is_launch_bound_from_its_trace_alone(tmp_path):
    # a real H200 trace of the trainer's step (fixture): 20-50 launches per ms of GPU idle, dispatch paced by
    # launch calls; beside it 1-5 ms stretches without a launch (its with_stack frames: dynamo's guard checks
    # around compiled blocks, the optimizer's Python), which are other host work, not dispatch
    import shutil

    source = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-evidence" / "traces"
    shutil.copytree(source, tmp_path / "traces")
    rules = {f.rule: f for f in advise(tmp_path / "traces").findings}
    assert "cuda_graphs" in rules
    if "host_work" in rules:   # the dispatch-paced idle is cuda_graphs', never counted again as host work
        evidence = rules["host_work"].evidence
        assert evidence["host_busy_idle_ms_per_step"] + evidence["launch_paced_idle_ms_per_step"] <= 45.6
    assert rules["cuda_graphs"].apply is None and rules["cuda_graphs"].change.startswith("torch.compile(")
