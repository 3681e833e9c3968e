"""HTA 0.5.0's per-rank views computed in numpy from the native frame (hta_native.py), as plain rows.

Each function follows HTA's own steps (breakdown_analysis.py, communication_analysis.py,
cuda_kernel_analysis.py, utils.merge_kernel_intervals), with pandas' operations replaced by the numpy
calls pandas makes: `sort_values` is numpy's quicksort over the same values in the same order and dtype
(tied rows then land where HTA's do: they change idle intervals and which zero-length overlaps appear),
`round` is numpy's, describe's statistics are pandas' formulas. tests/test_per_rank_hta_native.py holds every
table equal to stock HTA's. A view HTA cannot compute (it raises) raises ViewError here with the reason.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
from fleetscope.analysis.per_rank.hta_native import HtaRankFrame, hta_generation, inner_merge
from fleetscope.traces.validate import finite

Table = list[dict[str, Any]]

COMPUTATION, COMMUNICATION, MEMORY, OTHER = "COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER"
KERNEL_BREAKDOWN_TYPES = (COMPUTATION, COMMUNICATION, MEMORY)
"""TraceAnalysis.get_gpu_kernel_breakdown with include_memory_kernels=True, in HTA's bit order."""
DURATION_RATIO = 0.8
NUM_KERNELS = 10
CONSECUTIVE_KERNEL_DELAY_US = 30
"""TraceAnalysis.get_idle_time_breakdown's default."""
IDLE_KERNEL_CATEGORIES = ("kernel", "Kernel", "gpu_memset", "Memset", "gpu_memcpy", "Memcpy", "mtia_ccp_events")
IDLE_CATEGORY_NAMES = {0: "host_wait", 1: "kernel_wait", 2: "other"}
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "runFunction - job_prep_and_submit_for_execution")
MEMORY_LAUNCH_NAMES = ("cudaMemsetAsync", "cudaMemcpyAsync")
LAUNCH_RUNTIME_CUTOFF_US = 50
LAUNCH_DELAY_CUTOFF_US = 100
MAX_LAUNCH_PAIRS = 20_000_000
"""HTA joins launches and kernels many-to-many on correlation: past this many pairs the view is refused."""

KERNEL_RULES = {
    # (communication, memory, not computation): HTA's get_kernel_type, regular expressions and all
    "0.5": (re.compile(r"^nccl.*Kernel"), re.compile(r"(^Memcpy)|(^Memset)|(^dma)"),
            re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")),
    "0.6": (re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)"), re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)"),
            re.compile(r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)"
                       r"|(^runFunction)|(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)"
                       r"|(^collective_subgraph_execution)")),
}
"""HTA 0.5 (holistictraceanalysis) and 0.6 (published as traceinsight: the same `hta` package) classify kernels
differently (0.6 adds HIP, HCCL and MTIA names, and counts `Stream Wait Event` as no computation)."""


class ViewError(Exception):
    """HTA raises on this rank for this view; the message says what is missing."""


@functools.lru_cache(maxsize=65536)
def kernel_type(name: str) -> str:
    """HTA's get_kernel_type, regular expressions and all, of the installed HTA (hta_generation; classified once
    per distinct name)."""
    communication, memory, not_computation = KERNEL_RULES[hta_generation()]
    if communication.match(name):
        return COMMUNICATION
    if memory.match(name):
        return MEMORY
    if not not_computation.match(name):
        return COMPUTATION
    return OTHER


# --- pandas' operations -----------------------------------------------------------------------------


def sort_order(values: np.ndarray, ascending: bool = True) -> np.ndarray:
    """pandas' `sort_values` order of one column without NaN (nargsort, quicksort)."""
    if ascending:
        return np.argsort(values, kind="quicksort")
    reverse = np.arange(values.size)[::-1]
    return reverse[values[::-1].argsort(kind="quicksort")][::-1]


def pandas_round(value: Any, decimals: int) -> Any:
    """DataFrame.round on one value: numpy's rounding of floats, ints unchanged."""
    if isinstance(value, (float, np.floating)):
        return float(np.round(np.float64(value), decimals))
    return value


def python_scalar(value: Any) -> Any:
    """A JSON-safe scalar (NaN and infinities become None, anything else not JSON its text)."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and finite(value) is None:
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def merge_intervals(ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HTA's merge_kernel_intervals: (starts, ends) of the union of [ts, ts + dur), touching ones merged."""
    if not ts.size:
        return ts[:0], (ts + dur)[:0]
    order = sort_order(ts)
    ts, end = ts[order], (ts + dur)[order]
    new_group = np.empty(ts.size, dtype=bool)
    new_group[0] = False
    new_group[1:] = ts[1:] > np.maximum.accumulate(end[:-1])
    group = np.cumsum(new_group)
    starts = np.flatnonzero(np.r_[True, np.diff(group) != 0])
    return np.minimum.reduceat(ts, starts), np.maximum.reduceat(end, starts)


def _gpu_rows(frame: HtaRankFrame) -> np.ndarray:
    """What these views call GPU kernels: `stream != -1`."""
    return np.flatnonzero(frame.stream != -1)


def _types(frame: HtaRankFrame, rows: np.ndarray) -> np.ndarray:
    names = frame.name[rows]
    unique, inverse = np.unique(names, return_inverse=True)
    return np.asarray([kernel_type(frame.symbols[i]) for i in unique.tolist()], dtype=object)[inverse] \
        if unique.size else np.asarray([], dtype=object)


# --- temporal breakdown, overlap ------------------------------------------------------------------------


def temporal_breakdown(frame: HtaRankFrame, rank: int) -> Table:
    """HTA's get_temporal_breakdown row of this rank."""
    rows = _gpu_rows(frame)
    if not rows.size:
        raise ViewError("IndexError: single positional indexer is out-of-bounds")  # no GPU kernels
    ts, dur = frame.ts[rows], frame.dur[rows]
    starts, ends = merge_intervals(ts, dur)
    kernel_time = ends[-1] - starts[0]
    idle_time = kernel_time - (ends.sum() - starts.sum())
    compute = _types(frame, rows) == COMPUTATION
    comp_starts, comp_ends = merge_intervals(ts[compute], dur[compute])
    compute_time = comp_ends.sum() - comp_starts.sum()
    non_compute_time = kernel_time - compute_time - idle_time
    if not (idle_time <= kernel_time and compute_time <= kernel_time and non_compute_time >= 0):
        raise ViewError("AssertionError:")  # HTA asserts without a message
    row = {"rank": rank, "idle_time(us)": idle_time, "compute_time(us)": compute_time,
           "non_compute_time(us)": non_compute_time, "kernel_time(us)": kernel_time}
    for part in ("idle_time", "compute_time", "non_compute_time"):
        share = np.float64(row[f"{part}(us)"]) / np.float64(kernel_time)
        row[f"{part}_pctg"] = np.round(100 * share, 2)
    return [{key: python_scalar(value) for key, value in row.items()}]


def _sweep(intervals: list[tuple[np.ndarray, np.ndarray, int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    """HTA's melt-concat-sort of merged intervals: (times, status) sorted as its frame is, after adding
    each (starts, ends, value) in turn (starts as +value, ends as -value)."""
    times, status = np.asarray([], dtype=dtype), np.asarray([], dtype=np.int64)
    for starts, ends, value in intervals:
        times = np.concatenate([times, starts.astype(dtype), ends.astype(dtype)])
        status = np.concatenate([status, np.full(starts.size, value), np.full(ends.size, -value)])
        order = sort_order(times)
        times, status = times[order], status[order]
    return times, status


def _time_dtype(frame: HtaRankFrame):
    return np.float64 if frame.ts.dtype.kind == "f" or frame.dur.dtype.kind == "f" else np.int64


def comm_comp_overlap(frame: HtaRankFrame, rank: int) -> Table:
    """HTA's get_comm_comp_overlap row of this rank."""
    rows = _gpu_rows(frame)
    types = _types(frame, rows)
    ts, dur = frame.ts[rows], frame.dur[rows]
    comp = merge_intervals(ts[types == COMPUTATION], dur[types == COMPUTATION])
    comm = merge_intervals(ts[types == COMMUNICATION], dur[types == COMMUNICATION])
    times = np.concatenate([comm[0], comm[1], comp[0], comp[1]]).astype(_time_dtype(frame))
    status = np.concatenate([np.full(comm[0].size, 1), np.full(comm[1].size, -1),
                             np.full(comp[0].size, 2), np.full(comp[1].size, -2)])
    order = sort_order(times)
    times, running = times[order], np.cumsum(status[order])
    both = np.flatnonzero(running[:-1] == 3)
    overlap = (times[both + 1] - times[both]).sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.float64(overlap) / np.float64((comm[1] - comm[0]).sum())
    return [{"rank": rank, "comp_comm_overlap_pctg": python_scalar(np.round(100 * ratio, 2))}]


# --- kernel breakdown -----------------------------------------------------------------------------------


def kernel_breakdown(frame: HtaRankFrame, rank: int) -> tuple[Table, Table]:
    """HTA's get_gpu_kernel_breakdown parts of this rank: (time per kernel type and overlap of types,
    unnormalized: `kernel_type`, `sum`; per-kernel rows). The cross-rank totals are joined elsewhere."""
    rows = _gpu_rows(frame)
    types = _types(frame, rows)
    ts, dur, names = frame.ts[rows], frame.dur[rows], frame.name[rows]
    return _type_time(ts, dur, types, _time_dtype(frame)), [
        row for kind in KERNEL_BREAKDOWN_TYPES
        for row in _kernel_rows(names[types == kind], dur[types == kind], frame.symbols, kind, rank)]


def _type_time(ts, dur, types, dtype) -> Table:
    """HTA's _get_gpu_kernel_type_time: time in each combination of running kernel types."""
    intervals = [(*merge_intervals(ts[types == kind], dur[types == kind]), 1 << bit)
                 for bit, kind in enumerate(KERNEL_BREAKDOWN_TYPES)]
    times, status = _sweep(intervals, dtype)
    running = np.cumsum(status)
    positions = np.flatnonzero(running[:-1] > 0)
    # each span truncated to whole microseconds before it is added, as HTA's int() of each
    spans = np.diff(times)[positions].astype(np.int64)
    sets = running[positions]
    totals = {_running_label(int(value)): int(spans[sets == value].sum()) for value in np.unique(sets).tolist()}
    return [{"kernel_type": label, "sum": totals[label]} for label in sorted(totals)]


def _running_label(running: int) -> str:
    return " overlapping ".join(kind for bit, kind in enumerate(KERNEL_BREAKDOWN_TYPES) if running & (1 << bit))


def _kernel_rows(names: np.ndarray, dur: np.ndarray, symbols: list[str], kind: str, rank: int) -> Table:
    """HTA's _aggr_gpu_kernel_time of one kernel type: per-name statistics sorted by total, the names past
    the top NUM_KERNELS or past DURATION_RATIO of the cumulated time folded into `others` (whose
    statistics HTA takes over the folded names' totals)."""
    if not names.size:
        return []
    ids, inverse = np.unique(names, return_inverse=True)
    labels = np.asarray([symbols[i] for i in ids.tolist()], dtype=object)
    by_label = np.argsort(labels, kind="stable")  # groupby sorts its keys
    # each name's durations in row order (what a mask per name gives), from one stable sort
    grouped = np.split(dur[np.argsort(inverse, kind="stable")], np.cumsum(np.bincount(inverse))[:-1])
    stats = [_stats(grouped[position]) for position in by_label.tolist()]
    table = {"name": labels[by_label]} | {key: np.asarray([s[key] for s in stats]) for key in stats[0]}
    order = sort_order(table["sum"], ascending=False)
    table = {key: column[order] for key, column in table.items()}
    table["std"] = np.where(np.isnan(table["std"]), 0.0, table["std"])
    if table["name"].size > NUM_KERNELS:
        table = _folded(table)
    return [{"name": str(name), "sum (us)": python_scalar(total), "max (us)": python_scalar(high), "min (us)": python_scalar(low),
             "stddev": python_scalar(spread), "mean (us)": python_scalar(mean), "kernel_type": kind, "rank": int(rank)}
            for name, total, high, low, spread, mean in zip(table["name"], table["sum"], table["max"], table["min"],
                                                             table["std"], table["mean"])]


def _stats(values: np.ndarray) -> dict[str, Any]:
    """pandas' groupby sum, max, min, mean, std (ddof 1) of one group."""
    count = values.size
    mean = values.sum() / count if values.dtype.kind == "f" else np.float64(values.sum()) / count
    if count > 1:
        deviations = values.astype(np.float64) - mean
        std = np.sqrt((deviations * deviations).sum() / (count - 1))
    else:
        std = np.nan
    return {"sum": values.sum(), "max": values.max(), "min": values.min(), "mean": mean, "std": std}


def _folded(table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    cumsum = np.cumsum(table["sum"])
    cut = np.quantile(cumsum, DURATION_RATIO)
    names = table["name"].copy()
    kept = table["sum"] < 0  # HTA's "always false" keep_idx: kernels of negative total stay apart
    names[~kept & ((cumsum > cut) | (np.arange(names.size) >= NUM_KERNELS))] = "others"
    labels = sorted(set(names.tolist()))
    stats = [_stats(table["sum"][names == label]) for label in labels]
    folded = {"name": np.asarray(labels, dtype=object)} | {key: np.asarray([s[key] for s in stats]) for key in stats[0]}
    folded["std"] = np.where(np.isnan(folded["std"]), 0.0, folded["std"])
    return folded


# --- idle time --------------------------------------------------------------------------------------------


def idle_time_breakdown(frame: HtaRankFrame, rank: int) -> tuple[Table, Table]:
    """HTA's get_idle_time_breakdown of this rank, with idle interval statistics: (breakdown rows,
    interval statistics rows), per stream in order of first appearance, categories in HTA's order."""
    cats = [i for i, s in enumerate(frame.symbols) if s in IDLE_KERNEL_CATEGORIES]
    rows = np.flatnonzero((frame.stream != -1) & np.isin(frame.cat, cats))
    if not rows.size:
        raise ViewError("ValueError: No objects to concatenate")  # no GPU kernels
    runtime_ts = _runtime_starts(frame, frame.index_correlation[rows])
    streams = frame.stream[rows]
    _, first = np.unique(streams, return_index=True)
    breakdown, intervals = [], []
    for stream in streams[np.sort(first)].tolist():
        on_stream = streams == stream
        parts = _idle_of_stream(frame.ts[rows][on_stream], frame.dur[rows][on_stream], runtime_ts[on_stream])
        for category, idle, ratio, stats in parts:
            name = IDLE_CATEGORY_NAMES[category]
            breakdown.append({"rank": rank, "stream": stream, "idle_category": name,
                              "idle_time": pandas_round(idle, 2), "idle_time_ratio": pandas_round(ratio, 2)})
            intervals.append({"rank": rank, "stream": stream} | {key: pandas_round(value, 2)
                                                                  for key, value in stats.items()})
    return ([{k: python_scalar(v) for k, v in row.items()} for row in breakdown],
            [{k: python_scalar(v) for k, v in row.items()} for row in intervals])


def _runtime_starts(frame: HtaRankFrame, links: np.ndarray) -> np.ndarray:
    """The aligned start of the row whose `index` is each link (HTA's join on index_correlation), NaN
    where no row has it."""
    order = np.argsort(frame.index, kind="stable")
    labels = frame.index[order]
    slot = np.clip(np.searchsorted(labels, links), 0, max(labels.size - 1, 0))
    found = labels[slot] == links if labels.size else np.zeros(links.size, dtype=bool)
    if found.any() and np.any(np.diff(labels) == 0):
        duplicated = np.isin(links[found], labels[1:][np.diff(labels) == 0])
        if duplicated.any():
            raise ViewError("a kernel's launch row appears twice after the step filter (not computable natively)")
    starts = frame.ts[order[slot]].astype(np.float64) if labels.size else np.zeros(links.size)
    return np.where(found, starts, np.nan)


def _idle_of_stream(ts: np.ndarray, dur: np.ndarray, runtime_ts: np.ndarray) -> list[tuple]:
    """HTA's _analyze_idle_time_for_stream: per category present, (category, idle time, its share of the
    stream's idle time, describe() of its intervals)."""
    order = sort_order(ts)
    ts, dur, runtime_ts = ts[order], dur[order], runtime_ts[order]
    end = (ts + dur).astype(np.float64)
    previous_end = np.r_[np.nan, end[:-1]]
    interval = ts.astype(np.float64) - previous_end
    with np.errstate(invalid="ignore"):
        host_wait = runtime_ts > previous_end
        kernel_wait = ~host_wait & (interval < CONSECUTIVE_KERNEL_DELAY_US)
    category = np.where(host_wait, 0, np.where(kernel_wait, 1, 2))
    present = sorted(set(category.tolist()))
    sums = {c: np.nansum(interval[category == c]) if np.any(~np.isnan(interval[category == c])) else 0.0
            for c in present}
    total = np.float64(sum(sums[c] for c in present))
    with np.errstate(divide="ignore", invalid="ignore"):
        return [(c, np.float64(sums[c]), np.float64(sums[c]) / total, _describe(interval[category == c]))
                for c in present]


def _describe(values: np.ndarray) -> dict[str, Any]:
    """pandas' Series.describe of a float column (NaN left out)."""
    values = values[~np.isnan(values)]
    count = values.size
    if not count:
        return {"count": 0.0, "mean": np.nan, "std": np.nan, "min": np.nan, "25%": np.nan, "50%": np.nan,
                "75%": np.nan, "max": np.nan}
    mean = values.sum() / count
    std = np.sqrt(((values - mean) ** 2).sum() / (count - 1)) if count > 1 else np.nan
    q25, q50, q75 = np.percentile(values, [25.0, 50.0, 75.0])
    return {"count": float(count), "mean": mean, "std": std, "min": values.min(), "25%": q25, "50%": q50,
            "75%": q75, "max": values.max()}


# --- CUDA launch statistics -------------------------------------------------------------------------------


def cuda_launch_stats(frame: HtaRankFrame, rank: int) -> Table:
    """HTA's get_cuda_kernel_launch_stats of this rank summarized as one row (hta_views._launch_row):
    host launches joined with their GPU rows on correlation."""
    launch_names = [i for i, s in enumerate(frame.symbols) if s in LAUNCH_NAMES + MEMORY_LAUNCH_NAMES]
    launched = np.unique(frame.correlation[np.isin(frame.name, launch_names)])
    with_launch = np.isin(frame.correlation, launched)
    cpu = np.flatnonzero(with_launch & (frame.stream == -1))
    gpu = np.flatnonzero(with_launch & (frame.stream != -1))
    left, right = _bounded_merge(frame.correlation[cpu], frame.correlation[gpu])
    cpu, gpu = cpu[left], gpu[right]
    cpu_duration, gpu_duration = frame.dur[cpu], frame.dur[gpu]
    delay = np.clip(frame.ts[gpu] - frame.ts[cpu] - cpu_duration, 0, None)
    return [launch_row(rank, cpu_duration, gpu_duration, delay)]


def _bounded_merge(left_keys: np.ndarray, right_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    right_sorted = np.sort(right_keys)
    pairs = (np.searchsorted(right_sorted, left_keys, "right") - np.searchsorted(right_sorted, left_keys)).sum()
    if pairs > MAX_LAUNCH_PAIRS:
        raise ViewError(f"{pairs} launch/kernel pairs share correlation ids (not computable natively)")
    return inner_merge(left_keys, right_keys)


def launch_row(rank: int, cpu_duration: np.ndarray, gpu_duration: np.ndarray, delay: np.ndarray) -> dict[str, Any]:
    """The per-rank summary of HTA's per-launch table (the report's cuda_launch_stats row)."""
    count = cpu_duration.size

    def mean(values):
        return values.sum() / count if count else np.nan

    return {k: python_scalar(v) for k, v in {
        "rank": int(rank), "launches": count,
        "cpu_duration_mean(us)": mean(cpu_duration.astype(np.float64)),
        "gpu_duration_mean(us)": mean(gpu_duration.astype(np.float64)),
        "launch_delay_mean(us)": mean(delay.astype(np.float64)),
        "launch_delay_p95(us)": np.quantile(delay.astype(np.float64), 0.95) if count else np.nan,
        "launch_delay_max(us)": delay.max() if count else np.nan,
        f"runtime_over_{LAUNCH_RUNTIME_CUTOFF_US}us": int((cpu_duration > LAUNCH_RUNTIME_CUTOFF_US).sum()),
        f"delay_over_{LAUNCH_DELAY_CUTOFF_US}us": int((delay > LAUNCH_DELAY_CUTOFF_US).sum()),
        "gpu_shorter_than_cpu": int((gpu_duration < cpu_duration).sum()),
    }.items()}


# --- rows for HTA's straggler view ----------------------------------------------------------------------


def straggler_rows(frame: HtaRankFrame) -> dict[str, list]:
    """The rows HTA's cross-rank straggler view reads from this rank, in frame order (its groupby().last()
    depends on it), as plain columns: ProfilerStep rows, communication kernels inside a step on a
    stream > 0, and per step the rows holding its earliest start and latest end."""
    symbols = frame.symbols
    is_step = np.asarray([s.startswith("ProfilerStep") for s in symbols], dtype=bool)
    is_comm = np.asarray([s.startswith(("ncclKernel", "ncclDevKernel")) for s in symbols], dtype=bool)
    names = frame.name
    iteration = frame.iteration
    with np.errstate(invalid="ignore"):
        in_step = iteration >= 0
    keep = is_step[names] | (is_comm[names] & in_step & (frame.stream > 0)) if names.size else np.zeros(0, bool)
    end = frame.ts + frame.dur
    for number in np.unique(iteration[in_step]):
        rows = np.flatnonzero(iteration == number)
        keep[rows[np.argmin(frame.ts[rows])]] = True
        keep[rows[np.argmax(end[rows])]] = True
    rows = np.flatnonzero(keep)
    return {"index": frame.index[rows].tolist(), "name": [symbols[i] for i in names[rows].tolist()],
            "ts": frame.ts[rows].tolist(), "dur": frame.dur[rows].tolist(), "stream": frame.stream[rows].tolist(),
            "iteration": iteration[rows].tolist(), "ts_dtype": str(frame.ts.dtype), "dur_dtype": str(frame.dur.dtype),
            "iteration_dtype": frame.iteration_dtype}
