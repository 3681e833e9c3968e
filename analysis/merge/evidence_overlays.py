"""The report's per-rank evidence in the merged trace (pure planning): per-step counters and host-stall
marks on the `fleetscope analysis` track.

Counters, one sample at the start of each drawn step that has a value (the report's JSON, schema in
report/model.py):
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
from typing import TYPE_CHECKING, Any

from fleetscope.analysis.per_rank.events import HOST_CATEGORIES_BY_KIND, Kind
from fleetscope.analysis.per_rank.names import is_host_sync_call, is_tensor_read_op
from fleetscope.traces.validate import finite_number

if TYPE_CHECKING:
    from fleetscope.analysis.merge.window import GroupedEvents

EVIDENCE_CATEGORY = "fleetscope.evidence"
HOST_STALL_FIELDS = ("sync_count", "sync_us", "tensor_reads", "dtoh_count", "dtoh_us", "input_wait_us")
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


def rank_evidence(window: dict, rank_entry: dict | None, trainer_rank: dict | None) -> RankEvidence | None:
    """From the report JSON: the window, this rank's `windows[].ranks[]` entry and its
    `trainer.ranks[]` entry (each may be missing). None when there is nothing to draw."""
    counters: list[StepCounter] = []
    stalls: dict[int, dict[str, Any]] = {}
    if rank_entry is not None:
        counters += _step_counters(_dicts(rank_entry.get("steps")))
        host = rank_entry.get("host_stalls")
        stall_steps = _dicts(host.get("steps")) if isinstance(host, dict) else []
        counters += _stall_counters(stall_steps)
        stalls = {s["step"]: {k: s[k] for k in HOST_STALL_FIELDS if _number(s.get(k))} for s in stall_steps
                  if _int(s.get("step")) and any(_number(s.get(k)) and s[k] > 0
                                                 for k in ("sync_count", "tensor_reads", "dtoh_count"))}
    if trainer_rank is not None:
        counters += _memory_counters(trainer_rank.get("memory")) + _input_counters(trainer_rank.get("input"))
    counters = [c for c in counters if c.values]
    collectives = _bandwidth_marks(window.get("bandwidth"))
    if not (counters or stalls or collectives):
        return None
    return RankEvidence(counters=counters, stalls=stalls, collectives=collectives)


_INSTANCE_FIELDS = ("bytes", "members", "moving_us", "wait_us", "algbw_gbps", "busbw_gbps", "peak_pct")


def _bandwidth_marks(bandwidth: Any) -> dict[tuple, list[tuple[str, dict[str, Any]]]]:
    if not isinstance(bandwidth, dict):
        return {}
    rows = bandwidth.get("rows") if isinstance(bandwidth.get("rows"), list) else []
    marks: dict[tuple, list[tuple[str, dict[str, Any]]]] = {}
    for instance in _dicts(bandwidth.get("instances")):
        row = rows[instance["row"]] if _int(instance.get("row")) and 0 <= instance["row"] < len(rows) else None
        if not isinstance(row, dict) or not (_int(instance.get("step")) and _int(instance.get("ordinal"))):
            continue
        what = f"{row.get('collective')} {row.get('size_bucket')}"
        notes = {k: instance[k] for k in _INSTANCE_FIELDS if _number(instance.get(k))}
        notes.update({k: row[k] for k in ("scope", "group", "peak_busbw_gbps") if row.get(k) is not None})
        found = [(f"bandwidth: {what}", notes)]
        if row.get("slow") is True:
            found.append((f"slow collective: {what}", {"verdict": str(row.get("verdict") or ""), **notes}))
        marks[(instance["step"], str(instance.get("name")), instance["ordinal"])] = found
    return marks


def _step_counters(steps: list[dict]) -> list[StepCounter]:
    loader = _by_step(steps, lambda s: s.get("data_loader_ms"))
    phases: dict[str, dict[int, float]] = {}
    for entry in steps:
        for phase, ms in (entry.get("phases_ms") or {}).items() if isinstance(entry.get("phases_ms"), dict) else ():
            if _int(entry.get("step")) and _number(ms) and phase != "train_step":
                phases.setdefault(str(phase), {})[entry["step"]] = float(ms)
    return [StepCounter(label="data loader (ms)", unit="ms", values=loader)] + [
        StepCounter(label=f"phase {phase} (ms)", unit="ms", values=values) for phase, values in sorted(phases.items())]


def _stall_counters(steps: list[dict]) -> list[StepCounter]:
    return [
        StepCounter(label="host sync (ms)", unit="ms", values=_by_step(steps, lambda s: _scaled(s.get("sync_us")))),
        StepCounter(label="tensor reads", unit="count", values=_by_step(steps, lambda s: s.get("tensor_reads"))),
        StepCounter(label="D2H copies (ms)", unit="ms", values=_by_step(steps, lambda s: _scaled(s.get("dtoh_us")))),
    ]


def _memory_counters(memory: Any) -> list[StepCounter]:
    if not isinstance(memory, dict) or not isinstance(memory.get("steps"), list):
        return []
    counters = []
    for label, key in (("peak allocated (MiB)", "allocated_mb"), ("peak reserved (MiB)", "reserved_mb")):
        values = memory.get(key)
        if isinstance(values, list) and len(values) == len(memory["steps"]):
            counters.append(StepCounter(label=label, unit="MiB", values={
                step: float(value) for step, value in zip(memory["steps"], values) if _int(step) and _number(value)}))
    return counters


def _input_counters(found: Any) -> list[StepCounter]:
    if not isinstance(found, dict):
        return []
    steps, values = found.get("recorded_steps"), found.get("data_ms")
    if not isinstance(steps, list) or not isinstance(values, list) or len(steps) != len(values):
        return []
    return [StepCounter(label="trainer data (ms)", unit="ms", values={
        step: float(value) for step, value in zip(steps, values) if _int(step) and _number(value)})]


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


def _by_step(steps: list[dict], value_of) -> dict[int, float]:
    found = {}
    for entry in steps:
        value = value_of(entry)
        if _int(entry.get("step")) and _number(value):
            found[entry["step"]] = float(value)
    return found


def _scaled(us: Any) -> float | None:
    return us / 1000.0 if _number(us) else None


def _dicts(value: Any) -> list[dict]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return finite_number(value) is not None
