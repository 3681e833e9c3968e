"""The benchmark scripts' pure planning parts."""

from __future__ import annotations

import importlib.util
import sys

from helpers import REPO, requires_trace_processor, trace_processor


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_multi_gpu_jobs_cover_modes_scaling_buckets_and_a_straggler():
    multi_gpu = load("multi_gpu")
    jobs = {job.name: job for job in multi_gpu.plan_jobs(8, straggle_ms=20)}
    assert set(jobs) == {"mode-ddp", "mode-fsdp", "mode-tp", "mode-fsdp_tp", "scaling-fsdp-1", "bucket-25",
                         "bucket-50", "straggler", "ep8-fsdp", "ep8-ddp", "ep2-fsdp-edp4", "ep2-tp2-fsdp",
                         "ep8-hot-expert"}
    assert jobs["mode-tp"].args[-1] == "8" and jobs["scaling-fsdp-1"].nproc == 1
    assert "faults.straggle_rank=7" in jobs["straggler"].args
    assert "mode-fsdp_tp" not in {job.name for job in multi_gpu.plan_jobs(2, straggle_ms=20)}


def test_multi_gpu_expert_parallel_jobs():
    multi_gpu = load("multi_gpu")
    jobs = {job.name: job for job in multi_gpu.expert_parallel_jobs(2)}
    assert set(jobs) == {"ep2-fsdp", "ep2-ddp", "ep2-hot-expert"}
    assert "parallel.ep=2" in jobs["ep2-ddp"].args and "faults.hot_expert=3" in jobs["ep2-hot-expert"].args
    assert multi_gpu.expert_parallel_jobs(1) == []
    wide = {job.name: job for job in multi_gpu.expert_parallel_jobs(8)}
    assert wide["ep2-tp2-fsdp"].args == ["--parallel", "fsdp_tp", "--tp", "2", "--set", "parallel.ep=2"]
    assert "ep2-tp2-fsdp" not in {job.name for job in multi_gpu.expert_parallel_jobs(6)}  # dp 3: no ep 2


def test_multi_gpu_breadth_jobs_cover_accumulation_hsdp_and_every_pipeline_schedule():
    multi_gpu = load("multi_gpu")
    jobs = {job.name: job for job in multi_gpu.plan_breadth_jobs(8, straggle_ms=20)}
    assert set(jobs) == {"accumulation-fsdp", "hsdp", "pp-gpipe", "pp-1f1b", "pp-interleaved_1f1b", "pp-slow-stage"}
    assert "parallel.dp_replicate=2" in jobs["hsdp"].args and "faults.slow_stage_ms=20" in jobs["pp-slow-stage"].args
    assert {job.name for job in multi_gpu.plan_breadth_jobs(2, straggle_ms=20)} == set(jobs) - {"hsdp"}
    # Every planned job is a valid configuration for its world size (checked as the launcher checks it).
    from fleetscope.launcher.spec import JobSpec
    from fleetscope.trainer.config import TrainConfig, apply_overrides
    for nproc in (2, 8):
        for job in multi_gpu.plan_breadth_jobs(nproc, straggle_ms=20):
            sets = [job.args[i + 1] for i, a in enumerate(job.args) if a == "--set"]
            mode = job.args[job.args.index("--parallel") + 1]
            train = apply_overrides(TrainConfig(run_dir="/r"), [f"parallel.mode={mode}", "model.preset=small",
                                                                "data.batch_size=8", *sets])
            JobSpec(train=train, nproc_per_node=nproc)


def test_profiler_overhead_summary_separates_windows():
    import argparse

    overhead = load("profiler_overhead")

    def run(inside_ms: float, after_ms: float, profiled: bool) -> list[dict]:
        return [{"step": s, "profiled": profiled and s in (22, 23),
                 "step_time_ms": inside_ms if profiled and s in (22, 23) else (after_ms if s > 23 else 10.0)}
                for s in range(40)]

    runs = {"capture_off": [run(0, 10.0, False)] * 2, "never": [run(0, 10.0, False)] * 2,
            "profiled": [run(12.0, 10.5, True)] * 2, "teardown": [run(12.0, 10.0, True)] * 2}
    args = argparse.Namespace(preset="small", batch=4, seq=128, steps=40, compile="none", skip=3)
    summary = overhead.summarize(runs, args)
    assert summary["arms"]["profiled"]["after_vs_never"]["median_pct"] == 5.0       # CUPTI kept: 5% slower after
    assert summary["arms"]["teardown"]["after_vs_never"]["median_pct"] == 0.0
    assert summary["arms"]["teardown"]["inside_vs_never"]["median_pct"] == 20.0
    assert summary["capture_on_vs_off"]["median_pct"] == 0.0


@requires_trace_processor
def test_merge_scale_measures_the_engine_on_a_merged_trace(tmp_path):
    from fleetscope.analysis.merge.run import merge
    from test_merge import gpu_rank_events, kineto_document, write_trace

    for rank in (0, 1):
        write_trace(tmp_path / "t" / f"rank{rank}.json", kineto_document(rank, gpu_rank_events()))
    result = merge(tmp_path / "t", tmp_path / "out.perfetto-trace")
    loaded = load("merge_scale").measure_engine(result.output, trace_processor())
    expected = sum(s.slice_count + s.overlay_slice_count + s.instant_count + s.overlay_instant_count
                   for s in result.per_rank)
    assert loaded["slices"] == expected and loaded["peak_rss_mb"] > 1 and loaded["elapsed_s"] > 0
