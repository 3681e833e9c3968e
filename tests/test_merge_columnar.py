"""The columnar packet encoder (perfetto/columnar.py) writes the bytes the per-event writer writes:
on rows made to hit every field and edge (varint widths, new names between chunks, flows, annotations,
counters, the sequence's first packet), and on merges of a real H200 trace (the merge's planner, column_plan.py,
is held to the trace processor in test_merge_column_plan.py)."""

from __future__ import annotations

import io
import math
import random
from pathlib import Path

import numpy as np
import pytest

import fleetscope.analysis.merge.run as merge_run
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.perfetto.columnar import FlowColumns, TrackEventColumns, write_track_events
from fleetscope.analysis.merge.perfetto.writer import (
    COUNTER,
    INSTANT,
    SLICE_BEGIN,
    SLICE_END,
    PacketStream,
    SequenceWriter,
    TrackSpec,
)

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
EAGER = FIXTURES / "h200-small-hf-eager-2steps.json.gz"
COLLECTIVE_FLOW = 1 << 63


def random_rows(seed: int, count: int) -> list[tuple]:
    """(type, ts, uuid, name, category, counter value, flows, annotations) rows touching every edge."""
    rng = random.Random(seed)
    names = ["", "aten::mm", "ProfilerStep#3", "ncclDevKernel_AllReduce", "σ-kernel ✓", "x" * 300]
    categories = ["", "kernel", "cpu_op", "gpu_user_annotation"]
    timestamps = [0, 1, 127, 128, 16_383, 16_384, 1_700_000_000_123_456_789, (1 << 63) - 1]
    uuids = [1, 127, 128, (1 << 32) | 5, (200 << 32) | 70_000, (1 << 64) - 1]
    values = [0.0, -0.0, 1.5, -2.25e300, math.inf, -math.inf, math.nan, 7]
    annotation_names = ["call", "dur_us", "idle_us", "σ"]
    annotation_values = ["", "aten::_local_scalar_dense", "σ ✓" * 50, 0, 1, -1, 127, 128, (1 << 63) - 1, -(1 << 63),
                         1 << 63, 0.0, -0.0, 2.5, math.nan, math.inf, True, False, None, [1, 2], {"a": 1}]
    rows = []
    for row in range(count):
        kind = rng.choice([SLICE_BEGIN, SLICE_BEGIN, SLICE_END, SLICE_END, INSTANT, COUNTER])
        if row % 9 == 0:
            names.append(f"op {row}")
        flows = ((), ())
        if kind == SLICE_BEGIN and rng.random() < 0.4:
            outgoing = [rng.choice([row + 1, COLLECTIVE_FLOW | row]) for _ in range(rng.choice([0, 1, 1, 2, 5]))]
            flows = (outgoing, [row + 7] * rng.choice([0, 1, 1, 3]))
        annotations = None
        if kind in (SLICE_BEGIN, INSTANT) and rng.random() < 0.1:
            annotations = {"step": row, "cause": "host stall", "nested": {"a": [1, 2.5, "b"]}, "ok": True}
        elif kind in (SLICE_BEGIN, INSTANT) and rng.random() < 0.3:  # plain values: encoded from columns
            keys = rng.sample(annotation_names, rng.choice([1, 1, 2, 4]))
            annotations = {key: rng.choice(annotation_values) for key in keys}
            if row % 13 == 0:
                annotation_names.append(f"new key {row}")
        ts = rng.choice(timestamps) if rng.random() < 0.3 else rng.randrange(1 << 40, 1 << 61)
        rows.append((kind, ts, rng.choice(uuids), rng.choice(names), rng.choice(categories), rng.choice(values),
                     flows, annotations))
    return rows


def write_each(writer: SequenceWriter, rows: list[tuple]) -> None:
    """The reference: the per-event writer, row by row."""
    for kind, ts, uuid, name, category, value, (outgoing, terminating), annotations in rows:
        if kind == SLICE_BEGIN:
            writer.slice_begin(ts, uuid, name, category, flow_ids=outgoing, terminating_flow_ids=terminating,
                               annotations=annotations)
        elif kind == INSTANT:
            writer.instant(ts, uuid, name, category, annotations=annotations)
        elif kind == COUNTER:
            writer.counter(ts, uuid, value)
        else:
            writer.slice_end(ts, uuid)


def as_columns(rows: list[tuple]) -> TrackEventColumns:
    named = [r for r in rows if r[0] in (SLICE_BEGIN, INSTANT)]
    return TrackEventColumns(
        types=np.array([r[0] for r in rows], dtype=np.uint8),
        timestamps_ns=np.array([r[1] for r in rows], dtype=np.int64),
        track_uuids=np.array([r[2] for r in rows], dtype=np.uint64),
        names=[r[3] for r in named], categories=[r[4] for r in named],
        counter_values=np.array([r[5] for r in rows if r[0] == COUNTER], dtype=np.float64),
        flows=FlowColumns.of_rows({i: r[6] for i, r in enumerate(rows) if r[0] == SLICE_BEGIN and (r[6][0] or r[6][1])}),
        annotations={i: r[7] for i, r in enumerate(rows) if r[7]},
    )


def encoded(batches: list[list[tuple]], *, columnar: bool, started: bool, chunk_rows: int = 1 << 14) -> bytes:
    handle = io.BytesIO()
    stream = PacketStream(handle, batch_packets=3)
    writer = SequenceWriter(stream=stream, sequence_id=300)
    if started:
        writer.track(TrackSpec(uuid=1, name="rank 0", pid=1_000_000, order=0))
    for rows in batches:
        if columnar:
            write_track_events(writer, as_columns(rows), chunk_rows=chunk_rows)
        else:
            write_each(writer, rows)
    stream.flush()
    return handle.getvalue()


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1 << 14])
@pytest.mark.parametrize("started", [True, False])
def test_columns_encode_to_the_per_event_writers_bytes(chunk_rows, started):
    batches = [random_rows(seed, count) for seed, count in ((1, 300), (2, 0), (3, 157))]
    assert encoded(batches, columnar=True, started=started, chunk_rows=chunk_rows) == \
        encoded(batches, columnar=False, started=started)


def test_a_negative_timestamp_is_refused_as_the_per_event_writer_refuses_it():
    rows = random_rows(4, 20)
    rows[11] = (SLICE_END, -5, 3, "", "", 0.0, ((), ()), None)
    for columnar in (True, False):
        with pytest.raises(ValueError):
            encoded([rows], columnar=columnar, started=True)


def merged_bytes(tmp_path: Path, name: str, *, generic_reader: bool, monkeypatch, **options) -> Path:
    """The merge of EAGER decoded to columns, or read by the generic reader (as a file the decoder refuses)."""
    with monkeypatch.context() as patch:
        if generic_reader:
            patch.setattr(merge_run, "decode_window", lambda data: None)
        result = merge_run.merge(EAGER, tmp_path / name, options=MergeOptions(workers=1, **options))
    return result.output


@pytest.mark.parametrize("options", [{"event_args": True}, {"event_args": True, "steps": frozenset({1}),
                                                            "overlays": False}],
                         ids=["event-args", "event-args-one-step-no-overlays"])
def test_a_real_merge_is_the_same_trace_either_way(tmp_path, monkeypatch, options):
    """With the events' args drawn, the planner's columns take them from the generic reader's events, whichever
    reader gave the columns."""
    columnar = merged_bytes(tmp_path, "columnar.perfetto-trace", generic_reader=False, monkeypatch=monkeypatch,
                            **options)
    per_event = merged_bytes(tmp_path, "generic.perfetto-trace", generic_reader=True, monkeypatch=monkeypatch,
                             **options)
    new, old = check_trace(columnar), check_trace(per_event)
    assert new.ok, new.problems[:5]
    assert new.slices == old.slices and new.instants == old.instants
    assert new.arrows == old.arrows and dict(new.counter_values) == dict(old.counter_values)
    assert len(new.slices) > 20_000 and new.arrows
    assert columnar.read_bytes() == per_event.read_bytes()


@pytest.mark.parametrize("begin_idents", [[5, 8, 7, -1], [5, 5, 7, -1]], ids=["unique", "repeated"])
def test_each_slice_begin_gets_the_flows_of_its_ident(begin_idents):
    from fleetscope.analysis.merge.flows import FlowPlan
    from fleetscope.analysis.merge.operation_columns import _planned_flows

    flows = FlowPlan()
    flows.outgoing.update({5: [1, 2], 9: [3], 7: [6]})
    flows.terminating.update({7: [4], 5: [11]})
    rows = np.arange(0, 2 * len(begin_idents), 2)
    columns = _planned_flows(rows, np.array(begin_idents, dtype=np.int64), flows)
    for row, ident in zip(rows.tolist(), begin_idents):
        assert columns.of_row(row) == (list(flows.outgoing.get(ident, [])), list(flows.terminating.get(ident, [])))
