"""HTA 0.5.0's per-rank frame, rebuilt in numpy from one lean decode of the trace (no pandas, no HTA).

Why a decode of its own rather than fleetscope's table (events.py): HTA's views depend on what that table
leaves out or reorders on purpose: every event's position in `traceEvents` (`index`, the row order HTA's
filter and sorts start from), host `cpu_op` rows (HTA's earliest `ts`, its time base), HTA's rounding of
times (start up, end down, to whole microseconds) and the dtypes pandas gives the columns (numpy's
quicksort orders tied rows by dtype, and tied rows change idle intervals). And the ranks HTA runs on are
chosen after every rank is parsed (report/build.py: the slowest, the one waited for, ...), with a step
filter that counts ProfilerStep names over all of them: computing the views inside the parse would cost
every rank that time, most of them never shown. So each chosen rank's worker decodes only the six fields
these views read (msgspec skips every other key, in `args` too) into the columns
below, and hta_native_views.py computes the views from them. Where the HTA stage will take every GPU rank
(at most 16 a window), the parse builds the same columns from its own decode instead (`parsed_columns`:
one inflate and one decode a trace) and stores the views under each outcome of the step filter
(`frames_by_filter_key`, hta_cache.store_parsed_views).

What is reproduced from HTA (hta/common/trace.py, trace_filter.py): the rows (events with `dur`, `cat` and
`ts`, not the `Trace` span), `index_correlation` (cpu->gpu and gpu->cpu links of one inner merge on
`correlation`), `iteration`, alignment by the earliest `ts` (`end` stays unaligned, as in HTA), and the
step filter of `align_and_filter_trace(include_last_profiler_step=True)`: GPU rows launched by host rows
that start by the end of the last step, then those host rows.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
import re
from itertools import repeat
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from fleetscope.analysis.per_rank.hta_frame import pandas_kind
from fleetscope.traces.kineto_schema import (
    ABSENT,
    PARSE_COMPLETE_TYPES,
    TRACE_SPAN_CATEGORY,
    HtaRankArgs,
    HtaRankDocument,
    HtaRankEvent,
)

EVENT_SYNC_NAMES = ("Event Sync", "Context Sync")
"""Device synchronization rows: on stream -1 but GPU rows for HTA's filters."""
STEP_PREFIX = "ProfilerStep"
_STEP_NUMBER = re.compile(r"ProfilerStep\s*#\s*(\d+)")


class NotComputable(Exception):
    """The native frame cannot reproduce HTA's for this file (its message says why)."""


_NO_ARGS = HtaRankArgs()
_DECODER = msgspec.json.Decoder(HtaRankDocument)
_TS, _DUR, _CAT, _NAME, _ARGS, _STREAM, _CORRELATION = map(
    attrgetter, ("ts", "dur", "cat", "name", "args", "stream", "correlation"))
# map + attrgetter walks the events in C: about twice as fast as comprehensions


@dataclass(frozen=True, kw_only=True)
class HtaRankFrame:
    """One rank's rows after HTA's alignment and step filter, in HTA's row order; every column a numpy
    array of the dtype HTA's frame has."""

    index: np.ndarray
    """Position of the row's event in `traceEvents`."""
    cat: np.ndarray
    """Id into `symbols`."""
    name: np.ndarray
    """Id into `symbols`."""
    symbols: list[str]
    ts: np.ndarray
    """Aligned: minus `min_ts`."""
    dur: np.ndarray
    end: np.ndarray
    """Not aligned (HTA aligns `ts` only)."""
    stream: np.ndarray
    correlation: np.ndarray
    index_correlation: np.ndarray
    iteration: np.ndarray
    """float64: NaN on stream 0 rows (as HTA's column, int there only when no row has NaN)."""
    min_ts: int | float
    iteration_dtype: str = "int64"
    """The dtype of HTA's iteration column: chosen over the whole frame before the step filter (HTA adds
    the column as it parses the rank), so the rows the filter keeps, even none, keep it."""


def decode_rank_frame(data: bytes, step_names: tuple[str, ...] = ()) -> HtaRankFrame:
    """HTA's aligned, step-filtered frame of a trace's decompressed JSON bytes; `step_names`: the
    ProfilerStep names of every rank HTA runs on (its filter counts them). NotComputable for a file whose
    values this path does not reproduce (HTA's own loader then decides)."""
    try:
        events = _DECODER.decode(data).traceEvents
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as error:
        raise NotComputable(f"the trace does not decode as Kineto JSON: {str(error)[:200]}") from None
    return filtered_frame(unfiltered_frame(_columns(events)), step_names)


@dataclass(frozen=True, kw_only=True)
class UnfilteredFrame:
    """A rank's frame before HTA's step filter: what both outcomes of the filter start from."""

    columns: dict[str, np.ndarray]
    is_gpu: np.ndarray
    symbols: list[str]
    min_ts: int | float
    iteration_dtype: str = "int64"
    """HtaRankFrame.iteration_dtype."""

    @property
    def step_names(self) -> frozenset[str]:
        """The names HTA's filter counts on this rank (any symbol holding "ProfilerStep")."""
        return frozenset(s for s in self.symbols if STEP_PREFIX in s)


def unfiltered_frame(columns: dict[str, Any]) -> UnfilteredFrame:
    """HTA's aligned frame of the kept rows' raw columns (_columns), before its step filter."""
    symbols, cat, name = _symbols(columns["cat"], columns["name"])
    ts, dur, end = _times(columns)
    stream, correlation = _int_column(columns["stream"], "stream"), _int_column(columns["correlation"], "correlation")
    index = columns["index"]
    is_gpu = _gpu_rows(stream, correlation, name, symbols)
    index_correlation = _index_correlation(index, correlation, is_gpu)
    iteration = _iterations(ts, dur, name, symbols, stream, index, index_correlation)
    min_ts = ts.min() if ts.size else np.int64(0)
    frame = dict(index=index, cat=cat, name=name, ts=ts - min_ts, dur=dur, end=end, stream=stream,
                 correlation=correlation, index_correlation=index_correlation, iteration=iteration)
    return UnfilteredFrame(columns=frame, is_gpu=is_gpu, symbols=symbols,
                           min_ts=min_ts.item() if hasattr(min_ts, "item") else min_ts,
                           iteration_dtype=iteration_dtype(iteration))


def filtered_frame(unfiltered: UnfilteredFrame, step_names: tuple[str, ...] = (), *,
                   applies: bool | None = None) -> HtaRankFrame:
    """The frame after HTA's step filter, with the ProfilerStep names `step_names` of the other ranks
    (or `applies`: whether the filter applies, when the caller knows)."""
    if applies is None:
        applies = step_filter_applies(unfiltered.step_names, step_names)
    rows = (_step_filter(unfiltered.columns, unfiltered.is_gpu, unfiltered.symbols) if applies
             else np.arange(unfiltered.is_gpu.size))
    return HtaRankFrame(**{key: column[rows] for key, column in unfiltered.columns.items()},
                        symbols=unfiltered.symbols, min_ts=unfiltered.min_ts,
                        iteration_dtype=unfiltered.iteration_dtype)


FILTERED = ("<two or more ProfilerStep names>",)
"""step_filter_key of any set of names that makes HTA's filter apply whatever the rank holds."""


def step_filter_key(step_names: tuple[str, ...]) -> tuple[str, ...]:
    """What of `step_names` a rank's filtered frame depends on: FILTERED with two or more ProfilerStep
    names (the filter applies), else those names (whether it applies depends on the rank's own too)."""
    names = tuple(sorted({s for s in step_names if STEP_PREFIX in s}))
    return FILTERED if len(names) >= 2 else names


def frames_by_filter_key(unfiltered: UnfilteredFrame) -> dict[tuple[str, ...], HtaRankFrame]:
    """The rank's frame under the step_filter_key of every step_names the other ranks can give that does
    not name a step this rank lacks: FILTERED, no names, and each of the rank's own."""
    own = tuple(sorted(unfiltered.step_names))
    filtered = filtered_frame(unfiltered, applies=True)
    alone = filtered if len(own) >= 2 else filtered_frame(unfiltered, applies=False)
    frames = {FILTERED: filtered, (): alone}
    if len(own) < 2:
        frames.update({(name,): alone for name in own})
    return frames


def _columns(events: list[HtaRankEvent]) -> dict[str, Any]:
    """The kept rows' raw values (lists) and the dtype kinds pandas would infer over every event."""
    starts, durs, cats = list(map(_TS, events)), list(map(_DUR, events)), list(map(_CAT, events))
    kinds, index = _kept_rows(starts, durs, cats)
    kept = list(map(events.__getitem__, index))
    args = [a if type(a) is HtaRankArgs else _NO_ARGS for a in map(_ARGS, kept)]
    return {"index": np.asarray(index, dtype=np.int64), "cat": list(map(cats.__getitem__, index)),
            "name": list(map(_NAME, kept)), "ts": list(map(starts.__getitem__, index)),
            "dur": list(map(durs.__getitem__, index)), "stream": list(map(_STREAM, args)),
            "correlation": list(map(_CORRELATION, args)), "kinds": kinds}


def _kept_rows(starts: list, durs: list, cats: list) -> tuple[dict[str, Any], list[int]]:
    """(the dtype kinds pandas would infer for ts and dur over every event, the positions of HTA's rows: events
    with a ts, a dur and a cat, the `Trace` span left out). NotComputable for a non-numeric ts or dur."""
    kinds, keep, _ = _kinds_and_rows(starts, durs, cats)
    return kinds, np.flatnonzero(keep).tolist()


def _kinds_and_rows(starts: list, durs: list, cats: list
                    ) -> tuple[dict[str, Any], np.ndarray, tuple[np.ndarray | None, np.ndarray | None]]:
    """_kept_rows' kinds and row mask, and every event's ts and dur as float64 (NaN where missing; None where
    a value does not fit a float): the columns of HTA's frame where pandas makes them float64."""
    ts_types, dur_types = set(map(type, starts)), set(map(type, durs))
    kinds = {"ts": pandas_kind(ts_types), "dur": pandas_kind(dur_types), "ts_missing": type(None) in ts_types}
    if kinds["ts"] not in ("int", "float") or kinds["dur"] not in ("int", "float"):
        raise NotComputable("non-numeric ts or dur")
    start, dur = _as_float(starts), _as_float(durs)
    keep = _present_numbers(starts, start) & _present_numbers(durs, dur) & _kept_categories(cats)
    return kinds, keep, (start, dur)


def _as_float(values: list) -> np.ndarray | None:
    """Numbers or None (checked by the caller) as float64 in C, None mapped to NaN (msgspec never decodes a
    NaN); None for an int beyond a float."""
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:
        return None


def _present_numbers(values: list, as_float: np.ndarray | None) -> np.ndarray:
    return ~np.isnan(as_float) if as_float is not None else _present(values)


def _kept_categories(cats: list) -> np.ndarray:
    """Events whose cat is present and not `Trace`, judged once per distinct value."""
    try:
        kept_of = {cat: cat is not None and cat != TRACE_SPAN_CATEGORY for cat in set(cats)}
    except TypeError:  # an unhashable category (a list or an object)
        return _present(cats) & np.fromiter(map(operator.ne, cats, repeat(TRACE_SPAN_CATEGORY)), dtype=bool, count=len(cats))
    return np.fromiter(map(kept_of.__getitem__, cats), dtype=bool, count=len(cats))


def parsed_columns(events: list[Any]) -> dict[str, Any]:
    """_columns of the events fleetscope's own parse decoded (events.decode_selectively: every phase with
    its `ts`, `dur`, `cat` and `name`, a key it did not find as kineto_schema.ABSENT), so one decode of a trace
    serves both. NotComputable where the rows would differ from this module's decode: a row of another
    phase than X (only X events carry their args there). Every step is one call over a column (a map in C,
    numpy, a lookup per distinct value): the parse pays this once a rank, ~20 passes over 150k events."""
    durs = list(map(_DUR, events))
    if ABSENT in durs:
        durs = [None if value is ABSENT else value for value in durs]
    starts, cats = list(map(_TS, events)), list(map(_CAT, events))
    kinds, keep, (start, dur) = _kinds_and_rows(starts, durs, cats)
    rows = np.flatnonzero(keep)
    index = rows.tolist()
    kept = list(map(events.__getitem__, index))
    if not set(map(type, kept)) <= PARSE_COMPLETE_TYPES:
        raise NotComputable("a row that is not a complete event")
    args = list(map(_ARGS, kept))
    if None in args:
        args = [_NO_ARGS if a is None else a for a in args]
    ts_float = kinds["ts"] == "float"
    dur_float = ts_float or kinds["dur"] == "float"
    return {"index": rows.astype(np.int64), "cat": list(map(cats.__getitem__, index)),
            "name": list(map(_NAME, kept)),
            "ts": start[rows] if ts_float and start is not None else list(map(starts.__getitem__, index)),
            "dur": dur[rows] if dur_float and dur is not None else list(map(durs.__getitem__, index)),
            "stream": _ints_or_minus_one(list(map(_STREAM, args)), "stream"),
            "correlation": _ints_or_minus_one(list(map(_CORRELATION, args)), "correlation"), "kinds": kinds}


def _ints_or_minus_one(values: list, what: str) -> np.ndarray:
    """_int_column of an args key's values, -1 where the key is missing (HTA's default)."""
    types = set(map(type, values))
    if not types <= {int, _ABSENT_TYPE}:
        raise NotComputable(f"an args.{what} that is not an integer")
    try:
        if _ABSENT_TYPE in types:
            return np.fromiter(map(_MINUS_ONE_IF_ABSENT.get, values, values), dtype=np.int64, count=len(values))
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise NotComputable(f"an args.{what} beyond int64") from None


_ABSENT_TYPE = type(ABSENT)
_MINUS_ONE_IF_ABSENT = {ABSENT: -1}


def _present(values: list) -> np.ndarray:
    return np.fromiter(map(operator.is_not, values, repeat(None)), dtype=bool, count=len(values))


def _symbols(cats: list, names: list) -> tuple[list[str], np.ndarray, np.ndarray]:
    """One string table for `cat` and `name` (as HTA's), and each row's ids (interned in C: dict.fromkeys)."""
    values = cats + names
    try:
        symbols = list(dict.fromkeys(values))
    except TypeError:  # an unhashable name (a list or an object)
        raise NotComputable("an event name or category that is not text") from None
    # a value equal to a string is that string: the distinct values are all text iff every value is
    if not set(map(type, symbols)) <= {str}:
        raise NotComputable("an event name or category that is not text")
    ids = dict(zip(symbols, range(len(symbols))))
    codes = np.fromiter(map(ids.__getitem__, values), dtype=np.int64, count=len(values))
    return symbols, codes[: len(cats)], codes[len(cats):]


def _times(columns: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ts, dur, end) as HTA's frame holds them before alignment (dtypes included)."""
    kinds = columns["kinds"]
    ts_float = kinds["ts"] == "float"
    try:
        start = np.asarray(columns["ts"], dtype=np.float64 if ts_float else np.int64)
        dur = np.asarray(columns["dur"], dtype=np.float64 if kinds["dur"] == "float" or ts_float else np.int64)
    except OverflowError:
        raise NotComputable("a time beyond int64") from None
    if ts_float:  # HTA's round_down_time_stamps: start up, end down, to whole microseconds
        end = np.floor(start + dur)
        start = np.ceil(start)
        dur = end - start
        start = start if kinds["ts_missing"] else start.astype(np.int64)
    start, dur = downcast(start), downcast(dur)
    return start, dur, start + dur


def iteration_dtype(iteration: np.ndarray) -> str:
    """HTA's iteration column's dtype: float64 where some row has none (NaN), else the smallest int."""
    if np.isnan(iteration).any():
        return "float64"
    return str(downcast(iteration.astype(np.int64)).dtype)


def downcast(values: np.ndarray) -> np.ndarray:
    """pandas' `to_numeric(downcast="integer")` of an int column: the smallest signed int dtype holding it."""
    if values.dtype.kind != "i" or not values.size:
        return values
    low, high = values.min(), values.max()
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.astype(dtype)
    return values


def _int_column(values: list | np.ndarray, what: str) -> np.ndarray:
    if isinstance(values, np.ndarray):  # parsed_columns checked and converted it
        return values
    if not set(map(type, values)) <= {int}:
        raise NotComputable(f"an args.{what} that is not an integer")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise NotComputable(f"an args.{what} beyond int64") from None


def _gpu_rows(stream: np.ndarray, correlation: np.ndarray, name: np.ndarray, symbols: list[str]) -> np.ndarray:
    """HTA's GPUKernelFilter: kernels and copies (stream and correlation >= 0) and device syncs."""
    syncs = [i for i, s in enumerate(symbols) if s in EVENT_SYNC_NAMES]
    return ((stream >= 0) & (correlation >= 0)) | np.isin(name, syncs)


def inner_merge(left_keys: np.ndarray, right_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (left, right) of pandas' `left.merge(right, how="inner")` on one key, in its row order:
    left rows in order, each with its matching right rows in order."""
    order = np.argsort(right_keys, kind="stable")
    sorted_keys = right_keys[order]
    first = np.searchsorted(sorted_keys, left_keys, side="left")
    last = np.searchsorted(sorted_keys, left_keys, side="right")
    counts = last - first
    left = np.repeat(np.arange(left_keys.size), counts)
    offsets = np.arange(left.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return left, order[np.repeat(first, counts) + offsets]


def _index_correlation(index: np.ndarray, correlation: np.ndarray, is_gpu: np.ndarray) -> np.ndarray:
    """HTA's transform_correlation_to_index: min(correlation, 0), then for each (host, GPU) pair sharing a
    correlation id the host row gets the GPU row's index and the GPU row the host row's (later pairs win)."""
    linked = np.minimum(correlation, 0)
    has = correlation != -1
    cpu_rows, gpu_rows = np.flatnonzero(has & ~is_gpu), np.flatnonzero(has & is_gpu)
    left, right = inner_merge(correlation[cpu_rows], correlation[gpu_rows])
    cpu_rows, gpu_rows = cpu_rows[left], gpu_rows[right]
    linked[cpu_rows] = index[gpu_rows]
    linked[gpu_rows] = index[cpu_rows]
    return downcast(linked)


def _step_rows(name: np.ndarray, symbols: list[str], prefix_only: bool = True) -> np.ndarray:
    wanted = [i for i, s in enumerate(symbols) if (s.startswith(STEP_PREFIX) if prefix_only else STEP_PREFIX in s)]
    return np.isin(name, wanted)


def _iterations(ts, dur, name, symbols, stream, index, index_correlation) -> np.ndarray:
    """HTA's add_iteration: host rows take the number of the last ProfilerStep row (trace order) whose
    [ts, ts + dur) holds their start; GPU rows (stream > 0) their launch's; -1 where neither; NaN on stream 0."""
    host = np.full(ts.size, -1.0)
    for row in np.flatnonzero(_step_rows(name, symbols)):
        found = _STEP_NUMBER.match(symbols[name[row]])
        if found is None:
            raise NotComputable(f"a step named {symbols[name[row]]!r} without a number")
        host[(ts[row] <= ts) & (ts < ts[row] + dur[row])] = int(found.group(1))
    iteration = np.where(stream < 0, host, np.nan)
    device = np.flatnonzero(stream > 0)
    if device.size:
        order = np.argsort(index, kind="stable")
        link = index_correlation[device]
        slot = np.clip(np.searchsorted(index[order], link), 0, index.size - 1)
        found = index[order[slot]] == link
        iteration[device] = np.where(link > 0, np.where(found, iteration[order[slot]], np.nan), -1.0)
    return iteration


def step_filter_applies(own_names: frozenset[str], step_names: tuple[str, ...]) -> bool:
    """HTA filters a rank's rows only when the ranks hold two or more ProfilerStep names in all."""
    return len(own_names | {s for s in step_names if STEP_PREFIX in s}) >= 2


def _filter_keeps_stepless_ranks() -> bool:
    return hta_generation() == "0.6"


@functools.lru_cache(maxsize=1)
def hta_generation() -> str:
    """"0.6" where the `hta` package Python would import is traceinsight 0.6 or later, else "0.5" (also without
    HTA: the native views then follow 0.5, the version the `hta` extra installs)."""
    spec = importlib.util.find_spec("hta")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    for package in ("traceinsight", "HolisticTraceAnalysis"):
        try:
            distribution = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if origin is not None and Path(distribution.locate_file("hta/__init__.py")).resolve() != origin:
            continue
        numbers = [int(part) for part in re.findall(r"\d+", distribution.version)[:2]]
        return "0.6" if numbers >= [0, 6] else "0.5"
    return "0.5"


def _step_filter(frame: dict[str, np.ndarray], is_gpu: np.ndarray, symbols: list[str]) -> np.ndarray:
    """Row positions HTA's _filter_irrelevant_gpu_kernels keeps, in its order, where it applies
    (step_filter_applies): GPU rows whose correlation a kept host row has (once per such host row), then
    host rows starting (aligned) by the latest step end (not aligned)."""
    cpu = np.flatnonzero(~is_gpu)
    steps = cpu[_step_rows(frame["name"][cpu], symbols, prefix_only=False)]
    if _filter_keeps_stepless_ranks():
        # HTA 0.6: a rank without host rows is kept whole; one without steps keeps its host rows up to their end
        if not cpu.size:
            return np.arange(is_gpu.size)
        last_end = frame["end"][steps].max() if steps.size else frame["end"][cpu].max()
        cpu = cpu[frame["ts"][cpu] <= last_end]
    elif not steps.size:
        cpu = cpu[:0]
    else:
        cpu = cpu[frame["ts"][cpu] <= frame["end"][steps].max()]
    gpu = np.flatnonzero(is_gpu)
    left, _ = inner_merge(frame["correlation"][gpu], frame["correlation"][cpu])
    return np.concatenate([gpu[left], cpu])
