"""Op-level timelines recorded by a framework's own timers, in the schema of the OSDI'25 straggler artifact
(github.com/ByteDance-Seed/StragglerAnalysis): one row per op with its worker's ranks, step, op type,
start, duration, micro-batch and model chunk.

Three encodings of that schema are read into one typed `OpTimeline`:
  - the artifact's table (`trace-*.parquet`, or the same columns as CSV, optionally gzipped): columns
    dp_rank, stage, rank, step, optype, start_ts, duration (seconds), seq_id, mc, mb_id, gmc (optional);
  - the artifact's Chrome JSON timeline (`timeline-*.json[.gz]`, as its to_timeline.py writes it): one
    complete event per op, pid = DP rank, tid = rank x 5 + category, the PP rank in the thread's name,
    step / model_chunk / mb_id / seq_id in args, ts and dur in microseconds; a collective is drawn from its
    last member's arrival to its end (its transfer), so its start there is not its own.
Reading parquet needs pyarrow, which fleetscope does not require; the other two need nothing more.
Every refusal is an OpTimelineError naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import re
from pathlib import Path

import numpy as np
import orjson
import pandas as pd

from .safe_read import read_input
from .validate import finite

OP_TYPES = ("forward-compute", "backward-compute", "forward-send", "forward-recv", "backward-send",
            "backward-recv", "params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce",
            "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "optimizer-clip-main-grad", "optimizer", "gc")
"""The op types of the schema (the artifact's metatypes.OpType); an op of any other type is refused."""

TABLE_COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id", "mc", "mb_id")
"""Columns every table encoding must have; `gmc` (the model chunk's index in the whole model) is optional."""

JSON_CATEGORIES_PER_RANK = 5
"""The artifact's timeline writer gives each rank five threads (compute, pp-comm, tp-comm, dp-comm, misc):
tid = rank x 5 + category."""
_THREAD_NAME = re.compile(r"PP rank (\d+), TP rank (\d+)")


class OpTimelineError(ValueError):
    """An op timeline that cannot be read; the message names the file and the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class OpTimeline:
    """One op per row, columns as numpy arrays of one length; times in seconds from each step's start."""
    source: str
    """The file the timeline was read from."""
    rank: np.ndarray
    dp_rank: np.ndarray
    stage: np.ndarray
    """The worker's pipeline-parallel rank."""
    step: np.ndarray
    op_type: np.ndarray
    """Index into OP_TYPES."""
    seq_id: np.ndarray
    """Order of the op among the ops of its type in its step on its worker, from 0."""
    start_s: np.ndarray
    duration_s: np.ndarray
    micro_batch: np.ndarray
    """-1 where the op belongs to no micro-batch."""
    model_chunk: np.ndarray
    """The virtual pipeline stage within the worker's stage; -1 where none."""

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def end_s(self) -> np.ndarray:
        return self.start_s + self.duration_s

    def type_names(self) -> np.ndarray:
        return np.asarray(OP_TYPES, dtype=object)[self.op_type]

    def select(self, keep: np.ndarray) -> OpTimeline:
        """The rows where `keep` is true."""
        return dataclasses.replace(self, **{field.name: getattr(self, field.name)[keep]
                                            for field in dataclasses.fields(self) if field.name != "source"})


def read_op_timeline(path: str | Path) -> OpTimeline:
    """The op timeline in the file: the artifact's table (.parquet, .csv[.gz]) or Chrome JSON (.json[.gz])."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith((".json", ".json.gz")):
        return _from_chrome_json(path, _read_bytes(path))
    if name.endswith((".csv", ".csv.gz")):
        try:
            frame = pd.read_csv(io.BytesIO(_read_bytes(path)))
        except (ValueError, pd.errors.ParserError) as error:
            raise OpTimelineError(f"{path}: not a CSV table: {error}") from None
        return _from_table(path, frame)
    if name.endswith(".parquet"):
        return _from_table(path, _read_parquet(path))
    raise OpTimelineError(f"{path}: not an op timeline (expected .parquet, .csv[.gz] or the artifact's .json[.gz])")


def _read_bytes(path: Path) -> bytes:
    data = read_input(path)
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise OpTimelineError(f"{path}: broken gzip data: {error}") from None
    return data


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        import pyarrow  # noqa: F401  (pandas needs it for parquet; fleetscope does not install it)
    except ImportError:
        raise OpTimelineError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or give the same "
                              "columns as CSV or the artifact's JSON timeline") from None
    try:
        return pd.read_parquet(io.BytesIO(_read_bytes(path)))
    except (ValueError, OSError) as error:
        raise OpTimelineError(f"{path}: not a parquet table: {error}") from None


def _from_table(path: Path, frame: pd.DataFrame) -> OpTimeline:
    missing = [column for column in TABLE_COLUMNS if column not in frame.columns]
    if missing:
        raise OpTimelineError(f"{path}: missing column(s) {', '.join(missing)} "
                              f"(the schema: {', '.join(TABLE_COLUMNS)})")
    columns = {column: _integers(path, column, frame[column]) for column in
               ("dp_rank", "stage", "rank", "step", "seq_id", "mc", "mb_id")}
    return _checked(path, OpTimeline(
        source=str(path), rank=columns["rank"], dp_rank=columns["dp_rank"], stage=columns["stage"],
        step=columns["step"], op_type=_op_types(path, "optype", frame["optype"].astype(str).to_numpy()),
        seq_id=columns["seq_id"], start_s=_seconds(path, "start_ts", frame["start_ts"]),
        duration_s=_seconds(path, "duration", frame["duration"]), micro_batch=columns["mb_id"],
        model_chunk=columns["mc"]))


def _integers(path: Path, field: str, values: pd.Series) -> np.ndarray:
    numbers = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numbers) | (numbers != np.round(numbers))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise OpTimelineError(f"{path}: {field} of row {row} is {values.iloc[row]!r}, not an integer")
    return numbers.astype(np.int64)


def _seconds(path: Path, field: str, values) -> np.ndarray:
    numbers = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numbers)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise OpTimelineError(f"{path}: {field} of row {row} is {pd.Series(values).iloc[row]!r}, not a finite number")
    return numbers


def _op_types(path: Path, field: str, names: np.ndarray) -> np.ndarray:
    index = {name: code for code, name in enumerate(OP_TYPES)}
    unknown = sorted(set(names) - set(index))
    if unknown:
        raise OpTimelineError(f"{path}: {field} {unknown[0]!r} is not an op type of the schema "
                              f"({len(unknown)} unknown; known: {', '.join(OP_TYPES)})")
    return np.fromiter((index[name] for name in names), dtype=np.int64, count=len(names))


def _from_chrome_json(path: Path, data: bytes) -> OpTimeline:
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise OpTimelineError(f"{path}: not JSON: {error}") from None
    events = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(events, list):
        raise OpTimelineError(f"{path}: no list of events (a JSON array, or an object with traceEvents)")
    stage_of_thread = _stages_of_threads(path, events)
    ops = [event for event in events if isinstance(event, dict) and event.get("ph") == "X"]
    if not ops:
        raise OpTimelineError(f"{path}: no complete ('ph': 'X') events")
    rows = _json_rows_fast(ops, stage_of_thread)
    if rows is None:  # something is off: the checking reader names the event and the field
        rows = [_json_row(path, number, event, stage_of_thread) for number, event in enumerate(ops)]
    table = np.array([row[:8] for row in rows], dtype=np.float64)
    integers = table.astype(np.int64)
    # the writer draws a collective from its last member's arrival to its end, so a member that ended before
    # the last arrival has a negative dur: it keeps its end and takes no time
    end_us = table[:, 6] + table[:, 7]
    start_us = np.minimum(table[:, 6], end_us)
    return _checked(path, OpTimeline(
        source=str(path), rank=integers[:, 0] // JSON_CATEGORIES_PER_RANK, dp_rank=integers[:, 1],
        stage=integers[:, 2], step=integers[:, 3], op_type=_op_types(path, "name", np.array([r[8] for r in rows])),
        seq_id=integers[:, 4], start_s=start_us / 1e6, duration_s=(end_us - start_us) / 1e6,
        micro_batch=integers[:, 5], model_chunk=np.array([r[9] for r in rows], dtype=np.int64)))


def _stages_of_threads(path: Path, events: list) -> dict[tuple[int, int], int]:
    stages = {}
    for event in events:
        if isinstance(event, dict) and event.get("ph") == "M" and event.get("name") == "thread_name":
            match = _THREAD_NAME.match(str((event.get("args") or {}).get("name", "")))
            if match and isinstance(event.get("pid"), int) and isinstance(event.get("tid"), int):
                stages[(event["pid"], event["tid"])] = int(match.group(1))
    if not stages:
        raise OpTimelineError(f"{path}: no thread_name metadata naming each thread's PP rank ('PP rank N, TP rank M')")
    return stages


def _json_rows_fast(ops: list, stage_of_thread: dict) -> list[tuple] | None:
    """The rows of well-formed events (what _json_row reads) without checks per field; None unless every
    field has its type."""
    try:
        rows = [(e["tid"], e["pid"], stage_of_thread[(e["pid"], e["tid"])], a["step"], a["seq_id"],
                 -1 if a.get("mb_id") is None else a["mb_id"], e["ts"], e["dur"], e["name"],
                 -1 if a.get("model_chunk") is None else a["model_chunk"]) for e in ops for a in (e["args"],)]
    except (KeyError, TypeError):
        return None
    columns = list(zip(*rows))
    integers_ok = all(type(value) is int for column in (0, 1, 3, 4, 5, 9) for value in columns[column])
    times_ok = all(type(value) in (int, float) for column in (6, 7) for value in columns[column])
    names_ok = all(type(value) is str for value in columns[8])
    if not (integers_ok and times_ok and names_ok and np.isfinite(np.array(columns[6:8], dtype=np.float64)).all()):
        return None
    return rows


def _json_row(path: Path, number: int, event: dict, stage_of_thread: dict) -> tuple:
    """(tid, pid, stage, step, seq_id, mb_id, ts, dur, name, model_chunk) of one op event."""
    args = event.get("args")
    where = f"{path}: op event {number}"
    if not isinstance(args, dict):
        raise OpTimelineError(f"{where}: no args (step, seq_id, mb_id, model_chunk)")
    values = []
    for field, source in (("tid", event), ("pid", event), ("step", args), ("seq_id", args)):
        value = source.get(field)
        if not isinstance(value, int) or isinstance(value, bool):
            raise OpTimelineError(f"{where}: {field} is {value!r}, not an integer")
        values.append(value)
    stage = stage_of_thread.get((values[1], values[0]))
    if stage is None:
        raise OpTimelineError(f"{where}: thread pid {values[1]} tid {values[0]} has no thread_name with its PP rank")
    times = []
    for field in ("ts", "dur"):
        value = event.get(field)
        if not isinstance(value, (int, float)) or finite(value) is None:
            raise OpTimelineError(f"{where}: {field} is {value!r}, not a finite number")
        times.append(value)
    optional = [args.get(field) for field in ("mb_id", "model_chunk")]
    optional = [-1 if value is None else value for value in optional]
    if not all(isinstance(value, int) for value in optional):
        raise OpTimelineError(f"{where}: mb_id / model_chunk are {optional!r}, not integers")
    return (values[0], values[1], stage, values[2], values[3], optional[0], *times, str(event.get("name")), optional[1])


def _checked(path: Path, timeline: OpTimeline) -> OpTimeline:
    if len(timeline) == 0:
        raise OpTimelineError(f"{path}: no ops")
    for field in ("rank", "dp_rank", "stage", "seq_id"):
        values = getattr(timeline, field)
        if (values < 0).any():
            raise OpTimelineError(f"{path}: {field} {int(values.min())} is negative")
    if (timeline.duration_s < 0).any():
        row = int(np.flatnonzero(timeline.duration_s < 0)[0])
        raise OpTimelineError(f"{path}: duration of op {row} is negative ({timeline.duration_s[row]} s)")
    return timeline


JSON_CATEGORIES = ("compute", "pp-comm", "tp-comm", "dp-comm", "misc")
"""The artifact's thread per rank and kind of op, in tid order."""
_CATEGORY_OF_TYPE = {"forward-send": 1, "forward-recv": 1, "backward-send": 1, "backward-recv": 1,
                     "params-all-gather": 3, "grads-reduce-scatter": 3, "separate-grads-all-reduce": 3,
                     "layernorm-grads-all-reduce": 3, "embedding-grads-all-reduce": 3, "optimizer-clip-main-grad": 3}


def chrome_timeline_bytes(timeline: OpTimeline, *, compress: bool) -> bytes:
    """The timeline as the artifact's Chrome JSON (what read_op_timeline reads back), for Perfetto."""
    category = np.array([_CATEGORY_OF_TYPE.get(name, 0) for name in OP_TYPES])[timeline.op_type]
    tid = timeline.rank * JSON_CATEGORIES_PER_RANK + category
    names = timeline.type_names()
    events = [{"name": name, "cat": name, "ph": "X", "pid": pid, "tid": thread, "ts": ts, "dur": dur,
               "args": {"step": step, "model_chunk": chunk, "mb_id": batch, "seq_id": seq}}
              for name, pid, thread, ts, dur, step, chunk, batch, seq in zip(
                  names.tolist(), timeline.dp_rank.tolist(), tid.tolist(), (timeline.start_s * 1e6).tolist(),
                  (timeline.duration_s * 1e6).tolist(), timeline.step.tolist(), timeline.model_chunk.tolist(),
                  timeline.micro_batch.tolist(), timeline.seq_id.tolist())]
    workers = sorted(set(zip(timeline.rank.tolist(), timeline.dp_rank.tolist(), timeline.stage.tolist())))
    for rank, dp_rank, stage in workers:
        for index, kind in enumerate(JSON_CATEGORIES):
            thread = rank * JSON_CATEGORIES_PER_RANK + index
            events.append({"name": "thread_name", "ph": "M", "pid": dp_rank, "tid": thread,
                           "args": {"name": f"PP rank {stage}, TP rank 0, {kind}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": dp_rank, "tid": thread,
                           "args": {"sort_index": thread}})
    for dp_rank in sorted({worker[1] for worker in workers}):
        events.append({"name": "process_name", "ph": "M", "pid": dp_rank, "args": {"name": f"DP rank [{dp_rank}]"}})
    data = orjson.dumps(events)
    return gzip.compress(data, compresslevel=6, mtime=0) if compress else data
