"""Checking a merge's output against what the merge says it wrote (for tests, the CLI and users).

`verify_merge(result)` reads the Perfetto trace back (perfetto/check.py: nesting, interning, flows,
thread descriptors) and compares its processes and per-process slice counts with the `MergeResult`;
with a trace processor (`trace_processor=PATH`, or the one `find_trace_processor` finds when
`engine=True`) it also loads the trace in Perfetto's engine and compares the engine's tables with the
merge's counts (perfetto/sql.py). The critical-path tracks are checked too: the segments of one step form a
chain across ranks, and every arrow that starts on a critical-path slice ends on one of another rank. Each
rank's `fleetscope analysis` track is compared with the report (expectations.py): every `step N` slice lasts
the report's step time, and the rank's `idle: <cause>` slices sum to its idle by cause where every gap is
drawn. The ideal replay's process (ideal_overlays.py) holds the slices and threads the merge wrote.
`verify_trace_file(path)` does the same for a file alone, with the read-back as the expectation
(without the report's figures).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from fleetscope.analysis.merge.critical_path_overlays import PATH_TRACK_NAME
from fleetscope.analysis.merge.expectations import analysis_track_problems
from fleetscope.analysis.merge.ideal_overlays import IDEAL_PROCESS_NAME
from fleetscope.analysis.merge.perfetto.check import CROSS_RANK_FLOW_BIT, TraceCheck, check_trace
from fleetscope.analysis.merge.perfetto.sql import (
    DRAWN_PROCESS_PREFIXES,
    EngineExpectations,
    check_with_trace_processor,
    find_trace_processor,
)
from fleetscope.analysis.merge.run import MergeResult
from fleetscope.analysis.merge.sources import CLOCK_GIVEN
from fleetscope.analysis.merge.summary import SUMMARY_PID, SUMMARY_PROCESS_NAME
from fleetscope.analysis.merge.whole_run_counters import WHOLE_RUN_PROCESS_NAME


def verify_merge(result: MergeResult, *, trace_processor: str | Path | None = None,
                 engine: bool = False) -> list[str]:
    """Problems found in `result.output` (empty when it holds what the merge reported)."""
    check = check_trace(result.output)
    problems = list(check.problems)
    expected = expected_slices_by_process(result)
    processes = [p.name for p in check.processes()]
    expected_processes = (([IDEAL_PROCESS_NAME] if result.ideal_slices else [])
                          + ([WHOLE_RUN_PROCESS_NAME] if result.whole_run_samples else [])
                          + ([SUMMARY_PROCESS_NAME] if result.summary else []) + list(expected))
    if processes != expected_processes:
        problems.append(f"processes {_listed(processes)} != the merged ranks {_listed(expected_processes)}")
    problems += summary_problems(result, check) + flow_end_problems(result, check)
    found = check.slice_count_by_process()
    problems += [f"{name}: {found.get(name, 0)} slices in the file, the merge wrote {count}"
                 for name, count in {**expected, **_ideal_counts(result, "slices")}.items()
                 if found.get(name, 0) != count]
    threads = check.thread_count_by_process()
    problems += [f"{name}: {threads.get(name, 0)} threads in the file, the merge made {count}"
                 for name, count in _ideal_counts(result, "threads").items() if threads.get(name, 0) != count]
    problems += [f"{s.process_name}: {threads.get(s.process_name, 0)} threads in the file, the merge made "
                 f"{s.thread_count}" for s in result.per_rank if s.files and threads.get(s.process_name, 0) != s.thread_count]
    if not any(s.clock_source == CLOCK_GIVEN for s in result.per_rank):
        problems += critical_path_problems(check)     # given offsets move ranks off the report's clock
    problems += analysis_track_problems(check, {s.process_name: s.expected for s in result.per_rank
                                                if s.files and s.overlay_slice_count})
    binary = find_trace_processor(trace_processor) if (engine or trace_processor) else None
    if binary is not None:
        problems += check_with_trace_processor(result.output, binary, expected=merge_expectations(result, check)).problems
    return problems


def _ideal_counts(result: MergeResult, what: str) -> dict[str, int]:
    """The ideal replay's process -> its slices or threads as the merge wrote them (none without the process)."""
    if not result.ideal_slices:
        return {}
    return {IDEAL_PROCESS_NAME: result.ideal_slices if what == "slices" else result.ideal_threads}


def critical_path_problems(check: TraceCheck, tolerance_ns: int = 1000) -> list[str]:
    """The segments of one step form a chain: across ranks, in time order, none starts more than
    `tolerance_ns` before the previous one ends (a merge that removed other clock offsets than the
    report's moves a rank's segments off the chain); a crossing joins two ranks' segments."""
    on_path = {uuid for uuid, track in check.tracks.items() if track.name.startswith(PATH_TRACK_NAME)}
    by_step: dict[Any, list] = defaultdict(list)
    for piece in check.slices:
        if piece.track_uuid in on_path:
            by_step[(piece.annotations or {}).get("step")].append(piece)
    problems = []
    for step, pieces in sorted(by_step.items(), key=str):
        pieces.sort(key=lambda p: (p.start_ns, p.end_ns))
        for before, after in zip(pieces, pieces[1:]):
            if after.start_ns < before.end_ns - tolerance_ns:
                problems.append(f"critical path of step {step}: {_owner(check, after)}'s segment at {after.start_ns} "
                                f"starts {(before.end_ns - after.start_ns) / 1000:.1f} us before "
                                f"{_owner(check, before)}'s ends (clock offsets other than the report's?)")
    for flow_id, start, end in check.arrows:
        if start[0] in on_path and (end[0] not in on_path or check.process_of(start[0]) is check.process_of(end[0])):
            problems.append(f"critical-path flow {flow_id} does not join two ranks' critical-path segments")
    return problems


def _owner(check: TraceCheck, piece) -> str:
    process = check.process_of(piece.track_uuid)
    return process.name if process is not None else f"track {piece.track_uuid}"


def verify_outputs(result: MergeResult, *, trace_processor: str | Path | None = None,
                   engine: bool = False) -> list[str]:
    """`verify_merge` of every file a merge wrote (the shards and the summary file when sharded)."""
    problems = []
    for each in [*result.shards, result]:
        problems += [f"{each.output.name}: {p}" for p in verify_merge(each, trace_processor=trace_processor,
                                                                      engine=engine)]
    return problems


def summary_problems(result: MergeResult, check: TraceCheck) -> list[str]:
    """Every summarized rank has its summary tracks with the slices, instants and counter samples written."""
    found = summary_counts(check)
    problems = []
    for count in result.summary:
        got = found.get(count.rank, (0, 0, 0))
        if got != (count.slice_count, count.instant_count, count.counter_sample_count):
            problems.append(f"rank {count.rank}: summary holds (slices, instants, counter samples) {got}, "
                            f"the merge wrote {(count.slice_count, count.instant_count, count.counter_sample_count)}")
    extra = sorted(set(found) - {c.rank for c in result.summary})
    if extra:
        problems.append(f"summary tracks of ranks the merge did not summarize: {extra[:10]}")
    return problems


def summary_counts(check: TraceCheck) -> dict[int, tuple[int, int, int]]:
    """rank -> (slices, instants, counter samples) on the summary process's `rank R: ...` tracks."""
    counts: dict[int, list[int]] = {}

    def rank_of(uuid: int) -> int | None:
        process = check.process_of(uuid)
        name = check.tracks[uuid].name if uuid in check.tracks else ""
        if process is None or process.pid != SUMMARY_PID or not name.startswith("rank ") or ":" not in name:
            return None
        text = name[len("rank "):name.index(":")]
        return int(text) if text.isdigit() else None

    for position, items in enumerate((check.slices, check.instants)):
        for item in items:
            rank = rank_of(item.track_uuid)
            if rank is not None:
                counts.setdefault(rank, [0, 0, 0])[position] += 1
    for uuid, samples in check.counter_values.items():
        rank = rank_of(uuid)
        if rank is not None:
            counts.setdefault(rank, [0, 0, 0])[2] += len(samples)
    return {rank: tuple(values) for rank, values in counts.items()}


def flow_end_problems(result: MergeResult, check: TraceCheck) -> list[str]:
    """Arrows join slices of ranks drawn in full only (never the summary, never a rank left out)."""
    present = {s.process_name for s in result.per_rank if s.files}
    stray = Counter()
    for _, start, end in check.arrows:
        for uuid in (start[0], end[0]):
            process = check.process_of(uuid)
            if process is None or process.name not in present:
                stray[process.name if process else "no process"] += 1
    return [f"{count} flow ends on {name}, not a rank drawn in full" for name, count in sorted(stray.items())]


def _listed(names: list[str]) -> str:
    return str(names) if len(names) <= 12 else f"{names[:6]} ... ({len(names)} in all)"


def verify_trace_file(path: str | Path, trace_processor: str | Path) -> list[str]:
    """Problems of a merged trace on its own: the read-back's invariants, and the engine's tables
    compared with the read-back."""
    check = check_trace(path)
    return list(check.problems) + critical_path_problems(check) + check_with_trace_processor(
        path, trace_processor, expected=readback_expectations(check)).problems


def expected_slices_by_process(result: MergeResult) -> dict[str, int]:
    """Process name -> slices written (recorded events plus overlay slices), in rank order."""
    return {s.process_name: s.slice_count + s.overlay_slice_count for s in result.per_rank if s.files}


def merge_expectations(result: MergeResult, check: TraceCheck) -> EngineExpectations:
    """What the engine must see: the merge's own counts (the engine's `slice` table holds instants too), and the cross-rank arrows it wrote (from the
    read-back: which instances reached more than one rank depends on every rank)."""
    merged = [s for s in result.per_rank if s.files]
    firsts = [s.first_timestamp_ns for s in merged if s.first_timestamp_ns is not None]
    lasts = [s.last_timestamp_ns for s in merged if s.last_timestamp_ns is not None]
    firsts += [c.first_ns for c in result.summary if c.first_ns is not None]
    lasts += [c.last_ns for c in result.summary if c.last_ns is not None]
    for bounds in (result.whole_run_bounds_ns, result.ideal_bounds_ns):
        if bounds is not None:
            firsts.append(bounds[0])
            lasts.append(bounds[1])
    return EngineExpectations(
        slices_by_process={s.process_name: s.slice_count + s.overlay_slice_count + s.instant_count
                           + s.overlay_instant_count for s in merged},
        threads_by_process={s.process_name: s.thread_count for s in merged},
        cross_rank_flows=cross_rank_arrows(check),
        arrows=len(check.arrows),
        counter_samples=(sum(s.counter_sample_count for s in merged) + sum(c.counter_sample_count for c in result.summary)
                         + result.whole_run_samples),
        time_bounds_ns=(min(firsts), max(lasts)) if firsts and lasts else None,
        summary_slices={c.rank: c.slice_count for c in result.summary if c.slice_count},
    )


def readback_expectations(check: TraceCheck) -> EngineExpectations:
    timestamps = [t for s in check.slices for t in (s.start_ns, s.end_ns)]
    timestamps += [i.ts_ns for i in check.instants]
    timestamps += [ts for samples in check.counter_values.values() for ts, _ in samples]
    return EngineExpectations(
        slices_by_process={name: count for name, count in
                           (check.slice_count_by_process() + check.instant_count_by_process()).items()
                           if _engine_lists(name)},
        threads_by_process={name: count for name, count in check.thread_count_by_process().items()
                            if _engine_lists(name)},
        cross_rank_flows=cross_rank_arrows(check),
        arrows=len(check.arrows),
        counter_samples=sum(len(samples) for samples in check.counter_values.values()),
        time_bounds_ns=(min(timestamps), max(timestamps)) if timestamps else None,
    )


def _engine_lists(process_name: str | None) -> bool:
    """Whether perfetto/sql.py's counts list the process: the drawn files' own (`rank R (host)`, or another
    tool's trace), not the summary, the whole run or the ideal replay."""
    return process_name is not None and process_name.startswith(DRAWN_PROCESS_PREFIXES)


def cross_rank_arrows(check: TraceCheck) -> dict[int, int]:
    """Collective flow id -> arrows joining slices of two different processes."""
    arrows: Counter = Counter()
    for flow_id, start, end in check.arrows:
        if flow_id & CROSS_RANK_FLOW_BIT and check.process_of(start[0]) is not check.process_of(end[0]):
            arrows[flow_id] += 1
    return dict(arrows)
