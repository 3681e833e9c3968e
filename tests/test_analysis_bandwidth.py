"""Collective sizes and bandwidth against amounts computed here from the synthetic traces' own numbers."""

from __future__ import annotations

import math

import pytest
from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.cross_rank.bandwidth import (
    INTER_NODE,
    INTRA_NODE,
    STATUS_NOT_RECORDED,
    bus_factor,
    size_bucket,
)
from fleetscope.analysis.per_rank.names import collective_type
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal

from helpers.kineto import KinetoBuilder

NELEMS = 48 * 2**20          # bf16: 96 MiB, in the 64-256 MiB bucket
ARRIVAL_US = {0: 300.0, 1: 500.0}
END_US = 900.0


def nccl_rank(rank: int, *, host: str = "node0", kernel: str = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
              collective: str = "allreduce", nelems: int = NELEMS, out_nelems: int | None = None,
              dtype: str = "BFloat16", world: int = 2, message: bool = True,
            group_size: int | None = None) -> KinetoBuilder:
    """Two steps of 1000 us, one collective per step from ARRIVAL_US[rank] to END_US on every rank."""
    builder = KinetoBuilder(rank=rank, world_size=world, host=host)
    args = {"Collective name": collective, "In msg nelems": nelems, "Out msg nelems": out_nelems or nelems,
            "dtype": dtype, "Group size": group_size or world, "Process Group Name": "0",
            "Process Group Description": "mesh_dp"} if message else {}
    for index, start in enumerate((0.0, 1000.0)):
        builder.step(index + 1, start, 1000.0)
        builder.kernel("sm90_xmma_gemm_bf16", start + 50, 200.0, launch_ts=start + 10)
        arrival = ARRIVAL_US[rank % 2]
        builder.kernel(f"{kernel}(ncclDevKernelArgsStorage<4096ul>)", start + arrival, END_US - arrival,
                       launch_ts=start + 20, stream=20, args=args)
    return builder


def write_ranks(tmp_path, **kwargs):
    for rank in (0, 1):
        nccl_rank(rank, **kwargs).write(tmp_path / f"rank{rank}.json.gz")
    return analyze(tmp_path, use_hta=False, use_cache=False)


def test_all_reduce_bandwidth_is_bytes_over_the_time_after_the_last_arrival(tmp_path):
    report = write_ranks(tmp_path)
    bandwidth = report.windows[0].bandwidth
    (row,) = bandwidth.rows
    size = NELEMS * 2
    moving_us = END_US - max(ARRIVAL_US.values())                    # 400 us, data moves after the last arrival
    expected_algbw = size / (moving_us * 1e-6) / 1e9
    assert row.collective == "all_reduce" and row.instances == 2 and row.members == 2
    assert row.total_bytes == 2 * size
    assert row.algbw_gbps == pytest.approx(expected_algbw, rel=0.01)
    assert row.busbw_gbps == pytest.approx(expected_algbw * 2 * (2 - 1) / 2, rel=0.01)
    # waits 200 us (rank 0) and 0 (rank 1): mean 100 us per instance, against 400 us moving
    assert row.wait_pct == pytest.approx(100 * 100 / (100 + 400), abs=0.01)
    assert (row.bucket_min_bytes, row.bucket_max_bytes) == (64 * 2**20, 256 * 2**20)
    assert row.scope == INTRA_NODE and row.group == "mesh_dp pg 0"
    assert row.peak_pct == pytest.approx(100 * row.busbw_gbps / 450.0, rel=1e-9)
    assert "64 MiB-256 MiB" in row.verdict and "all-reduce" in row.verdict


def test_all_gather_counts_the_gathered_output_and_uses_its_bus_factor(tmp_path):
    report = write_ranks(tmp_path, kernel="ncclDevKernel_AllGather_RING_LL", collective="_allgather_base",
                         nelems=1_000_000, out_nelems=2_000_000, dtype="Float")
    (row,) = report.windows[0].bandwidth.rows
    algbw = 2_000_000 * 4 / 400e-6 / 1e9
    assert row.collective == "all_gather"
    assert row.algbw_gbps == pytest.approx(algbw, rel=0.01)
    assert row.busbw_gbps == pytest.approx(algbw / 2, rel=0.01)


def test_members_on_two_hosts_are_inter_node_and_the_override_sets_the_peak(tmp_path):
    for rank in (0, 1):
        nccl_rank(rank, host=f"node{rank}").write(tmp_path / f"rank{rank}.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False, link_peak_gbps=100.0)
    (row,) = report.windows[0].bandwidth.rows
    assert row.scope == INTER_NODE and row.peak_busbw_gbps == 100.0
    assert row.peak_pct == pytest.approx(row.busbw_gbps, rel=1e-9)


def test_traces_without_message_args_say_not_recorded(tmp_path):
    report = write_ranks(tmp_path, message=False)
    bandwidth = report.windows[0].bandwidth
    assert bandwidth.status == STATUS_NOT_RECORDED and bandwidth.rows == []
    assert "nelems" in bandwidth.reason


def test_gloo_traces_say_sizes_are_not_recorded(tmp_path):
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, backend="gloo").step(1, 0, 1000.0).gloo(100.0 + 50 * rank, 300.0)
        builder.write(tmp_path / f"rank{rank}.json.gz")
    bandwidth = analyze(tmp_path, use_hta=False, use_cache=False).windows[0].bandwidth
    assert bandwidth.status == STATUS_NOT_RECORDED and "gloo" in bandwidth.reason


def test_bandwidth_is_rendered(tmp_path):
    report = write_ranks(tmp_path)
    assert "64 MiB-256 MiB" in render_terminal(report)
    assert "Collective bandwidth" in render_html(report)


@pytest.mark.parametrize("members, allreduce, gather", [(2, 1.0, 0.5), (8, 1.75, 0.875)])
def test_bus_factors_follow_nccl_tests(members, allreduce, gather):
    assert bus_factor("all_reduce", members) == allreduce
    assert bus_factor("all_gather", members) == bus_factor("reduce_scatter", members) == gather
    assert bus_factor("all_to_all", members) == gather and bus_factor("broadcast", members) == 1.0


def test_size_buckets_are_powers_of_four():
    assert size_bucket(4**10) == (4**10, 4**11)
    assert size_bucket(4**10 - 1) == (4**9, 4**10)
    assert all(low <= s < high for s in (1, 3, 17, 10**9, 3 * 2**30)
               for low, high in [size_bucket(s)])
    assert math.log(size_bucket(10**9)[0], 4) % 1 == 0


@pytest.mark.parametrize("arg, kernel, expected", [
    ("allreduce", "ncclDevKernel_AllReduce_Sum_f32", "all_reduce"),
    ("reduce_scatter_tensor_coalesced", "ncclDevKernel_ReduceScatter_Sum", "reduce_scatter"),
    ("all_to_all", "ncclDevKernel_SendRecv", "all_to_all"),
    (None, "ncclDevKernel_AllGather_RING_LL", "all_gather"),
    (None, "ncclDevKernel_Broadcast_RING_LL", "broadcast"),
    (None, "sm90_gemm", None),
])
def test_collective_type_prefers_the_collective_name_arg(arg, kernel, expected):
    assert collective_type(arg, kernel) == expected


def test_bandwidth_fields_are_in_the_documented_schema(tmp_path):
    import re

    from fleetscope.analysis.report import model as report_module

    bandwidth = write_ranks(tmp_path).to_json()["windows"][0]["bandwidth"]
    keys = set(bandwidth) | set(bandwidth["rows"][0])
    assert {k for k in keys if not re.search(rf"\b{k}\b", report_module.__doc__)} == set()


def test_bandwidth_survives_the_json_round_trip(tmp_path):
    from fleetscope.analysis.analyze import load_report_json, write_report_json

    report = write_ranks(tmp_path)
    loaded = load_report_json(write_report_json(report, tmp_path / "out" / "report.json"))
    assert loaded.windows[0].bandwidth == report.windows[0].bandwidth


def test_the_group_size_arg_sets_the_bus_factor_when_some_members_have_no_trace(tmp_path):
    (row,) = write_ranks(tmp_path, group_size=4).windows[0].bandwidth.rows
    assert row.members == 4
    assert row.busbw_gbps == pytest.approx(row.algbw_gbps * 2 * 3 / 4, rel=1e-9)


def test_each_instance_is_kept_and_a_row_below_half_the_peak_is_slow(tmp_path):
    """96 MiB moved in 400 us: busbw 251.7 GB/s for 2 ranks (factor 1): 56% of NVLink's 450 GB/s (not
    slow), 25% of a 1000 GB/s link (slow)."""
    for rank in (0, 1):
        nccl_rank(rank).write(tmp_path / f"rank{rank}.json.gz")
    busbw = NELEMS * 2 / 400e-6 / 1e9
    fast = analyze(tmp_path, use_hta=False, use_cache=False).windows[0].bandwidth
    slow = analyze(tmp_path, use_hta=False, use_cache=False, link_peak_gbps=1000.0).windows[0].bandwidth
    assert not fast.rows[0].slow and slow.rows[0].slow
    assert [(i.step, i.name, i.ordinal, i.row) for i in fast.instances] == [
        (1, "nccl:AllReduce [mesh_dp pg 0]", 0, 0), (2, "nccl:AllReduce [mesh_dp pg 0]", 0, 0)]
    for instance in fast.instances:
        assert instance.busbw_gbps == pytest.approx(busbw, rel=1e-6) and instance.bytes == NELEMS * 2
        assert instance.moving_us == pytest.approx(400.0) and instance.wait_us == pytest.approx(100.0)
        assert instance.peak_pct == pytest.approx(100 * busbw / 450.0, rel=1e-6)


def test_one_ranks_trace_gives_apparent_bandwidth_as_a_labelled_lower_bound(tmp_path):
    # only rank 0 profiled (arrives at 300 us, ends at 900 us): no last arrival to measure from
    from fleetscope.analysis.cross_rank.bandwidth import STATUS_ONE_RANK
    nccl_rank(0, world=8, group_size=8).write(tmp_path / "rank0.json.gz")
    report = analyze(tmp_path, use_hta=False, use_cache=False)
    bandwidth = report.windows[0].bandwidth
    assert bandwidth.status == STATUS_ONE_RANK and "lower bound" in bandwidth.reason
    (row,) = bandwidth.rows
    size = NELEMS * 2
    apparent = size / (END_US - ARRIVAL_US[0]) / 1e3
    assert (row.instances, row.members, row.scope) == (2, 8, INTRA_NODE)
    assert row.algbw_gbps == pytest.approx(apparent) and row.busbw_gbps == pytest.approx(apparent * 2 * 7 / 8)
    assert len(bandwidth.instances) == 2 and all(i.algbw_gbps == pytest.approx(apparent) for i in bandwidth.instances)
    assert "lower bound" in row.verdict
    text, html = render_terminal(report), render_html(report)
    assert f"bandwidth {STATUS_ONE_RANK}" in text and row.verdict in text
    assert STATUS_ONE_RANK in html and "lower bound" in html
