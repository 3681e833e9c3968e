"""HTA 0.5.0's cross-rank straggler view (`get_potential_stragglers(num_candidates=1)` with the
late-start metric, hta/analyzers/straggler.py), computed in numpy from the rows each rank sent
(per_rank/hta_native_views.straggler_rows), so the parent needs neither HTA nor pandas.

HTA's steps: the profiler steps of all ranks; the rows of those iterations; the mean iteration time
(latest end less earliest start, over the number of iterations); communication kernels (names starting
`ncclKernel`, `ncclDevKernel_` read as such: upstream issue #360) on a stream > 0, in an iteration > 0,
lasting at least 1% of it; the last one per (rank, stream, iteration, name); the (stream, name) whose
duration varies most across ranks on average over iterations; then per iteration the ranks whose
normalized start is the latest, counted over iterations; the rank counted most often. Ties break as
HTA's do (groupby's sorted keys, symbol ids in order of first appearance over the ranks, pandas' sort).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from fleetscope.analysis.per_rank.hta_native_views import sort_order

MIN_NORMALIZED_DURATION = 0.01
NUM_CANDIDATES = 1
_STEP_NUMBER = re.compile(r"ProfilerStep\s*#\s*(\d+)")
_MODERN_NCCL = "ncclDevKernel_"


class StragglerViewError(ValueError):
    """HTA raises a ValueError here (no profiler step, no significant communication kernel)."""


@dataclass(frozen=True)
class _Rows:
    """Every rank's rows, concatenated in rank order, each rank's in frame order."""

    rank: np.ndarray
    name: np.ndarray
    """Symbol ids (first appearance over the ranks)."""
    ts: np.ndarray
    dur: np.ndarray
    stream: np.ndarray
    iteration: np.ndarray
    symbols: list[str]


def potential_stragglers(per_rank: list[tuple[int, dict[str, list], Any]]) -> list[dict[str, int]]:
    """HTA's straggler ranks from `(rank, straggler_rows, min_ts)` of every rank."""
    rows = _concatenated(per_rank)
    steps = _profiler_steps(rows)
    if not steps:
        raise StragglerViewError(f"invalid value for argument: profiler_steps=None; available profiler steps={steps}")
    selected = np.isin(rows.iteration, steps)
    metric_rank, metric_iteration, metric = _late_start_metric(rows, selected)
    counts_rank, counts = _top_k(metric_rank, metric_iteration, metric)
    order = sort_order(counts, ascending=False)
    return [{"rank": int(counts_rank[i])} for i in order[:NUM_CANDIDATES]]


def _concatenated(per_rank) -> _Rows:
    base = min(min_ts for _, _, min_ts in per_rank)
    symbols: dict[str, int] = {}
    columns: dict[str, list] = {"rank": [], "name": [], "ts": [], "dur": [], "stream": [], "iteration": []}
    for rank, rows, min_ts in sorted(per_rank, key=lambda item: item[0]):
        columns["rank"].append(np.full(len(rows["name"]), rank, dtype=np.int64))
        columns["name"].append(np.asarray([symbols.setdefault(n, len(symbols)) for n in rows["name"]], dtype=np.int64))
        columns["ts"].append(np.asarray(rows["ts"], dtype=rows["ts_dtype"]) + (min_ts - base))
        columns["dur"].append(np.asarray(rows["dur"], dtype=rows["dur_dtype"]))
        columns["stream"].append(np.asarray(rows["stream"], dtype=np.int64))
        columns["iteration"].append(np.asarray(rows["iteration"], dtype=np.float64))
    return _Rows(**{key: np.concatenate(parts) for key, parts in columns.items()}, symbols=list(symbols))


def _profiler_steps(rows: _Rows) -> list[int]:
    """HTA's get_profiler_steps: the numbers of the ProfilerStep rows of every rank, -1 left out."""
    step_ids = [i for i, s in enumerate(rows.symbols) if s.startswith("ProfilerStep")]
    numbers = set()
    for name in np.unique(rows.name[np.isin(rows.name, step_ids)]).tolist():
        found = _STEP_NUMBER.match(rows.symbols[name])
        numbers.add(int(found.group(1)) if found else -1)
    return sorted(numbers - {-1})


def _comm_ids(symbols: list[str]) -> list[int]:
    """HTA's comm_op_ids over its symbol table seen with modern NCCL names read as old ones (each such
    name's first id, as HTA's name -> id map gives)."""
    modern = ["ncclKernel_" + s[len(_MODERN_NCCL):] if s.startswith(_MODERN_NCCL) else s for s in symbols]
    first: dict[str, int] = {}
    for index, name in enumerate(modern):
        first.setdefault(name, index)
    return sorted({first[name] for name in modern if name.startswith("ncclKernel")})


def _late_start_metric(rows: _Rows, selected: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HTA's _compute_normalized_start_time_of_significant_comm_kernels: (rank, iteration, normalized
    start) of the candidate kernels, in HTA's row order."""
    iteration = rows.iteration[selected]
    iterations = sorted(set(iteration.tolist()) - {-1.0})
    keep = np.flatnonzero(selected)[np.isin(iteration, iterations)]
    ts, dur = rows.ts[keep], rows.dur[keep]
    if not keep.size:
        raise StragglerViewError("attempt to get argmax of an empty sequence")
    t_min = ts.min()
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_iteration = np.float64((ts + dur).max() - t_min) / float(len(iterations))
    long = keep[(rows.stream[keep] > 0) & (rows.iteration[keep] > 0)
                & (dur >= mean_iteration * MIN_NORMALIZED_DURATION) & np.isin(rows.name[keep], _comm_ids(rows.symbols))]
    last = _last_of_groups(rows, long)
    duration = rows.dur[last] / mean_iteration
    stream, name, iteration = rows.stream[last], rows.name[last], rows.iteration[last]
    chosen = _most_varying(stream, iteration, name, duration)
    candidates = last[(stream == chosen[0]) & (name == chosen[1])]
    return rows.rank[candidates], rows.iteration[candidates], (rows.ts[candidates] - t_min) / mean_iteration


def _last_of_groups(rows: _Rows, positions: np.ndarray) -> np.ndarray:
    """groupby(["rank", "stream", "iteration", "name"]).last(): per group its last row, groups sorted."""
    keys = (rows.name[positions], rows.iteration[positions], rows.stream[positions], rows.rank[positions])
    order = np.lexsort(keys)  # stable: within a group, rows stay in order
    sorted_keys = [k[order] for k in keys]
    last = np.ones(order.size, dtype=bool)
    if order.size:
        last[:-1] = np.any([k[1:] != k[:-1] for k in sorted_keys], axis=0)
    return positions[order[last]]


def _most_varying(stream, iteration, name, duration) -> tuple[int, int]:
    """(stream, name) of the largest mean over iterations of the duration's standard deviation across
    ranks (HTA's idxmax: the first in sorted key order among equals)."""
    spread: dict[tuple[int, int], list[float]] = {}
    groups: dict[tuple[int, float, int], list[float]] = {}
    for s, i, n, d in zip(stream.tolist(), iteration.tolist(), name.tolist(), duration.tolist()):
        groups.setdefault((s, i, n), []).append(d)
    for (s, _i, n), values in sorted(groups.items()):
        spread.setdefault((s, n), []).append(np.std(values, ddof=1) if len(values) > 1 else np.nan)
    if not spread:
        raise StragglerViewError("attempt to get argmax of an empty sequence")
    means = {key: np.nanmean(values) if not np.all(np.isnan(values)) else np.nan for key, values in spread.items()}
    finite = [(key, value) for key, value in sorted(means.items()) if not np.isnan(value)]
    if not finite:
        raise StragglerViewError("Encountered all NA values")
    best = max(value for _, value in finite)
    return next(key for key, value in finite if value == best)


def _top_k(rank: np.ndarray, iteration: np.ndarray, metric: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HTA's _get_top_k_stragglers_with_metric (k = NUM_CANDIDATES): (ranks, times each was among the k
    latest), as its Series' index and values."""
    if np.unique(iteration).size <= 1:
        threshold = np.sort(metric)[::-1][NUM_CANDIDATES - 1]
        return rank, (metric >= threshold).astype(np.int64)
    late = np.zeros(metric.size, dtype=np.int64)
    for number in np.unique(iteration):
        if number < 0:
            continue
        group = iteration == number
        threshold = np.sort(metric[group])[::-1][NUM_CANDIDATES - 1]
        late[group] = metric[group] >= threshold
    ranks = np.unique(rank)
    return ranks, np.asarray([late[rank == r].sum() for r in ranks], dtype=np.int64)
