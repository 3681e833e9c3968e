"""Collectives of sub-groups (a 2-D run: tensor-parallel pairs inside a data-parallel world) are matched per
process group, in the report, the clock alignment and the merged trace's arrows.

Four ranks, two per host; TP groups {0,1} (pg 1) and {2,3} (pg 2), the world is pg 0. Per 1000 us step:
  compute          ranks 0-2: 100-300          rank 3: 100-450 (150 us more work)
  TP all-reduce    ranks 0,1: 300-350          rank 2: 300-500, rank 3: 450-500 (rank 2 waits for 3)
  compute          ranks 0,1: 350-360          rank 2: 500-510, rank 3: 500-515
  world all-reduce ranks 0,1: 360-600          rank 2: 510-600, rank 3: 515-600
Rank 3 holds up its own TP partner by 150 us; ranks 0 and 1 never wait for it at TP (their group is done at
350), only at the world all-reduce, where rank 3 arrives 155 us after the median of the others.
Host node1 (ranks 2, 3) runs its clock 37 ms ahead.
"""

from collections import defaultdict
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.perfetto.check import CROSS_RANK_FLOW_BIT, check_trace
from helpers.kineto import BASE_TIME_NS, KinetoBuilder

OFFSET_US = 37_000.0
STEPS = (0.0, 1000.0)
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
TP_A, TP_B, WORLD = "nccl:AllReduce [mesh_tp pg 1]", "nccl:AllReduce [mesh_tp pg 2]", "nccl:AllReduce [default_pg pg 0]"

COMPUTE_END = {0: 300, 1: 300, 2: 300, 3: 450}
TP_TIMES = {0: (300, 350), 1: (300, 350), 2: (300, 500), 3: (450, 500)}
WORLD_START = {0: 360, 1: 360, 2: 510, 3: 515}
WORLD_END = 600


def _group_args(name: str, description: str, ranks: list[int]) -> dict:
    return {"Process Group Name": name, "Process Group Description": description,
            "Process Group Ranks": str(ranks), "Collective name": "allreduce", "Group size": len(ranks)}


def _rank(rank: int) -> KinetoBuilder:
    host = rank // 2
    builder = KinetoBuilder(rank=rank, world_size=4, host=f"node{host}",
                            base_time_ns=BASE_TIME_NS + round(host * OFFSET_US * 1000))
    tp_args = _group_args("1" if rank < 2 else "2", "mesh_tp", [0, 1] if rank < 2 else [2, 3])
    world_args = _group_args("0", "default_pg", [0, 1, 2, 3])
    for index, s in enumerate(STEPS):
        builder.step(index + 1, s, 1000.0)
        builder.kernel("sm90_xmma_gemm_bf16", s + 100, COMPUTE_END[rank] - 100, launch_ts=s + 30)
        tp_start, tp_end = TP_TIMES[rank]
        builder.kernel(ALLREDUCE, s + tp_start, tp_end - tp_start, launch_ts=s + 40, stream=20, args=tp_args)
        builder.kernel("elementwise_kernel", s + tp_end, WORLD_START[rank] - tp_end, launch_ts=s + 45)
        builder.kernel(ALLREDUCE, s + WORLD_START[rank], WORLD_END - WORLD_START[rank], launch_ts=s + 50,
                       stream=21, args=world_args)
    return builder


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    for rank in range(4):
        _rank(rank).write(tmp_path / "traces" / f"rank{rank}.json.gz")
    return tmp_path / "traces"


def test_each_groups_collective_is_compared_among_its_members(traces):
    report = analyze(traces, use_hta=False)
    assert "rank 3 is the straggler: the others wait for it, last at 4 of the 4 collectives it took part in" in report.verdict
    window = report.windows[0]
    stragglers = window.stragglers
    assert stragglers.matched_collectives == 3 * len(STEPS) and stragglers.unmatched_collectives == 0
    by_name = defaultdict(list)
    for detail in stragglers.details:
        by_name[detail.name].append(detail)
    assert sorted(by_name) == sorted([TP_A, TP_B, WORLD])
    for detail in by_name[TP_A]:       # ranks 2 and 3 are not in this group
        assert detail.arrival_us[2:] == [None, None] and detail.wait_us[:2] == [0.0, 0.0]
    for detail in by_name[TP_B]:
        assert detail.arrival_us[:2] == [None, None]
        assert detail.wait_us[2:] == [pytest.approx(150.0), 0.0]
    instances = {(i.step, i.name): i for i in stragglers.worst_instances}
    for step in (1, 2):
        assert instances[(step, TP_B)].last_rank == 3 and instances[(step, TP_B)].participants == 2
        assert instances[(step, TP_B)].lateness_us == pytest.approx(150.0)
        assert instances[(step, TP_A)].lateness_us == pytest.approx(0.0)
        assert instances[(step, WORLD)].last_rank == 3 and instances[(step, WORLD)].participants == 4
        assert instances[(step, WORLD)].lateness_us == pytest.approx(155.0)
    waited = {w.rank: w.waited_us for w in stragglers.by_wait}
    # per step: ranks 0 and 1 wait 155 us at the world all-reduce only; rank 2 150 at TP and 5 at the world
    assert waited == pytest.approx({0: 310.0, 1: 310.0, 2: 310.0, 3: 0.0})
    assert stragglers.waited_for_rank == 3 and stragglers.consistent


def test_clock_offset_comes_from_the_collectives_both_hosts_share(traces):
    # the TP groups never span hosts: their ends (350 on node0, 500 on node1) say nothing about the clocks
    window = analyze(traces, use_hta=False).windows[0]
    node1 = next(h for h in window.clock.hosts if h.host == "node1")
    assert node1.source == "collectives" and node1.collective_samples == len(STEPS)
    assert node1.offset_us == pytest.approx(OFFSET_US, abs=0.01)


def test_merged_trace_joins_each_instance_across_its_groups_members_only(traces, tmp_path):
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace").output)
    assert check.ok, check.problems
    members = defaultdict(set)
    for flow_id, a, b in check.arrows:
        if flow_id & CROSS_RANK_FLOW_BIT:
            for track_uuid, _, _ in (a, b):
                members[flow_id].add(check.process_of(track_uuid).name)
    groups = sorted(sorted(m) for m in members.values())
    tp_a, tp_b = ["rank 0 (node0)", "rank 1 (node0)"], ["rank 2 (node1)", "rank 3 (node1)"]
    assert groups == sorted([tp_a, tp_a, tp_b, tp_b, tp_a + tp_b, tp_a + tp_b])


def test_merged_trace_marks_the_late_arrival_at_its_groups_collective(traces, tmp_path):
    report = analyze(traces, use_hta=False)
    check = check_trace(merge(traces, tmp_path / "out.perfetto-trace", report=report).output)
    marks = [i for i in check.instants if check.tracks[i.track_uuid].name == "fleetscope analysis"
             and i.name.startswith("arrived last")]
    on_rank3 = sorted(i.name for i in marks if check.process_of(i.track_uuid).name == "rank 3 (node1)")
    assert f"arrived last: {TP_B} (step 1 #0)" in on_rank3 and f"arrived last: {WORLD} (step 1 #0)" in on_rank3
    assert all(check.process_of(i.track_uuid).name == "rank 3 (node1)" for i in marks)
