"""One merged Perfetto trace of all ranks.

`merge(path, out)` reads the Kineto traces of a run directory (or of any directory of traces) and
writes ONE native Perfetto protobuf trace: a process per rank named `rank R (host)` and listed in
rank order, a track per CPU thread and per GPU stream, every complete event as a slice (with its
category), instant events, counters, on one clock (`baseTimeNanoseconds` plus the event's offset,
minus the rank's measured clock offset to rank 0 when the run directory has one).

The trace is streamed: ranks are read one at a time (a rank's windows one after another, all into
its process) and written packet by packet with interned names, so memory is bounded by one trace
file however many ranks there are.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from fleetscope.traces.kineto import TraceReadError, distributed_rank, read_trace
from fleetscope.traces.layout import MERGED_TRACE

from .merge_sources import MergeInputs, MergeProblem, RankSource, TraceFile, find_merge_inputs
from .perfetto_plan import OP_BEGIN, OP_COUNTER, OP_END, OP_INSTANT, RankTracks, WindowClock, WindowPlan, plan_window
from .perfetto_writer import PacketStream, SequenceWriter, TrackSpec, write_preamble

PROCESS_PID_BASE = 1_000_000
"""Process ids in the merged trace are `PROCESS_PID_BASE + rank`: unique, never 0, and the UI's
`rank 3 (node7) 1000003` still ends in the rank. Real pids would collide across hosts."""

_PREAMBLE_SEQUENCE_ID = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMergeSummary:
    """What went into one rank's process."""

    rank: int
    process_name: str
    files: tuple[str, ...]
    """The trace files merged (one per profiling window), in the order they were read."""
    slice_count: int
    instant_count: int
    counter_sample_count: int
    track_count: int
    overlap_track_count: int
    """Extra tracks made for events that overlap others on their thread without nesting."""
    clock_offset_ns: int
    first_timestamp_ns: int | None


@dataclass(frozen=True, kw_only=True)
class MergeResult:
    output: Path
    ranks: list[int]
    """Ranks with a process in the output, in order."""
    slices_per_rank: dict[int, int]
    output_bytes: int
    input_bytes: int
    """Stored (possibly compressed) size of the trace files read."""
    elapsed_s: float
    per_rank: list[RankMergeSummary] = field(default_factory=list)
    problems: list[MergeProblem] = field(default_factory=list)

    @property
    def slice_count(self) -> int:
        return sum(self.slices_per_rank.values())


def merge(
    path: str | Path,
    out: str | Path | None = None,
    *,
    offsets_ns: Mapping[int, int] | None = None,
    ranks: Iterable[int] | None = None,
    progress: Callable[[RankMergeSummary], None] | None = None,
) -> MergeResult:
    """Merge the traces under `path` into one Perfetto trace at `out`.

    `path`: a run directory or any directory of Kineto traces (or one trace file).
    `out`: default `report/merged.perfetto-trace` in a run directory, else `merged.perfetto-trace`
    next to the traces. The file is replaced atomically when the merge is done.
    `offsets_ns`: rank -> clock offset to rank 0 (ns), overriding `clock/rank<R>.json`.
    `ranks`: merge only these ranks. `progress` is called after each rank.
    """
    started = time.perf_counter()
    inputs = find_merge_inputs(path, offsets_ns=offsets_ns)
    selected = _select_ranks(inputs, ranks)
    destination = _output_path(inputs, out)
    problems = list(inputs.problems)
    summaries = []
    with _atomic_output(destination) as handle:
        stream = PacketStream(handle)
        preamble = _Preamble(stream=stream)
        for source in selected:
            summary = _merge_rank(source, stream, preamble, problems)
            summaries.append(summary)
            if progress is not None:
                progress(summary)
        stream.flush()
    merged = [s for s in summaries if s.files]
    return MergeResult(
        output=destination,
        ranks=[s.rank for s in merged],
        slices_per_rank={s.rank: s.slice_count for s in merged},
        output_bytes=destination.stat().st_size,
        input_bytes=sum(f.bytes for source in selected for f in source.files),
        elapsed_s=time.perf_counter() - started,
        per_rank=summaries,
        problems=problems,
    )


def _select_ranks(inputs: MergeInputs, ranks: Iterable[int] | None) -> list[RankSource]:
    if ranks is None:
        return inputs.ranks
    wanted = set(ranks)
    available = {source.rank for source in inputs.ranks}
    unknown = sorted(wanted - available)
    if unknown:
        raise ValueError(f"ranks {unknown} not found under {inputs.root} (available: {sorted(available)})")
    return [source for source in inputs.ranks if source.rank in wanted]


def _output_path(inputs: MergeInputs, out: str | Path | None) -> Path:
    if out is not None:
        return Path(out).expanduser().absolute()
    if inputs.run_layout is not None:
        return inputs.run_layout.merged_trace
    directory = inputs.root if inputs.root.is_dir() else inputs.root.parent
    return directory / MERGED_TRACE


@contextmanager
def _atomic_output(destination: Path) -> Iterator:
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    try:
        with open(staging, "wb") as handle:
            yield handle
        os.replace(staging, destination)
    finally:
        staging.unlink(missing_ok=True)


@dataclass(kw_only=True)
class _Preamble:
    """Written once, just before the first event, when the first timestamp is known."""

    stream: PacketStream
    written: bool = False

    def write_once(self, first_timestamp_ns: int) -> None:
        if not self.written:
            write_preamble(self.stream, sequence_id=_PREAMBLE_SEQUENCE_ID, first_timestamp_ns=first_timestamp_ns)
            self.written = True


def _merge_rank(source: RankSource, stream: PacketStream, preamble: _Preamble,
                problems: list[MergeProblem]) -> RankMergeSummary:
    tracks = RankTracks.for_rank(source.rank)
    writer = SequenceWriter(stream=stream, sequence_id=rank_sequence_id(source.rank))
    totals: Counter = Counter()
    merged_files: list[str] = []
    first_ns: int | None = None
    for trace_file in source.files:
        plan = _plan_file(trace_file, source, tracks, problems)
        if plan is None:
            continue
        if not merged_files:
            preamble.write_once(plan.first_ts_ns or 0)
            writer.track(_process_track(source, tracks))
        _emit_window(plan, writer)
        merged_files.append(str(trace_file.path))
        first_ns = plan.first_ts_ns if first_ns is None else min(first_ns, plan.first_ts_ns or first_ns)
        totals.update(slices=plan.slice_count, instants=plan.instant_count,
                      counters=plan.counter_sample_count, overlaps=plan.overlap_lane_count)
    return RankMergeSummary(
        rank=source.rank, process_name=source.process_name, files=tuple(merged_files),
        slice_count=totals["slices"], instant_count=totals["instants"],
        counter_sample_count=totals["counters"], track_count=tracks.track_count,
        overlap_track_count=totals["overlaps"], clock_offset_ns=source.clock_offset_ns,
        first_timestamp_ns=first_ns,
    )


def rank_sequence_id(rank: int) -> int:
    """Each rank is its own packet sequence (its own interning table)."""
    return _PREAMBLE_SEQUENCE_ID + 1 + rank


def _process_track(source: RankSource, tracks: RankTracks) -> TrackSpec:
    return TrackSpec(uuid=tracks.process_uuid, name=source.process_name,
                     pid=PROCESS_PID_BASE + source.rank, order=source.rank)


def _plan_file(trace_file: TraceFile, source: RankSource, tracks: RankTracks,
               problems: list[MergeProblem]) -> WindowPlan | None:
    """Read one window and plan it; the parsed JSON is released on return."""
    try:
        document = read_trace(trace_file.path)
    except TraceReadError as error:
        problems.append(MergeProblem(path=str(trace_file.path), rank=source.rank, reason=error.reason))
        return None
    declared_rank, _ = distributed_rank(document)
    if declared_rank is not None and declared_rank != source.rank:
        problems.append(MergeProblem(path=str(trace_file.path), rank=source.rank,
                                     reason=f"distributedInfo says rank {declared_rank}; merged as rank {source.rank}"))
    base_ns = document.get("baseTimeNanoseconds")
    clock = WindowClock(base_ns=base_ns if isinstance(base_ns, int) else 0, offset_ns=source.clock_offset_ns)
    plan = plan_window(document["traceEvents"], tracks, clock)
    for reason, count in sorted(plan.skipped.items()):
        problems.append(MergeProblem(path=str(trace_file.path), rank=source.rank, reason=f"{count} events: {reason}"))
    return plan


def _emit_window(plan: WindowPlan, writer: SequenceWriter) -> None:
    for spec in plan.new_tracks:
        writer.track(spec)
    for operation in plan.operations:
        kind = operation[1]
        if kind == OP_END:
            writer.slice_end(operation[0], operation[2])
        elif kind == OP_BEGIN:
            writer.slice_begin(operation[0], operation[2], operation[3], operation[4])
        elif kind == OP_INSTANT:
            writer.instant(operation[0], operation[2], operation[3], operation[4])
        elif kind == OP_COUNTER:
            writer.counter(operation[0], operation[2], operation[3])
