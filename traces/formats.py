"""The record formats the trainer writes and the analysis reads, besides the trace files themselves.

* step markers: the trainer names each profiled step `ProfilerStep#<global step>` and marks its phases
  with `record_function` ranges (`train_step` > `forward` / `backward` / `optimizer_step`);
* metric records: `metrics/rank<R>.jsonl`, one JSON object per line per step (the fields of
  `trainer.metrics.StepMetrics`); readers skip lines that are not such objects and count them;
* MLPerf-style log lines: `:::MLLOG {json}`, one per step per rank;
* injected-fault ranges: `fleetscope_injected_<what>` record_function names (the INJECTED_* names).
Writer and readers import these names, so they cannot disagree.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_MARKER_PREFIX = "ProfilerStep#"
TRAIN_STEP = "train_step"
PHASES = (TRAIN_STEP, "forward", "backward", "optimizer_step")
"""record_function ranges the trainer emits inside every step (the first encloses the others)."""
MLLOG_PREFIX = ":::MLLOG "
INJECTED_PREFIX = "fleetscope_injected_"
"""record_function ranges of deliberately injected faults (trainer/faults.py): ground truth in a trace."""
INJECTED_DELAY = INJECTED_PREFIX + "delay"
"""faults.straggle_*: a sleep before the step's forward."""
INJECTED_DATA_DELAY = INJECTED_PREFIX + "data_delay"
"""faults.data_delay_*: a sleep inside the DataLoader's fetch of a batch."""
INJECTED_SYNC = INJECTED_PREFIX + "sync"
"""faults.sync_per_layer: one `.item()` (aten::_local_scalar_dense) per decoder layer per forward."""
INJECTED_GRAPH_BREAK = INJECTED_PREFIX + "graph_break"
"""faults.graph_break: where a decoder block's compiled graph was broken."""
INJECTED_LEAK = INJECTED_PREFIX + "leak"
"""faults.leak_mb_per_step: the allocation of the tensors kept alive."""
INJECTED_SLOW_PHASE = INJECTED_PREFIX + "slow_phase"
"""faults.slow_phase*: a sleep inside the forward / backward / optimizer_step range."""
INJECTED_SLOW_STAGE = INJECTED_PREFIX + "slow_stage"
"""faults.slow_stage*: a sleep inside every micro-batch forward of one pipeline stage."""
MICROBATCH_PREFIX = "microbatch["
"""`microbatch[<i>]` ranges: one per micro-batch (gradient accumulation: its forward and backward; pipeline
parallel: each of its stage forwards and backwards, inside a `pp_forward` / `pp_backward` range)."""
PP_FORWARD = "pp_forward"
PP_BACKWARD = "pp_backward"
"""Ranges of one pipeline stage's forward / backward of one micro-batch (the stage's compute)."""


P2P_MARKER_PREFIX = "pp_p2p["
"""`pp_p2p[<send|recv> <forward|backward> mb=<i> peer=<global rank>]`: an empty range the pipeline stage opens
right before it issues each send / recv of a micro-batch's activations (forward) or gradients (backward), in
issue order: what the trace's own send / recv events do not say (peer, micro-batch, direction)."""
PP_SCHEDULE_PREFIX = "pp_schedule["
"""`pp_schedule[<schedule> stages=<n> microbatches=<m> rank_stages=<i>,<j>]`: an empty range once per step on
every pipeline rank: the schedule, the number of stages and micro-batches, the stages this rank holds."""
_P2P_MARKER_RE = re.compile(r"^pp_p2p\[(send|recv) (forward|backward) mb=(\d+) peer=(\d+)\]$")
_PP_SCHEDULE_RE = re.compile(r"^pp_schedule\[(\S+) stages=(\d+) microbatches=(\d+) rank_stages=([\d,]+)\]$")


@dataclass(frozen=True, slots=True)
class P2PMarker:
    kind: str
    """send or recv"""
    direction: str
    """forward (activations, to the next stage) or backward (gradients, to the previous stage)"""
    microbatch: int
    peer: int
    """Global rank of the other side."""


@dataclass(frozen=True, slots=True)
class ScheduleMarker:
    schedule: str
    stages: int
    microbatches: int
    rank_stages: tuple[int, ...]


def p2p_marker(kind: str, direction: str, microbatch: int, peer: int) -> str:
    return f"{P2P_MARKER_PREFIX}{kind} {direction} mb={microbatch} peer={peer}]"


def parse_p2p_marker(name: str) -> P2PMarker | None:
    match = _P2P_MARKER_RE.match(name) if name.startswith(P2P_MARKER_PREFIX) else None
    return P2PMarker(match[1], match[2], int(match[3]), int(match[4])) if match else None


def schedule_marker(schedule: str, stages: int, microbatches: int, rank_stages: list[int]) -> str:
    return (f"{PP_SCHEDULE_PREFIX}{schedule} stages={stages} microbatches={microbatches} "
            f"rank_stages={','.join(map(str, rank_stages))}]")


def parse_schedule_marker(name: str) -> ScheduleMarker | None:
    match = _PP_SCHEDULE_RE.match(name) if name.startswith(PP_SCHEDULE_PREFIX) else None
    if match is None:
        return None
    return ScheduleMarker(match[1], int(match[2]), int(match[3]), tuple(int(i) for i in match[4].split(",")))


def microbatch_range(index: int) -> str:
    """The record_function name of micro-batch `index`."""
    return f"{MICROBATCH_PREFIX}{index}]"


def parse_microbatch_range(name: str) -> int | None:
    """i of a `microbatch[i]` range, else None."""
    if not (name.startswith(MICROBATCH_PREFIX) and name.endswith("]")):
        return None
    digits = name[len(MICROBATCH_PREFIX):-1]
    return int(digits) if digits.isascii() and digits.isdigit() else None


def step_marker(step: int) -> str:
    """The annotation name of global step `step`."""
    return f"{STEP_MARKER_PREFIX}{step}"


def parse_step_marker(name: str) -> int | None:
    """N of a `ProfilerStep#N` annotation, else None."""
    if not name.startswith(STEP_MARKER_PREFIX):
        return None
    digits = name[len(STEP_MARKER_PREFIX):]
    return int(digits) if digits.isascii() and digits.isdigit() else None


def metric_line(record: dict[str, Any]) -> str:
    """One metrics/rank<R>.jsonl line (with its newline)."""
    return json.dumps(record, separators=(",", ":")) + "\n"


def mllog_line(event: dict[str, Any]) -> str:
    return MLLOG_PREFIX + json.dumps(event, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True)
class MetricRecords:
    """The step records of one metrics file, and what was wrong with the lines that were not."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)
    """(line number, why) of lines skipped."""


def read_metric_records(path: Path, *, max_bad_lines_kept: int = 20) -> MetricRecords:
    """Every step record of a metrics file: JSON objects with an integer `step` and finite numbers."""
    records, bad = [], []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            why = None
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError) as error:
                why = f"not JSON ({type(error).__name__})"
            else:
                why = _record_problem(record)
            if why is None:
                records.append(record)
            elif len(bad) < max_bad_lines_kept:
                bad.append((number, why))
    return MetricRecords(path=path, records=records, bad_lines=bad)


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    step = record.get("step")
    if type(step) is not int or step < 0:
        return "no integer step"
    if any(isinstance(v, float) and not math.isfinite(v) for v in record.values()):
        return "a non-finite number"
    return None
