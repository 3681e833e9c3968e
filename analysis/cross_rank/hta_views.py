"""HTA's (Holistic Trace Analysis) views of a window's GPU traces, as plain JSON-ready tables.

HTA only understands GPU traces; CPU-only traces get one line saying why it was skipped. Each HTA analysis
runs on its own, so one that breaks (HTA 0.5.0 has pandas-3 problems) costs that table, not the others.

`run_hta` (the default) does not use HTA's JSON loader: each rank's HTA frame is built and its per-rank
views computed in a worker process (per_rank/hta_rank.py); here the ranks' tables are joined the way HTA
joins them (rank order; kernel totals summed over ranks) and HTA's cross-rank straggler view runs on the
few rows each rank sent. `run_stock_hta` is HTA's own load of the same files, with the same tables: the
reference the fast path is tested against.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
import multiprocessing
import multiprocessing.forkserver
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetscope.analysis.per_rank.hta_cache import cached_rank_hta, hta_code_digest
from fleetscope.analysis.per_rank.hta_rank import (
    LAUNCH_DELAY_CUTOFF_US,
    LAUNCH_RUNTIME_CUTOFF_US,
    RankHta,
    analysis_of,
    one_line,
    quietly,
    trace_of,
)

Progress = Callable[[int, int], None]

STATUS_OK = "ok"
STATUS_PARTIAL = "partial"
STATUS_SKIPPED = "skipped"
STATUS_FAILED = "failed"

Table = list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class HtaViews:
    """What HTA said about one window."""

    status: str
    """ok (every analysis ran), partial (some failed), skipped (not applicable), failed (nothing ran)."""
    reason: str | None = None
    """One line: why HTA was skipped or failed."""
    tables: dict[str, Table] = field(default_factory=dict)
    """Analysis name -> rows (HTA's column names, units as HTA gives them, e.g. `idle_time(us)`)."""
    errors: dict[str, str] = field(default_factory=dict)
    """Analysis name -> the error that stopped it."""
    not_applicable: dict[str, str] = field(default_factory=dict)
    """Analysis name -> why it was not run (e.g. the straggler view on one rank)."""


def skipped(reason: str) -> HtaViews:
    return HtaViews(status=STATUS_SKIPPED, reason=reason)


def run_hta(trace_files: dict[int, Path], *, has_comm_kernels: bool = True, step_names: tuple[str, ...] = (),
            workers: int | None = None, progress: Progress | None = None,
            cache_dir: Path | None = None) -> HtaViews:
    """HTA's views of the window's traces from frames built per rank in worker processes; never raises for
    HTA's own failures. `has_comm_kernels`: whether the traces hold NCCL kernels (HTA's straggler view
    needs them); `step_names`: the ProfilerStep names of these ranks (HTA's step filter counts them over
    all ranks); `progress(done, total)` as ranks finish; `cache_dir`: the parsed-trace cache's directory
    (open_cache), where each rank's views are kept (per_rank/hta_cache.py), or None for no cache."""
    if not trace_files:
        return skipped("no readable trace")
    ranks = sorted(trace_files)
    try:
        per_rank = _per_rank(trace_files, step_names, workers, progress, cache_dir)
    except Exception as error:  # noqa: BLE001 - HTA raises anything from asserts to KeyErrors
        return HtaViews(status=STATUS_FAILED, reason=f"HTA could not load the traces: {one_line(error)}")
    joins = _joins(per_rank)
    return _views(ranks, has_comm_kernels, lambda name, run: joins[name](), joins)


def run_stock_hta(trace_files: dict[int, Path], *, has_comm_kernels: bool = True) -> HtaViews:
    """The same views from HTA's own loader (`TraceAnalysis(trace_files=...)`): slow, the reference."""
    if not trace_files:
        return skipped("no readable trace")
    try:
        analysis = _load(trace_files)
    except Exception as error:  # noqa: BLE001 - HTA raises anything from asserts to KeyErrors
        return HtaViews(status=STATUS_FAILED, reason=f"HTA could not load the traces: {one_line(error)}")
    ranks = sorted(trace_files)
    return _views(ranks, has_comm_kernels, lambda name, run: run(analysis), _analyses(ranks))


def _views(ranks: list[int], has_comm_kernels: bool, compute: Callable[[str, Callable], dict[str, Table]],
           analyses: dict[str, Callable]) -> HtaViews:
    tables: dict[str, Table] = {}
    errors: dict[str, str] = {}
    analyses = dict(analyses)
    not_applicable = {}
    if len(ranks) < 2 or not has_comm_kernels:
        del analyses["potential_stragglers"]
        not_applicable["potential_stragglers"] = (
            "HTA's straggler view needs at least two ranks" if len(ranks) < 2
            else "HTA's straggler view needs NCCL kernels (these ranks communicate on the host)")
    for name, run in analyses.items():
        try:
            tables.update(quietly(lambda name=name, run=run: compute(name, run)))
        except _RankError as error:
            errors[name] = str(error)
        except Exception as error:  # noqa: BLE001
            errors[name] = one_line(error)
    if not tables:
        return HtaViews(status=STATUS_FAILED, reason="every HTA analysis failed", errors=errors,
                        not_applicable=not_applicable)
    status = STATUS_PARTIAL if errors else STATUS_OK
    reason = f"{len(errors)} HTA analyses failed" if errors else None
    return HtaViews(status=status, reason=reason, tables=tables, errors=errors, not_applicable=not_applicable)


class _RankError(Exception):
    """A view failed on one rank (its message is HTA's error there): the view fails, as in HTA."""


def _per_rank(trace_files: dict[int, Path], step_names: tuple[str, ...], workers: int | None,
              progress: Progress | None, cache_dir: Path | None = None) -> list[RankHta]:
    """rank_hta (through the cache) for every rank, one worker process per rank when there are several;
    in rank order."""
    ranks = sorted(trace_files)
    paths = [str(Path(trace_files[r]).absolute()) for r in ranks]
    names = [tuple(step_names)] * len(ranks)
    one = functools.partial(cached_rank_hta, cache_dir=None if cache_dir is None else str(cache_dir),
                            code_digest=None if cache_dir is None else hta_code_digest())
    workers = min(len(ranks), workers or os.cpu_count() or 1)
    collected: list[RankHta] = []
    if workers <= 1 or len(ranks) < 2:
        outcomes = map(one, paths, ranks, names)
        return _collect(outcomes, len(ranks), progress)
    _import_joins()
    with ProcessPoolExecutor(max_workers=workers, mp_context=_hta_worker_context()) as pool:
        collected = _collect(pool.map(one, paths, ranks, names, chunksize=1), len(ranks), progress)
    return collected


def _import_joins() -> None:
    """Import what joining the ranks' views needs here (HTA's straggler view, pandas: a few tenths of a
    second) while the workers' server still imports HTA itself (start_hta_workers), not after the workers
    are done: starting workers waits for that server."""
    import hta.analyzers.straggler  # noqa: F401
    import hta.trace_analysis  # noqa: F401


_HTA_WORKER_MODULES = ["hta.trace_analysis", "hta.common.trace", "fleetscope.analysis.per_rank.hta_cache",
                       "fleetscope.analysis.per_rank.hta_rank"]


def _hta_worker_context() -> multiprocessing.context.BaseContext:
    """Workers forked from a server that imported HTA once, not from this process: by now it holds every
    rank's result (hundreds of MB at 1,024 ranks), which forked workers would carry as their own."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_HTA_WORKER_MODULES)
    return context


def start_hta_workers() -> None:
    """Start the server HTA's workers fork from now, so that it imports HTA (a few tenths of a second)
    while the traces are still being read, not after; run_hta works the same without it."""
    _hta_worker_context()
    try:
        multiprocessing.forkserver.ensure_running()
    except (OSError, ValueError):  # no server now: run_hta starts one, or says why HTA could not run
        pass


def _collect(outcomes, total: int, progress: Progress | None) -> list[RankHta]:
    collected = []
    for outcome in outcomes:
        collected.append(outcome)
        if progress is not None:
            progress(len(collected), total)
    return collected


def _joins(per_rank: list[RankHta]) -> dict[str, Callable[[], dict[str, Table]]]:
    """Analysis name -> a function joining the ranks' tables of it as HTA's multi-rank call returns them."""
    def frames(view: str) -> list:
        for result in per_rank:
            if view in result.errors:
                raise _RankError(result.errors[view])
        return [result.frames[view] for result in per_rank]

    return {
        "temporal_breakdown": lambda: {"temporal_breakdown": _rows(_concat(frames("temporal_breakdown")))},
        "idle_time_breakdown": lambda: _joined_idle(frames("idle_time_breakdown")),
        "comm_comp_overlap": lambda: {"comm_comp_overlap": _rows(_concat(frames("comm_comp_overlap")))},
        "kernel_breakdown": lambda: _joined_kernels(frames("kernel_breakdown")),
        "cuda_launch_stats": lambda: {"cuda_launch_stats": [
            _launch_row(r.rank, f) for r, f in zip(per_rank, frames("cuda_launch_stats"))]},
        "potential_stragglers": lambda: {"potential_stragglers": _joined_stragglers(per_rank)},
    }


def _concat(frames: list):
    import pandas as pd

    return pd.concat(frames)


def _joined_idle(parts: list) -> dict[str, Table]:
    tables = {"idle_time_breakdown": _rows(_concat([idle for idle, _ in parts]))}
    if all(intervals is not None for _, intervals in parts):
        tables["idle_interval_stats"] = _rows(_concat([intervals for _, intervals in parts]))
    return tables


def _joined_kernels(parts: list) -> dict[str, Table]:
    """HTA's get_gpu_kernel_breakdown over several ranks: per-type time summed over ranks, then its
    share; per-kernel rows of every rank sorted by type, name and rank."""
    by_type = _concat([types[["kernel_type", "sum"]] for types, _ in parts])
    by_type = by_type.groupby(by=["kernel_type"])["sum"].agg(["sum"]).reset_index()
    by_type = by_type.sort_values(by=["sum"], ignore_index=True, ascending=False)
    by_type["percentage"] = (by_type["sum"] / by_type["sum"].sum()) * 100
    by_type = by_type.round({"percentage": 1})
    kernels = _concat([kernels for _, kernels in parts])
    kernels = kernels.sort_values(by=["kernel_type", "name", "rank"], ignore_index=True)
    return {"kernel_type_breakdown": _rows(by_type), "kernel_breakdown": _rows(kernels)}


def _joined_stragglers(per_rank: list[RankHta]) -> Table:
    """HTA's straggler view over the rows the ranks sent, each moved onto HTA's common time base."""
    base = min(result.min_ts for result in per_rank)
    frames, symbols = {}, {}
    for result in per_rank:
        rows = result.straggler_rows.copy()
        rows["ts"] = rows["ts"] + (result.min_ts - base)
        ids = [symbols.setdefault(name, len(symbols)) for name in rows["name"].tolist()]
        rows["name"] = ids
        frames[result.rank] = rows
    return _potential_stragglers(analysis_of(trace_of(frames, list(symbols))))


def _load(trace_files: dict[int, Path]):
    from hta.trace_analysis import TraceAnalysis  # heavy import, only when HTA runs

    logging.getLogger("hta").setLevel(logging.ERROR)
    files = {rank: str(Path(path).absolute()) for rank, path in trace_files.items()}
    directory = str(Path(next(iter(files.values()))).parent)
    return quietly(lambda: TraceAnalysis(trace_files=files, trace_dir=directory,
                                         include_last_profiler_step=True))


def _analyses(ranks: list[int]) -> dict[str, Callable[[Any], dict[str, Table]]]:
    """Analysis name -> function of a TraceAnalysis returning named tables."""
    return {
        "temporal_breakdown": lambda a: {"temporal_breakdown": _rows(a.get_temporal_breakdown(visualize=False))},
        "idle_time_breakdown": lambda a: _idle_tables(a, ranks),
        "comm_comp_overlap": lambda a: {"comm_comp_overlap": _rows(a.get_comm_comp_overlap(visualize=False))},
        "kernel_breakdown": _kernel_tables,
        "cuda_launch_stats": lambda a: {"cuda_launch_stats": _launch_stats(a, ranks)},
        "potential_stragglers": lambda a: {"potential_stragglers": _potential_stragglers(a)},
    }


def _launch_stats(analysis, ranks: list[int]) -> Table:
    """HTA's per-launch table summarized per rank (it has one row per kernel launch)."""
    per_rank = analysis.get_cuda_kernel_launch_stats(
        ranks=ranks, runtime_cutoff=LAUNCH_RUNTIME_CUTOFF_US, launch_delay_cutoff=LAUNCH_DELAY_CUTOFF_US,
        visualize=False)
    return [_launch_row(rank, frame) for rank, frame in sorted(per_rank.items())]


def _launch_row(rank: int, frame) -> dict[str, Any]:
    return {
        "rank": int(rank), "launches": len(frame),
        "cpu_duration_mean(us)": _scalar(frame["cpu_duration"].mean()),
        "gpu_duration_mean(us)": _scalar(frame["gpu_duration"].mean()),
        "launch_delay_mean(us)": _scalar(frame["launch_delay"].mean()),
        "launch_delay_p95(us)": _scalar(frame["launch_delay"].quantile(0.95)),
        "launch_delay_max(us)": _scalar(frame["launch_delay"].max()),
        f"runtime_over_{LAUNCH_RUNTIME_CUTOFF_US}us": int((frame["cpu_duration"] > LAUNCH_RUNTIME_CUTOFF_US).sum()),
        f"delay_over_{LAUNCH_DELAY_CUTOFF_US}us": int((frame["launch_delay"] > LAUNCH_DELAY_CUTOFF_US).sum()),
        "gpu_shorter_than_cpu": int((frame["gpu_duration"] < frame["cpu_duration"]).sum()),
    }


def _potential_stragglers(analysis) -> Table:
    """HTA's own straggler view, with current NCCL kernel names recognised (see _ModernNcclSymbols)."""
    from hta.analyzers.straggler import find_stragglers_with_late_start_comm_kernels

    def late_start(df, symbol_table, n_stragglers=2, visualize=False):
        return find_stragglers_with_late_start_comm_kernels(df, _ModernNcclSymbols(symbol_table), n_stragglers,
                                                            visualize)

    ranks = analysis.get_potential_stragglers(num_candidates=1, straggler_identification_impl=late_start)
    return [{"rank": int(rank)} for rank in ranks]


class _ModernNcclSymbols:
    """HTA's symbol table seen with `ncclDevKernel_*` names as `ncclKernel_*`: HTA 0.5.0's straggler view
    only looks for the old prefix (upstream issue #360). Symbol ids are unchanged."""

    def __init__(self, table) -> None:
        self._names = [_old_nccl_name(s) for s in table.get_sym_table()]
        self._ids: dict[str, int] = {}
        for index, name in enumerate(self._names):
            self._ids.setdefault(name, index)

    def get_sym_table(self) -> list[str]:
        return self._names

    def get_sym_id_map(self) -> dict[str, int]:
        return self._ids


def _old_nccl_name(name: str) -> str:
    return "ncclKernel_" + name[len("ncclDevKernel_"):] if name.startswith("ncclDevKernel_") else name


def _idle_tables(analysis, ranks: list[int]) -> dict[str, Table]:
    idle, intervals = analysis.get_idle_time_breakdown(ranks=ranks, visualize=False, show_idle_interval_stats=True)
    tables = {"idle_time_breakdown": _rows(idle)}
    if intervals is not None:
        tables["idle_interval_stats"] = _rows(intervals)
    return tables


def _kernel_tables(analysis) -> dict[str, Table]:
    by_type, kernels = analysis.get_gpu_kernel_breakdown(visualize=False)
    return {"kernel_type_breakdown": _rows(by_type), "kernel_breakdown": _rows(kernels)}


def _rows(frame) -> Table:
    """DataFrame -> list of dicts with JSON-safe scalars (NaN/inf become None)."""
    frame = frame.reset_index(drop=True)
    return [{str(k): _scalar(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def _scalar(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
