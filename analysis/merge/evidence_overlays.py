"""The report's per-rank evidence in the merged trace (pure planning): per-step counters and host-stall
marks on the `fleetscope analysis` track.

Counters, one sample at the start of each drawn step that has a value (the typed report, report/model.py):
  * `data loader (ms)`: windows[].ranks[].steps[].data_loader_ms (DataLoader fetch ranges of the trace);
  * `phase <name> (ms)`: the step's phases_ms (forward, backward, optimizer_step);
  * `host sync (ms)`, `tensor reads`, `D2H copies (ms)`: windows[].ranks[].host_stalls.steps[];
  * `peak allocated (MiB)`, `peak reserved (MiB)`: the trainer's per-step allocator peaks
    (trainer.ranks[].memory, from metrics/rank<R>.jsonl);
  * `trainer data (ms)`: the trainer's own input wait per step (trainer.ranks[].input.data_ms).
Marks:
  * `host stalls (step N)` at the start of each step with syncs, tensor reads or D2H copies, annotated
    with that step's host_stalls entry;
  * `host sync: <call>` at each blocking call of the rank's events inside a drawn step (the calls
    host_stalls.py counts: names.is_host_sync_call, names.is_tensor_read_op), with its duration;
  * `bandwidth: <collective> <size>` at the start of each collective instance of the rank that the report
    timed (windows[].bandwidth.instances[]: algbw, busbw, % of the link's peak, bytes, data movement and
    wait), and `slow collective: <collective> <size>` with the row's verdict where bandwidth.py calls the
    instance's row slow.
What the report lacks is not drawn: no counter without values, no marks without stalls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from fleetscope.analysis.per_rank.events import HOST_CATEGORIES_BY_KIND, Kind
from fleetscope.analysis.per_rank.names import is_host_sync_call, is_tensor_read_op
from fleetscope.traces.validate import finite_number

if TYPE_CHECKING:
    from fleetscope.analysis.cross_rank.bandwidth import Bandwidth
    from fleetscope.analysis.merge.window import GroupedEvents
    from fleetscope.analysis.per_rank.host_stalls import StepStalls
    from fleetscope.analysis.per_rank.steps import StepTiming
    from fleetscope.analysis.per_rank.trainer_records import InputEvidence, MemoryEvidence, RankRecords
    from fleetscope.analysis.report.model import RankReport, WindowReport

EVIDENCE_CATEGORY = "fleetscope.evidence"
MAX_SYNC_MARKS = 10_000
"""Blocking calls marked per window (a trace with a sync per op would drown the track)."""
SYNC_CATEGORIES = tuple(sorted(HOST_CATEGORIES_BY_KIND[Kind.CUDA_RUNTIME] | HOST_CATEGORIES_BY_KIND[Kind.CPU_OP]))


@dataclass(frozen=True, kw_only=True)
class StepCounter:
    label: str
    unit: str
    values: dict[int, float]
    """step -> value."""


@dataclass(frozen=True, kw_only=True)
class RankEvidence:
    counters: list[StepCounter] = field(default_factory=list)
    stalls: dict[int, dict[str, Any]] = field(default_factory=dict)
    """step -> its host_stalls.steps[] entry, for steps with a stall."""
    collectives: dict[tuple, list[tuple[str, dict[str, Any]]]] = field(default_factory=dict)
    """Collective instance key (step, name, ordinal) -> (mark name, annotations) to draw at its start."""

    def collective_marks(self, hits: dict) -> list[tuple[int, str, dict]]:
        """Marks at the instances found on this rank (`hits`: key -> flows.CollectiveHit)."""
        return [(hit.start_ns, name, notes) for key, hit in hits.items() for name, notes in self.collectives.get(key, ())]

    def counter_samples(self, ranges: list[tuple[int, int, int]]) -> list[tuple[tuple, str, list[tuple[int, float]]]]:
        """(counter track key, unit, samples at the drawn steps' starts) per counter with a value."""
        found = []
        for counter in self.counters:
            samples = [(start, counter.values[step]) for step, start, _ in ranges if step in counter.values]
            if samples:
                found.append((("counter", "fleetscope", counter.label), counter.unit, samples))
        return found

    def stall_marks(self, ranges: list[tuple[int, int, int]]) -> list[tuple[int, str, dict]]:
        return [(start, f"host stalls (step {step})", dict(self.stalls[step])) for step, start, _ in ranges
                if step in self.stalls]


def rank_evidence(window: "WindowReport | None", rank_entry: "RankReport | None",
                  trainer_rank: "RankRecords | None") -> RankEvidence | None:
    """From the report: the window, this rank's `windows[].ranks[]` entry and its `trainer.ranks[]` entry
    (each may be missing). None when there is nothing to draw."""
    counters: list[StepCounter] = []
    stalls: dict[int, dict[str, Any]] = {}
    if rank_entry is not None:
        counters += _step_counters(rank_entry.steps)
        stall_steps = rank_entry.host_stalls.steps if rank_entry.host_stalls is not None else []
        counters += _stall_counters(stall_steps)
        stalls = {s.step: _stall_notes(s) for s in stall_steps
                  if any(_number(count) and count > 0 for count in (s.sync_count, s.tensor_reads, s.dtoh_count))}
    if trainer_rank is not None:
        counters += _memory_counters(trainer_rank.memory) + _input_counters(trainer_rank.input)
    counters = [c for c in counters if c.values]
    collectives = _bandwidth_marks(window.bandwidth if window is not None else None)
    if not (counters or stalls or collectives):
        return None
    return RankEvidence(counters=counters, stalls=stalls, collectives=collectives)


def _stall_notes(stalls: "StepStalls") -> dict[str, Any]:
    """The annotations of a `host stalls` mark: those of the step's figures that are numbers."""
    figures = {"sync_count": stalls.sync_count, "sync_us": stalls.sync_us, "tensor_reads": stalls.tensor_reads,
               "dtoh_count": stalls.dtoh_count, "dtoh_us": stalls.dtoh_us, "input_wait_us": stalls.input_wait_us}
    return {name: value for name, value in figures.items() if _number(value)}


def _bandwidth_marks(bandwidth: "Bandwidth | None") -> dict[tuple, list[tuple[str, dict[str, Any]]]]:
    if bandwidth is None:
        return {}
    rows = bandwidth.rows
    marks: dict[tuple, list[tuple[str, dict[str, Any]]]] = {}
    for instance in bandwidth.instances:
        if not 0 <= instance.row < len(rows):
            continue
        row = rows[instance.row]
        what = f"{row.collective} {row.size_bucket}"
        figures = {"bytes": instance.bytes, "members": instance.members, "moving_us": instance.moving_us,
                   "wait_us": instance.wait_us, "algbw_gbps": instance.algbw_gbps, "busbw_gbps": instance.busbw_gbps,
                   "peak_pct": instance.peak_pct}
        notes = {name: value for name, value in figures.items() if _number(value)}
        notes.update({name: value for name, value in (("scope", row.scope), ("group", row.group),
                                                      ("peak_busbw_gbps", row.peak_busbw_gbps)) if value is not None})
        found = [(f"bandwidth: {what}", notes)]
        if row.slow is True:
            found.append((f"slow collective: {what}", {"verdict": row.verdict, **notes}))
        marks[(instance.step, instance.name, instance.ordinal)] = found
    return marks


def _step_counters(steps: "list[StepTiming]") -> list[StepCounter]:
    loader = _by_step((s.step, s.data_loader_ms) for s in steps)
    phases: dict[str, dict[int, float]] = {}
    for entry in steps:
        for phase, ms in entry.phases_ms.items():
            if _number(ms) and phase != "train_step":
                phases.setdefault(str(phase), {})[entry.step] = float(ms)
    return [StepCounter(label="data loader (ms)", unit="ms", values=loader)] + [
        StepCounter(label=f"phase {phase} (ms)", unit="ms", values=values) for phase, values in sorted(phases.items())]


def _stall_counters(steps: "list[StepStalls]") -> list[StepCounter]:
    return [
        StepCounter(label="host sync (ms)", unit="ms", values=_by_step((s.step, _scaled(s.sync_us)) for s in steps)),
        StepCounter(label="tensor reads", unit="count", values=_by_step((s.step, s.tensor_reads) for s in steps)),
        StepCounter(label="D2H copies (ms)", unit="ms", values=_by_step((s.step, _scaled(s.dtoh_us)) for s in steps)),
    ]


def _memory_counters(memory: "MemoryEvidence | None") -> list[StepCounter]:
    if memory is None:
        return []
    counters = []
    for label, values in (("peak allocated (MiB)", memory.allocated_mb), ("peak reserved (MiB)", memory.reserved_mb)):
        if len(values) == len(memory.steps):
            counters.append(StepCounter(label=label, unit="MiB", values=_by_step(zip(memory.steps, values))))
    return counters


def _input_counters(found: "InputEvidence | None") -> list[StepCounter]:
    if found is None or len(found.recorded_steps) != len(found.data_ms):
        return []
    return [StepCounter(label="trainer data (ms)", unit="ms", values=_by_step(zip(found.recorded_steps, found.data_ms)))]


def sync_marks(grouped: "GroupedEvents", ranges: list[tuple[int, int, int]]) -> list[tuple[int, str, dict]]:
    """A mark at each host sync and tensor read that starts inside a drawn step, from its start to its end
    as the parse found them (`steps`: not extended to the next step), as host_stalls.py counts them."""
    if not ranges:
        return []
    spans = [(start, end) for _, start, end in ranges]
    verdicts: dict[str, bool] = {}
    marks = []
    for thread, slices in grouped.slices.items():
        if grouped.is_gpu(thread):
            continue
        for start, end, name, category, _, _ in slices:
            if category not in SYNC_CATEGORIES or not is_blocking(name, verdicts):
                continue
            if any(b <= start < e for b, e in spans):
                marks.append((start, f"host sync: {name}", {"call": name, "dur_us": (end - start) / 1000}))
    marks.sort(key=lambda mark: mark[0])
    return marks[:MAX_SYNC_MARKS]


def is_blocking(name: str, verdicts: dict[str, bool]) -> bool:
    """Whether a call blocks the host on the device (a sync or a tensor read); `verdicts` caches by name."""
    known = verdicts.get(name)
    if known is None:
        known = verdicts[name] = bool(is_host_sync_call(name) or is_tensor_read_op(name))
    return known


def _by_step(values: Iterable[tuple[int, Any]]) -> dict[int, float]:
    """step -> value, for the (step, value) pairs whose value is a finite number."""
    return {step: float(value) for step, value in values if _number(value)}


def _scaled(us: Any) -> float | None:
    return us / 1000.0 if _number(us) else None


def _number(value: Any) -> bool:
    return finite_number(value) is not None
