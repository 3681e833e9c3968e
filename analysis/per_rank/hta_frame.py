"""One rank's trace as HTA's (Holistic Trace Analysis 0.5.0) per-rank DataFrame, without HTA's JSON loader.

HTA's loader (`hta.common.trace.Trace.load_traces`) reads a trace with stdlib json, builds a DataFrame
from a list of dicts, then runs row-by-row `apply` calls (stream numbers, args, symbol ids, iterations),
which is most of its cost. Here the same frame comes from a selective msgspec decode and column-wise
numpy work: the same rows (events with a `dur` and a `cat`, not the `Trace` span), the same columns and
values (HTA's default ParserConfig args, `ts` rounded up and `end` down to whole microseconds, `index`
= position in `traceEvents`, `index_correlation`, `iteration`), and the same dtypes. Only the symbol ids
differ (HTA numbers symbols in set-iteration order, which varies from run to run anyway).

The steps that decide which rows survive and in which order (linking launches to kernels, aligning
time, dropping kernels outside the traced steps) are HTA's own functions, called on this frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
from fleetscope.traces.kineto_schema import (
    HTA_ARGS,
    HTA_RAW_ARGS,
    TRACE_SPAN_CATEGORY,
    HtaArgs,
    HtaDocument,
    HtaEvent,
)

_RAW_ARGS = HTA_RAW_ARGS
_MISSING = msgspec.UNSET
_NO_ARGS = HtaArgs()
_DECODER = msgspec.json.Decoder(HtaDocument)


@dataclass(frozen=True, kw_only=True)
class HtaFrame:
    """HTA's view of one rank: its DataFrame (before HTA's alignment and step filter) and symbols."""

    frame: Any
    """pandas DataFrame with HTA's columns; `cat` and `name` are ids into `symbols`."""
    symbols: list[str]
    meta: dict[str, Any]
    """The trace's top-level keys that HTA keeps as metadata (the known Kineto ones)."""


def decode_hta_frame(data: bytes) -> HtaFrame | None:
    """HTA's per-rank frame of a trace's decompressed JSON bytes; None when this decoder cannot take the
    file (another shape; the caller then uses HTA's own loader, which explains what is wrong)."""
    try:
        document = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    meta = {key: getattr(document, key) for key in HtaDocument.__struct_fields__
            if key != "traceEvents" and getattr(document, key) is not _MISSING}
    columns = _columns(document.traceEvents)
    if columns is None:
        return None
    frame, symbols = _frame(*columns)
    return HtaFrame(frame=frame, symbols=symbols, meta=meta)


def _columns(events: list[HtaEvent]):
    """Per-column lists of the events HTA keeps, in trace order, and the dtype pandas gives the columns
    it infers over every event; None for time values the column-wise path does not reproduce
    (non-numeric): those files go to HTA's own loader."""
    # map + attrgetter walks the events in C: about twice as fast as comprehensions over ~100k events
    starts = list(map(_TS, events))
    durs = list(map(_DUR, events))
    cats = list(map(_CAT, events))
    kinds: dict[str, Any] = {"ts": pandas_kind(set(map(type, starts))), "dur": pandas_kind(set(map(type, durs))),
                             "pid": pandas_kind(set(map(type, map(_PID, events)))),
                             "tid": pandas_kind(set(map(type, map(_TID, events))))}
    kinds["ts_missing"] = None in starts
    if kinds["ts"] not in ("int", "float") or kinds["dur"] not in ("int", "float"):
        return None
    index = [i for i, (s, d, c) in enumerate(zip(starts, durs, cats))
             if d is not None and c is not None and s is not None and c != TRACE_SPAN_CATEGORY]
    kept = list(map(events.__getitem__, index))
    args = [a if type(a) is HtaArgs else _NO_ARGS for a in map(_ARGS, kept)]
    return (index, list(map(cats.__getitem__, index)), list(map(_NAME, kept)), list(map(_PID, kept)),
            list(map(_TID, kept)), list(map(starts.__getitem__, index)), list(map(durs.__getitem__, index)), args,
            kinds, len(events))


_TS, _DUR, _CAT, _NAME, _PID, _TID, _ARGS = map(attrgetter, ("ts", "dur", "cat", "name", "pid", "tid", "args"))


def pandas_kind(types: set[type]) -> str:
    """The dtype pandas infers for a column built from dicts holding values of these types (NoneType for
    a missing key): int64, float64 (any float or any missing), or object."""
    if types <= {int}:
        return "int"
    if types <= {int, float, type(None)}:
        return "float"
    return "object"


def _typed(values: list, kind: str):
    import pandas as pd

    if kind == "object":
        return pd.Series(values, dtype=object)
    return pd.Series(np.asarray(values, dtype=np.int64 if kind == "int" else np.float64))


def _frame(index, cats, names, pids, tids, starts, durs, args, kinds: dict[str, Any], total: int):
    import pandas as pd

    ts_float = kinds["ts"] == "float"
    start = np.asarray(starts, dtype=np.float64 if ts_float else np.int64)
    dur = np.asarray(durs, dtype=np.float64 if kinds["dur"] == "float" or ts_float else np.int64)
    if ts_float:  # HTA's round_down_time_stamps: start up, end down, to whole microseconds
        end = np.floor(start + dur)
        start = np.ceil(start)
        dur = end - start
        # HTA's rounded column is int64 unless some event has no ts (then NaN keeps it float64)
        start = start.astype(np.float64 if kinds["ts_missing"] else np.int64)
    symbols, cat_ids, name_ids = _symbols(cats, names)
    data = {
        "index": pd.Series(np.asarray(index, dtype=np.int64)),
        "cat": pd.Series(cat_ids), "name": pd.Series(name_ids),
        "pid": _typed(pids, kinds["pid"]), "tid": _typed(tids, kinds["tid"]),
        "ts": pd.Series(start), "dur": pd.Series(dur),
    }
    if ts_float:
        data["end"] = pd.Series(end)
    data.update(_arg_columns(args))
    frame = pd.DataFrame(data)
    frame.index = pd.Index(np.asarray(index, dtype=np.int64))
    if frame["stream"].dtype.kind != "i":  # ints are already what HTA's int() gives
        frame["stream"] = pd.Series([_stream_number(s) for s in frame["stream"].tolist()], index=frame.index,
                                    dtype=np.int64)
    for column in frame.columns:
        if frame[column].dtype.kind == "i":
            frame[column] = pd.to_numeric(frame[column], errors="coerce", downcast="integer")
    return frame, symbols


def _symbols(cats: list, names: list) -> tuple[list[str], np.ndarray, np.ndarray]:
    """One string table for `cat` and `name` (as HTA's), and each row's ids."""
    import pandas as pd

    codes, uniques = pd.factorize(np.asarray(cats + names, dtype=object), use_na_sentinel=False)
    return list(uniques), codes[: len(cats)].astype(np.int64), codes[len(cats):].astype(np.int64)


def _arg_columns(args: list) -> dict[str, Any]:
    import pandas as pd

    columns = {}
    for column, _key, default in HTA_ARGS:
        if column in _RAW_ARGS:
            columns[column] = pd.Series(_raw_values(args, column, default))
        else:
            columns[column] = _inferred(list(map(attrgetter(column), args)))
    return columns


def _inferred(values: list):
    """pandas' inference for a list of scalars, with the common all-int / all-float cases done in numpy."""
    import pandas as pd

    types = set(map(type, values))
    try:
        if types == {int}:
            return pd.Series(np.asarray(values, dtype=np.int64))
        if types <= {int, float} and values:
            return pd.Series(np.asarray(values, dtype=np.float64))
    except OverflowError:
        pass
    return pd.Series(values)


def _raw_values(args: list, column: str, default: str) -> list:
    """A nested column: the raw JSON of every row that has it decoded in one call, the default elsewhere."""
    raws = list(map(attrgetter(column), args))
    present = [i for i, raw in enumerate(raws) if raw is not None and raw is not _MISSING]
    values: list = [default] * len(raws)
    if present:
        decoded = msgspec.json.decode(b"[" + b",".join(bytes(raws[i]) for i in present) + b"]")
        for i, value in zip(present, decoded):
            values[i] = value
    return values


def _stream_number(value: Any) -> int:
    """HTA's normalize_gpu_stream_numbers: int(value), or -1 where that is a ValueError."""
    try:
        return int(value)
    except ValueError:
        return -1


def add_iterations(frame, symbols: list[str]) -> None:
    """HTA's add_iteration, column-wise: host rows (stream < 0) take the number N of the last
    `ProfilerStep#N` row (in trace order) whose [ts, ts + dur) holds their start; device rows
    (stream > 0) take their launch's (`index_correlation`); -1 where neither applies; rows on stream 0
    get none (NaN), as in HTA."""
    import re

    import pandas as pd

    pattern = re.compile(r"ProfilerStep\s*#\s*(\d+)")
    step_ids = [i for i, s in enumerate(symbols) if isinstance(s, str) and s.startswith("ProfilerStep")]
    names = frame["name"].to_numpy()
    steps = frame.loc[np.isin(names, step_ids), ["ts", "dur", "name"]]
    start = frame["ts"].to_numpy()
    stream = frame["stream"].to_numpy()
    host_iteration = np.full(len(frame), -1.0)
    for step_ts, step_dur, step_name in steps.itertuples(index=False, name=None):
        number = int(pattern.match(symbols[step_name]).group(1))
        host_iteration[(step_ts <= start) & (start < step_ts + step_dur)] = number
    iteration = np.where(stream < 0, host_iteration, np.nan)
    link = frame["index_correlation"].to_numpy()
    labels = frame.index.to_numpy()
    device = np.flatnonzero(stream > 0)
    if device.size:
        order = np.argsort(labels, kind="stable")
        slot = np.clip(np.searchsorted(labels, link[device], sorter=order), 0, labels.size - 1)
        found = labels[order[slot]] == link[device]
        linked = np.where(found, iteration[order[slot]], np.nan)
        iteration[device] = np.where(link[device] > 0, linked, -1.0)
    frame["iteration"] = pd.to_numeric(pd.Series(iteration, index=frame.index), downcast="integer")

