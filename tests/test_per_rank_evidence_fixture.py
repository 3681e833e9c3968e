"""The evidence views on a real H200 trace of the trainer (tests/fixtures/gpu/h200-small-evidence):
GPU time by phase and kernel category, host stalls, and the trainer's memory and compile records."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.traces.formats import read_metric_records

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-evidence"


@pytest.fixture(scope="module")
def report() -> dict:
    return analyze(FIXTURE, write_default_outputs=False, use_cache=False, use_hta=False).to_json()


def test_gpu_time_is_attributed_to_the_phases_and_categories_of_a_real_step(report):
    gpu = report["windows"][0]["gpu_time"]
    phases = gpu["by_phase_us"]
    assert phases["forward"] > 0 and phases["backward"] > phases["optimizer_step"] > 0
    # every kernel lands in exactly one phase bucket (launch found through its correlation id)
    assert sum(phases.values()) == pytest.approx(gpu["total_us"], rel=1e-6)
    assert sum(gpu["by_category_us"].values()) == pytest.approx(gpu["total_us"], rel=1e-6)
    assert {"gemm", "attention", "elementwise", "optimizer"} <= set(gpu["by_category_us"])
    # the attention and GEMM kernels are most of a transformer step's forward/backward work
    assert gpu["by_category_us"]["gemm"] > gpu["by_category_us"]["reduction"]


def test_host_stalls_of_each_profiled_step(report):
    stalls = report["windows"][0]["ranks"][0]["host_stalls"]
    assert [s["step"] for s in stalls["steps"]] == [10, 11]
    # the trainer reads the loss one step late: one scalar read and one D2H copy per step, no more
    assert all(s["tensor_reads"] == 1 and s["dtoh_count"] == 1 for s in stalls["steps"])
    assert all(s["input_wait_us"] > 0 for s in stalls["steps"])
    assert sum(stalls["idle_by_cause_us"].values()) > 0


def test_memory_and_compile_records_of_the_run(report):
    records = read_metric_records(FIXTURE / "metrics" / "rank0.jsonl").records
    memory = report["trainer"]["ranks"][0]["memory"]
    assert memory["peak_allocated_mb"] == max(r.max_memory_allocated_mb for r in records)
    assert memory["fragmentation_mb"] == pytest.approx(memory["peak_reserved_mb"] - 11289.3759765625, abs=1.0)
    assert memory["leak_suspected"] is False
    compiled = report["trainer"]["ranks"][0]["compile"]
    assert compiled["graphs"] == 2 and compiled["graph_break_count"] == 0
    assert compiled["steps_with_compilations"] == [0] and compiled["compiled_in_timed_steps"] == []
    assert report["trainer"]["warnings"] == []


def test_bandwidth_says_not_recorded_on_a_single_rank_without_collectives(report):
    bandwidth = report["windows"][0]["bandwidth"]
    assert bandwidth["status"] == "not recorded" and bandwidth["rows"] == []
