"""The merge's planner (column_plan.py) against Perfetto's trace processor: every Kineto event of the input drawn
once, with its arrows; its lane and flow rules on arrays against their references; and a file read by the
generic reader (one the columnar decoder refuses: event_window.py) planned to the same bytes as when decoded."""

from __future__ import annotations

import bisect
import copy
import gzip
import json
from collections import Counter
import random
from pathlib import Path

import fleetscope.analysis.merge.run as merge_run
import numpy as np
import pytest
from fleetscope.analysis.merge.column_flows import (
    ColumnSliceFinder,
    plan_trace_flows_on_columns,
)
from fleetscope.analysis.merge.column_lanes import (
    _one_lane_codes,
    nest_codes,
    slice_lanes,
    track_codes,
)
from fleetscope.analysis.merge.flows import (
    ENCLOSING_SEARCH_LIMIT,
    LAUNCH_FLOWS_COVERED_CATEGORY,
    LAUNCH_FLOWS_LEFT_OUT,
    TRACE_FLOW_STEPS_LEFT_OUT,
    FlowPlan,
    in_begin_order,
)
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.sql import run_query
from fleetscope.analysis.merge.plan import OUTSIDE_CLOCK
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.slice_table import SliceTable
from fleetscope.analysis.merge.tracks import RankTracks, emission_ranks
from fleetscope.analysis.merge.verify import verify_outputs
from fleetscope.analysis.merge.window import GroupedEvents

from helpers import requires_trace_processor, trace_processor

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
NEGATIVE_DURATION = "negative duration clamped to 0 (slice kept)"


@pytest.mark.parametrize("seed", range(4))
def test_one_lane_order_is_the_nesting_loops_where_everything_nests(seed):
    rng = random.Random(seed)
    single = 0
    for _ in range(500):
        count = rng.randint(1, 14)
        slices = sorted(((start, start + rng.choice([0, 0, 1, 2, 3, 5, 8, 13]))
                         for start in (rng.randint(0, 24) for _ in range(count))), key=lambda s: (s[0], -s[1]))
        starts = np.array([s for s, _ in slices], dtype=np.int64)
        ends = np.array([e for _, e in slices], dtype=np.int64)
        codes, _, lane_count = nest_codes(starts.tolist(), ends.tolist())
        fast = _one_lane_codes(starts, ends)
        if lane_count == 1:
            single += 1
            assert fast is not None and fast.tolist() == codes, slices
        else:
            assert fast is None, slices
    assert single > 50


def _merged_bytes(source: Path, out: Path, monkeypatch, *, generic_reader: bool, **options) -> bytes:
    with monkeypatch.context() as patched:
        if generic_reader:
            patched.setattr(merge_run, "decode_window", lambda data: None)
        merge_run.merge(source, out, options=MergeOptions(workers=1, **options), use_cache=False)
    return out.read_bytes()


def _kineto_events(source: Path) -> list[dict]:
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt") as handle:
        return json.load(handle)["traceEvents"]


def _drawn_in_input(events: list[dict]) -> Counter:
    """(category, name) -> count of the slices and instants the merge draws of a Kineto trace (every complete
    event and instant; an instant's category is dropped: '')."""
    drawn = Counter((e.get("cat", ""), e["name"]) for e in events if e.get("ph") == "X")
    drawn.update(("", e["name"]) for e in events if e.get("ph") in ("i", "I"))
    return drawn


def _drawn_in_engine(trace: Path) -> Counter:
    rows = run_query(trace, "SELECT category, name, COUNT(*) AS n FROM slice WHERE category IS NULL "
                            "OR category NOT LIKE 'fleetscope.%' GROUP BY category, name", trace_processor())
    return Counter({(row["category"], row["name"]): int(row["n"]) for row in rows})


GPU_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}


def _arrows_in_input(events: list[dict]) -> Counter:
    """Launch arrows (a GPU slice whose correlation id a host call has; no clock skew in these fixtures) and
    the trace's own `fwdbwd` arrows (one per id with both ends)."""
    host = {e["args"]["correlation"] for e in events if e.get("ph") == "X" and e.get("cat") not in GPU_WORK
            and "correlation" in e.get("args", {})}
    launches = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") in GPU_WORK
                   and e.get("args", {}).get("correlation") in host)
    ends = Counter(e["id"] for e in events if e.get("ph") in ("s", "f") and e.get("cat") == "fwdbwd")
    return Counter(launch=launches, fwdbwd=sum(1 for count in ends.values() if count >= 2))


def _arrows_in_engine(trace: Path) -> Counter:
    rows = run_query(trace, "SELECT so.category AS a, si.category AS b, COUNT(*) AS n FROM flow f "
                            "JOIN slice so ON f.slice_out = so.id JOIN slice si ON f.slice_in = si.id GROUP BY a, b",
                     trace_processor())
    found = Counter()
    for row in rows:
        kind = "launch" if row["b"] in GPU_WORK else "fwdbwd" if (row["a"], row["b"]) == ("cpu_op", "cpu_op") else "other"
        found[kind] += int(row["n"])
    return found


@requires_trace_processor
@pytest.mark.parametrize("options", [{}, {"overlays": False, "flows": False}], ids=["default", "no-flows"])
def test_every_kineto_event_is_drawn_once_with_its_arrows(tmp_path, options):
    source = FIXTURES / "h200-small-hf-eager-2steps.json.gz"
    result = merge_run.merge(source, tmp_path / "out.perfetto-trace", options=MergeOptions(workers=1, **options),
                             use_cache=False)
    events = _kineto_events(source)
    assert _drawn_in_engine(result.output) == _drawn_in_input(events)
    expected = _arrows_in_input(events) if options.get("flows", True) else Counter()
    assert _arrows_in_engine(result.output) == expected
    assert verify_outputs(result, engine=True) == []


@requires_trace_processor
@pytest.mark.parametrize("options", [{"steps": frozenset({1})}, {"time_window_s": (0.0, 0.05)}], ids=["step", "time"])
def test_a_filtered_merge_draws_a_part_of_the_input_and_counts_the_rest(tmp_path, options):
    source = FIXTURES / "h200-small-hf-eager-2steps.json.gz"
    result = merge_run.merge(source, tmp_path / "out.perfetto-trace", options=MergeOptions(workers=1, **options),
                             use_cache=False)
    drawn, given = _drawn_in_engine(result.output), _drawn_in_input(_kineto_events(source))
    assert drawn and all(count <= given[key] for key, count in drawn.items())
    left_out = sum(given.values()) - sum(drawn.values())
    assert left_out > 0 and sum(summary.filtered_count for summary in result.per_rank) == left_out
    assert verify_outputs(result, engine=True) == []


def test_a_file_the_columnar_decoder_refuses_is_planned_from_the_generic_reader_s_events(tmp_path, monkeypatch):
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": "1", "dur": 2, "pid": 1, "tid": 1},'
                     '{"ph": "X", "name": "b", "ts": 3, "dur": 2, "pid": 1, "tid": 1}, 7]}')
    read = []
    window_of_events = merge_run.window_of_events
    monkeypatch.setattr(merge_run, "window_of_events", lambda *args: read.append(1) or window_of_events(*args))
    result = merge_run.merge(trace, tmp_path / "out.perfetto-trace", options=MergeOptions(workers=1), use_cache=False)
    assert read and result.slice_count == 1
    assert sorted(note.reason for note in result.notes) == ["1 events: complete event without numeric ts/dur",
                                                            "1 events: not a JSON object"]


def _edge_times_trace(path: Path, *, huge: bool) -> Path:
    """Complete events the columnar planner once left to a per-event one: one before the trace clock's zero
    and one beyond 2^63 ns once placed (left out, counted), a correlation id beyond int64 (its launch arrow
    drawn) and one beyond 64 bits (no id: no arrow), and with `huge` a time beyond float64's exact nanoseconds that is still writable."""
    events = [
        {"ph": "X", "name": "step", "cat": "user_annotation", "ts": 1000, "dur": 500, "pid": 1, "tid": 1},
        {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 1010, "dur": 5, "pid": 1, "tid": 1,
         "args": {"correlation": 2**63 + 5}},
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 1020, "dur": 50, "pid": 0, "tid": 7,
         "args": {"correlation": 2**63 + 5, "stream": 7, "device": 0}},
        {"ph": "X", "name": "cudaMemcpyAsync", "cat": "cuda_runtime", "ts": 1200, "dur": 5, "pid": 1, "tid": 1,
         "args": {"correlation": 2**64}},
        {"ph": "X", "name": "Memcpy HtoD", "cat": "gpu_memcpy", "ts": 1210, "dur": 5, "pid": 0, "tid": 7,
         "args": {"correlation": 2**64, "stream": 7, "device": 0}},
        {"ph": "X", "name": "before zero", "cat": "cpu_op", "ts": -2_000_000_000, "dur": 5, "pid": 1, "tid": 1},
        {"ph": "X", "name": "beyond 2^63", "cat": "cpu_op", "ts": 9_000_000_000_000_000, "dur": 9e15,
         "pid": 1, "tid": 1},
        {"ph": "X", "name": "negative", "cat": "cpu_op", "ts": 1100, "dur": -3, "pid": 1, "tid": 1},
    ]
    if huge:
        events.append({"ph": "X", "name": "late", "cat": "cpu_op", "ts": 5_000_000_000_000_000, "dur": 1,
                       "pid": 1, "tid": 2})
    path.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": 1_000_000_000, "traceEvents": events}))
    return path


@requires_trace_processor
@pytest.mark.parametrize("huge", [False, True])
def test_events_outside_the_writable_clock_are_left_out_counted_on_columns(tmp_path, monkeypatch, huge):
    trace = _edge_times_trace(tmp_path / "rank0.pt.trace.json", huge=huge)
    monkeypatch.setattr(merge_run, "window_of_events", None)   # the columnar decoder takes every such window
    result = merge_run.merge(trace, tmp_path / "out.perfetto-trace", options=MergeOptions(workers=1, overlays=False),
                             use_cache=False)
    drawn = {name for _, name in _drawn_in_engine(result.output)}
    assert drawn == {"step", "cudaLaunchKernel", "gemm", "cudaMemcpyAsync", "Memcpy HtoD", "negative"} | (
        {"late"} if huge else set())
    assert _arrows_in_engine(result.output) == Counter(launch=1)
    assert sorted(note.reason for note in result.notes) == [
        f"1 events: {NEGATIVE_DURATION}", f"2 events: {OUTSIDE_CLOCK}"]


@pytest.mark.parametrize("huge", [False, True])
def test_the_generic_reader_s_events_leave_out_the_same_events_in_the_same_bytes(tmp_path, monkeypatch, huge):
    trace = _edge_times_trace(tmp_path / "rank0.pt.trace.json", huge=huge)
    columnar = _merged_bytes(trace, tmp_path / "columnar.perfetto-trace", monkeypatch, generic_reader=False)
    generic_reader = _merged_bytes(trace, tmp_path / "generic-reader.perfetto-trace", monkeypatch, generic_reader=True)
    assert columnar == generic_reader


@pytest.mark.parametrize("seed", range(4))
def test_lanes_on_arrays_are_the_nesting_loops(seed):
    rng = random.Random(seed)
    on_arrays = 0
    for _ in range(1500):
        count = rng.randint(1, 40)
        slices = sorted(((start, start + rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 30]))
                         for start in (rng.randint(0, 60) for _ in range(count))), key=lambda s: (s[0], -s[1]))
        starts = np.array([s for s, _ in slices], dtype=np.int64)
        ends = np.array([e for _, e in slices], dtype=np.int64)
        codes, lanes, lane_count = nest_codes(starts.tolist(), ends.tolist())
        fast_codes, fast_lanes, fast_count = track_codes(starts, ends)
        assert (fast_codes.tolist(), fast_lanes.tolist(), fast_count) == (codes, lanes, lane_count), slices
        on_arrays += lane_count > 1 and slice_lanes(starts, ends) is not None
    assert on_arrays > 300


def _random_table(rng: random.Random) -> SliceTable:
    threads = [(1, 1), (1, 2), (2, 7)]
    rows = sorted((rng.randint(0, 60), rng.choice([0, 1, 3, 8, 20]), rng.randrange(len(threads)))
                   for _ in range(rng.randint(0, 30)))
    starts = np.array([start for start, _, _ in rows], dtype=np.int64)
    count = len(rows)
    return SliceTable(idents=np.arange(count, dtype=np.int64) * 3, starts=starts,
                      ends=starts + np.array([length for _, length, _ in rows], dtype=np.int64), names=["a"],
                      name_ids=np.zeros(count, dtype=np.int64), categories=["c"],
                      category_ids=np.zeros(count, dtype=np.int64), threads=threads,
                      thread_ids=np.array([thread for _, _, thread in rows], dtype=np.int64),
                      correlations=np.zeros(count, dtype=np.int64), has_correlation=np.zeros(count, dtype=bool))


def _reference_trace_flows(table: SliceTable, grouped: GroupedEvents, plan: FlowPlan, tracks: RankTracks) -> None:
    """Chrome JSON's binding of flow events, one event at a time: each end to the latest-starting slice of its
    thread that encloses it (or, for an `f` without `bp: e`, the next slice to start), each chain's slices in
    (time, slice) order, each once, drawn where Perfetto can join them (flows.in_begin_order)."""
    by_thread: dict[tuple, list[tuple[int, int, int]]] = {}
    for row in np.lexsort((np.arange(len(table.starts)), -table.ends, table.starts)).tolist():
        thread = table.threads[table.thread_ids[row]]
        by_thread.setdefault(thread, []).append((int(table.starts[row]), int(table.ends[row]), int(table.idents[row])))
    ranks = emission_ranks(table.threads, {})
    begin_of = {ident: (start, ranks[thread]) for thread, rows in by_thread.items() for start, _, ident in rows}

    def bound(thread: tuple, ts: int, enclosing: bool) -> int | None:
        rows = by_thread.get(thread, [])
        starts = [start for start, _, _ in rows]
        if not enclosing:
            index = bisect.bisect_left(starts, ts)
            return rows[index][2] if index < len(rows) else None
        index = bisect.bisect_right(starts, ts) - 1
        return next((rows[i][2] for i in range(index, max(index - ENCLOSING_SEARCH_LIMIT, -1), -1)
                     if rows[i][1] >= ts), None)

    chains: dict[tuple, list[tuple[int, int]]] = {}
    for _, category, flow_id, thread, ts, enclosing in grouped.flow_events:
        ident = None if category == LAUNCH_FLOWS_COVERED_CATEGORY and plan.launches_matched else \
            bound(thread, ts, enclosing)
        if ident is not None:
            chains.setdefault((category, flow_id), []).append((ts, ident))
    for key in sorted(chains, key=str):
        idents = list(dict.fromkeys(ident for _, ident in sorted(chains[key])))
        idents = in_begin_order(idents, begin_of.__getitem__, plan) if len(idents) >= 2 else idents
        if len(idents) >= 2:
            flow_id = tracks.new_flow_id()
            for ident in idents[:-1]:
                plan.outgoing[ident].append(flow_id)
            plan.terminating[idents[-1]].append(flow_id)
            plan.trace_flow_count += 1


@pytest.mark.parametrize("seed", range(3))
def test_trace_flows_bound_on_arrays_are_chrome_json_s_bindings(seed):
    rng = random.Random(seed)
    chains = left_out = 0
    for _ in range(300):
        table = _random_table(rng)
        grouped = GroupedEvents()
        for _ in range(rng.randint(0, 25)):
            grouped.flow_events.append((rng.choice("stf"), rng.choice(["fwdbwd", "ac2g", "user"]),
                                        rng.choice([1, 2, 3, "2", "x"]), rng.choice([(1, 1), (1, 2), (2, 7), (3, 3)]),
                                        rng.randint(-5, 70), rng.random() < 0.7))
        launch_flows = rng.choice([0, 4])
        plans, tracks = [], []
        for reference in (True, False):
            plan, rank_tracks = FlowPlan(launch_flow_count=launch_flows), RankTracks.for_rank(0)
            if reference:
                _reference_trace_flows(table, grouped, plan, rank_tracks)
            else:
                plan_trace_flows_on_columns(grouped, rank_tracks, plan, ColumnSliceFinder(copy.deepcopy(table)))
            plans.append((dict(plan.outgoing), dict(plan.terminating), plan.trace_flow_count,
                          plan.trace_flow_steps_left_out))
            tracks.append(rank_tracks.new_flow_id())
        assert plans[0] == plans[1] and tracks[0] == tracks[1]
        chains += plans[0][2]
        left_out += plans[0][3]
    assert chains > 100 and left_out > 5


def _merged(source: Path, out: Path, monkeypatch, *, generic_reader: bool) -> merge_run.MergeResult:
    """The merge of `source` decoded to columns, or read by the generic reader (the columnar decoder refused)."""
    with monkeypatch.context() as patched:
        if generic_reader:
            patched.setattr(merge_run, "decode_window", lambda data: None)
        return merge_run.merge(source, out, options=MergeOptions(workers=1), use_cache=False)


def _sync_edge_trace(path: Path) -> Path:
    """A host call that waits on the GPU (cudaStreamSynchronize, 100-109 us) and the GPU's `Stream Sync`
    (101-109): HTA's critical-path overlay draws the edge back from the GPU to the host as a flow whose `s`
    binds to the GPU slice and whose `f` (bp e) binds to the enclosing host call, which began first. A
    forward-to-backward flow beside it is drawable; a kernel whose timestamp is 2 us before its launch's
    (host and device clocks apart) has no launch arrow, and its `ac2g` pair is not drawn backwards instead."""
    events = [
        {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 0, "dur": 200, "pid": 1, "tid": 1},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 5, "dur": 20, "pid": 1, "tid": 1},
        {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 10, "dur": 5, "pid": 1, "tid": 1,
         "args": {"correlation": 1}},
        {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 20, "dur": 70, "pid": 0, "tid": 7,
         "args": {"correlation": 1, "stream": 7, "device": 0}},
        {"ph": "X", "name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 100, "dur": 9, "pid": 1, "tid": 1,
         "args": {"correlation": 2}},
        {"ph": "X", "name": "Stream Sync", "cat": "cuda_sync", "ts": 101, "dur": 8, "pid": 0, "tid": 7,
         "args": {"correlation": 2, "stream": 7, "device": 0}},
        {"ph": "X", "name": "backward", "cat": "cpu_op", "ts": 150, "dur": 20, "pid": 1, "tid": 1},
        {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 160, "dur": 5, "pid": 1, "tid": 1,
         "args": {"correlation": 3}},
        {"ph": "X", "name": "relu", "cat": "kernel", "ts": 158, "dur": 10, "pid": 0, "tid": 7,
         "args": {"correlation": 3, "stream": 7, "device": 0}},
        {"ph": "s", "id": 3, "pid": 1, "tid": 1, "ts": 160, "cat": "ac2g", "name": "ac2g"},
        {"ph": "f", "id": 3, "pid": 0, "tid": 7, "ts": 158, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        {"ph": "s", "id": 172, "pid": 0, "tid": 7, "ts": 101, "cat": "critical_path", "name": "critical_path"},
        {"ph": "f", "id": 172, "pid": 1, "tid": 1, "ts": 109, "cat": "critical_path", "name": "critical_path",
         "bp": "e"},
        {"ph": "s", "id": 9, "pid": 1, "tid": 1, "ts": 5, "cat": "fwdbwd", "name": "fwdbwd"},
        {"ph": "f", "id": 9, "pid": 1, "tid": 1, "ts": 150, "cat": "fwdbwd", "name": "fwdbwd", "bp": "e"},
    ]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


@pytest.mark.parametrize("generic_reader", [False, True])
def test_arrows_perfetto_cannot_join_in_begin_order_are_counted_not_drawn(tmp_path, monkeypatch, generic_reader):
    trace = _sync_edge_trace(tmp_path / "rank0.pt.trace.json")
    result = _merged(trace, tmp_path / "out.perfetto-trace", monkeypatch, generic_reader=generic_reader)
    check = check_trace(result.output)
    assert check.ok, check.problems
    assert verify_outputs(result) == []
    drawn = {(a[2], b[2]) for flow_id, a, b in check.arrows}
    assert drawn == {("cudaLaunchKernel", "gemm"), ("cudaStreamSynchronize", "Stream Sync"),
                     ("aten::mm", "backward")}
    assert [note.reason for note in result.notes] == [f"1 events: {TRACE_FLOW_STEPS_LEFT_OUT}",
                                                      f"1 events: {LAUNCH_FLOWS_LEFT_OUT}"]


def test_the_two_planners_draw_the_same_bytes_around_a_flow_left_out(tmp_path, monkeypatch):
    trace = _sync_edge_trace(tmp_path / "rank0.pt.trace.json")
    columnar = _merged_bytes(trace, tmp_path / "columnar.perfetto-trace", monkeypatch, generic_reader=False)
    generic_reader = _merged_bytes(trace, tmp_path / "generic-reader.perfetto-trace", monkeypatch, generic_reader=True)
    assert columnar == generic_reader


def _equal_begins_trace(path: Path, *, end_thread_first: bool, launch: bool) -> Path:
    """Two slices that begin at the same instant, joined by an arrow: a trace flow from thread 1's slice to
    thread 2's, or a launch from a host call to its kernel. The thread that appears first in the trace
    has its track written first at that instant."""
    if launch:
        first = {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 100, "dur": 5, "pid": 0, "tid": 7,
                 "args": {"correlation": 1, "stream": 7, "device": 0}}
        second = {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 100, "dur": 3, "pid": 1,
                  "tid": 1, "args": {"correlation": 1}}
        flows = []
    else:
        first = {"ph": "X", "name": "on_2", "cat": "cpu_op", "ts": 100, "dur": 10, "pid": 1, "tid": 2}
        second = {"ph": "X", "name": "on_1", "cat": "cpu_op", "ts": 100, "dur": 10, "pid": 1, "tid": 1}
        flows = [{"ph": "s", "id": 7, "pid": 1, "tid": 1, "ts": 105, "cat": "fwdbwd", "name": "fwdbwd"},
                 {"ph": "f", "id": 7, "pid": 1, "tid": 2, "ts": 106, "cat": "fwdbwd", "name": "fwdbwd", "bp": "e"}]
    slices = [first, second] if end_thread_first else [second, first]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": slices + flows}))
    return path


@pytest.mark.parametrize("generic_reader", [False, True])
@pytest.mark.parametrize("launch", [False, True])
@pytest.mark.parametrize("end_thread_first", [False, True])
def test_an_arrow_between_slices_that_begin_together_is_drawn_only_when_its_start_is_written_first(
        tmp_path, monkeypatch, generic_reader, launch, end_thread_first):
    trace = _equal_begins_trace(tmp_path / "rank0.pt.trace.json", end_thread_first=end_thread_first, launch=launch)
    result = _merged(trace, tmp_path / "out.perfetto-trace", monkeypatch, generic_reader=generic_reader)
    check = check_trace(result.output)
    assert check.ok, check.problems
    reason = LAUNCH_FLOWS_LEFT_OUT if launch else TRACE_FLOW_STEPS_LEFT_OUT
    assert len(check.arrows) == (0 if end_thread_first else 1)
    assert [note.reason for note in result.notes] == ([f"1 events: {reason}"] if end_thread_first else [])
    # the trace processor, where there is one, joins exactly the arrows the file holds (merge --verify)
    assert verify_outputs(result, engine=True) == []


@requires_trace_processor
@pytest.mark.parametrize("folder", ["kineto/resnet50_2021", "hta/ns_resolution", "hta/cpu_only"])
def test_epoch_microsecond_traces_are_drawn_in_full_on_columns(tmp_path, monkeypatch, folder):
    """Epoch-microsecond timestamps as JSON integers (2021's Kineto) or floats with sub-microsecond digits: an
    int's nanoseconds are figured exactly, a float's as Python's float64 product."""
    source = Path(__file__).parent / "fixtures" / "public" / folder
    monkeypatch.setattr(merge_run, "window_of_events", None)   # the columnar decoder takes every such window
    result = merge_run.merge(source, tmp_path / "out.perfetto-trace", options=MergeOptions(workers=1),
                             use_cache=False)
    given = Counter()
    for path in sorted(source.glob("*.json*")):
        given += _drawn_in_input(_kineto_events(path))
    assert _drawn_in_engine(result.output) == given
    assert verify_outputs(result, engine=True) == []


def test_the_generic_reader_s_events_give_the_same_bytes_for_an_epoch_microsecond_trace(tmp_path, monkeypatch):
    source = Path(__file__).parent / "fixtures" / "public" / "kineto" / "resnet50_2021"
    columnar = _merged_bytes(source, tmp_path / "columnar.perfetto-trace", monkeypatch, generic_reader=False)
    generic_reader = _merged_bytes(source, tmp_path / "generic-reader.perfetto-trace", monkeypatch, generic_reader=True)
    assert columnar == generic_reader


def test_nanoseconds_of_epoch_ints_are_exact_and_of_floats_python_s():
    from fleetscope.analysis.merge.window_decode import nanoseconds

    values = [1623142623531625, 1712195495502094.565, 12.5, -3, 0.0005]
    assert nanoseconds(values, 7).tolist() == [7 + round(v * 1000) for v in values]
    assert nanoseconds([float("nan")], 0) is None and nanoseconds([1e300], 0) is None


@pytest.mark.parametrize("event_args", [False, True])
def test_the_chrome_json_and_args_are_the_same_from_either_reader(tmp_path, monkeypatch, event_args):
    """The Chrome JSON beside the output (and with event args, the debug annotations) written from the columns:
    the same files whichever reader read the trace, arrows and made-up slices included."""
    trace = _sync_edge_trace(tmp_path / "rank0.pt.trace.json")
    written = []
    for generic_reader in (False, True):
        out = tmp_path / f"{generic_reader}.perfetto-trace"
        chrome = tmp_path / f"{generic_reader}.trace.json.gz"
        _merged_bytes(trace, out, monkeypatch, generic_reader=generic_reader, chrome_json=chrome, event_args=event_args)
        with gzip.open(chrome, "rb") as handle:
            written.append((out.read_bytes(), handle.read()))
    assert written[0] == written[1]
    assert b'"correlation"' in written[0][1] and b'"ph":"s"' in written[0][1]
