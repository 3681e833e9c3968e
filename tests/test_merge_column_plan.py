"""The merge's plan on columns (column_plan.py) against the per-event planner (plan.py): the same bytes."""

from __future__ import annotations

import copy
import json
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
    LAUNCH_FLOWS_LEFT_OUT,
    TRACE_FLOW_STEPS_LEFT_OUT,
    FlowPlan,
    plan_trace_flows,
)
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.slice_table import SliceTable
from fleetscope.analysis.merge.tracks import RankTracks
from fleetscope.analysis.merge.verify import verify_outputs
from fleetscope.analysis.merge.window import GroupedEvents

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


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


def _merged_bytes(source: Path, out: Path, monkeypatch, *, per_event: bool, **options) -> bytes:
    with monkeypatch.context() as patched:
        if per_event:
            patched.setattr(merge_run, "decode_window", lambda data: None)
        merge_run.merge(source, out, options=MergeOptions(workers=1, **options), use_cache=False)
    return out.read_bytes()


@pytest.mark.parametrize("options", [{}, {"steps": frozenset({1})}, {"drop_python_functions": True},
                                     {"overlays": False, "flows": False}])
def test_columnar_plan_writes_the_per_event_planners_bytes(tmp_path, monkeypatch, options):
    source = FIXTURES / "h200-small-hf-eager-2steps.json.gz"
    columnar = _merged_bytes(source, tmp_path / "columnar.perfetto-trace", monkeypatch, per_event=False, **options)
    per_event = _merged_bytes(source, tmp_path / "per-event.perfetto-trace", monkeypatch, per_event=True, **options)
    assert columnar == per_event


def test_a_window_the_decoder_refuses_is_planned_event_by_event(tmp_path, monkeypatch):
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": "1", "dur": 2, "pid": 1, "tid": 1},'
                     '{"ph": "X", "name": "b", "ts": 3, "dur": 2, "pid": 1, "tid": 1}]}')
    planned = []
    plan_window = merge_run.plan_window
    monkeypatch.setattr(merge_run, "plan_window", lambda *args: planned.append(1) or plan_window(*args))
    result = merge_run.merge(trace, tmp_path / "out.perfetto-trace", options=MergeOptions(workers=1), use_cache=False)
    assert planned and result.slice_count == 1


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


@pytest.mark.parametrize("seed", range(3))
def test_trace_flows_bound_on_arrays_are_the_per_event_bindings(seed):
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
        plans, tracks, sorted_threads = [], [], []
        for bind in (plan_trace_flows, plan_trace_flows_on_columns):
            each_table = copy.deepcopy(table)
            plan, rank_tracks = FlowPlan(launch_flow_count=launch_flows), RankTracks.for_rank(0)
            bind(grouped, rank_tracks, plan, ColumnSliceFinder(each_table))
            plans.append((dict(plan.outgoing), dict(plan.terminating), plan.trace_flow_count,
                          plan.trace_flow_steps_left_out))
            tracks.append(rank_tracks.new_flow_id())
            sorted_threads.append(each_table.sorted_threads)
        assert plans[0] == plans[1] and tracks[0] == tracks[1] and sorted_threads[0] == sorted_threads[1]
        chains += plans[0][2]
        left_out += plans[0][3]
    assert chains > 100 and left_out > 5


def _merged(source: Path, out: Path, monkeypatch, *, per_event: bool) -> merge_run.MergeResult:
    """The merge of `source` by the columnar planner, or by the per-event one."""
    with monkeypatch.context() as patched:
        if per_event:
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


@pytest.mark.parametrize("per_event", [False, True])
def test_arrows_perfetto_cannot_join_in_begin_order_are_counted_not_drawn(tmp_path, monkeypatch, per_event):
    trace = _sync_edge_trace(tmp_path / "rank0.pt.trace.json")
    result = _merged(trace, tmp_path / "out.perfetto-trace", monkeypatch, per_event=per_event)
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
    columnar = _merged_bytes(trace, tmp_path / "columnar.perfetto-trace", monkeypatch, per_event=False)
    per_event = _merged_bytes(trace, tmp_path / "per-event.perfetto-trace", monkeypatch, per_event=True)
    assert columnar == per_event


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


@pytest.mark.parametrize("per_event", [False, True])
@pytest.mark.parametrize("launch", [False, True])
@pytest.mark.parametrize("end_thread_first", [False, True])
def test_an_arrow_between_slices_that_begin_together_is_drawn_only_when_its_start_is_written_first(
        tmp_path, monkeypatch, per_event, launch, end_thread_first):
    trace = _equal_begins_trace(tmp_path / "rank0.pt.trace.json", end_thread_first=end_thread_first, launch=launch)
    result = _merged(trace, tmp_path / "out.perfetto-trace", monkeypatch, per_event=per_event)
    check = check_trace(result.output)
    assert check.ok, check.problems
    reason = LAUNCH_FLOWS_LEFT_OUT if launch else TRACE_FLOW_STEPS_LEFT_OUT
    assert len(check.arrows) == (0 if end_thread_first else 1)
    assert [note.reason for note in result.notes] == ([f"1 events: {reason}"] if end_thread_first else [])
    # the trace processor, where there is one, joins exactly the arrows the file holds (merge --verify)
    assert verify_outputs(result, engine=True) == []


@pytest.mark.parametrize("folder", ["kineto/resnet50_2021", "hta/ns_resolution", "hta/cpu_only"])
def test_epoch_microsecond_traces_are_planned_on_columns_with_the_same_bytes(tmp_path, monkeypatch, folder):
    """Epoch-microsecond timestamps as JSON integers (2021's Kineto) or floats with sub-microsecond digits take the
    columnar planner too (they fell back to the per-event one): an int's nanoseconds are figured exactly, a float's
    as Python's float64 product, so both planners write the same bytes."""
    source = Path(__file__).parent / "fixtures" / "public" / folder
    refused = []
    plan_columns = merge_run.plan_window_columns

    def watched(*args):
        try:
            return plan_columns(*args)
        except merge_run.ColumnsRefused as error:
            refused.append(str(error))
            raise

    monkeypatch.setattr(merge_run, "plan_window_columns", watched)
    columnar = _merged_bytes(source, tmp_path / "columnar.perfetto-trace", monkeypatch, per_event=False)
    assert refused == []
    per_event = _merged_bytes(source, tmp_path / "per-event.perfetto-trace", monkeypatch, per_event=True)
    assert columnar == per_event


def test_nanoseconds_of_epoch_ints_are_exact_and_of_floats_python_s():
    from fleetscope.analysis.merge.window_decode import nanoseconds

    values = [1623142623531625, 1712195495502094.565, 12.5, -3, 0.0005]
    assert nanoseconds(values, 7).tolist() == [7 + round(v * 1000) for v in values]
    assert nanoseconds([float("nan")], 0) is None and nanoseconds([1e300], 0) is None
