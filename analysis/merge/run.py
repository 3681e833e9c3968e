"""One merged Perfetto trace of all ranks.

`merge(path, out)` reads the Kineto traces of a run directory (or of any directory of traces) and
writes ONE native Perfetto protobuf trace:

* a process per rank named `rank R (host)`, listed in rank order; a track per CPU thread and per GPU
  stream; every complete event as a slice (name and category), instants, counters;
* one clock: `baseTimeNanoseconds` plus the event's offset, minus the rank's clock offset to rank 0:
  `offsets_ns` when given, else the offsets the analysis report used, else `clock/rank<R>.json`;
* arrows from CPU launches to GPU work and between ranks at the same collective instance
  (perfetto_flows.py); a `fleetscope analysis` track per rank with steps, idle gaps and straggler
  marks, and step-time / idle / memory counters (perfetto_overlays.py); the report's ideal replay of the
  critical-path steps as a process of its own, a thread per rank (ideal_overlays.py);
* optionally the same events as Chrome JSON (merge_json.py).

The trace is streamed: ranks are read one at a time (a rank's windows one after another, all into
its process) and written a chunk of packets at a time, encoded from columns with interned names
(perfetto/columnar.py), so memory is bounded by one trace file however many ranks there are (one per
worker process with `MergeOptions.workers`, which gives the same bytes faster).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping, Sequence

from fleetscope.analysis.merge.chrome_json import ChromeJsonWriter
from fleetscope.analysis.merge.focus import FocusPlan
from fleetscope.analysis.merge.ideal_overlays import (IDEAL_SEQUENCE_ID, IdealProcess, plan_ideal_process,
                                                      write_ideal_process)
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.outputs import PlannedOutput, plan_merge_focus, planned_outputs
from fleetscope.analysis.merge.summary import (
    SUMMARY_SEQUENCE_ID,
    RankSummaryCount,
    SummaryWindow,
    plan_rank_summary,
    summary_process,
    write_rank_summary,
)
from fleetscope.analysis.merge.operation_columns import RowSources, event_args_of, with_event_args
from fleetscope.analysis.merge.perfetto.columnar import TrackEventColumns, write_track_events
from fleetscope.analysis.merge.perfetto.writer import (
    COUNTER,
    INSTANT,
    SLICE_BEGIN,
    PacketStream,
    SequenceWriter,
    TrackSpec,
    write_preamble,
)
from fleetscope.analysis.merge.column_plan import plan_window_columns
from fleetscope.analysis.merge.event_window import window_of_events
from fleetscope.analysis.merge.expectations import RankExpectations, rank_expectations, window_expectations
from fleetscope.analysis.merge.plan import WindowPlan
from fleetscope.analysis.merge.window_decode import decode_window
from fleetscope.analysis.merge.moe_overlays import moe_merge_views
from fleetscope.analysis.merge.report_view import (
    ReportSource,
    load_report,
    report_clock_offsets_ns,
    report_mismatch,
    report_step_figures,
    report_view,
)
from fleetscope.analysis.merge.stages import merge_analysis

if TYPE_CHECKING:
    from fleetscope.analysis.report.model import Report
from fleetscope.analysis.merge.sources import (
    CLOCK_GIVEN,
    CLOCK_NONE,
    CLOCK_REPORT,
    MergeInputs,
    MergeProblem,
    RankSource,
    TraceFile,
    find_merge_inputs,
    idle_gap_rows,
)
from fleetscope.analysis.merge.tracks import PROCESS_PID_BASE, RankTracks
from fleetscope.analysis.merge.window import WindowClock, WindowContext
from fleetscope.analysis.per_rank.cache import open_cache
from fleetscope.analysis.per_rank.parse import cyclic_gc_paused
from fleetscope.analysis.per_rank.rank import base_time_ns_of
from fleetscope.traces.atomic import atomic_output
from fleetscope.traces.kineto import TraceReadError, decode_trace, decompress, distributed_rank, read_raw
from fleetscope.analysis.merge.whole_run_counters import WHOLE_RUN_SEQUENCE_ID, WholeRunPlan, plan_whole_run, write_whole_run
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.traces.validate import bounded_name
from fleetscope.traces.layout import MERGED_TRACE

_PREAMBLE_SEQUENCE_ID = 1
_COPY_CHUNK_BYTES = 1 << 20
_COLLECTIVE_FLOW_BIT = 1 << 63


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMergeSummary:
    """What went into one rank's process."""

    rank: int
    process_name: str
    files: tuple[str, ...]
    """The trace files merged (one per profiling window), in the order they were read."""
    slice_count: int
    """Slices of recorded events (== the inputs' complete events, less those filtered out)."""
    overlay_slice_count: int
    instant_count: int
    overlay_instant_count: int
    """Straggler marks on the analysis track."""
    counter_sample_count: int
    flow_count: int
    track_count: int
    thread_count: int
    """CPU threads, each a thread track of the rank's process."""
    overlap_track_count: int
    """Extra tracks made for events that overlap others on their thread without nesting."""
    filtered_count: int
    """Events left out by the options (python functions, steps, time window)."""
    clock_offset_ns: int
    """Subtracted from this rank's timestamps (in its first merged window)."""
    clock_source: str
    """Where the offset came from: given, clock file, analysis report or none."""
    first_timestamp_ns: int | None
    last_timestamp_ns: int | None = None
    """The last timestamp written for this rank (slice ends included)."""
    step_ranges_ns: tuple[tuple[int, int, int, int], ...] = ()
    """(window, step, start ns, end ns) of each step drawn on the analysis track, on the merged clock."""
    expected: RankExpectations = RankExpectations()
    """What the report says this rank's analysis track holds (expectations.py; verify.py compares)."""
    profiler_trace: bool = True
    """False: the process draws a Chrome trace of another tool (RankSource.profiler_trace), no rank."""


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
    """Inputs that could not be used: unreadable or missing traces, a bad clock file or report."""
    notes: list[MergeProblem] = field(default_factory=list)
    """Events repaired or left out of a usable trace (e.g. negative durations clamped to 0, an
    unsupported phase), counted per file and reason."""
    chrome_json: Path | None = None
    chrome_json_uncompressed_bytes: int | None = None
    summary: list[RankSummaryCount] = field(default_factory=list)
    """The summary tracks of every rank (summary.py), when the file holds them."""
    whole_run_samples: int = 0
    """Counter samples of the whole run (whole_run_counters.py) in this file: every rank's timeline, binned."""
    whole_run_bounds_ns: tuple[int, int] | None = None
    """The first and last of those samples (merged clock)."""
    ideal_slices: int = 0
    """Slices of the ideal replay's process (ideal_overlays.py) in this file."""
    ideal_threads: int = 0
    """Its threads: one per rank with ideal ops."""
    ideal_bounds_ns: tuple[int, int] | None = None
    focus: FocusPlan | None = None
    """The focus set of a default merge: which ranks are in full and why, and what was left out."""
    shards: list["MergeResult"] = field(default_factory=list)
    """With `shard_ranks`: one result per shard file (this result is the summary file's)."""

    @property
    def outputs(self) -> list[Path]:
        """Every file written: the shards, then this one."""
        return [shard.output for shard in self.shards] + [self.output]

    @property
    def slice_count(self) -> int:
        return sum(self.slices_per_rank.values())

    def step_ranges_ns(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(window, step) -> (earliest start, latest end) over the ranks, on the merged clock."""
        ranges: dict[tuple[int, int], tuple[int, int]] = {}
        for summary in self.per_rank:
            for window, step, start, end in summary.step_ranges_ns:
                known = ranges.get((window, step))
                ranges[(window, step)] = (start, end) if known is None else (min(known[0], start), max(known[1], end))
        return ranges


def merge(
    path: str | Path,
    out: str | Path | None = None,
    *,
    options: MergeOptions | None = None,
    offsets_ns: Mapping[int, int] | None = None,
    report: ReportSource = None,
    progress: Callable[[RankMergeSummary], None] | None = None,
    use_cache: bool = True,
    cache_dir: Path | None = None,
    records: RunRecords | None = None,
) -> MergeResult:
    """Merge the traces under `path` into one Perfetto trace at `out`.

    `path`: a run directory or any directory of Kineto traces (or one trace file).
    `out`: default `report/merged.perfetto-trace` in a run directory, else `merged.perfetto-trace`
    next to the traces. The file is replaced atomically when the merge is done.
    `options`: what to keep and add (MergeOptions): by default the focus set in full and a summary of
    every rank (focus.py, summary.py); `ranks`, `focus=None` (all) or `shard_ranks` otherwise.
    `offsets_ns`: rank -> clock offset to rank 0 (ns), overriding `clock/rank<R>.json`. `report`: the
    analysis report (a Report, its JSON dict or a path) for straggler marks and the focus set; a run
    directory's report/report.json is used when not given; one that does not match the traces is a
    problem and is not used. Without a report, the focus set comes from the cross-rank stages run here
    on the same parse (stages.py).
    `progress` is called after each rank. Each file's steps and collective instances come from the
    per-rank parse, through the parsed-trace cache (`use_cache`, `cache_dir`) as `analyze` uses it.
    `records`: the run directory's records (inputs/records.py) when the caller has read them (postprocess).
    With `shard_ranks`, the result is the summary file's and `shards` holds one result per shard.
    """
    options = options or MergeOptions()
    started = time.perf_counter()
    cache = open_cache(cache_dir)[0] if use_cache else None
    inputs = find_merge_inputs(path, offsets_ns=offsets_ns, cache=cache, records=records)
    destination = _output_path(inputs, out)
    problems, notes = list(inputs.problems), []
    if not inputs.ranks:   # nothing to draw: no file (an empty one would open as a trace of nothing)
        return MergeResult(output=destination, ranks=[], slices_per_rank={}, output_bytes=0, input_bytes=0,
                           elapsed_s=time.perf_counter() - started, problems=problems)
    loaded = load_report(report, inputs.run_layout, problems, notes) if (
        options.overlays or _plans_focus(options)) else None
    loaded = _matching_report(loaded, inputs, problems)
    focus = plan_merge_focus(inputs, loaded, options.focus, analysis=lambda: merge_analysis(inputs)) \
        if _plans_focus(options) else None
    inputs.parsed = None  # the per-rank results: every rank's file keeps what it draws (WindowModel)
    files = planned_outputs(inputs, destination, options, focus)
    origin: list[int | None] = [None]
    whole_run = _whole_run_plan(inputs, options, notes)
    ideal = _ideal_plan(inputs, loaded if options.overlays else None, options)
    results = [_merge_file(inputs, planned, options, loaded if options.overlays else None, problems, notes,
                           origin, progress, whole_run=whole_run if planned is files[-1] else None,
                           ideal=ideal if planned is files[-1] else None)
               for planned in files]
    result = results[-1]
    shards = results[:-1] if options.shard_ranks is not None else []
    return dataclasses.replace(
        result, elapsed_s=time.perf_counter() - started, focus=focus, shards=shards,
        ranks=sorted({r for each in results for r in each.ranks}),
        slices_per_rank={r: n for each in results for r, n in each.slices_per_rank.items()},
        input_bytes=sum(each.input_bytes for each in results))


def _whole_run_plan(inputs: MergeInputs, options: MergeOptions, notes: list[MergeProblem]) -> WholeRunPlan | None:
    """Every rank's whole-run counters, for the last file of the merge (the summary's when there is one); none
    for a folder of traces (no timelines) or when the merge keeps only some steps or a time range."""
    run = inputs.records
    if run is None or options.filters_events:
        return None
    offsets = {rank: round(offset.offset_us * 1000) for rank, offset in run.clock.items()}
    offsets.update({source.rank: source.clock_offset_ns for source in inputs.ranks   # as the ranks are drawn
                    if source.clock_source != CLOCK_NONE})
    plan = plan_whole_run(run, set(offsets) | run.record_ranks, offsets)
    notes += [MergeProblem(reason=f"whole-run counters: {problem}") for problem in plan.problems]
    return plan if plan.ranks else None


def _ideal_plan(inputs: MergeInputs, report: "Report | None", options: MergeOptions) -> IdealProcess | None:
    """The report's ideal replay as its own process, for the last file of the merge; on each rank's clock as its
    own tracks are drawn (the rank's window offset: the report's unless offsets were given). None without a
    replay, or for a merge of a time range (its slices would sit outside it)."""
    if report is None or options.time_window_s is not None:
        return None
    sources = {source.rank: source for source in inputs.ranks}
    windows = [(w.window, w.ideal_replay) for w in report.windows]

    def shift_ns(rank: int, window_key: Any) -> int | None:
        source = sources.get(rank)
        if source is None:
            return None
        reported = report_clock_offsets_ns(report, window_key)
        merged = reported[rank] if source.clock_source != CLOCK_GIVEN and rank in reported else source.clock_offset_ns
        return reported.get(rank, 0) - merged

    plan = plan_ideal_process(windows, shift_ns, options.steps)
    return plan if plan.slices else None


def _matching_report(report: "Report | None", inputs: MergeInputs, problems: list[MergeProblem]) -> "Report | None":
    """The report, unless it states ranks or event counts other than the traces' (a report of other
    traces, or of these before they changed): then it is named a problem and not used."""
    mismatch = report_mismatch(report, inputs.event_counts()) if report is not None else None
    if mismatch is None:
        return report
    problems.append(MergeProblem(reason=f"analysis report not used: it does not match the traces ({mismatch})"))
    return None


class EmptySelection(ValueError):
    """A --steps / --time-range selection that keeps no event of any rank: nothing is written."""


def _refuse_an_empty_selection(options: MergeOptions, summaries: list) -> None:
    """Raises EmptySelection (the output's temporary file is then discarded) when a selection left nothing."""
    if options.filters_events and summaries and not any(s.slice_count or s.instant_count for s in summaries):
        what = (f"steps {sorted(options.steps)[:10]}" if options.steps is not None
                else f"time range {options.time_window_s[0]:g}-{options.time_window_s[1]:g} s")
        raise EmptySelection(f"the selection ({what}) keeps no event of any rank: nothing written")


def _plans_focus(options: MergeOptions) -> bool:
    return options.focus is not None and options.ranks is None and options.shard_ranks is None


def _merge_file(inputs: MergeInputs, planned: "PlannedOutput", options: MergeOptions, report: "Report | None",
                problems: list[MergeProblem], notes: list[MergeProblem], origin: list[int | None],
                progress: Callable[[RankMergeSummary], None] | None, *,
                whole_run: WholeRunPlan | None = None, ideal: IdealProcess | None = None) -> MergeResult:
    """One output file: its ranks in full, then the summary of `planned.summary_of`; `origin` carries the
    time origin from file to file (shards count `time_window_s` from the same instant)."""
    started = time.perf_counter()
    destination = planned.path
    json_writer = ChromeJsonWriter(options.chrome_json) if options.chrome_json and planned.sources else None
    try:
        with atomic_output(destination, fsync=False) as handle, cyclic_gc_paused():
            session = _MergeSession(stream=PacketStream(handle), options=options, report=report,
                                    json_writer=json_writer, problems=problems, notes=notes, origin_ns=origin[0],
                                    moe=moe_merge_views(inputs.records, report, [s.rank for s in planned.sources])
                                    if options.overlays else {})
            summaries = _merge_ranks(session, planned.sources, handle, destination, progress)
            _refuse_an_empty_selection(options, summaries)
            summary_counts = write_summaries(session, planned) if planned.summary_of else []
            if whole_run is not None:
                _write_whole_run(session, whole_run)
            if ideal is not None:
                _write_ideal(session, ideal)
            session.stream.flush()
            origin[0] = session.origin_ns
        if json_writer is not None:
            json_writer.close()
    except BaseException:
        if json_writer is not None:
            json_writer.abandon()
        raise
    merged = [s for s in summaries if s.files]
    return MergeResult(
        output=destination,
        ranks=[s.rank for s in merged],
        slices_per_rank={s.rank: s.slice_count for s in merged},
        output_bytes=destination.stat().st_size,
        input_bytes=sum(f.bytes for source in planned.sources for f in source.files),
        elapsed_s=time.perf_counter() - started,
        per_rank=summaries,
        problems=problems,
        notes=notes,
        chrome_json=json_writer.path if json_writer else None,
        chrome_json_uncompressed_bytes=json_writer.uncompressed_bytes if json_writer else None,
        summary=summary_counts,
        whole_run_samples=whole_run.sample_count if whole_run is not None else 0,
        whole_run_bounds_ns=whole_run.bounds_ns if whole_run is not None else None,
        ideal_slices=ideal.slice_count if ideal is not None else 0,
        ideal_threads=len(ideal.slices) if ideal is not None else 0,
        ideal_bounds_ns=ideal.bounds_ns if ideal is not None else None,
    )


def _write_whole_run(session: "_MergeSession", plan: WholeRunPlan) -> None:
    if not session.preamble_written:
        first = min((r.step_ms[0][0] for r in plan.ranks if r.step_ms), default=0)
        write_preamble(session.stream, sequence_id=_PREAMBLE_SEQUENCE_ID, first_timestamp_ns=first)
        session.preamble_written = True
    write_whole_run(SequenceWriter(stream=session.stream, sequence_id=WHOLE_RUN_SEQUENCE_ID, shown=bounded_name), plan)


def _write_ideal(session: "_MergeSession", plan: IdealProcess) -> None:
    if not session.preamble_written:
        write_preamble(session.stream, sequence_id=_PREAMBLE_SEQUENCE_ID, first_timestamp_ns=plan.bounds_ns[0])
        session.preamble_written = True
    write_ideal_process(SequenceWriter(stream=session.stream, sequence_id=IDEAL_SEQUENCE_ID, shown=bounded_name), plan)


def _merge_ranks(session: "_MergeSession", sources: list[RankSource], handle: IO[bytes], destination: Path,
                 progress: Callable[[RankMergeSummary], None] | None) -> list[RankMergeSummary]:
    """Every rank into the output, in rank order. With `options.worker_count` > 1, the first rank with events
    is merged here (it writes the file's preamble and fixes the time origin and the JSON clock), the others in worker processes that
    each write one rank's packets to a part file, appended here in rank order."""
    pending = list(sources)
    summaries = []
    while pending and (session.options.worker_count <= 1 or len(pending) < 2 or not session.preamble_written):
        summaries.append(session.merge_rank(pending.pop(0), progress))
    if pending:
        session.stream.flush()
        summaries += merge_in_workers(session, pending, handle, destination, progress)
    return summaries


def _output_path(inputs: MergeInputs, out: str | Path | None) -> Path:
    if out is not None:
        return Path(out).expanduser().absolute()
    if inputs.run_layout is not None:
        return inputs.run_layout.merged_trace
    directory = inputs.root if inputs.root.is_dir() else inputs.root.parent
    return directory / MERGED_TRACE


def write_summaries(session: "_MergeSession", planned: PlannedOutput) -> list[RankSummaryCount]:
    """The summary of every rank of `planned.summary_of`, one rank at a time, after the ranks in full."""
    writer = SequenceWriter(stream=session.stream, sequence_id=SUMMARY_SEQUENCE_ID, shown=bounded_name)
    in_full = {source.rank for source in planned.sources}
    counts = []
    for source in planned.summary_of:
        plan = plan_rank_summary(source.rank, source.host, session.summary_windows(source),
                                 note=planned.notes.get(source.rank, ""), steps=session.options.steps)
        if not counts:
            if not session.preamble_written:
                write_preamble(session.stream, sequence_id=_PREAMBLE_SEQUENCE_ID, first_timestamp_ns=plan.first_ns or 0)
                session.preamble_written = True
            writer.track(summary_process())
        write_rank_summary(writer, plan)
        counts.append(RankSummaryCount(rank=source.rank, slice_count=plan.slice_count, instant_count=plan.instant_count,
                                       counter_sample_count=plan.counter_sample_count,
                                       arrivals_left_out=plan.arrivals_left_out, first_ns=plan.first_ns,
                                       last_ns=plan.last_ns, in_full=source.rank in in_full))
    return counts


def rank_sequence_id(rank: int) -> int:
    """Each rank is its own packet sequence (its own interning table)."""
    return _PREAMBLE_SEQUENCE_ID + 1 + rank


@dataclass(kw_only=True)
class _MergeSession:
    """State shared by the ranks of one merge: the output streams and the common time origin."""

    stream: PacketStream
    options: MergeOptions
    report: "Report | None"
    json_writer: ChromeJsonWriter | None
    problems: list[MergeProblem]
    notes: list[MergeProblem]
    origin_ns: int | None = None
    """The first merged event: where `options.time_window_s` counts from."""
    preamble_written: bool = False
    clock_choice: dict[int, tuple[int, str]] = field(default_factory=dict)
    """rank -> (offset ns, source) used for its first merged window."""
    moe: dict = field(default_factory=dict)
    """rank -> MoeMergeView (moe_overlays.py)."""

    def merge_rank(self, source: RankSource, progress: Callable[[RankMergeSummary], None] | None) -> RankMergeSummary:
        emitter = _RankEmitter(writer=SequenceWriter(stream=self.stream, sequence_id=rank_sequence_id(source.rank),
                                                            shown=bounded_name),
                               json_writer=self.json_writer, pid=PROCESS_PID_BASE + source.rank,
                               event_args=self.options.event_args)
        tracks = RankTracks.for_rank(source.rank)
        totals: Counter = Counter()
        merged_files: list[str] = []
        step_ranges: list[tuple[int, int, int, int]] = []
        expected: list = []
        first_ns: int | None = None
        last_ns: int | None = None
        for position, trace_file in enumerate(source.files):
            window_key = trace_file.window if trace_file.window is not None else position
            planned = self._plan_file(trace_file, source, tracks, window_key, first_window=not merged_files)
            if planned is None:
                continue
            plan, events = planned
            if not merged_files:
                self._start_rank(emitter, source, tracks, plan)
            emitter.emit(plan, events)
            merged_files.append(str(trace_file.path))
            step_ranges += [(window_key, step, start, end) for step, start, end in plan.step_ranges]
            expected.append(window_expectations(report_step_figures(self.report, rank=source.rank, window_key=window_key),
                                                trace_file.model, window_key))
            if plan.first_ts_ns is not None:
                first_ns = plan.first_ts_ns if first_ns is None else min(first_ns, plan.first_ts_ns)
                last_ns = plan.last_ts_ns if last_ns is None else max(last_ns, plan.last_ts_ns)
            _add_totals(totals, plan)
        clock = self.clock_choice.get(source.rank, (source.clock_offset_ns, source.clock_source))
        summary = dataclasses.replace(
            _summary(source, tracks, merged_files, totals, (first_ns, last_ns), clock, step_ranges),
            expected=rank_expectations(expected, self.options))
        if progress is not None:
            progress(summary)
        return summary

    def summary_windows(self, source: RankSource) -> list[SummaryWindow]:
        """The rank's files as the summary draws them, on the clock its full tracks use."""
        windows = []
        for position, trace_file in enumerate(source.files):
            window_key = trace_file.window if trace_file.window is not None else position
            offset_ns, _ = self._clock_offset(source, window_key)
            windows.append(SummaryWindow(window=window_key, model=trace_file.model,
                                         clock=WindowClock(base_ns=trace_file.model.base_time_ns, offset_ns=offset_ns)))
        return windows

    def _start_rank(self, emitter: "_RankEmitter", source: RankSource, tracks: RankTracks, plan: WindowPlan) -> None:
        first_ns = plan.first_ts_ns or 0
        if not self.preamble_written:
            write_preamble(self.stream, sequence_id=_PREAMBLE_SEQUENCE_ID, first_timestamp_ns=first_ns)
            self.preamble_written = True
        if self.json_writer is not None:
            self.json_writer.start_clock(first_ns)
        emitter.process(TrackSpec(uuid=tracks.process_uuid, name=source.process_name,
                                  pid=PROCESS_PID_BASE + source.rank, order=source.rank))

    def _plan_file(self, trace_file: TraceFile, source: RankSource, tracks: RankTracks, window_key: int,
                   *, first_window: bool) -> tuple[WindowPlan, list[Any]] | None:
        """Read one window and plan it; returns the plan and the window's events as the generic reader gives
        them (for their args: read only where they are drawn, or where the columnar decoder refuses the file)."""
        try:
            raw = read_raw(trace_file.path)
            decoded, refused = decode_window(decompress(raw, trace_file.path)), Counter()
            generic = decode_trace(raw, trace_file.path) if decoded is None or self._draws_event_args else None
            if decoded is None:   # a value of another type than Kineto writes: the generic reader's events
                decoded, refused = window_of_events(generic)
        except TraceReadError as error:
            self.problems.append(MergeProblem(path=str(trace_file.path), rank=source.rank, reason=error.reason))
            return None
        document = decoded.document
        self._check_rank(document, trace_file, source)
        context = self._window_context(document, trace_file, source, window_key, first_window=first_window)
        plan = plan_window_columns(decoded, tracks, context)
        plan.skipped.update(refused)
        events = generic["traceEvents"] if generic is not None else []
        if self.origin_ns is None:
            self.origin_ns = plan.origin_ns
        for reason, count in sorted(plan.skipped.items()):
            self.notes.append(MergeProblem(path=str(trace_file.path), rank=source.rank,
                                              reason=f"{count} events: {reason}"))
        return plan, events

    @property
    def _draws_event_args(self) -> bool:
        """Whether the events' args are drawn (debug annotations, or the Chrome JSON's args): the columns do
        not hold them, so the window is read a second time, by the generic reader, for them."""
        return self.json_writer is not None or self.options.event_args

    def _window_context(self, document: dict, trace_file: TraceFile, source: RankSource, window_key: int, *,
                        first_window: bool) -> WindowContext:
        base_ns = base_time_ns_of(document)
        offset_ns, clock_source = self._clock_offset(source, window_key)
        if first_window:
            self.clock_choice[source.rank] = (offset_ns, clock_source)
        clock = WindowClock(base_ns=base_ns, offset_ns=offset_ns)
        model = trace_file.model
        return WindowContext(
            clock=clock, options=self.options, window_key=window_key, origin_ns=self.origin_ns,
            report=report_view(self.report, rank=source.rank, window_key=window_key, first_window=first_window),
            steps=tuple((step, clock.to_ns(start), clock.to_ns(end)) for step, start, end in model.steps),
            step_spans=tuple((step, clock.to_ns(start), clock.to_ns(end)) for step, start, end in model.step_spans),
            collectives=tuple((clock.to_ns(start), key) for start, key in model.collectives),
            collective_ends_ns=tuple(clock.to_ns(end) for end in model.collective_ends_us),
            collective_source=model.collective_source,
            p2p=tuple((clock.to_ns(start), key, kind) for start, key, kind in model.p2p),
            moe=self.moe.get(source.rank),
            idle_gaps=tuple((clock.to_ns(start), clock.to_ns(end), cause)
                            for start, end, cause in idle_gap_rows(model.idle_gaps)),
            idle_basis=model.idle_gaps.basis if model.idle_gaps is not None else None,
        )

    def _clock_offset(self, source: RankSource, window_key: int) -> tuple[int, str]:
        """Offsets given by the caller win; then the ones the analysis report used for this window; then
        the clock files."""
        if source.clock_source != CLOCK_GIVEN:
            from_report = report_clock_offsets_ns(self.report, window_key)
            if source.rank in from_report:
                return from_report[source.rank], CLOCK_REPORT
        return source.clock_offset_ns, source.clock_source

    def _check_rank(self, document: dict, trace_file: TraceFile, source: RankSource) -> None:
        declared_rank, _ = distributed_rank(document)
        if declared_rank is not None and declared_rank != source.rank:
            self.problems.append(MergeProblem(
                path=str(trace_file.path), rank=source.rank,
                reason=f"distributedInfo says rank {declared_rank}; merged as rank {source.rank}"))


def _add_totals(totals: Counter, plan: WindowPlan) -> None:
    totals.update(slices=plan.slice_count, overlay_slices=plan.overlay_slice_count, instants=plan.instant_count,
                  overlay_instants=plan.overlay_instant_count,
                  counters=plan.counter_sample_count, overlaps=plan.overlap_lane_count,
                  filtered=plan.filtered_count,
                  flows=plan.flows.launch_flow_count + plan.flows.trace_flow_count + plan.flows.collective_flow_count
                  + plan.flows.p2p_flow_count)


def _summary(source: RankSource, tracks: RankTracks, files: list[str], totals: Counter,
             bounds_ns: tuple[int | None, int | None], clock: tuple[int, str],
             step_ranges: list[tuple[int, int, int, int]]) -> RankMergeSummary:
    return RankMergeSummary(
        rank=source.rank, process_name=source.process_name, files=tuple(files),
        slice_count=totals["slices"], overlay_slice_count=totals["overlay_slices"],
        instant_count=totals["instants"], overlay_instant_count=totals["overlay_instants"],
        counter_sample_count=totals["counters"], flow_count=totals["flows"],
        track_count=tracks.track_count, thread_count=tracks.thread_count, overlap_track_count=totals["overlaps"],
        filtered_count=totals["filtered"], clock_offset_ns=clock[0], clock_source=clock[1],
        first_timestamp_ns=bounds_ns[0], last_timestamp_ns=bounds_ns[1], step_ranges_ns=tuple(step_ranges),
        profiler_trace=source.profiler_trace,
    )


@dataclass(kw_only=True)
class _RankEmitter:
    """Writes planned operations to the Perfetto stream (and the Chrome JSON, when asked)."""

    writer: SequenceWriter
    json_writer: ChromeJsonWriter | None
    pid: int
    event_args: bool

    def process(self, spec: TrackSpec) -> None:
        self.writer.track(spec)
        if self.json_writer is not None:
            self.json_writer.process(self.pid, spec.name, spec.order or 0)

    def emit(self, plan: WindowPlan, events: list[Any]) -> None:
        """The window's tracks, its columns (with the events' args as annotations where those are drawn), then
        its Chrome JSON row by row."""
        for spec in plan.new_tracks:
            self.writer.track(spec)
            if self.json_writer is not None:
                self.json_writer.track(self.pid, spec.uuid, spec.name, spec.order, spec.is_counter)
        columns, sources = plan.columns, plan.row_sources
        write_track_events(self.writer, with_event_args(columns, sources, events) if self.event_args else columns)
        if self.json_writer is not None:
            self._json_rows(columns, sources, events)

    def _json_rows(self, columns: TrackEventColumns, sources: RowSources, events: list[Any]) -> None:
        """The Chrome JSON of the columns: a made-up slice's or mark's own annotations as its args, a Kineto
        event's args as the trace has them."""
        named = iter(zip(columns.names, columns.categories))
        values = iter(columns.counter_values.tolist())
        rows = zip(columns.types.tolist(), columns.timestamps_ns.tolist(), columns.track_uuids.tolist(),
                   sources.idents.tolist(), sources.ends_ns.tolist())
        for row, (kind, ts, uuid, ident, end_ns) in enumerate(rows):
            if kind == SLICE_BEGIN:
                name, category = next(named)
                args = columns.annotations.get(row) if ident < 0 else event_args_of(events, ident)
                self._json_begin(columns.flows.of_row(row), uuid, name, category, ts, end_ns, args)
            elif kind == INSTANT:
                name, category = next(named)
                args = columns.annotations.get(row) if ident < 0 else event_args_of(events, ident)
                self.json_writer.instant(self.pid, uuid, name, category, ts, args)
            elif kind == COUNTER:
                self.json_writer.counter(self.pid, uuid, ts, next(values))

    def _json_begin(self, flow_ids: tuple[Sequence[int], Sequence[int]], uuid: int, name: str, category: str,
                    ts: int, end_ns: int, args: Any) -> None:
        """A slice in the Chrome JSON, with its arrows' ends (collective ones are Perfetto's alone)."""
        outgoing, terminating = flow_ids
        self.json_writer.complete(self.pid, uuid, name, category, ts, end_ns, args)
        for flow_id in outgoing:
            if not flow_id & _COLLECTIVE_FLOW_BIT:
                self.json_writer.flow(ends=False, flow_id=flow_id, pid=self.pid, uuid=uuid, ts_ns=ts)
        for flow_id in terminating:
            self.json_writer.flow(ends=True, flow_id=flow_id, pid=self.pid, uuid=uuid, ts_ns=ts)


# --- worker processes (options.worker_count > 1) -----------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class _PartJob:
    source: RankSource
    options: MergeOptions
    report: "Report | None"
    """Pickled to each worker with the job: the typed report, as large as its JSON dict was."""
    origin_ns: int | None
    json_base_ns: int | None
    part_path: Path
    json_part_path: Path | None
    moe: dict = field(default_factory=dict)
    """This rank's entry of the session's MoE overlay data."""


@dataclass(frozen=True, kw_only=True)
class _PartOutcome:
    summary: RankMergeSummary
    problems: list[MergeProblem]
    notes: list[MergeProblem]


def merge_in_workers(session: _MergeSession, sources: list[RankSource], handle: IO[bytes], destination: Path,
                     progress: Callable[[RankMergeSummary], None] | None) -> list[RankMergeSummary]:
    """Merge `sources` in `session.options.worker_count` processes; parts are appended in rank order as they
    finish, so memory stays one rank per worker and disk one part per finished-but-not-appended rank. A worker
    that dies (killed by the system, out of memory) costs a second pool for the ranks not yet appended, then
    this process: the merged trace is never lost to it, and the notes say so."""
    jobs = [_part_job(session, source, destination) for source in sources]
    summaries: list[RankMergeSummary] = []

    def take(job: _PartJob, outcome: _PartOutcome) -> None:
        _append_part(job, handle, session.json_writer)
        session.problems.extend(outcome.problems)
        session.notes.extend(outcome.notes)
        summaries.append(outcome.summary)
        if progress is not None:
            progress(outcome.summary)

    try:
        for _attempt in range(WORKER_POOL_ATTEMPTS):
            pending = jobs[len(summaries):]
            if not pending:
                break
            try:
                with ProcessPoolExecutor(max_workers=min(session.options.worker_count, len(pending)),
                                         mp_context=_worker_context()) as pool:
                    for job, outcome in zip(pending, pool.map(merge_part, pending)):
                        take(job, outcome)
            except BrokenProcessPool as error:
                session.notes.append(MergeProblem(reason=f"a merge worker process ended unexpectedly ({error}); "
                                                         f"{len(jobs) - len(summaries)} rank(s) merged again"))
        for job in jobs[len(summaries):]:
            take(job, merge_part(job))
    finally:
        for job in jobs:
            job.part_path.unlink(missing_ok=True)
            if job.json_part_path is not None:
                job.json_part_path.unlink(missing_ok=True)
    return summaries


WORKER_POOL_ATTEMPTS = 2
"""Pools tried before the ranks left are merged in this process."""


def _worker_context() -> multiprocessing.context.BaseContext:
    """Fresh interpreters that import only the merge: this process holds every rank's parsed model
    (hundreds of MB at 1,024 ranks), and the forkserver HTA's views used holds HTA, either of which
    forked workers would carry as their own."""
    return multiprocessing.get_context("spawn")


def _part_job(session: _MergeSession, source: RankSource, destination: Path) -> _PartJob:
    stem = f".{destination.name}.{os.getpid()}.rank{source.rank}"
    json_writer = session.json_writer
    return _PartJob(
        source=source, options=session.options, report=session.report, origin_ns=session.origin_ns,
        json_base_ns=json_writer.base_ns if json_writer else None,
        part_path=destination.with_name(stem + ".part"),
        json_part_path=destination.with_name(stem + ".json.part") if json_writer else None,
        moe={source.rank: session.moe[source.rank]} if source.rank in session.moe else {},
    )


def merge_part(job: _PartJob) -> _PartOutcome:
    """One rank into a part file (runs in a worker process)."""
    json_writer = ChromeJsonWriter.fragment(job.json_part_path, base_ns=job.json_base_ns) \
        if job.json_part_path is not None else None
    with open(job.part_path, "wb") as handle, cyclic_gc_paused():
        session = _MergeSession(stream=PacketStream(handle), options=job.options, report=job.report,
                                json_writer=json_writer, problems=[], notes=[], origin_ns=job.origin_ns,
                                preamble_written=True, moe=job.moe)
        summary = session.merge_rank(job.source, None)
        session.stream.flush()
    if json_writer is not None:
        json_writer.close()
    return _PartOutcome(summary=summary, problems=session.problems, notes=session.notes)


def _append_part(job: _PartJob, handle: IO[bytes], json_writer: ChromeJsonWriter | None) -> None:
    with open(job.part_path, "rb") as part:
        shutil.copyfileobj(part, handle, _COPY_CHUNK_BYTES)
    if json_writer is not None and job.json_part_path is not None:
        json_writer.append_fragment(job.json_part_path)
