"""The whole run in the merged trace: every rank's step time and lateness over every step, as counters.

Profiler windows are drawn in full; between them the trace would be empty. Every rank's timeline
(`metrics/rank<R>.timeline`, traces/timeline.py) covers every step, so the merged trace gets one process,
`WHOLE_RUN_PROCESS_NAME`, with two counter tracks per rank:
  `rank R: step time (ms)`  the rank's step time (traces/timeline.py step_ms), a sample at each step's start;
  `rank R: lateness (ms)`   how long after the earliest rank the rank ended that step, on the merged clock
                            (each rank's start_us less its clock offset, as its drawn tracks are shifted).
Each rank's first step (warm-up, compilation) is left out; a step a resumed run repeated is drawn from its
later record (as the whole-run analysis reads it), so lateness compares the same attempt on every rank.
A long run is binned: at most `samples_per_rank` samples a rank (MAX_SAMPLES_TOTAL shared by every rank,
never more than MAX_SAMPLES_PER_RANK), each the mean of its bin at the bin's first step; the tracks'
description says how many steps a sample holds.
Planning is pure; `write_whole_run` writes. The timelines are those the run's records list
(RunRecords.timelines, inputs/records.py: listed once with the run's other records); their records are large,
so they are read here one rank at a time (memory-mapped): a first pass finds each step's earliest end over
every rank, a second plans each rank's samples.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from fleetscope.analysis.merge.perfetto.columnar import TrackEventColumns, write_track_events
from fleetscope.analysis.merge.perfetto.writer import COUNTER, SequenceWriter, TrackSpec
from fleetscope.analysis.merge.tracks import OP_COUNTER, PROCESS_PID_BASE
from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.analysis.inputs.timelines import TimelineFiles
from fleetscope.traces.timeline import FLAG_FIRST, last_of_each_step

WHOLE_RUN_PROCESS_NAME = "fleetscope whole run (every rank, every step)"
WHOLE_RUN_PID = PROCESS_PID_BASE - 2
WHOLE_RUN_PROCESS_UUID = (1 << 62) + (1 << 61)
WHOLE_RUN_SEQUENCE_ID = (1 << 30) + 1
"""One packet sequence for the whole-run counters (the summary's is 1 << 30, ranks' 2 + rank)."""
MAX_SAMPLES_PER_RANK = 4000
MAX_SAMPLES_TOTAL = 2_000_000
"""About 20 MB of counter packets, whatever the number of ranks and steps."""
MAX_STEP_INDEX = 1 << 24
"""Steps beyond this (16.7 million) are not drawn: the earliest-end table is indexed by step (128 MB at most)."""


@dataclass(frozen=True, kw_only=True)
class RankWholeRun:
    rank: int
    steps_per_sample: int
    step_ms: list[tuple[int, float]]
    """(ns on the merged clock, ms)."""
    lateness_ms: list[tuple[int, float]]
    clock_known: bool = True
    """Whether the rank's clock offset was measured (else its lateness includes its host's clock skew)."""


@dataclass(kw_only=True)
class WholeRunPlan:
    ranks: list[RankWholeRun] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Timelines not read, and why (the analysis report names them too)."""

    @property
    def sample_count(self) -> int:
        return sum(len(r.step_ms) + len(r.lateness_ms) for r in self.ranks)

    @property
    def bounds_ns(self) -> tuple[int, int] | None:
        """First and last sample on the merged clock (None without samples)."""
        stamps = [ts for r in self.ranks for samples in (r.step_ms, r.lateness_ms) for ts, _ in samples]
        return (min(stamps), max(stamps)) if stamps else None   # every sample: a wall clock may step back


def plan_whole_run(run: RunRecords, ranks: Iterable[int], offsets_ns: Mapping[int, int]) -> WholeRunPlan:
    """The counters of every rank of `ranks` that has a timeline in `run`'s listing; `offsets_ns`: each known
    clock offset, as the merge subtracts it from the rank's timestamps (a rank without one is taken at 0, and
    its lateness track says that it includes its host's clock skew)."""
    plan = WholeRunPlan()
    timelines = run.timelines
    listed = sorted(set(timelines.ranks).intersection(ranks)) if timelines is not None else []
    if not listed:
        return plan
    earliest_end = _earliest_ends(timelines, listed, offsets_ns, plan.problems)
    per_rank = max(1, min(MAX_SAMPLES_PER_RANK, MAX_SAMPLES_TOTAL // (2 * len(listed))))
    for rank in listed:
        columns = _columns(timelines, rank, offsets_ns.get(rank, 0), [])
        if columns is not None:
            samples = _rank_samples(rank, *columns, earliest_end, per_rank)
            plan.ranks.append(dataclasses.replace(samples, clock_known=rank == 0 or rank in offsets_ns))
    return plan


def write_whole_run(writer: SequenceWriter, plan: WholeRunPlan) -> None:
    """The process, its counter tracks, then every sample in time order (encoded as columns: a long run has
    up to MAX_SAMPLES_TOTAL of them)."""
    writer.track(TrackSpec(uuid=WHOLE_RUN_PROCESS_UUID, name=WHOLE_RUN_PROCESS_NAME, pid=WHOLE_RUN_PID, order=-2,
                           description="every rank's step time and lateness over the whole run (its timeline files)"))
    for order, rank in enumerate(plan.ranks):
        note = f"one sample per {rank.steps_per_sample} step(s), their mean"
        for kind, label in enumerate(_LABELS):
            writer.track(TrackSpec(uuid=_uuid(rank.rank, kind), name=f"rank {rank.rank}: {label}",
                                   parent_uuid=WHOLE_RUN_PROCESS_UUID, order=2 * order + kind, is_counter=True,
                                   counter_unit="ms", description=note + _basis(kind, rank)))
    operations = plan_operations(plan)
    if operations:
        write_track_events(writer, TrackEventColumns(
            types=np.full(len(operations), COUNTER, dtype=np.int64),
            timestamps_ns=np.array([op[0] for op in operations], dtype=np.int64),
            track_uuids=np.array([op[2] for op in operations], dtype=np.uint64),
            names=[], categories=[], counter_values=np.array([op[3] for op in operations], dtype=np.float64)))


def plan_operations(plan: WholeRunPlan) -> list[tuple]:
    """The counter samples as planned operations (tracks.OP_COUNTER), in time order: what write_whole_run writes."""
    operations = []
    for rank in plan.ranks:
        for kind, samples in enumerate((rank.step_ms, rank.lateness_ms)):
            uuid = _uuid(rank.rank, kind)
            operations += [(ts, OP_COUNTER, uuid, value) for ts, value in samples]
    return sorted(operations, key=lambda operation: operation[0])


_LABELS = ("step time (ms)", "lateness (ms)")


def _basis(kind: int, rank: RankWholeRun) -> str:
    if kind == 0:
        return ("; step time from the rank's timeline (step_ms), profiled steps included (they carry the "
                "profiler's cost; the report's whole-run figures use the other steps)")
    clock = "its clock offset measured" if rank.clock_known else \
        "no measured clock offset: includes its host's clock skew"
    return f"; its step end minus the earliest rank's that step, on the merged clock ({clock})"


def _uuid(rank: int, kind: int) -> int:
    return WHOLE_RUN_PROCESS_UUID + 1 + 2 * rank + kind


def _columns(timelines: TimelineFiles, rank: int, offset_ns: int, problems: list[str]):
    """(steps, start_ns on the merged clock, step_ms) of the rank's steps after its first; None: unreadable."""
    try:
        records = timelines.records_of(rank)
    except (OSError, ValueError) as error:
        problems.append(f"rank {rank}: {error}")
        return None
    records = records[last_of_each_step(records["step"])]   # a resumed run's repeated steps: the later one
    kept = records[((records["flags"] & FLAG_FIRST) == 0) & (records["step"] < MAX_STEP_INDEX)]
    if not len(kept):
        return None
    steps = kept["step"].astype(np.int64)
    start_ns = np.round(kept["start_us"] * 1000.0).astype(np.int64) - int(offset_ns)
    return steps, start_ns, kept["step_ms"].astype(np.float64)


def _earliest_ends(timelines: TimelineFiles, ranks: list[int], offsets_ns: Mapping[int, int],
                   problems: list[str]) -> np.ndarray:
    """Per step, the earliest end (ns, merged clock) over every rank (int64 max where no rank has the step)."""
    earliest = np.full(0, np.iinfo(np.int64).max, dtype=np.int64)
    for rank in ranks:
        columns = _columns(timelines, rank, offsets_ns.get(rank, 0), problems)
        if columns is None:
            continue
        steps, start_ns, step_ms = columns
        if steps.max() >= len(earliest):
            grown = np.full(int(steps.max()) + 1, np.iinfo(np.int64).max, dtype=np.int64)
            grown[:len(earliest)] = earliest
            earliest = grown
        np.minimum.at(earliest, steps, start_ns + np.round(step_ms * 1e6).astype(np.int64))
    return earliest


def _rank_samples(rank: int, steps: np.ndarray, start_ns: np.ndarray, step_ms: np.ndarray, earliest_end: np.ndarray,
                  per_rank: int) -> RankWholeRun:
    lateness = (start_ns + np.round(step_ms * 1e6).astype(np.int64) - earliest_end[steps]) / 1e6
    size = max(1, math.ceil(len(steps) / per_rank))
    first = np.arange(0, len(steps), size)
    counts = np.diff(np.append(first, len(steps)))
    ts = start_ns[first]
    step_mean = np.add.reduceat(step_ms, first) / counts
    late_mean = np.add.reduceat(lateness, first) / counts
    return RankWholeRun(rank=rank, steps_per_sample=size,
                        step_ms=list(zip(ts.tolist(), np.round(step_mean, 4).tolist())),
                        lateness_ms=list(zip(ts.tolist(), np.round(late_mean, 4).tolist())))
