"""Host syncs, input waits and GPU idle causes against the synthetic trace's known amounts."""

from __future__ import annotations

import numpy as np
import pytest
from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.per_rank.host_stalls import (
    IDLE_ALLOCATOR,
    IDLE_DEVICE,
    IDLE_HOST,
    IDLE_HOST_COMM,
    IDLE_INPUT,
    IDLE_SHORT,
    IDLE_SYNC,
    SYNC_SLACK_US,
    gap_causes,
)
from fleetscope.analysis.per_rank.intervals import Intervals
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal

from helpers.kineto import T0_US, KinetoBuilder

DATALOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def stalled_rank() -> KinetoBuilder:
    """Step 1, 0-1000 us. GPU busy 0-200, 300-500, 650-700, 705-720 (the rest of the step idle).
    Host: an .item() 140-205 with a cudaStreamSynchronize 150-200 and a DtoH copy of 5 us; a DataLoader
    fetch 400-600; a gloo all-reduce 800-1000. Gaps: 200-300 (100 us, starts when the sync returns: host
    sync), 500-650 (150 us, 100 of it inside the fetch: input wait), 700-705 (5 us: short), 720-1000
    (280 us, 200 of it in the gloo all-reduce: host collective).
    Step 2, 1000-2000 us: one kernel 1000-2000, no stalls."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0).step(2, 1000.0, 1000.0)
    builder.kernel("gemm_a", 0, 195.0, launch_ts=0)
    builder.kernel("Memcpy DtoH (Device -> Pinned)", 195, 5.0, launch_ts=145, cat="gpu_memcpy")
    builder.complete("aten::_local_scalar_dense", "cpu_op", 140, 65.0)
    builder.complete("cudaStreamSynchronize", "cuda_runtime", 150, 50.0)
    builder.kernel("gemm_b", 300, 100.0, launch_ts=290)
    builder.kernel("gemm_c", 400, 100.0, launch_ts=300)
    builder.annotation(DATALOADER, 400, 200.0)
    builder.gloo(800, 200.0)
    builder.kernel("gemm_d", 650, 50.0, launch_ts=640)
    builder.kernel("gemm_f", 705, 15.0, launch_ts=645)
    builder.kernel("gemm_e", 1000, 1000.0, launch_ts=1000)
    return builder


def test_stalls_per_step_and_idle_causes(tmp_path):
    stalled_rank().write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False)
    stalls = report.windows[0].ranks[0].host_stalls
    first, second = stalls.steps
    assert (first.sync_count, first.sync_us, first.tensor_reads) == (1, 50.0, 1)
    assert (first.dtoh_count, first.dtoh_us, first.input_wait_us) == (1, 5.0, 200.0)
    assert (second.sync_count, second.tensor_reads, second.dtoh_count, second.input_wait_us) == (0, 0, 0, 0.0)
    # the gap after the sync is the sync's for as long as the host waited in it (the read, 140-205 us: 65 us),
    # the rest (35 us) the host's, whose work would otherwise have overlapped the GPU's
    assert stalls.idle_by_cause_us == pytest.approx({IDLE_SYNC: 65.0, IDLE_HOST: 35.0, IDLE_SHORT: 5.0,
                                                     IDLE_INPUT: 150.0, IDLE_HOST_COMM: 280.0})
    assert stalls.idle_gaps_by_cause == {IDLE_SYNC: 1, IDLE_HOST: 1, IDLE_SHORT: 1, IDLE_INPUT: 1, IDLE_HOST_COMM: 1}
    assert [(op.op, op.count) for op in stalls.sync_ops] == [("unknown op", 1)]   # the builder names no op


def test_a_read_of_a_cpu_tensor_is_no_sync(tmp_path):
    # an optimizer's step counter read with .item(): `aten::_local_scalar_dense` with no runtime call inside
    builder = stalled_rank()
    builder.complete("aten::_local_scalar_dense", "cpu_op", 1500, 3.0)
    builder.write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False)
    first, second = report.windows[0].ranks[0].host_stalls.steps
    assert (first.tensor_reads, second.tensor_reads) == (1, 0)


def test_tensor_reads_are_kept_in_gpu_traces_and_rendered(tmp_path):
    stalled_rank().write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False)
    assert "host sync" in render_terminal(report)
    assert "Host stalls" in render_html(report)


def test_a_gap_long_after_a_sync_is_the_host_busy_elsewhere():
    gaps = Intervals.of([100.0, 500.0], [200.0, 600.0])
    sync = Intervals.of([50.0], [100.0 + SYNC_SLACK_US / 2])        # returned just before the first gap
    none = Intervals.empty()
    assert gap_causes(gaps, none, none, sync).tolist() == [IDLE_SYNC, IDLE_HOST]


def test_cpu_traces_have_idle_gaps_with_one_cause_and_no_gpu_totals(tmp_path):
    """CPU basis: step 0-1000 us, ops 0-100 and 300-400 (main thread), a gloo span 600-700: gaps 100-300,
    400-600 and 700-1000, each `no op running`; the report's GPU idle totals stay empty."""
    from fleetscope.analysis.per_rank.host_stalls import IDLE_NO_OP
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(0, 0, 1000.0)
    builder.complete("aten::mm", "cpu_op", 0, 100.0).complete("aten::add", "cpu_op", 300, 100.0)
    builder.gloo(600, 100.0)
    builder.write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False)
    from fleetscope.analysis.per_rank.parse import analyze_trace
    from fleetscope.analysis.inputs.sources import TraceSource
    result = analyze_trace(TraceSource(path=tmp_path / "rank0.json.gz", label="rank0", window=None))
    gaps = result.idle_gaps
    assert gaps.basis == "cpu" and gaps.causes() == [IDLE_NO_OP] * 3
    origin = result.steps[0].start_us
    assert [(a - origin, b - origin) for a, b in zip(gaps.starts_us.tolist(), gaps.ends_us.tolist())] == [
        (100, 300), (400, 600), (700, 1000)]
    stalls = report.windows[0].ranks[0].host_stalls       # the same gaps the merged trace draws as `idle:` slices
    assert stalls.idle_by_cause_us == pytest.approx({IDLE_NO_OP: 700.0})
    assert stalls.idle_gaps_by_cause == {IDLE_NO_OP: 3}


def test_a_gap_before_work_that_was_already_queued_is_a_device_dependency():
    gaps = Intervals.of([100.0, 500.0], [200.0, 600.0])
    none = Intervals.empty()
    queued = np.asarray([True, False])
    assert gap_causes(gaps, none, none, none, queued_before=queued).tolist() == [IDLE_DEVICE, IDLE_HOST]


def _stalls(builder: KinetoBuilder, tmp_path):
    builder.write(tmp_path / "rank0.json.gz")
    return analyze(tmp_path, use_hta=False, use_cache=False).windows[0].ranks[0].host_stalls


def test_a_copys_own_sync_is_not_a_host_sync(tmp_path):
    """Step 1: a batch copied from pageable memory (launched at 100, copied 104-300) and the stream synchronize
    that finishes it (105-300): the copy's wait, no read of a device value. Step 2: a DtoH copy then a
    synchronize: a read, counted."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0).step(2, 1000.0, 1000.0)
    builder.kernel("Memcpy HtoD (Pageable -> Device)", 104, 196.0, launch_ts=100, cat="gpu_memcpy")
    builder.complete("cudaStreamSynchronize", "cuda_runtime", 105, 195.0)
    builder.kernel("gemm", 320, 580.0, launch_ts=310)
    builder.kernel("gemm", 1000, 500.0, launch_ts=1000)
    builder.kernel("Memcpy DtoH (Device -> Pinned)", 1500, 2.0, launch_ts=1010, cat="gpu_memcpy")
    builder.complete("cudaStreamSynchronize", "cuda_runtime", 1015, 490.0)
    first, second = _stalls(builder, tmp_path).steps
    assert (first.sync_count, second.sync_count) == (0, 1)


def test_a_gap_the_host_spends_in_the_allocator_is_the_allocators(tmp_path):
    """Step 0-1000 us. Kernels 0-100, 460-600, 800-1000. A cudaFree 150-400 (250 of the 360 us gap 100-460: the
    whole gap is the allocator's); a cudaMalloc 620-680 (60 of the 200 us gap 600-800: 60 us the allocator's,
    140 the host's)."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0)
    builder.kernel("gemm", 0, 100.0, launch_ts=0)
    builder.complete("cudaFree", "cuda_runtime", 150, 250.0)
    builder.kernel("gemm", 460, 140.0, launch_ts=450)
    builder.complete("cudaMalloc", "cuda_runtime", 620, 60.0)
    builder.kernel("gemm", 800, 200.0, launch_ts=790)
    stalls = _stalls(builder, tmp_path)
    assert stalls.idle_by_cause_us == pytest.approx({IDLE_ALLOCATOR: 420.0, IDLE_HOST: 140.0})
    assert sum(stalls.idle_by_cause_us.values()) + stalls.steps_busy_us == pytest.approx(stalls.steps_span_us)


@pytest.mark.parametrize("compiled", [True, False])
def test_the_wait_inside_a_compiled_graphs_call_is_its_dispatch(tmp_path, compiled):
    """Step 0-2000 us. Eight kernels launched every 10 us (0-70) run back to back 5-405; then a 495 us gap
    (405-900) the host spends before launching the next kernel at 890: inside Inductor's call of a compiled graph
    (300-1200) that is the generated wrapper dispatching, which CUDA graphs remove; with no such call it is
    host work like any other."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 2000.0)
    for i in range(8):
        builder.kernel("triton_poi_fused_add_0", 5 + 50 * i, 50.0, launch_ts=10 * i)
    builder.kernel("triton_per_fused_sum_1", 900, 1100.0, launch_ts=890)
    if compiled:
        builder.annotation("## Call CompiledFxGraph fabc123 ##", 300, 900.0)
    stalls = _stalls(builder, tmp_path)
    assert stalls.idle_by_cause_us[IDLE_HOST] == pytest.approx(495.0)
    assert stalls.launch_paced_idle_us == pytest.approx(495.0 if compiled else 0.0)


@pytest.mark.parametrize("ops", [20, 2])
def test_a_gap_whose_ops_come_as_often_as_the_hosts_ops_do_is_dispatch(tmp_path, ops):
    """Step 0-2000 us. Eight kernels launched every 10 us (0-70) run back to back 5-405; the next is launched at
    600 (running 610-2000). In the 205 us gap 405-610 the host records `ops` ops before that one launch: twenty,
    one every 10 us as its ops come, is eager dispatch (views and casts between launches launch nothing, and
    cost the host as an op does); two is the host busy with work of its own. One launch in 205 us is no pace
    by launches alone (the median launch interval is 10 us). dispatch_ops counts the ops recorded in the gap."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 2000.0)
    for i in range(8):
        builder.kernel("elementwise", 5 + 50 * i, 50.0, launch_ts=10 * i)
    for ts in np.linspace(410.0, 590.0, ops):
        builder.op("aten::view", float(ts), 2.0)
    builder.kernel("gemm", 610, 1390.0, launch_ts=600)
    stalls = _stalls(builder, tmp_path)
    assert stalls.idle_by_cause_us[IDLE_HOST] == pytest.approx(205.0)
    assert stalls.launch_paced_idle_us == pytest.approx(205.0 if ops == 20 else 0.0)
    # the short gap 0-5 holds the step's range and the first launch call; the paced one, its ops and the call at 600
    assert stalls.dispatch_ops == 2 + (ops + 1 if ops == 20 else 0)
    assert stalls.launch_call_us == pytest.approx(4.0)


def test_the_idle_inside_an_ops_long_call_that_launches_is_that_ops(tmp_path):
    """Step 0-10000 us. A kernel 0-100; then the host is inside `aten::scaled_dot_product_attention` (200-6200)
    and, within it, `aten::_cudnn_attention_forward` (210-6190), which builds a plan and launches its kernel at
    6100 (running 6200-7000); then `aten::normal_` on a CPU tensor (7050-9000, no launch) before the last kernel,
    launched at 9050 (9100-10000). Of the 6100 us gap 100-6200, the 5980 us inside the innermost launching op's
    call are that op's (both ops are left out of a GPU trace's table); the 2100 us gap 7000-9100 is host work: its
    op launched nothing."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 10000.0)
    builder.kernel("gemm", 0, 100.0, launch_ts=0)
    builder.op("aten::scaled_dot_product_attention", 200, 6000.0)
    builder.op("aten::_cudnn_attention_forward", 210, 5980.0)
    builder.kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 6200, 800.0, launch_ts=6100)
    builder.op("aten::normal_", 7050, 1950.0)
    builder.kernel("gemm", 9100, 900.0, launch_ts=9050)
    stalls = _stalls(builder, tmp_path)
    assert stalls.idle_by_cause_us[IDLE_HOST] == pytest.approx(6100.0 + 2100.0)
    assert stalls.op_held_idle_us == pytest.approx({"aten::_cudnn_attention_forward": 5980.0})


def test_a_copy_to_pageable_memory_is_a_read_and_a_copy_from_it_is_the_copys(tmp_path):
    """Step 1, 0-1000 us: a kernel 0-300 queued ahead of a copy to pageable memory (`.tolist()`), called at 50,
    copied 300-302, the call returning at 305: the host waited 250 us for the queued kernel, and launches again
    at 600 (kernel 610-1000). Of the gap 302-610 (308 us), the read (host sync) is charged up to its wait, 250
    us, the host the rest; no pinned copy would remove it, so no refill is the copy's. Step 2, 1000-2000 us: the
    same wait in a copy from pageable memory (the batch's): the gap after it is the host's, and 250 us of it the
    copy's refill, which a pinned, non-blocking copy removes."""
    builder = KinetoBuilder(rank=0, world_size=1)
    builder.step(1, 0, 1000.0).step(2, 1000.0, 1000.0)
    for origin, copy in ((0.0, "Memcpy DtoH (Device -> Pageable)"), (1000.0, "Memcpy HtoD (Pageable -> Device)")):
        builder.kernel("gemm", origin, 300.0, launch_ts=origin)
        builder.kernel(copy, origin + 300, 2.0, launch_ts=origin + 50, cat="gpu_memcpy")
        builder.kernel("gemm", origin + 610, 390.0, launch_ts=origin + 600)
    # the builder's launch calls are 4 us cudaLaunchKernels: each copy's is a cudaMemcpyAsync over its wait
    for event in builder.events:
        if event["name"] == "cudaLaunchKernel" and event["ts"] - T0_US in (50.0, 1050.0):
            event.update(name="cudaMemcpyAsync", dur=255.0)
    stalls = _stalls(builder, tmp_path)
    first, second = stalls.steps
    assert stalls.idle_by_cause_us == pytest.approx({IDLE_SYNC: 250.0, IDLE_HOST: 58.0 + 308.0})
    assert (first.pageable_copy_refill_us, second.pageable_copy_refill_us) == (0.0, pytest.approx(250.0))
