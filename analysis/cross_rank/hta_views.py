"""HTA's (Holistic Trace Analysis) views of a window's GPU traces, as plain JSON-ready tables.

HTA only understands GPU traces; CPU-only traces get one line saying why it was skipped. Each HTA analysis
runs on its own, so one that breaks (HTA 0.5.0 has pandas-3 problems) costs that table, not the others.

`run_hta` (the default) needs neither HTA nor pandas for five of the six views: each rank's views are
computed natively in a worker process (per_rank/hta_rank_views.py, engine `native`) and sent back as plain
rows; here the ranks' tables are joined the way HTA joins them (rank order; kernel totals summed over
ranks). HTA's cross-rank straggler view runs HTA's own code on the few rows each rank sent, where HTA is
installed. `oracle=True` also runs stock HTA's analyzers on every rank (engine `hta`) and records, per
table, the largest difference (HtaViews.oracle). `run_stock_hta` is HTA's own load of the same files, with
the same tables: the reference both are tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetscope.analysis.cross_rank.hta_stragglers import (
    StragglerViewError,
    potential_stragglers,
)
from fleetscope.analysis.per_rank.hta_cache import cached_rank_views, hta_code_digest, views_if_cached
from fleetscope.analysis.per_rank.hta_native_views import (
    LAUNCH_DELAY_CUTOFF_US,
    LAUNCH_RUNTIME_CUTOFF_US,
    launch_row,
    pandas_round,
    python_scalar,
    sort_order,
)
from fleetscope.analysis.per_rank.hta_rank import one_line, quietly
from fleetscope.analysis.per_rank.parse import offset_progress
from fleetscope.analysis.per_rank.hta_rank_views import (
    ENGINE_HTA,
    ENGINE_NATIVE,
    RankViews,
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
    oracle: dict[str, dict[str, Any]] = field(default_factory=dict)
    """`--hta-oracle` only: table name -> {max_abs_diff, within_tolerance, tolerance} against stock HTA's
    analyzers on the same ranks; {error, within_tolerance} for a table on one side only (false) or an analysis
    that failed (true when both sides failed with the same kind of error)."""


def skipped(reason: str) -> HtaViews:
    return HtaViews(status=STATUS_SKIPPED, reason=reason)


def run_hta(trace_files: dict[int, Path], *, has_comm_kernels: bool = True, step_names: tuple[str, ...] = (),
            workers: int | None = None, progress: Progress | None = None,
            cache_dir: Path | None = None, oracle: bool = False, engine: str = ENGINE_NATIVE) -> HtaViews:
    """HTA's views of the window's traces, computed per rank in worker processes; never raises for a bad
    trace or HTA's own failures. `has_comm_kernels`: whether the traces hold NCCL kernels (HTA's straggler
    view needs them); `step_names`: the ProfilerStep names of these ranks (HTA's step filter counts them over
    all ranks); `progress(done, total)` as ranks finish; `cache_dir`: the parsed-trace cache's directory
    (open_cache), where each rank's views are kept (per_rank/hta_cache.py), or None for no cache;
    `oracle`: also run stock HTA's analyzers and record the differences (HtaViews.oracle; needs HTA);
    `engine`: native (default) or hta (HTA's analyzers per rank)."""
    if not trace_files:
        return skipped("no readable trace")
    ranks = sorted(trace_files)
    try:
        per_rank = _per_rank(trace_files, step_names, workers, progress, cache_dir, engine)
    except Exception as error:  # noqa: BLE001 - a worker that died, or HTA raising anything
        return HtaViews(status=STATUS_FAILED, reason=f"HTA's views could not be computed: {one_line(error)}")
    joins = _joins(per_rank, engine)
    views = _views(ranks, has_comm_kernels, lambda name, run: joins[name](), joins)
    if oracle:
        stock = run_hta(trace_files, has_comm_kernels=has_comm_kernels, step_names=step_names, workers=workers,
                        cache_dir=cache_dir, engine=ENGINE_HTA)
        views = dataclasses.replace(views, oracle=compare_tables(views, stock))
    return views


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
    reason = _straggler_view_not_applicable(len(ranks), has_comm_kernels)
    if reason:
        del analyses["potential_stragglers"]
        not_applicable["potential_stragglers"] = reason
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


def _straggler_view_not_applicable(ranks: int, has_comm_kernels: bool) -> str | None:
    if ranks < 2:
        return "HTA's straggler view needs at least two ranks"
    if not has_comm_kernels:
        return "HTA's straggler view needs NCCL kernels (these ranks communicate on the host)"
    return None


class _RankError(Exception):
    """A view failed on one rank (its message is HTA's error there): the view fails, as in HTA."""


def _per_rank(trace_files: dict[int, Path], step_names: tuple[str, ...], workers: int | None,
              progress: Progress | None, cache_dir: Path | None = None,
              engine: str = ENGINE_NATIVE) -> list[RankViews]:
    """rank_views (through the cache) for every rank, one worker process per rank when there are several;
    in rank order."""
    code_digest = None if cache_dir is None else hta_code_digest()
    found = _found_in_cache(trace_files, step_names, cache_dir, code_digest, engine)
    if found and progress is not None:
        progress(len(found), len(trace_files))
    ranks = sorted(set(trace_files) - set(found))
    paths = [str(Path(trace_files[r]).absolute()) for r in ranks]
    names = [tuple(step_names)] * len(ranks)
    one = functools.partial(cached_rank_views, cache_dir=None if cache_dir is None else str(cache_dir),
                            code_digest=code_digest, engine=engine)
    workers = min(len(ranks), workers or os.cpu_count() or 1)
    reported = offset_progress(progress, len(found), len(trace_files))
    if workers <= 1 or len(ranks) < 2:
        computed = _collect(map(one, paths, ranks, names), len(ranks), reported)
    else:
        _import_joins(engine)
        with ProcessPoolExecutor(max_workers=workers, mp_context=_worker_context(engine)) as pool:
            computed = _collect(pool.map(one, paths, ranks, names, chunksize=1), len(ranks), reported)
    return sorted([*found.values(), *computed], key=lambda views: views.rank)


def _found_in_cache(trace_files: dict[int, Path], step_names: tuple[str, ...], cache_dir: Path | None,
                    code_digest: str | None, engine: str) -> dict[int, RankViews]:
    """The ranks whose views the cache holds (the parse stores them when every rank gets HTA's views): read
    here, as starting workers (a server importing their modules, one fork each) costs far more than a hit."""
    if cache_dir is None or engine != ENGINE_NATIVE:
        return {}
    found = {}
    for rank in sorted(trace_files):
        views = views_if_cached(trace_files[rank], rank, tuple(step_names), cache_dir, code_digest, engine)
        if views is not None:
            found[rank] = views
    return found


def _import_joins(engine: str) -> None:
    """Import what HTA's own straggler view needs here (HTA, pandas: about a second) while the oracle's
    workers compute, not after them; the native view needs neither."""
    if engine == ENGINE_HTA:
        import hta.analyzers.straggler  # noqa: F401
        import hta.trace_analysis  # noqa: F401


_NATIVE_WORKER_MODULES = ["fleetscope.analysis.per_rank.hta_cache", "fleetscope.analysis.per_rank.hta_rank_views"]
_HTA_WORKER_MODULES = ["hta.trace_analysis", "hta.common.trace", *_NATIVE_WORKER_MODULES,
                       "fleetscope.analysis.per_rank.hta_rank"]


def _worker_context(engine: str = ENGINE_NATIVE) -> multiprocessing.context.BaseContext:
    """Workers forked from a server that imported their modules once, not from this process: by now it
    holds every rank's result (hundreds of MB at 1,024 ranks), which forked workers would carry as their
    own. Native workers import numpy and msgspec only; HTA's (the oracle) import HTA."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_HTA_WORKER_MODULES if engine == ENGINE_HTA else _NATIVE_WORKER_MODULES)
    return context


def start_hta_workers() -> None:
    """Start the server the workers fork from now, so that it imports their modules while the traces are
    still being read, not after; run_hta works the same without it."""
    _worker_context()
    try:
        multiprocessing.forkserver.ensure_running()
    except (OSError, ValueError):  # no server now: run_hta starts one, or says why it could not run
        pass


def _collect(outcomes, total: int, progress: Progress | None) -> list[RankViews]:
    collected = []
    for outcome in outcomes:
        collected.append(outcome)
        if progress is not None:
            progress(len(collected), total)
    return collected


def _joins(per_rank: list[RankViews], engine: str = ENGINE_NATIVE) -> dict[str, Callable[[], dict[str, Table]]]:
    """Analysis name -> a function joining the ranks' tables of it as HTA's multi-rank call returns them
    (the straggler view by HTA's own code for the `hta` engine)."""
    def tables(view: str, name: str) -> Table:
        for result in per_rank:
            if view in result.errors:
                raise _RankError(result.errors[view])
        return [row for result in per_rank for row in result.tables[name]]

    return {
        "temporal_breakdown": lambda: {"temporal_breakdown": tables("temporal_breakdown", "temporal_breakdown")},
        "idle_time_breakdown": lambda: {"idle_time_breakdown": tables("idle_time_breakdown", "idle_time_breakdown"),
                                        "idle_interval_stats": tables("idle_time_breakdown", "idle_interval_stats")},
        "comm_comp_overlap": lambda: {"comm_comp_overlap": tables("comm_comp_overlap", "comm_comp_overlap")},
        "kernel_breakdown": lambda: _joined_kernels(tables("kernel_breakdown", "kernel_type_time"),
                                                    tables("kernel_breakdown", "kernel_breakdown")),
        "cuda_launch_stats": lambda: {"cuda_launch_stats": tables("cuda_launch_stats", "cuda_launch_stats")},
        "potential_stragglers": lambda: {"potential_stragglers": (
            _joined_stragglers(per_rank) if engine == ENGINE_HTA else _native_stragglers(per_rank))},
    }


def _native_stragglers(per_rank: list[RankViews]) -> Table:
    if any(result.straggler_rows is None for result in per_rank):
        raise _RankError("a rank's trace could not be read")
    try:
        return potential_stragglers([(r.rank, r.straggler_rows, r.min_ts) for r in per_rank])
    except StragglerViewError as error:  # HTA raises a ValueError with the same words
        raise _RankError(f"ValueError: {error}") from None


def _joined_kernels(type_times: Table, kernels: Table) -> dict[str, Table]:
    """HTA's get_gpu_kernel_breakdown over several ranks: time per kernel type (and overlap of types)
    summed over ranks, largest first, with its share; per-kernel rows of every rank sorted by type, name
    and rank."""
    import numpy as np

    totals: dict[str, Any] = {}
    for row in type_times:
        totals[row["kernel_type"]] = totals.get(row["kernel_type"], 0) + row["sum"]
    labels = sorted(totals)  # groupby's order, which the sort below starts from
    sums = np.asarray([totals[label] for label in labels])
    order = sort_order(sums, ascending=False) if labels else []
    grand = sums.sum() if labels else 0
    by_type = [{"kernel_type": labels[i], "sum": python_scalar(sums[i]),
                "percentage": python_scalar(pandas_round(np.float64(sums[i]) / grand * 100, 1))}
               for i in order]
    kernels = sorted(kernels, key=lambda row: (row["kernel_type"], row["name"], row["rank"]))
    return {"kernel_type_breakdown": by_type, "kernel_breakdown": kernels}


def _joined_stragglers(per_rank: list[RankViews]) -> Table:
    """HTA's own straggler view over the rows the ranks sent, each moved onto HTA's common time base."""
    import pandas as pd
    from fleetscope.analysis.per_rank.hta_rank import analysis_of, trace_of

    if any(result.straggler_rows is None for result in per_rank):
        raise _RankError("a rank's trace could not be read")
    base = min(result.min_ts for result in per_rank)
    frames, symbols = {}, {}
    for result in per_rank:
        rows = result.straggler_rows
        ids = [symbols.setdefault(name, len(symbols)) for name in rows["name"]]
        frame = pd.DataFrame({
            "name": pd.Series(ids, dtype="int64"),
            "ts": pd.Series(rows["ts"], dtype=rows["ts_dtype"]) + (result.min_ts - base),
            "dur": pd.Series(rows["dur"], dtype=rows["dur_dtype"]),
            "stream": pd.Series(rows["stream"], dtype="int64"),
            "iteration": pd.Series(rows["iteration"], dtype=rows["iteration_dtype"]),
        })
        frame.index = pd.Index(rows["index"], dtype="int64")
        frames[result.rank] = frame
    return _potential_stragglers(analysis_of(trace_of(frames, list(symbols))))


def compare_tables(views: HtaViews, oracle: HtaViews, tolerance: float = 1e-9) -> dict[str, dict[str, Any]]:
    """Per table: the largest absolute difference between `views` and `oracle` (rows matched in order
    after sorting both by their text columns and ranks), and whether it is within `tolerance`."""
    compared: dict[str, dict[str, Any]] = {}
    for name in sorted(set(views.tables) | set(oracle.tables)):
        mine, theirs = views.tables.get(name), oracle.tables.get(name)
        if mine is None or theirs is None:
            side = "native" if mine is None else "HTA"
            compared[name] = {"error": f"the table is missing from the {side} result", "within_tolerance": False,
                              **({"oracle_failed": True} if theirs is None else {})}
            continue
        compared[name] = _table_difference(mine, theirs, tolerance)
    for name in sorted(set(views.errors) | set(oracle.errors)):
        mine, theirs = views.errors.get(name, "ok"), oracle.errors.get(name, "ok")
        same = mine.split(":")[0] == theirs.split(":")[0]  # the same kind of error on both sides
        compared[name] = {"error": f"native: {mine}; HTA: {theirs}", "within_tolerance": same,
                          **({"oracle_failed": True} if mine == "ok" else {})}
    return compared


def _table_difference(mine: Table, theirs: Table, tolerance: float) -> dict[str, Any]:
    def key(row):
        return sorted((k, v) for k, v in row.items() if isinstance(v, str) or k in ("rank", "stream"))

    def numbers(row):
        return sorted((k, round(v, 6)) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool))

    if len(mine) != len(theirs):
        return {"error": f"{len(mine)} rows natively, {len(theirs)} from HTA", "within_tolerance": False}
    largest = 0.0
    for a, b in zip(sorted(mine, key=lambda r: (repr(key(r)), repr(numbers(r)))),
                    sorted(theirs, key=lambda r: (repr(key(r)), repr(numbers(r))))):
        if set(a) != set(b) or key(a) != key(b):
            return {"error": "rows differ in their names or columns", "within_tolerance": False}
        for column, value in a.items():
            other = b[column]
            if (value is None) != (other is None):
                return {"error": f"{column}: a value on one side only", "within_tolerance": False}
            if isinstance(value, (int, float)) and not isinstance(value, bool) and other is not None:
                largest = max(largest, abs(float(value) - float(other)))
    return {"max_abs_diff": largest, "within_tolerance": largest <= tolerance, "tolerance": tolerance}


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
    return [launch_row(rank, frame["cpu_duration"].to_numpy(), frame["gpu_duration"].to_numpy(),
                       frame["launch_delay"].to_numpy()) for rank, frame in sorted(per_rank.items())]


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
    return [{str(k): python_scalar(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]
