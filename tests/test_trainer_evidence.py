"""The trainer's evidence: injected faults of known size show up, with those sizes, in the step metrics,
the traces and the compile record; communication estimates and MLLOG lines come from every rank.

Two real 2-rank DDP runs on gloo (compiled blocks with Dynamo's eager backend: the same graphs, breaks and
recompiles as Inductor at a fraction of the compile time) are shared by the slow tests: one with every
fault on, one baseline without faults. The memory fields are CUDA-only (null on CPU); on CPU the leak is
checked by what it keeps.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from helpers import metrics, torchrun

from fleetscope.trainer.config import ConfigError, FaultConfig, TrainConfig, apply_overrides
from fleetscope.traces.formats import (INJECTED_DATA_DELAY, INJECTED_GRAPH_BREAK, INJECTED_SLOW_PHASE,
                                       INJECTED_SYNC, MLLOG_PREFIX)

LAYERS = 2  # the tiny preset's decoder layers
STEPS = 5
ACTIVE = (3, 4)  # the profiled window's active steps: wait=2, warmup=1, active=2
DATA_DELAY_MS = 300.0
SLOW_MS = 150.0
LEAK_MB = 2.0
COMMON = ["-m", "fleetscope.trainer", "--device", "cpu", "--parallel", "ddp", "--steps", str(STEPS),
          "--profile", "wait=2,warmup=1,active=2", "--compile", "default",
          "--set", "performance.compile_backend=eager", "--set", "observability.clock_round_trips=0",
          "--set", "observability.mllog=true"]
FAULTS = ["faults.data_delay_rank=1", f"faults.data_delay_ms={DATA_DELAY_MS}", "faults.sync_per_layer=true",
          f"faults.leak_mb_per_step={LEAK_MB}", "faults.graph_break=true", "faults.slow_phase=optimizer_step",
          f"faults.slow_phase_ms={SLOW_MS}", "faults.slow_phase_rank=0"]


# --- configuration and pieces, no processes -------------------------------------------------


@pytest.mark.parametrize("assignment, field", [
    ("faults.data_delay_ms=-1", "faults.data_delay_ms"),
    ("faults.data_delay_rank=-2", "faults.data_delay_rank"),
    ("faults.leak_mb_per_step=-1", "faults.leak_mb_per_step"),
    ("faults.slow_phase=loss", "faults.slow_phase"),
    ("faults.slow_phase=backward", "faults.slow_phase_ms"),
    ("faults.slow_phase_rank=-3", "faults.slow_phase_rank"),
    ("faults.graph_break=true", "faults.graph_break"),
    ("performance.compile_backend=", "performance.compile_backend"),
])
def test_bad_fault_settings_name_the_field(assignment, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        apply_overrides(TrainConfig(run_dir="/tmp/x"), [assignment])


def test_faults_are_off_by_default_and_target_ranks():
    assert FaultConfig().data_delay_for(0) == 0 and FaultConfig().slow_phase_delay("forward", 0) == 0
    faults = FaultConfig(data_delay_rank=1, data_delay_ms=5, slow_phase="backward", slow_phase_ms=7)
    assert (faults.data_delay_for(0), faults.data_delay_for(1)) == (0, 5)
    assert [faults.slow_phase_delay("backward", r) for r in range(3)] == [7, 7, 7]  # slow_phase_rank -1: all
    assert faults.slow_phase_delay("forward", 0) == 0
    assert FaultConfig(slow_phase="forward", slow_phase_ms=3, slow_phase_rank=2).slow_phase_delay("forward", 1) == 0


def test_leak_keeps_the_bytes_it_says():
    from fleetscope.trainer.faults import MemoryLeak

    leak = MemoryLeak(1.5, torch.device("cpu"))
    for _ in range(3):
        leak.step()
    assert leak.kept_mb == pytest.approx(4.5)
    assert sum(t.numel() * t.element_size() for t in leak._kept) == 3 * int(1.5 * 2**20)
    assert MemoryLeak(0, torch.device("cpu")).kept_mb is None


def test_delayed_collate_sleeps_and_collates():
    from fleetscope.trainer.faults import DelayedCollate

    started = time.perf_counter()
    batch = DelayedCollate(50)([torch.tensor([1, 2]), torch.tensor([3, 4])])
    assert time.perf_counter() - started >= 0.05
    assert batch.tolist() == [[1, 2], [3, 4]]


def test_compile_watch_records_breaks_recompiles_and_the_steps_that_compiled(tmp_path):
    from torch._dynamo.utils import counters

    from fleetscope.trainer.compile_record import CompileWatch
    from fleetscope.traces.layout import RunLayout

    torch._dynamo.reset()
    counters.clear()

    def block(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x.cos()

    compiled = torch.compile(block, backend="eager")
    watch = CompileWatch(layout=RunLayout.at(tmp_path), rank=3, mode="default", backend="eager", use_cuda=False)
    compiled(torch.randn(4))
    assert watch.after_step(0) > 0
    compiled(torch.randn(4))
    assert watch.after_step(1) == 0
    compiled(torch.randn(2, 2))  # another rank: a guard fails, both frames recompile
    watch.after_step(2)
    watch.write(final=True)
    record = json.loads((tmp_path / "metrics" / "rank3.compile.json").read_text())
    assert record["final"] and record["written_after_step"] == 2 and record["rank"] == 3
    assert [s["step"] for s in record["steps_with_compilations"]] == [0, 2]
    assert record["steps_with_compilations"][1]["recompiles"] >= 1
    assert any("graph_break()" in b["reason"] for b in record["graph_breaks"])
    assert record["recompiles"] and all("rank mismatch" in r["reason"] for r in record["recompiles"])
    assert record["compile_time_s"] > 0 and record["graphs"] >= 2 and record["cuda_graphs"] is False


def test_bucket_estimate_spans_first_ready_to_last_done():
    from fleetscope.trainer.comm_timing import Clock, StepBuckets

    clock = Clock(use_cuda=False)
    # seconds: bucket A ready 1.000 done 1.004; bucket B ready 1.002 done 1.010
    estimate = StepBuckets(clock, [[1.000, 1.004], [1.002, 1.010]]).estimate()
    assert estimate.buckets == 2
    assert estimate.comm_ms == pytest.approx(10.0) and estimate.comm_exposed_ms == pytest.approx(8.0)
    assert estimate.total_mb is None and estimate.last_bucket_mb is None       # sizes not noted
    sized = StepBuckets(clock, [[1.000, 1.004], [1.002, 1.010]], [3 * 2**20, 2**19]).estimate()
    assert sized.total_mb == pytest.approx(3.5) and sized.last_bucket_mb == pytest.approx(0.5)
    assert StepBuckets(clock, []).estimate() is None
    assert StepBuckets(clock, [[1.0, None]]).estimate() is None  # never completed: no number


def test_mllog_parts_add_up_to_the_step():
    from fleetscope.trainer.metrics import StepMetrics
    from fleetscope.trainer.observability import mllog_line

    step = StepMetrics(step=1, rank=1, loss=1.0, step_time_ms=100.0, data_ms=10.0, forward_ms=30.0,
                       backward_ms=50.0, optimizer_ms=10.0, tokens_per_s=1.0, comm_ms=20.0, comm_exposed_ms=5.0)
    meta = json.loads(mllog_line(step)[len(MLLOG_PREFIX):])["metadata"]
    assert (meta["fwd_ms"], meta["bwd_ms"], meta["allreduce_ms"], meta["other_ms"]) == (30.0, 45.0, 5.0, 20.0)
    assert meta["rank"] == 1


# --- real runs ------------------------------------------------------------------------------


def _launch(run_dir: Path, faults: list[str]):
    extra = [arg for assignment in faults for arg in ("--set", assignment)]
    completed = torchrun(2, *COMMON, "--run-dir", str(run_dir), *extra)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faulty")
    return run_dir, _launch(run_dir, FAULTS)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("baseline")
    return run_dir, _launch(run_dir, [])


def _trace_events(run_dir: Path, rank: int) -> list[dict]:
    (path,) = (run_dir / "traces" / "window000").glob(f"rank{rank}.*.pt.trace.json.gz")
    with gzip.open(path) as handle:
        return [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]


def _within(events: list[dict], inner: str, outer: str) -> list[dict]:
    """`inner` events nested (same thread, time-contained) in some `outer` event."""
    outers = [e for e in events if e["name"] == outer]
    return [e for e in events if e["name"] == inner and any(
        o["tid"] == e["tid"] and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in outers)]


def _median(run_dir: Path, rank: int, field: str) -> float:
    return statistics.median(row[field] for row in metrics(run_dir, rank))


slow = pytest.mark.slow


@slow
def test_data_delay_shows_in_that_ranks_data_time_and_loader_span(faulty):
    run_dir, _ = faulty
    assert all(row["data_ms"] >= DATA_DELAY_MS for row in metrics(run_dir, 1))
    assert all(row["data_ms"] < DATA_DELAY_MS / 2 for row in metrics(run_dir, 0))
    events = _trace_events(run_dir, 1)
    loader = next(e["name"] for e in events if e["name"].startswith("enumerate(DataLoader)"))
    assert len(_within(events, INJECTED_DATA_DELAY, loader)) == len(ACTIVE)
    assert not [e for e in _trace_events(run_dir, 0) if e["name"] == INJECTED_DATA_DELAY]


@slow
def test_slow_phase_raises_that_phase_by_the_injected_amount(faulty, baseline):
    (run_dir, _), (base_dir, _) = faulty, baseline
    # The injected sleep lasts at least SLOW_MS, but the two runs' own optimizer times differ by a few ms on a
    # loaded machine: the same 10% tolerance as the trace-side check below.
    assert _median(run_dir, 0, "optimizer_ms") - _median(base_dir, 0, "optimizer_ms") >= SLOW_MS * 0.9
    assert _median(run_dir, 1, "optimizer_ms") < _median(base_dir, 1, "optimizer_ms") + SLOW_MS / 2
    events = _trace_events(run_dir, 0)
    assert len(_within(events, INJECTED_SLOW_PHASE, "optimizer_step")) == len(ACTIVE)


@slow
def test_leak_bookkeeping_and_cuda_only_memory_fields(faulty, baseline):
    (run_dir, _), (base_dir, _) = faulty, baseline
    for rank in range(2):
        rows = metrics(run_dir, rank)
        assert [row["fault_leaked_mb"] for row in rows] == [LEAK_MB * (s + 1) for s in range(STEPS)]
        for field in ("max_memory_allocated_mb", "max_memory_reserved_mb", "alloc_retries", "ooms"):
            assert all(row[field] is None for row in rows), field  # CPU: no allocator statistics
    assert all(row["fault_leaked_mb"] is None for row in metrics(base_dir, 0))


@slow
def test_sync_per_layer_adds_one_local_scalar_dense_per_layer_per_step(faulty, baseline):
    (run_dir, _), (base_dir, _) = faulty, baseline
    for rank in range(2):
        events, base = _trace_events(run_dir, rank), _trace_events(base_dir, rank)
        added = (len(_within(events, "aten::_local_scalar_dense", "forward"))
                 - len(_within(base, "aten::_local_scalar_dense", "forward")))
        assert added == LAYERS * len(ACTIVE)
        assert len(_within(events, "aten::_local_scalar_dense", INJECTED_SYNC)) == LAYERS * len(ACTIVE)


@slow
def test_graph_break_is_in_the_compile_record_with_its_reason(faulty, baseline):
    (run_dir, _), (base_dir, _) = faulty, baseline
    for rank in range(2):
        record = json.loads((run_dir / "metrics" / f"rank{rank}.compile.json").read_text())
        assert record["final"] and record["written_after_step"] == STEPS - 1
        assert any(INJECTED_GRAPH_BREAK in b["reason"] for b in record["graph_breaks"])
        assert [s["step"] for s in record["steps_with_compilations"]] == [0]
        assert record["steps_with_compilations"][0]["graph_breaks"] >= 1
        assert [row["compiled_frames"] > 0 for row in metrics(run_dir, rank)] == [True] + [False] * (STEPS - 1)
        assert len(_within(_trace_events(run_dir, rank), INJECTED_GRAPH_BREAK, "forward")) == LAYERS * len(ACTIVE)
    base = json.loads((base_dir / "metrics" / "rank0.compile.json").read_text())
    assert base["graph_break_count"] == 0 and base["recompiles"] == []


@slow
def test_ddp_communication_estimates_on_every_rank(baseline):
    run_dir, _ = baseline
    for rank in range(2):
        for row in metrics(run_dir, rank):
            assert row["comm_buckets"] >= 1
            assert 0 < row["comm_last_bucket_mb"] <= row["comm_mb"]
            assert 0 < row["comm_exposed_ms"] <= row["comm_ms"] < row["step_time_ms"]
            assert row["stop_agreement_ms"] is not None and row["stop_agreement_ms"] >= 0


@slow
def test_mllog_lines_come_from_every_rank(faulty):
    _, completed = faulty
    events = [json.loads(line[line.index(MLLOG_PREFIX) + len(MLLOG_PREFIX):])
              for line in completed.stdout.splitlines() if MLLOG_PREFIX in line]
    seen = sorted((e["metadata"]["rank"], e["metadata"]["step"]) for e in events)
    assert seen == [(rank, step) for rank in range(2) for step in range(STEPS)]
    for event in events:
        meta = event["metadata"]
        parts = meta["fwd_ms"] + meta["bwd_ms"] + meta["allreduce_ms"] + meta["other_ms"]
        assert parts == pytest.approx(event["value"], abs=0.01)
        assert meta["allreduce_ms"] > 0


# --- the same runs through the report: each injected cause is named with its amount -------------------


@pytest.fixture(scope="module")
def faulty_report(faulty):
    from fleetscope.analysis import analyze

    return analyze(faulty[0], write_default_outputs=False, use_hta=False).to_json()


@pytest.fixture(scope="module")
def baseline_report(baseline):
    from fleetscope.analysis import analyze

    return analyze(baseline[0], write_default_outputs=False, use_hta=False).to_json()


def _trainer_rank(report: dict, rank: int) -> dict:
    return next(r for r in report["trainer"]["ranks"] if r["rank"] == rank)


@slow
def test_report_names_the_input_wait_of_the_delayed_rank(faulty_report, baseline_report):
    delayed, other = _trainer_rank(faulty_report, 1)["input"], _trainer_rank(faulty_report, 0)["input"]
    assert delayed["mean_data_ms"] >= DATA_DELAY_MS and other["mean_data_ms"] < DATA_DELAY_MS / 2
    assert any("rank 1" in w and "input" in w for w in faulty_report["trainer"]["warnings"])
    assert not any("input" in w for w in baseline_report["trainer"]["warnings"])


@slow
def test_report_counts_the_forced_host_syncs_per_step(faulty_report, baseline_report):
    def reads(report: dict, rank: int) -> list[int]:
        window = report["windows"][0]
        stalls = next(r for r in window["ranks"] if r["rank"] == rank)["host_stalls"]
        return [s["tensor_reads"] for s in stalls["steps"]]

    for rank in (0, 1):
        extra = [f - b for f, b in zip(reads(faulty_report, rank), reads(baseline_report, rank))]
        assert extra == [LAYERS] * len(ACTIVE)


@slow
def test_report_lists_the_forced_graph_break_and_no_break_without_it(faulty_report, baseline_report):
    breaks = _trainer_rank(faulty_report, 0)["compile"]["graph_breaks"]
    assert any(INJECTED_GRAPH_BREAK in b["reason"] for b in breaks)
    assert _trainer_rank(baseline_report, 0)["compile"]["graph_break_count"] == 0


@slow
def test_report_shows_the_slow_phase_in_that_ranks_host_phase_times(faulty_report, baseline_report):
    def optimizer_ms(report: dict, rank: int) -> float:
        window = report["windows"][0]
        steps = next(r for r in window["ranks"] if r["rank"] == rank)["steps"]
        return statistics.median(s["phases_ms"]["optimizer_step"] for s in steps)

    assert optimizer_ms(faulty_report, 0) - optimizer_ms(baseline_report, 0) >= SLOW_MS * 0.9
    assert optimizer_ms(faulty_report, 1) - optimizer_ms(baseline_report, 1) < SLOW_MS / 2
