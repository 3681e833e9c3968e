"""The merged Perfetto trace on small hand-made Kineto traces (fast, no torchrun).

Every test reads the written trace back with the perfetto package's protobuf classes
(`fleetscope.analysis.merge.perfetto.check`) and compares it with what the inputs say.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from fleetscope.analysis.merge.run import PROCESS_PID_BASE, merge
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.sources import find_merge_inputs
from fleetscope.traces.clock import ClockOffset, write_clock_offset
from fleetscope.analysis.merge.perfetto.check import check_trace, iter_packets
from fleetscope.analysis.merge.tracks import NO_EVENT, OP_BEGIN, OP_END, nest_into_lanes
from fleetscope.traces.layout import RunLayout

BASE_NS = 1_790_000_000_000_000_000
MAIN_PID = 4242


def complete(name: str, ts_us: float, dur_us: float, *, tid: int = MAIN_PID, pid: int = MAIN_PID,
             cat: str = "cpu_op", args: dict | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts_us, "dur": dur_us}
    if args is not None:
        event["args"] = args
    return event


def kernel(name: str, ts_us: float, dur_us: float, *, stream: int = 7, correlation: int = 1) -> dict:
    return complete(name, ts_us, dur_us, pid=0, tid=stream, cat="kernel",
                    args={"device": 0, "stream": stream, "correlation": correlation})


def thread_name(tid: int, name: str, pid: int = MAIN_PID) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def kineto_document(rank: int | None, events: list[dict], *, host: str = "node0", base_ns: int = BASE_NS,
                    world_size: int = 2) -> dict:
    document = {"schemaVersion": 1, "host_name": host, "baseTimeNanoseconds": base_ns, "traceEvents": events}
    if rank is not None:
        document = {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size}, **document}
    return document


def write_trace(path: Path, document: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(document).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def gpu_rank_events(shift_us: float = 0.0) -> list[dict]:
    """A CPU thread launching kernels, a GPU stream where an annotation crosses kernel boundaries,
    a second CPU thread, instants, a counter, and events Perfetto must not drop (zero/negative dur)."""
    s = shift_us
    return [
        thread_name(MAIN_PID, "thread 4242 (python3)"),
        thread_name(4300, "thread 4300 (pt_autograd_0)"),
        complete("ProfilerStep#3", s + 0, 1000, cat="user_annotation"),
        complete("aten::mm", s + 10, 100),
        complete("cudaLaunchKernel", s + 20, 5, cat="cuda_runtime", args={"correlation": 11}),
        complete("aten::add", s + 200, 50),
        complete("aten::empty", s + 210, 0),
        complete("aten::bad_clock", s + 220, -3),
        complete("python_a", s + 300, 200, cat="python_function"),
        complete("python_b", s + 400, 200, cat="python_function"),  # crosses python_a
        complete("backward", s + 50, 400, tid=4300, cat="user_annotation"),
        kernel("sm90_gemm", s + 30, 60, correlation=11),
        kernel("ncclDevKernel_AllReduce", s + 95, 300, correlation=12),
        complete("forward", s + 25, 100, pid=0, tid=7, cat="gpu_user_annotation",
                 args={"device": 0, "stream": 7}),  # crosses the NCCL kernel
        {"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": MAIN_PID,
         "tid": MAIN_PID, "ts": s + 15, "args": {"Total Allocated": 3 << 20, "Total Reserved": 4 << 20,
                                                 "Device Type": 1, "Device Id": 0}},
        {"ph": "i", "s": "t", "cat": "user_instant", "name": "checkpoint", "pid": MAIN_PID, "tid": 4300,
         "ts": s + 60},
        {"ph": "s", "id": 5, "pid": MAIN_PID, "tid": MAIN_PID, "ts": s + 10, "cat": "fwdbwd", "name": "fwdbwd"},
        {"ph": "f", "id": 5, "pid": MAIN_PID, "tid": 4300, "ts": s + 50, "cat": "fwdbwd", "name": "fwdbwd", "bp": "e"},
        {"ph": "s", "id": 11, "pid": MAIN_PID, "tid": MAIN_PID, "ts": s + 20, "cat": "ac2g", "name": "ac2g"},
        {"ph": "f", "id": 11, "pid": 0, "tid": 7, "ts": s + 30, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        {"ph": "C", "name": "queue", "pid": MAIN_PID, "ts": s + 40, "args": {"depth": 3}},
        {"ph": "C", "name": "queue", "pid": MAIN_PID, "ts": s + 80, "args": {"depth": 1}},
    ]


def expected_slices(document: dict, offset_ns: int = 0) -> Counter:
    """(name, start_ns, end_ns) of every complete event, on the merged clock."""
    base = document.get("baseTimeNanoseconds", 0)
    found: Counter = Counter()
    for event in document["traceEvents"]:
        if event.get("ph") == "X":
            start = base + round(event["ts"] * 1000) - offset_ns
            found[(event["name"], start, start + max(0, round(event["dur"] * 1000)))] += 1
    return found


def rebuilt_slices(check, process_name: str) -> Counter:
    """Slices of recorded events (not the analysis overlay) in one process."""
    return Counter((s.name, s.start_ns, s.end_ns) for s in check.slices
                   if check.process_of(s.track_uuid).name == process_name
                   and not check.tracks[s.track_uuid].name.startswith("fleetscope analysis"))


@pytest.fixture
def two_rank_dir(tmp_path: Path) -> dict[int, dict]:
    documents = {
        0: kineto_document(0, gpu_rank_events(), host="node0"),
        1: kineto_document(1, gpu_rank_events(shift_us=5.5), host="node1", base_ns=BASE_NS + 2_000),
    }
    for rank, document in documents.items():
        write_trace(tmp_path / "traces" / f"worker{rank}.pt.trace.json.gz", document)
    return documents


# --- lane layout (pure) ---------------------------------------------------------------------

def made_up(start: int, end: int, name: str) -> tuple:
    return (start, end, name, "", NO_EVENT, None)


def test_nested_slices_share_one_lane():
    slices = [made_up(0, 100, "parent"), made_up(10, 20, "child"), made_up(20, 20, "empty"), made_up(30, 100, "tail")]
    operations: list[tuple] = []
    lanes = nest_into_lanes(slices, operations)
    assert lanes == 1
    assert [op[:2] for op in operations if op[1] == OP_BEGIN] == [(0, OP_BEGIN), (10, OP_BEGIN), (20, OP_BEGIN), (30, OP_BEGIN)]


def test_crossing_slices_move_to_an_extra_lane_deterministically():
    slices = [made_up(0, 100, "a"), made_up(50, 150, "b"), made_up(60, 70, "c"), made_up(120, 130, "d")]
    operations: list[tuple] = []
    lanes = nest_into_lanes(slices, operations)
    again: list[tuple] = []
    assert nest_into_lanes(list(slices), again) == lanes and again == operations
    assert lanes == 2
    lane_of = {op[3]: op[2] for op in operations if op[1] == OP_BEGIN}
    assert lane_of == {"a": 0, "b": 1, "c": 0, "d": 0}  # lane 0 is free again after a ends


def test_every_lane_is_time_ordered_and_balanced():
    slices = sorted([made_up(i * 7 % 50, i * 7 % 50 + (i * 13) % 40, f"s{i}") for i in range(60)],
                    key=lambda s: (s[0], -s[1]))
    operations: list[tuple] = []
    lanes = nest_into_lanes(slices, operations, lane_id=lambda lane: 100 + lane)
    assert {op[2] for op in operations} == set(range(100, 100 + lanes))
    for lane in range(100, 100 + lanes):
        depth, last = 0, -1
        for op in (op for op in operations if op[2] == lane):
            assert op[0] >= last
            last = op[0]
            depth += 1 if op[1] == OP_BEGIN else -1
            assert depth >= 0
        assert depth == 0
    assert sum(op[1] == OP_END for op in operations) == len(slices)


# --- whole merges of hand-made traces ---------------------------------------------------------

def test_merge_writes_one_process_per_rank_in_rank_order(two_rank_dir, tmp_path):
    result = merge(tmp_path / "traces", tmp_path / "out.perfetto-trace")
    check = check_trace(result.output)
    assert check.ok, check.problems
    processes = check.processes()
    assert [(p.name, p.pid, p.order) for p in processes] == [
        ("rank 0 (node0)", PROCESS_PID_BASE, 0),
        ("rank 1 (node1)", PROCESS_PID_BASE + 1, 1),
    ]
    assert result.ranks == [0, 1]
    assert result.output_bytes == result.output.stat().st_size > 0


def test_every_complete_event_becomes_a_slice_with_its_exact_interval(two_rank_dir, tmp_path):
    result = merge(tmp_path / "traces", tmp_path / "out.perfetto-trace")
    check = check_trace(result.output)
    for rank, document in two_rank_dir.items():
        process = f"rank {rank} ({document['host_name']})"
        expected = expected_slices(document)
        assert result.slices_per_rank[rank] == sum(expected.values())
        assert rebuilt_slices(check, process) == expected
    negative = [p for p in result.notes if "negative duration" in p.reason]
    assert len(negative) == 2 and all(p.path for p in negative)
    assert result.problems == []


def test_tracks_are_named_for_threads_and_gpu_streams_with_overlap_lanes(two_rank_dir, tmp_path):
    check = check_trace(merge(tmp_path / "traces", tmp_path / "out.perfetto-trace").output)
    rank0 = check.processes()[0]
    names = {t.name for t in check.tracks.values() if t.parent_uuid == rank0.uuid}
    assert {"thread 4242 (python3)", "thread 4300 (pt_autograd_0)", "GPU 0 stream 7",
            "GPU 0 stream 7 [overlap 1]", "thread 4242 (python3) [overlap 1]", "queue"} <= names
    by_name = {t.name: t for t in check.tracks.values() if t.parent_uuid == rank0.uuid}
    ordered = [t.name for t in sorted(by_name.values(), key=lambda t: t.order)]
    assert ordered[0] == "fleetscope analysis"
    main = ordered.index("thread 4242 (python3)")
    assert ordered[main + 1] == "thread 4242 (python3) [overlap 1]"
    assert main < ordered.index("thread 4300 (pt_autograd_0)") < ordered.index("GPU 0 stream 7")
    assert all(by_name[name].is_counter for name in ordered[1:main])
    assert by_name["queue"].is_counter
    assert check.counter_values[by_name["queue"].uuid] == [(BASE_NS + 40_000, 3.0), (BASE_NS + 80_000, 1.0)]
    gpu_slices = {s.name: s for s in check.slices if check.tracks[s.track_uuid].name.startswith("GPU 0 stream 7")
                  and check.process_of(s.track_uuid).uuid == rank0.uuid}
    assert gpu_slices["forward"].track_uuid != gpu_slices["ncclDevKernel_AllReduce"].track_uuid
    assert gpu_slices["sm90_gemm"].category == "kernel"


def test_instants_are_kept_and_memory_events_become_counters(two_rank_dir, tmp_path):
    check = check_trace(merge(tmp_path / "traces", tmp_path / "out.perfetto-trace").output)
    assert check.instant_count_by_process() == Counter({"rank 0 (node0)": 1, "rank 1 (node1)": 1})
    rank0 = check.processes()[0]
    counters = {t.name: check.counter_values[t.uuid] for t in check.tracks.values()
                if t.is_counter and t.parent_uuid == rank0.uuid}
    assert counters["GPU 0 memory allocated (MiB)"] == [(BASE_NS + 15_000, 3.0)]
    assert counters["GPU 0 memory reserved (MiB)"] == [(BASE_NS + 15_000, 4.0)]


def test_names_are_interned_once_per_rank(two_rank_dir, tmp_path):
    result = merge(tmp_path / "traces", tmp_path / "out.perfetto-trace")
    interned_names = Counter()
    for packet in iter_packets(result.output):
        for entry in packet.interned_data.event_names:
            interned_names[(packet.trusted_packet_sequence_id, entry.name)] += 1
        if packet.HasField("track_event") and packet.track_event.type == packet.track_event.TYPE_SLICE_BEGIN:
            assert not packet.track_event.name, "slice names must be interned, not inline"
    assert interned_names and max(interned_names.values()) == 1
    assert len({sequence for sequence, _ in interned_names}) == 2


def step_starts(check) -> dict[str, int]:
    return {check.process_of(s.track_uuid).name: s.start_ns for s in check.slices if s.name == "ProfilerStep#3"}


def test_timestamps_are_wall_clock_minus_the_rank_offset(two_rank_dir, tmp_path):
    plain = check_trace(merge(tmp_path / "traces", tmp_path / "a.perfetto-trace").output)
    shifted = check_trace(merge(tmp_path / "traces", tmp_path / "b.perfetto-trace", offsets_ns={1: 7_000}).output)
    assert step_starts(plain) == {"rank 0 (node0)": BASE_NS, "rank 1 (node1)": BASE_NS + 2_000 + 5_500}
    assert step_starts(shifted) == {"rank 0 (node0)": BASE_NS, "rank 1 (node1)": BASE_NS + 7_500 - 7_000}
    assert rebuilt_slices(shifted, "rank 1 (node1)") == expected_slices(two_rank_dir[1], offset_ns=7_000)


def test_run_directory_windows_share_one_process_and_clock_files_apply(tmp_path):
    layout = RunLayout.at(tmp_path / "run")
    documents = {}
    for window in (0, 1):
        for rank in (0, 1):
            document = kineto_document(rank, gpu_rank_events(shift_us=window * 10_000.0), host=f"node{rank}")
            write_trace(layout.trace_file(window, rank, f"node{rank}"), document)
            documents[(window, rank)] = document
    layout.clock_dir.mkdir(parents=True)
    write_clock_offset(ClockOffset(rank=1, offset_us=1.5, uncertainty_us=0.04, best_round_trip_us=0.08, round_trips=16,
                                   host="node1", measured_at_ns=0), layout.clock_file(1))
    result = merge(layout.root)
    assert result.output == layout.merged_trace and not layout.manifest_file.exists()
    check = check_trace(result.output)
    assert check.ok, check.problems
    assert [p.name for p in check.processes()] == ["rank 0 (node0)", "rank 1 (node1)"]
    for rank in (0, 1):
        expected = sum((expected_slices(documents[(w, rank)], offset_ns=1_500 * rank) for w in (0, 1)), Counter())
        assert rebuilt_slices(check, f"rank {rank} (node{rank})") == expected
    assert [len(s.files) for s in result.per_rank] == [2, 2]
    assert [s.clock_offset_ns for s in result.per_rank] == [0, 1_500]


def test_rank_comes_from_distributed_info_then_name_then_order(tmp_path):
    # rank 3 of 4 (a rank beyond the declared world size would be refused as inconsistent)
    write_trace(tmp_path / "a.json", kineto_document(3, [complete("x", 0, 1)], world_size=4))
    write_trace(tmp_path / "b_rank1.json", kineto_document(None, [complete("x", 0, 1)]))
    write_trace(tmp_path / "c.json", kineto_document(None, [complete("x", 0, 1)]))
    inputs = find_merge_inputs(tmp_path)
    assert [(s.rank, s.files[0].path.name) for s in inputs.ranks] == [(0, "c.json"), (1, "b_rank1.json"), (3, "a.json")]


def test_corrupt_trace_is_reported_by_name_and_the_others_merged(two_rank_dir, tmp_path):
    broken = tmp_path / "traces" / "worker2_rank2.pt.trace.json.gz"
    broken.write_bytes(gzip.compress(b'{"traceEvents": [')[:-6])
    result = merge(tmp_path / "traces", tmp_path / "out.perfetto-trace")
    assert result.ranks == [0, 1]
    assert any(p.path == str(broken) and p.rank == 2 for p in result.problems)
    assert check_trace(result.output).ok


def test_only_the_chosen_ranks_are_merged(two_rank_dir, tmp_path):
    result = merge(tmp_path / "traces", tmp_path / "out.perfetto-trace", options=MergeOptions(ranks=frozenset({1})))
    assert [p.name for p in check_trace(result.output).processes()] == ["rank 1 (node1)"]
    with pytest.raises(ValueError, match=r"ranks \[7\] not found"):
        merge(tmp_path / "traces", tmp_path / "out.perfetto-trace", options=MergeOptions(ranks=frozenset({7})))


@pytest.mark.damaged_trace
def test_checker_catches_an_unbalanced_track(tmp_path):
    from fleetscope.analysis.merge.perfetto.writer import PacketStream, SequenceWriter, TrackSpec

    path = tmp_path / "bad.perfetto-trace"
    with open(path, "wb") as handle:
        stream = PacketStream(handle)
        writer = SequenceWriter(stream=stream, sequence_id=5)
        writer.track(TrackSpec(uuid=1, name="p", pid=10))
        writer.slice_begin(100, 1, "open", "")
        writer.slice_end(200, 2)
        stream.flush()
    problems = check_trace(path).problems
    assert any("never ends" in p for p in problems)
    assert any("track 2 used before it is described" in p for p in problems)


def test_a_renamed_thread_keeps_its_own_name():
    from fleetscope.analysis.merge.plan import best_thread_name

    names = ["thread 9 (python)", "thread 9 (pt_gloo_runloop)", "thread 9 (python)"]
    assert best_thread_name(names, "python") == "thread 9 (pt_gloo_runloop)"
    assert best_thread_name(["thread 1 (python)"], "python") == "thread 1 (python)"
    assert best_thread_name([], "python") is None


@pytest.mark.damaged_trace
def test_large_traces_are_read_back_packet_by_packet(two_rank_dir, tmp_path, monkeypatch):
    import fleetscope.analysis.merge.perfetto.check as perfetto_check

    result = merge(tmp_path / "traces", tmp_path / "out.perfetto-trace")
    whole = [packet.SerializeToString() for packet in iter_packets(result.output)]
    monkeypatch.setattr(perfetto_check, "WHOLE_FILE_PARSE_BYTES", 0)
    monkeypatch.setattr(perfetto_check, "_READ_CHUNK_BYTES", 100)
    assert [packet.SerializeToString() for packet in iter_packets(result.output)] == whole
    truncated = tmp_path / "truncated.perfetto-trace"
    truncated.write_bytes(result.output.read_bytes()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        list(iter_packets(truncated))


@pytest.mark.damaged_trace
def test_checker_catches_thread_tracks_that_share_a_tid_or_name_no_process(tmp_path):
    from fleetscope.analysis.merge.perfetto.writer import PacketStream, SequenceWriter, TrackSpec

    path = tmp_path / "threads.perfetto-trace"
    with open(path, "wb") as handle:
        stream = PacketStream(handle)
        writer = SequenceWriter(stream=stream, sequence_id=5)
        writer.track(TrackSpec(uuid=1, name="rank 0", pid=1_000_000))
        writer.track(TrackSpec(uuid=2, name="a", parent_uuid=1, tid=10_000_000, thread_pid=1_000_000))
        writer.track(TrackSpec(uuid=3, name="b", parent_uuid=1, tid=10_000_000, thread_pid=1_000_000))
        writer.track(TrackSpec(uuid=4, name="c", parent_uuid=1, tid=10_000_001, thread_pid=7))
        stream.flush()
    problems = check_trace(path).problems
    assert any("thread id 10000000 of track 3 is not unique" in p for p in problems), problems
    assert any("names pid 7, which has no process" in p for p in problems), problems


def test_merged_threads_are_thread_tracks_with_unique_tids_per_rank(two_rank_dir, tmp_path):
    check = check_trace(merge(tmp_path / "traces", tmp_path / "out.perfetto-trace").output)
    threads = check.threads()
    assert check.ok and threads
    assert len({t.tid for t in threads}) == len(threads)
    for thread in threads:
        process = check.process_of(thread.uuid)
        assert thread.thread_pid == process.pid and not thread.name.endswith("]")
