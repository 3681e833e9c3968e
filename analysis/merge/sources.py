"""What a merge reads, per rank: the same inputs, per-rank parse and placement as the report.

The merge asks the analysis stages, never a parser of its own: `inputs.resolve` says which files a path
holds (run directory and manifest, attempts, any directory of traces), `per_rank.parse` gives each
file's per-rank model through the parsed-trace cache (after `analyze` a hit: the model is not computed
again), and `cross_rank.placement` gives every file its rank and window and names duplicates and
missing ranks. Each window's collectives are matched across ranks by `cross_rank.matching`, as in the
report, so the merge's instance keys are the report's. Of each model the merge keeps what it draws: the
steps and the collective instances; the models themselves stay in `MergeInputs.parsed` for the cross-rank
stages a merge without a report runs (stages.py). The trace file itself is read once more only to copy its
events into the output.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from fleetscope.analysis.cross_rank.clock_align import MeasuredOffset
from fleetscope.analysis.cross_rank.matching import match_by_window
from fleetscope.analysis.cross_rank.placement import Placement, place_traces
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.analysis.inputs.resolve import rank_from_name, resolve_input
from fleetscope.analysis.inputs.sources import TraceFailure, TraceSource
from fleetscope.analysis.per_rank.cache import ResultCache
from fleetscope.analysis.per_rank.collectives import CollectiveKey
from fleetscope.analysis.per_rank.host_stalls import IdleGaps
from fleetscope.analysis.per_rank.names import P2P_RECV, P2P_SEND
from fleetscope.analysis.per_rank.p2p import OUTSIDE_STEPS
from fleetscope.analysis.per_rank.parse import parse_traces
from fleetscope.analysis.per_rank.rank import RankResult, other_tool_trace_reason
from fleetscope.analysis.quantities import absent_runs, ranges_text, step_ranges
from fleetscope.traces.layout import RunLayout

CLOCK_GIVEN = "given"
CLOCK_FILE = "clock file"
CLOCK_REPORT = "analysis report"
CLOCK_NONE = "none"
"""Where a rank's clock offset came from: the caller, `clock/rank<R>.json`, the analysis report
(which may refine the measured offsets from collectives), or nowhere (offset 0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeProblem:
    """Something the merge could not use or had to repair, and why."""

    reason: str
    path: str | None = None
    rank: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowModel:
    """What the per-rank parse found in one trace file that the merge draws (trace clock, microseconds)."""

    steps: tuple[tuple[int, float, float], ...] = ()
    """(step, start_us, end_us) of each training step on the host, by start."""
    step_spans: tuple[tuple[int, float, float], ...] = ()
    """(step, start_us, end_us) of the span each step is timed by, in `steps`' order: the report's step
    (StepTiming.span_start_us / span_end_us: the host's range, or the GPU's span where the GPU bounds the
    step), so its length is the report's step_time_ms."""
    collectives: tuple[tuple[float, CollectiveKey], ...] = ()
    """(start_us, instance key) of each collective the report matches across ranks."""
    collective_source: str | None = None
    p2p: tuple[tuple[float, tuple, str], ...] = ()
    """(start_us, transfer key, send|recv) of each send / receive in a step whose peer is known (flows.p2p_flow_id)."""
    idle_gaps: IdleGaps | None = None
    """Each idle gap inside the steps with its cause (host_stalls.find_idle_gaps), kept as the parse's
    arrays: a model is held for every rank (the summary), and a GPU trace has thousands of gaps."""
    collective_ends_us: tuple[float, ...] = ()
    """End of each collective of `collectives` (same order): the summary's comm time per step."""
    utilization: tuple[float, float, float] | None = None
    """(busy, idle, comm) percent of the window's span (per_rank/utilization.py); None: nothing measured."""
    event_count: int = 0
    base_time_ns: int = 0
    """The trace's `baseTimeNanoseconds` (the summary places a rank without reading its trace)."""
    bounds_us: tuple[float, float] | None = None
    """(first start, last end) of the trace's events, trace clock."""
    groups: frozenset[str] = frozenset()
    """Process groups the rank's collectives name (per_rank/comm_bytes.py): the focus set's peers."""

    @classmethod
    def of(cls, result: RankResult) -> "WindowModel":
        calls = result.collectives
        use = result.utilization
        return cls(
            steps=tuple((s.step, s.start_us, s.end_us) for s in result.steps),
            step_spans=tuple((s.step, s.span_start_us, s.span_end_us) for s in result.steps),
            collectives=tuple((float(start), key) for start, key in zip(calls.start_us, calls.keys)),
            collective_source=calls.source,
            p2p=tuple((c.start_us, transfer_key(result.rank, c), c.kind) for c in result.p2p.calls
                      if c.peer is not None and c.kind in (P2P_SEND, P2P_RECV) and c.step != OUTSIDE_STEPS),
            idle_gaps=result.idle_gaps,
            collective_ends_us=tuple(float(end) for end in calls.end_us),
            utilization=(use.busy_pct, use.idle_pct, use.comm_pct) if use is not None else None,
            event_count=result.event_count,
            base_time_ns=result.base_time_ns,
            bounds_us=(result.first_start_us, result.last_end_us)
            if result.first_start_us is not None and result.last_end_us is not None else None,
            groups=frozenset(g for g in (calls.sizes.group if calls.sizes is not None else ()) if g),
        )


def idle_gap_rows(gaps: IdleGaps | None) -> list[tuple[float, float, str]]:
    """(start_us, end_us, cause) of each gap."""
    if gaps is None:
        return []
    return list(zip(gaps.starts_us.tolist(), gaps.ends_us.tolist(), gaps.causes()))


def transfer_key(rank: int | None, call) -> tuple:
    """(step, direction, micro-batch, sender, receiver): the same on the sending and the receiving rank."""
    sender, receiver = (rank, call.peer) if call.kind == P2P_SEND else (call.peer, rank)
    return (call.step, call.direction, call.microbatch, sender, receiver)


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceFile:
    path: Path
    window: int | None
    bytes: int
    model: WindowModel = WindowModel()


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSource:
    """Everything merged into one rank's process."""

    rank: int
    host: str
    files: tuple[TraceFile, ...]
    """In window order (name order when windows are unknown)."""
    clock_offset_ns: int = 0
    """This rank's clock minus rank 0's; subtracted from its timestamps."""
    clock_source: str = CLOCK_NONE
    profiler_trace: bool = True
    """False: its files hold no torch.profiler event (a Chrome trace of another tool): drawn, never called a rank."""

    @property
    def process_name(self) -> str:
        if not self.profiler_trace:
            return f"trace {', '.join(f.path.name for f in self.files)} (not a torch.profiler trace)"
        return f"rank {self.rank} ({self.host})"


@dataclass(frozen=True, kw_only=True)
class ParsedRanks:
    """What the cross-rank stages read (report/build.py), from the merge's one parse."""

    results: list[RankResult]
    """Every placed rank of every window, collectives matched (cross_rank/matching.py)."""
    source_kind: str
    world_size: int | None = None
    measured_offsets: dict[int, MeasuredOffset] = field(default_factory=dict)


@dataclass(kw_only=True)
class MergeInputs:
    root: Path
    run_layout: RunLayout | None
    """Set when the input is a run directory."""
    ranks: list[RankSource]
    problems: list[MergeProblem] = field(default_factory=list)
    parsed: ParsedRanks | None = None
    """The per-rank results themselves; the merge lets go of them once its focus set is planned."""
    records: RunRecords | None = None
    """What the run directory states besides its traces (inputs/records.py), as read once."""

    @property
    def input_bytes(self) -> int:
        return sum(f.bytes for source in self.ranks for f in source.files)

    def event_counts(self) -> dict[tuple[int | None, int], int]:
        """(window, rank) -> events the per-rank parse counted (a report of these traces counts the same)."""
        return {(f.window, source.rank): f.model.event_count for source in self.ranks for f in source.files}


def find_merge_inputs(path: str | Path, *, offsets_ns: Mapping[int, int] | None = None,
                      cache: ResultCache | None = None, workers: int | None = None,
                      records: RunRecords | None = None) -> MergeInputs:
    """The traces under `path` grouped by rank, sorted by rank; `offsets_ns` overrides clock files. `records`:
    the run directory's records when the caller has read them (read here otherwise)."""
    inputs = resolve_input(path, records=records)
    # after analyze (postprocess) this process holds HTA and the report's leftovers: spawned workers
    # read the cache entries without a copy of it each
    outcomes = parse_traces(inputs.sources, cache=cache, workers=workers, fresh_workers=True)
    placement = place_traces(inputs, outcomes)
    by_label = {source.label: source for source in inputs.sources}
    problems = [_failure_problem(f, by_label) for f in inputs.failures + placement.failures]
    problems += _missing_problems(placement, inputs.world_size)
    problems += [MergeProblem(reason=f"clock offset not used: {p}") for p in inputs.clock_problems]
    offsets = {rank: (round(m.offset_us * 1000), CLOCK_FILE) for rank, m in inputs.measured_offsets.items()}
    offsets.update({rank: (int(offset), CLOCK_GIVEN) for rank, offset in dict(offsets_ns or {}).items()})
    results = match_by_window(placement.results)
    problems += other_tool_traces(results, by_label)
    ranks = _rank_sources(results, by_label, offsets)
    if not ranks:
        problems.append(MergeProblem(path=str(inputs.root), reason="no readable Kineto trace found"))
    parsed = ParsedRanks(results=results, source_kind=inputs.kind, world_size=inputs.world_size,
                         measured_offsets=dict(inputs.measured_offsets))
    return MergeInputs(root=inputs.root, run_layout=inputs.layout, ranks=ranks, problems=problems, parsed=parsed,
                       records=inputs.records)


def _missing_problems(placement: Placement, declared: int | None) -> list[MergeProblem]:
    """One problem per window lacking rank traces, its missing ranks as ranges in full ("2-127"): ranges come
    from the ranks present, so a large declared world costs nothing and no rank is left unlisted."""
    if not placement.missing:
        return []
    world = max([r.world_size for r in placement.results if r.world_size] + [declared or 0])
    if world <= 0:      # no declared size: the listed ranks are all that is known
        return [MergeProblem(reason=f"no trace: {len(placement.missing)} rank(s) "
                                    f"({step_ranges(m.rank for m in placement.missing)})")]
    present: dict[int | None, set[int]] = defaultdict(set)
    for result in placement.results:
        present[result.window].add(result.rank)
    problems = []
    for window in sorted({m.window for m in placement.missing}, key=lambda w: -1 if w is None else w):
        runs = absent_runs(world, present[window])
        count = sum(last - first + 1 for first, last in runs)
        where = f" in window {window}" if window is not None else ""
        problems.append(MergeProblem(reason=f"no trace{where}: {count} rank(s) ({ranges_text(runs)})"))
    return problems


def other_tool_traces(results: list[RankResult], by_label: dict[str, TraceSource]) -> list[MergeProblem]:
    """A problem per file with no torch.profiler event, named as analyze names it (per_rank/rank.py), with the
    file and no rank: the merge still draws it (a viewer of any Chrome trace is useful), and is partial."""
    reasons = [(result, other_tool_trace_reason(result)) for result in results]
    return [MergeProblem(path=str(by_label[r.label].path) if r.label in by_label else r.path, reason=reason)
            for r, reason in reasons if reason is not None]


def _failure_problem(failure: TraceFailure, by_label: dict[str, TraceSource]) -> MergeProblem:
    source = by_label.get(failure.label)
    path = str(source.path) if source is not None else failure.label
    rank = failure.rank if failure.rank is not None else rank_from_name(Path(failure.label).name)
    return MergeProblem(path=path, rank=rank, reason=failure.reason)


def _rank_sources(results: list[RankResult], by_label: dict[str, TraceSource],
                  offsets: dict[int, tuple[int, str]]) -> list[RankSource]:
    by_rank: dict[int, list[RankResult]] = defaultdict(list)
    for result in results:
        by_rank[result.rank].append(result)
    sources = []
    for rank in sorted(by_rank):
        placed = sorted(by_rank[rank], key=lambda r: (r.window if r.window is not None else -1, r.label))
        files = tuple(_trace_file(r, by_label) for r in placed)
        offset, clock_source = offsets.get(rank, (0, CLOCK_NONE))
        sources.append(RankSource(rank=rank, host=placed[0].host, files=files, clock_offset_ns=offset,
                                  clock_source=clock_source,
                                  profiler_trace=any(result.profiler_events for result in placed)))
    return sources


def _trace_file(result: RankResult, by_label: dict[str, TraceSource]) -> TraceFile:
    path = by_label[result.label].path if result.label in by_label else Path(result.path)
    return TraceFile(path=path, window=result.window, bytes=path.stat().st_size, model=WindowModel.of(result))
