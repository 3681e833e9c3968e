"""HTA's (Holistic Trace Analysis) views of a window's GPU traces, as plain JSON-ready tables.

HTA only understands GPU traces; CPU-only traces get one line saying why it was skipped. Each HTA analysis
runs on its own, so one that breaks (HTA 0.5.0 has pandas-3 problems) costs that table, not the others.
HTA is given our rank numbering through an explicit rank -> file map.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

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


def run_hta(trace_files: dict[int, Path], *, has_comm_kernels: bool = True) -> HtaViews:
    """Load the window's traces into HTA and run each analysis; never raises for HTA's own failures.
    `has_comm_kernels`: whether the traces hold NCCL kernels (HTA's straggler view needs them)."""
    if not trace_files:
        return skipped("no readable trace")
    try:
        analysis = _load(trace_files)
    except Exception as error:  # noqa: BLE001 - HTA raises anything from asserts to KeyErrors
        return HtaViews(status=STATUS_FAILED, reason=f"HTA could not load the traces: {_one_line(error)}")
    ranks = sorted(trace_files)
    tables: dict[str, Table] = {}
    errors: dict[str, str] = {}
    analyses = _analyses(ranks)
    not_applicable = {}
    if len(ranks) < 2 or not has_comm_kernels:
        del analyses["potential_stragglers"]
        not_applicable["potential_stragglers"] = (
            "HTA's straggler view needs at least two ranks" if len(ranks) < 2
            else "HTA's straggler view needs NCCL kernels (these ranks communicate on the host)")
    for name, run in analyses.items():
        try:
            tables.update(_quietly(lambda: run(analysis)))
        except Exception as error:  # noqa: BLE001
            errors[name] = _one_line(error)
    if not tables:
        return HtaViews(status=STATUS_FAILED, reason="every HTA analysis failed", errors=errors,
                        not_applicable=not_applicable)
    status = STATUS_PARTIAL if errors else STATUS_OK
    reason = f"{len(errors)} HTA analyses failed" if errors else None
    return HtaViews(status=status, reason=reason, tables=tables, errors=errors, not_applicable=not_applicable)


def _load(trace_files: dict[int, Path]):
    from hta.trace_analysis import TraceAnalysis  # heavy import, only when HTA runs

    logging.getLogger("hta").setLevel(logging.ERROR)
    files = {rank: str(Path(path).absolute()) for rank, path in trace_files.items()}
    directory = str(Path(next(iter(files.values()))).parent)
    return _quietly(lambda: TraceAnalysis(trace_files=files, trace_dir=directory,
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


LAUNCH_RUNTIME_CUTOFF_US = 50
LAUNCH_DELAY_CUTOFF_US = 100


def _launch_stats(analysis, ranks: list[int]) -> Table:
    """HTA's per-launch table summarized per rank (it has one row per kernel launch)."""
    per_rank = analysis.get_cuda_kernel_launch_stats(
        ranks=ranks, runtime_cutoff=LAUNCH_RUNTIME_CUTOFF_US, launch_delay_cutoff=LAUNCH_DELAY_CUTOFF_US,
        visualize=False)
    rows = []
    for rank, frame in sorted(per_rank.items()):
        rows.append({
            "rank": int(rank), "launches": int(len(frame)),
            "cpu_duration_mean(us)": _scalar(frame["cpu_duration"].mean()),
            "gpu_duration_mean(us)": _scalar(frame["gpu_duration"].mean()),
            "launch_delay_mean(us)": _scalar(frame["launch_delay"].mean()),
            "launch_delay_p95(us)": _scalar(frame["launch_delay"].quantile(0.95)),
            "launch_delay_max(us)": _scalar(frame["launch_delay"].max()),
            f"runtime_over_{LAUNCH_RUNTIME_CUTOFF_US}us": int((frame["cpu_duration"] > LAUNCH_RUNTIME_CUTOFF_US).sum()),
            f"delay_over_{LAUNCH_DELAY_CUTOFF_US}us": int((frame["launch_delay"] > LAUNCH_DELAY_CUTOFF_US).sum()),
            "gpu_shorter_than_cpu": int((frame["gpu_duration"] < frame["cpu_duration"]).sum()),
        })
    return rows


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


def _quietly(call: Callable[[], Any]) -> Any:
    """Run `call` with HTA's prints and progress output kept off the user's terminal."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call()


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
