"""All-to-all bytes per peer: the profiler's split-size args (whole, even, truncated at 30 entries) and the
trainer's MoE records, against byte counts computed here from the synthetic traces' own numbers."""

from __future__ import annotations

import json

import pytest
from helpers.kineto import KinetoBuilder

from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.per_rank.comm_bytes import (
    SPLIT_EVEN,
    SPLIT_NOT_RECORDED,
    SPLIT_RECORDS,
    SPLIT_TRACE,
    SPLIT_TRUNCATED,
    parse_split,
    split_bytes,
)
from fleetscope.traces.formats import MoeRecord, moe_range

HIDDEN = 1024
"""Elements per token row (bf16: 2 KiB a row)."""
ROW_BYTES = HIDDEN * 2
SENDS = {0: [100, 300], 1: [200, 600]}
"""Token rows each rank sends each peer (rank 1 sends twice as much: the busiest sender)."""


def _truncated(values: list[int]) -> str:
    """The profiler's form of a list longer than 30 entries (kTruncatLength): the first 30, then '...'."""
    return "[" + ", ".join(map(str, values[:30])) + ", ...]"


def test_split_text_is_parsed_whole_even_or_truncated():
    assert parse_split("[3, 5]") == ([3, 5], False)
    assert parse_split('"[3, 5]"') == ([3, 5], False)
    assert parse_split("[]") == ([], False)
    assert parse_split(_truncated(list(range(40)))) == (None, True)
    assert parse_split("[3, x]") == (None, False) and parse_split("[-1, 2]") == (None, False)
    assert parse_split(None) == (None, False) and parse_split("3, 5") == (None, False)


def test_bytes_per_peer_are_rows_times_the_row_size():
    rows = split_bytes(8 * 16, 6 * 16, "BFloat16", 2, "[3, 5]", "[4, 2]")
    assert rows.status == SPLIT_TRACE
    assert rows.send_bytes == (3 * 16 * 2, 5 * 16 * 2) and rows.recv_bytes == (4 * 16 * 2, 2 * 16 * 2)
    even = split_bytes(400, 400, "Float", 4, "[]", "[]")
    assert even.status == SPLIT_EVEN and even.send_bytes == (400.0,) * 4       # 100 elements x 4 bytes each
    assert split_bytes(400, 400, "Float", 40, _truncated([10] * 40), "[]").status == SPLIT_TRUNCATED
    assert split_bytes(100, 96, "Float", 2, "[3, 5]", "[4, 2]").status == SPLIT_NOT_RECORDED   # 100 % 8 != 0
    assert split_bytes(128, 96, "Unknown", 2, "[3, 5]", "[4, 2]").status == SPLIT_NOT_RECORDED


def _rank(rank: int, *, in_split: str | None = None, with_moe: bool = False) -> KinetoBuilder:
    """Two steps, one NCCL all-to-all (SendRecv kernels, the `all_to_allv` collective) per step: rank 0
    arrives at 300 us, rank 1 at 500 us, both end at 900 us; inside a moe/dispatch range with `with_moe`."""
    sends = SENDS[rank]
    receives = [SENDS[peer][rank] for peer in (0, 1)]
    args = {"Collective name": "all_to_allv", "In msg nelems": sum(sends) * HIDDEN,
            "Out msg nelems": sum(receives) * HIDDEN, "dtype": "BFloat16", "Group size": 2,
            "In split size": in_split or str(sends), "Out split size": str(receives),
            "Process Group Name": "1", "Process Group Description": "mesh_ep"}
    builder = KinetoBuilder(rank=rank, world_size=2)
    for index, start in enumerate((0.0, 1000.0)):
        builder.step(index + 1, start, 1000.0)
        if with_moe:
            builder.annotation(moe_range("dispatch", 0), start + 5, 40.0)
        arrival = 300.0 if rank == 0 else 500.0
        builder.kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", start + arrival, 900.0 - arrival,
                       launch_ts=start + 20, stream=20, args=args)
    return builder


def _bandwidth(tmp_path, **kwargs):
    for rank in (0, 1):
        _rank(rank, **kwargs).write(tmp_path / f"rank{rank}.json.gz")
    return analyze(tmp_path, use_hta=False, use_cache=False).windows[0].bandwidth


def test_an_uneven_all_to_all_is_sized_by_its_busiest_sender(tmp_path):
    (row,) = _bandwidth(tmp_path).rows
    busiest = sum(SENDS[1]) * ROW_BYTES                       # rank 1: 800 rows
    assert row.collective == "all_to_all" and row.instances == 2
    assert row.total_bytes == 2 * busiest
    assert row.algbw_gbps == pytest.approx(busiest / 400e-6 / 1e9, rel=1e-6)      # moves after 500 us, to 900
    assert row.split_status == {SPLIT_TRACE: 2}
    assert row.max_peer_bytes == 600 * ROW_BYTES
    assert row.sender_max_over_mean == pytest.approx(800 / 600)                  # 800 vs (400 + 800) / 2
    assert "busiest sender moves 1.33x the mean" in row.verdict


def test_truncated_split_sizes_are_said_not_guessed(tmp_path):
    (row,) = _bandwidth(tmp_path, in_split=_truncated([25] * 32)).rows
    assert row.split_status == {SPLIT_TRUNCATED: 2}
    assert row.max_peer_bytes is None and row.sender_max_over_mean is None
    # the instance keeps the trace's own size: the first rank's max(in, out) elements
    assert row.total_bytes == 2 * max(sum(SENDS[0]), SENDS[0][0] + SENDS[1][0]) * ROW_BYTES
    assert "split sizes truncated in 2 instance(s)" in row.verdict


def test_the_trainers_records_replace_truncated_split_sizes(tmp_path):
    run = tmp_path / "run"
    window = run / "traces" / "window000"
    window.mkdir(parents=True)
    (run / "metrics").mkdir()
    for rank in (0, 1):
        _rank(rank, in_split=_truncated([25] * 32), with_moe=True).write(window / f"rank{rank}.node0.pt.trace.json.gz")
        lines = [MoeRecord(step=step, layer=0, rank=rank, ep=2, ep_rank=rank, ep_ranks=[0, 1],
                           tokens_per_expert=[0, 0], send_tokens=SENDS[rank],
                           send_bytes=[n * ROW_BYTES for n in SENDS[rank]],
                           recv_tokens=[SENDS[p][rank] for p in (0, 1)],
                           recv_bytes=[SENDS[p][rank] * ROW_BYTES for p in (0, 1)]).to_json() for step in (1, 2)]
        (run / "metrics" / f"rank{rank}.moe.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (row,) = analyze(run, use_hta=False, use_cache=False).windows[0].bandwidth.rows
    assert row.split_status == {SPLIT_RECORDS: 2}
    assert row.total_bytes == 2 * sum(SENDS[1]) * ROW_BYTES and row.max_peer_bytes == 600 * ROW_BYTES


def _gloo_rank(rank: int, *, extra_span: bool = False) -> KinetoBuilder:
    """A gloo all-to-all per step with record_shapes args: the issuing c10d::alltoall_base_ op lists the
    output / input dims ([rows, 64] fp32) and the output / input split sizes; rank 1 sends twice as much."""
    sends = SENDS[rank]
    receives = [SENDS[peer][rank] for peer in (0, 1)]
    builder = KinetoBuilder(rank=rank, world_size=2, backend="gloo")
    for index, start in enumerate((0.0, 1000.0)):
        builder.step(index + 1, start, 1000.0)
        builder.complete("c10d::alltoall_base_", "cpu_op", start + 90, 5.0, args={
            "Concrete Inputs": ["", "", "", str(receives), str(sends), "False", "-1"],
            "Input type": ["float", "float", "", "ScalarList", "ScalarList", "Scalar", "Scalar"],
            "Input Dims": [[sum(receives), 64], [sum(sends), 64], [], [], [], [], []]})
        builder.gloo(start + 100 + 200 * rank, 400.0 - 200 * rank, name="gloo:all_to_all")
        if extra_span:                                   # an all-to-all no alltoall_base_ op issued
            builder.gloo(start + 600, 100.0, name="gloo:all_to_all")
    return builder


def test_gloo_all_to_all_bytes_come_from_the_issuing_host_ops_split_sizes(tmp_path):
    for rank in (0, 1):
        _gloo_rank(rank).write(tmp_path / f"rank{rank}.json.gz")
    (row,) = analyze(tmp_path, use_hta=False, use_cache=False).windows[0].bandwidth.rows
    assert row.split_status == {SPLIT_TRACE: 2}
    assert row.total_bytes == 2 * sum(SENDS[1]) * 64 * 4            # the busiest sender, 800 rows of 256 B
    assert row.max_peer_bytes == 600 * 64 * 4
    assert row.algbw_gbps == pytest.approx(800 * 256 / 200e-6 / 1e9, rel=1e-6)     # moves from 300 to 500 us


def test_gloo_spans_that_do_not_pair_with_host_ops_stay_unsized(tmp_path):
    for rank in (0, 1):
        _gloo_rank(rank, extra_span=True).write(tmp_path / f"rank{rank}.json.gz")
    bandwidth = analyze(tmp_path, use_hta=False, use_cache=False).windows[0].bandwidth
    assert bandwidth.rows == [] and bandwidth.status == "not recorded"


@pytest.mark.parametrize("in_split", [12, "[1, 2", "[1.5, 2]", "[nan]", "[" + "9" * 400 + ", 1]", "[[1], [2]]"])
def test_odd_split_args_are_not_recorded_and_nothing_breaks(tmp_path, in_split):
    for rank in (0, 1):
        builder = _rank(rank)
        for event in builder.events:
            if "In split size" in event["args"]:
                event["args"]["In split size"] = in_split
        builder.write(tmp_path / f"rank{rank}.json.gz")
    (row,) = analyze(tmp_path, use_hta=False, use_cache=False).windows[0].bandwidth.rows
    # (the 400-digit count parses but disagrees with the elements sent: not recorded either)
    assert row.split_status == {SPLIT_NOT_RECORDED: 2} and row.max_peer_bytes is None
    assert row.total_bytes == 2 * max(sum(SENDS[0]), SENDS[0][0] + SENDS[1][0]) * ROW_BYTES   # the trace's own size


def test_odd_record_shapes_args_leave_the_gloo_all_to_all_unsized(tmp_path):
    for rank in (0, 1):
        builder = _gloo_rank(rank)
        for event in builder.events:
            if event["name"] == "c10d::alltoall_base_":
                event["args"]["Input Dims"] = [[-1, 64], "x"]
        builder.write(tmp_path / f"rank{rank}.json.gz")
    assert analyze(tmp_path, use_hta=False, use_cache=False).windows[0].bandwidth.rows == []
