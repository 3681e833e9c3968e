"""The record formats the trainer writes and the analysis reads, besides the trace files themselves.

* step markers: the trainer names each profiled step `ProfilerStep#<global step>` and marks its phases
  with `record_function` ranges (`train_step` > `forward` / `backward` / `optimizer_step`);
* metric records: `metrics/rank<R>.jsonl`, one JSON object per line per step (the fields of
  `trainer.metrics.StepMetrics`); readers skip lines that are not such objects and count them;
* MLPerf-style log lines: `:::MLLOG {json}`, one per step per rank;
* injected-fault ranges: `fleetscope_injected_<what>` record_function names (the INJECTED_* names);
* MoE ranges: `moe/<kind>[layer <L>]` record_function (and NVTX) names on every MoE layer (`moe_range`);
* MoE records: `metrics/rank<R>.moe.jsonl`, one JSON object per (step, layer) (`MoeRecord`).
Writer and readers import these names, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .jsontext import strict_dumps
from .safe_read import read_metadata
from .validate import MAX_WORLD_SIZE, finite

STEP_MARKER_PREFIX = "ProfilerStep#"
TRAIN_STEP = "train_step"
STEP_SOURCE_CAPTURE = "whole capture"
"""Where a trace's steps come from when it has no step markers: the whole capture as one step."""
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
INJECTED_HANG = INJECTED_PREFIX + "hang"
"""faults.hang_rank / hang_step: a rank that blocks forever before its step's collectives."""
INJECTED_SLOW_STAGE = INJECTED_PREFIX + "slow_stage"
"""faults.slow_stage*: a sleep inside every micro-batch forward of one pipeline stage."""
INJECTED_STAGE_WORK = INJECTED_PREFIX + "stage_work"
"""faults.stage_work_ms: a sleep inside every micro-batch forward and backward of every pipeline stage."""
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
    return strict_dumps(record, separators=(",", ":")) + "\n"


def mllog_line(event: dict[str, Any]) -> str:
    return MLLOG_PREFIX + strict_dumps(event, separators=(",", ":"))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One line of `metrics/rank<R>.jsonl` as the analysis reads it: one rank's step (trainer/metrics.py
    StepMetrics writes the fields). A number that is absent, not a number or not finite is None; fields this
    version does not know are ignored. `parse_step_record` is the one way a line becomes one."""

    step: int
    """Global training step."""
    rank: int | None = None
    profiled: bool = False
    """The step ran inside a profiler window (its time includes the profiler's own cost)."""
    first_of_process: bool = False
    """The first step of its process (a resumed run's restart): set from a timeline's FLAG_FIRST; step
    metrics do not carry it (their first step is the rank's lowest)."""
    loss: float | None = None
    step_time_ms: float | None = None
    data_ms: float | None = None
    forward_ms: float | None = None
    backward_ms: float | None = None
    optimizer_ms: float | None = None
    tokens_per_s: float | None = None
    max_memory_allocated_mb: float | None = None
    max_memory_reserved_mb: float | None = None
    tflops: float | None = None
    mfu_pct: float | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    comm_ms: float | None = None
    comm_exposed_ms: float | None = None
    comm_buckets: int | None = None
    comm_mb: float | None = None
    comm_last_bucket_mb: float | None = None
    stop_agreement_ms: float | None = None
    compiled_frames: int | None = None
    fault_leaked_mb: float | None = None


_STEP_RECORD_FIELDS = {f.name: f.type for f in dataclasses.fields(StepRecord)
                       if f.name not in ("step", "rank", "profiled", "first_of_process")}
MAX_STEP = 2**53
"""Steps stay below this (exact as floats and int64); a larger one was not written by a trainer."""


def parse_step_record(line: str | bytes | dict[str, Any]) -> tuple[StepRecord | None, str | None]:
    """(the record, None), or (None, why the line is not one): a JSON object with an integer `step`, finite
    numbers, a rank below MAX_WORLD_SIZE, and every time / size / share / count within its bound."""
    if isinstance(line, dict):
        data = line
    else:
        try:
            data = json.loads(line)
        except (ValueError, RecursionError) as error:
            return None, f"not JSON ({type(error).__name__})"
    why = _record_problem(data)
    if why is not None:
        return None, why
    numbers = {name: _typed(data.get(name), kind) for name, kind in _STEP_RECORD_FIELDS.items()}
    return StepRecord(step=data["step"], rank=data.get("rank"), profiled=data.get("profiled") is True,
                      **numbers), None


def _typed(value: Any, kind: str) -> float | int | None:
    """A field's value as its declared type: counts as int, the rest as float; None where not a finite number."""
    number = finite(value)
    if number is None:
        return None
    return int(number) if kind == "int | None" else number


@dataclass(frozen=True, kw_only=True)
class MetricRecords:
    """The step records of one metrics file, and what was wrong with the lines that were not."""

    path: Path
    records: list[StepRecord] = field(default_factory=list)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)
    """(line number, why) of the first lines skipped."""
    bad_line_count: int = 0
    """How many lines were skipped in all."""


def is_steady(step: Any, lowest_step: Any, profiled: Any, first_of_process: Any = False, *,
              warmup_steps: int = 1) -> np.ndarray:
    """THE rule of which steps count as a rank's steady steps (elementwise over numpy arrays). Every reader of
    step records and timelines asks here: the report's run step time, the gate and compare, advise, the
    whole-run scan, the profiling cost, the live progress line. A step is steady unless it is
      - warm-up: one of the rank's first `warmup_steps` steps from its lowest (`lowest_step`): compilation,
        CUDA graph recording, the allocator's first growth, the first batch. One by default; the profiling
        cost, which compares medians to the percent, leaves out 3 (per_rank/profiling_cost.py);
      - the first step of a process (`first_of_process`, a timeline's FLAG_FIRST): a resumed run warms up
        again after its restart;
      - profiled (`profiled`): it ran inside a profiler window, whose own cost is in its time.
    Absent records (a timeline block's step -1) are below the lowest step, so never steady."""
    step = np.asarray(step)
    return ((step >= np.asarray(lowest_step) + warmup_steps) & ~np.asarray(profiled, dtype=bool)
            & ~np.asarray(first_of_process, dtype=bool))


def steady(records: Sequence[StepRecord], *, warmup_steps: int = 1) -> list[StepRecord]:
    """One rank's steady step records, in their order (`is_steady`, its lowest step being the records')."""
    if not records:
        return []
    keep = is_steady(np.fromiter((r.step for r in records), dtype=np.int64, count=len(records)),
                     min(r.step for r in records),
                     np.fromiter((r.profiled for r in records), dtype=bool, count=len(records)),
                     np.fromiter((r.first_of_process for r in records), dtype=bool, count=len(records)),
                     warmup_steps=warmup_steps)
    return [record for record, kept in zip(records, keep.tolist()) if kept]


def own_work_ms(step_ms: float | None, comm_exposed_ms: float | None) -> float | None:
    """A step's own work from step metrics: its time less the gradient communication it waited for
    (`comm_exposed_ms`, which holds any waiting for a later rank), never below 0; None when either is unknown.
    In a synchronous data-parallel job every rank's step time is about the same: the rank the others wait for
    is the one with the most own work. analysis/quantities.py's compute floor is this arithmetic."""
    if step_ms is None or comm_exposed_ms is None:
        return None
    return max(step_ms - max(comm_exposed_ms, 0.0), 0.0)


def read_metric_records(path: Path, *, within: Path | None = None, max_bad_lines_kept: int = 20) -> MetricRecords:
    """Every step record of a metrics file (parse_step_record). With `within` (the run directory) a file that
    resolves outside it is refused (InputRefused)."""
    records, bad, count = [], [], 0
    data = read_metadata(path, within=within)  # the safe reader: a FIFO or a symlink loop is refused, never opened
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        record, why = parse_step_record(raw)
        if record is not None:
            records.append(record)
            continue
        count += 1
        if len(bad) < max_bad_lines_kept:
            bad.append((number, why))
    return MetricRecords(path=path, records=records, bad_lines=bad, bad_line_count=count)


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    step = record.get("step")
    if type(step) is not int or step < 0:
        return "no integer step"
    if step >= MAX_STEP:
        return f"step {_shown(step)} is beyond {MAX_STEP}"
    if any(isinstance(v, float) and finite(v) is None for v in record.values()):
        return "a non-finite number"
    if record.get("profiled") is not None and type(record["profiled"]) is not bool:
        return f"profiled {_shown(record['profiled'])} is not true or false"
    rank = record.get("rank")
    if "rank" in record and not (type(rank) is int and 0 <= rank < MAX_WORLD_SIZE):
        return f"rank {_shown(rank)} is not a rank (an integer from 0 to {MAX_WORLD_SIZE - 1})"
    for key, value in record.items():
        limit = _magnitude_limit(key)
        if limit is None or value is None:
            continue
        if type(value) not in (int, float):
            return f"{key} {_shown(value)} is not a number"
        if not 0 <= value <= limit:
            return f"{key} = {value!r} is outside [0, {limit:g}]"
    return None


_MAGNITUDE_LIMITS = (("_ms", 1e10), ("_s", 1e10), ("_mb", 1e10), ("_pct", 1e4), ("tflops", 1e7),
                     ("_retries", 1e12), ("ooms", 1e12), ("_bytes", 1e18), ("_count", 1e15))
"""A metrics field named with one of these endings is a time, a size, a share or a count: never negative,
and never beyond these bounds (over 100 days in ms, 10 PB in MiB, 10,000%): a line that says otherwise was
not written by a trainer, and would flip a comparison or reach advice."""


@functools.lru_cache(maxsize=1024)
def _magnitude_limit(key: str) -> float | None:
    if key == "tokens_per_s":
        return 1e12
    return next((limit for ending, limit in _MAGNITUDE_LIMITS if key.endswith(ending)), None)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- MoE layers ------------------------------------------------------------------------------

MOE_RANGE_PREFIX = "moe/"
MOE_ROUTER, MOE_DISPATCH, MOE_EXPERTS, MOE_COMBINE = "router", "dispatch", "experts", "combine"
MOE_SPLIT_SIZES_D2H = "split_sizes_d2h"
"""Inside `dispatch` under expert parallelism: the one device-to-host copy of the all-to-all split sizes."""
MOE_RANGE_KINDS = (MOE_ROUTER, MOE_DISPATCH, MOE_EXPERTS, MOE_COMBINE, MOE_SPLIT_SIZES_D2H)
"""Per MoE layer and forward: router (gate logits and top-k), dispatch (permute tokens by expert; with
expert parallelism also the count exchange, the split-size copy and the token all-to-all), experts (the
local grouped GEMMs), combine (with expert parallelism the return all-to-all, then the weighted sum)."""
_MOE_RANGE_RE = re.compile(r"^moe/(?P<kind>[a-z_0-9]+)\[layer (?P<layer>\d+)\]$")


def moe_range(kind: str, layer: int) -> str:
    """`moe/dispatch[layer 5]`: the range name of one MoE phase of decoder layer `layer` (0-based)."""
    if kind not in MOE_RANGE_KINDS:
        raise ValueError(f"unknown MoE range kind {kind!r}; known: {MOE_RANGE_KINDS}")
    return f"{MOE_RANGE_PREFIX}{kind}[layer {layer}]"


def parse_moe_range(name: str) -> tuple[str, int] | None:
    """(kind, layer) of a `moe_range` name, else None (also for kinds this version does not know)."""
    match = _MOE_RANGE_RE.match(name)
    if match is None or match["kind"] not in MOE_RANGE_KINDS:
        return None
    return match["kind"], int(match["layer"])


@dataclass(frozen=True, kw_only=True)
class MoeRecord:
    """One line of `metrics/rank<R>.moe.jsonl`: what one MoE layer routed on one rank in one step.

    Counts are token copies (a token routed to k experts counts k times), summed over every forward of the
    step except activation-checkpointing recomputes; bytes are those of the hidden states as sent (the
    activation dtype: bf16 under autocast). The peer lists are indexed by rank inside the expert-parallel
    group (`ep_rank`; global rank = the ep group's ranks in order, see `ep_ranks`) and are whole: never
    truncated. Without expert parallelism there is no exchange: `ep` is 1 and the peer lists hold one entry,
    this rank's own tokens (kept local)."""

    step: int
    """Global training step."""
    layer: int
    """Decoder layer index (0-based), as in the `moe/...[layer L]` ranges."""
    rank: int
    """Global rank that wrote the record."""
    ep: int
    """Expert-parallel degree."""
    ep_rank: int
    """This rank's index inside its expert-parallel group."""
    ep_ranks: list[int]
    """Global ranks of the expert-parallel group, by ep rank."""
    tokens_per_expert: list[int]
    """Token copies this rank's router sent to each expert, indexed by GLOBAL expert id (all experts)."""
    send_tokens: list[int]
    """Token copies this rank sent to each ep peer (sum of tokens_per_expert over that peer's experts)."""
    send_bytes: list[int]
    """Bytes of hidden states this rank sent to each ep peer in dispatch (the combine returns as many)."""
    recv_tokens: list[int]
    """Token copies this rank received from each ep peer (its experts' load from that peer)."""
    recv_bytes: list[int]
    """Bytes of hidden states received from each ep peer in dispatch."""
    split_sizes_d2h_ms: float | None = None
    """Host wall ms the step spent in this layer's `moe/split_sizes_d2h` copies (every forward, recomputes
    included): on CUDA, the wait for the device to catch up; None without expert parallelism (no copy)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MOE_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(MoeRecord))
MOE_REQUIRED_FIELDS = tuple(f.name for f in dataclasses.fields(MoeRecord) if f.default is dataclasses.MISSING)


MAX_MOE_LINE_BYTES = 4 << 20
"""A record is kilobytes (one count per expert and per ep peer); a longer line is not one this trainer wrote."""
MAX_EXPERTS = 1 << 16
"""More experts than any MoE model has (DeepSeek-V3: 256); beyond it tokens_per_expert is not believed."""
MAX_COUNT = 2**53
"""Token and byte counts stay below this (exact as floats, as the analysis sums them)."""


@dataclass(frozen=True, kw_only=True)
class MoeRecords:
    """The well-formed records of one `rank<R>.moe.jsonl` file, and what was wrong with the other lines."""

    path: Path
    records: list[MoeRecord] = field(default_factory=list)
    bad_line_count: int = 0
    first_problem: str | None = None
    """(line N: why) of the first line skipped."""


def read_moe_file(path: Path) -> MoeRecords:
    """Every well-formed record of a `rank<R>.moe.jsonl` file, read line by line (the file grows with the
    run); lines that are not a record as MoeRecord describes it are counted and skipped. The caller checks
    the entry first (safe_read.entry_problem): this opens without following a final symlink, never blocks."""
    records, bad, first = [], 0, None
    with open(os.open(path, _STREAM_FLAGS), "rb") as handle:
        for number, raw in enumerate(_bounded_lines(handle, MAX_MOE_LINE_BYTES), start=1):
            why = "longer than a record" if raw is None else None
            if raw is not None and not raw.strip():
                continue
            if why is None:
                try:
                    data = json.loads(raw)
                except (ValueError, RecursionError) as error:
                    why = f"not JSON ({type(error).__name__})"
                else:
                    why = moe_record_problem(data)
            if why is None:
                records.append(MoeRecord(**{name: data[name] for name in MOE_RECORD_FIELDS if name in data}))
                continue
            bad += 1
            first = first or f"line {number}: {why}"
    return MoeRecords(path=path, records=records, bad_line_count=bad, first_problem=first)


def read_moe_records(path: Path) -> list[MoeRecord]:
    """Every well-formed record of a `rank<R>.moe.jsonl` file (other lines are skipped)."""
    return read_moe_file(path).records


_STREAM_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _bounded_lines(handle, limit: int):
    """The file's lines; None in place of a line longer than `limit` bytes (never held whole)."""
    while True:
        line = handle.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = handle.readline(limit + 1)
        yield None


def _counts_problem(value: Any, name: str, length: int | None = None) -> str | None:
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v < MAX_COUNT for v in value):
        return f"{name} is not a list of non-negative integers"
    if length is not None and len(value) != length:
        return f"{name} has {len(value)} entries, not one per ep rank ({length})"
    return None


def moe_record_problem(data: Any) -> str | None:
    """Why `data` is not a MoeRecord as the trainer writes it (types, bounds, list lengths), or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    missing = [name for name in MOE_REQUIRED_FIELDS if name not in data]
    if missing:
        return f"no {missing[0]}"
    for name in ("step", "layer", "rank", "ep_rank"):
        if type(data[name]) is not int or not 0 <= data[name] < MAX_COUNT:
            return f"{name} is not a non-negative integer"
    ep = data["ep"]
    if type(ep) is not int or not 1 <= ep <= MAX_WORLD_SIZE or data["ep_rank"] >= ep:
        return f"ep {ep!r} is not a group size above ep_rank {data['ep_rank']}"
    ranks = data["ep_ranks"]
    if not isinstance(ranks, list) or len(ranks) != ep or not all(type(r) is int and 0 <= r < MAX_WORLD_SIZE
                                                                  for r in ranks):
        return "ep_ranks is not a list of ep ranks"
    experts = data["tokens_per_expert"]
    problem = _counts_problem(experts, "tokens_per_expert") or next(
        (p for p in (_counts_problem(data[name], name, ep) for name in
                     ("send_tokens", "send_bytes", "recv_tokens", "recv_bytes")) if p), None)
    if problem:
        return problem
    if not 1 <= len(experts) <= MAX_EXPERTS:
        return f"tokens_per_expert has {len(experts)} entries (1..{MAX_EXPERTS})"
    d2h = data.get("split_sizes_d2h_ms")
    if d2h is not None and not (type(d2h) in (int, float) and finite(d2h) is not None and d2h >= 0):
        return "split_sizes_d2h_ms is not a finite non-negative number"
    return None
