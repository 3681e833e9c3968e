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


def skipped(reason: str) -> HtaViews:
    return HtaViews(status=STATUS_SKIPPED, reason=reason)


def run_hta(trace_files: dict[int, Path]) -> HtaViews:
    """Load the window's traces into HTA and run each analysis; never raises for HTA's own failures."""
    if not trace_files:
        return skipped("no readable trace")
    try:
        analysis = _load(trace_files)
    except Exception as error:  # noqa: BLE001 - HTA raises anything from asserts to KeyErrors
        return HtaViews(status=STATUS_FAILED, reason=f"HTA could not load the traces: {_one_line(error)}")
    ranks = sorted(trace_files)
    tables: dict[str, Table] = {}
    errors: dict[str, str] = {}
    for name, run in _analyses(ranks).items():
        try:
            tables.update(_quietly(lambda: run(analysis)))
        except Exception as error:  # noqa: BLE001
            errors[name] = _one_line(error)
    if not tables:
        return HtaViews(status=STATUS_FAILED, reason="every HTA analysis failed", errors=errors)
    status = STATUS_PARTIAL if errors else STATUS_OK
    reason = f"{len(errors)} HTA analyses failed" if errors else None
    return HtaViews(status=status, reason=reason, tables=tables, errors=errors)


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
    }


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
