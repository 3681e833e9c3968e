"""HTA's per-rank views of one trace by stock HTA's analyzers, computed where the trace is read (a worker
process): the `hta` engine of hta_rank_views.py (the oracle behind --hta-oracle, and the fallback for a
file the native frame does not reproduce); the default engine is native (hta_native*.py).

The rank's frame (hta_frame.py, or HTA's own loader for a file that decoder cannot take) is loaded into
an `hta.common.trace.Trace` holding just this rank, aligned and filtered by HTA's own code, and HTA's
analyzers run on it: idle time and launch statistics as HTA's own calls; temporal breakdown,
communication/computation overlap and kernel breakdown as HTA's steps without its row-by-row kernel
typing (hta_kernel_views.py). Only their small tables travel back, plus the few rows HTA's cross-rank straggler
view reads (cross_rank/hta_views.py joins the ranks).
"""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetscope.analysis.per_rank.hta_frame import add_iterations, decode_hta_frame
from fleetscope.analysis.per_rank.hta_kernel_views import (
    comm_comp_overlap,
    kernel_breakdown,
    temporal_breakdown,
)
from fleetscope.traces.kineto import decompress, read_raw

LAUNCH_RUNTIME_CUTOFF_US = 50
LAUNCH_DELAY_CUTOFF_US = 100
STRAGGLER_COLUMNS = ("name", "ts", "dur", "stream", "iteration")

Table = list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class RankHta:
    """HTA's views of one rank (frames as pandas objects: they travel between processes by pickle)."""

    rank: int
    frames: dict[str, Any] = field(default_factory=dict)
    """View name -> this rank's DataFrame of it (kernel views: before the cross-rank totals)."""
    errors: dict[str, str] = field(default_factory=dict)
    straggler_rows: Any = None
    """DataFrame: this rank's ProfilerStep rows, communication kernels inside steps and the rows that
    bound each step, names as strings, `ts` on this rank's own alignment (min_ts)."""
    min_ts: int | float = 0
    """The rank's earliest `ts` (HTA aligns every rank by the global minimum of these)."""
    loader: str = "fleetscope"
    """Which loader built the frame: fleetscope (hta_frame.py) or hta (HTA's own, as a fallback)."""


def rank_hta(path: str | Path, rank: int, step_names: tuple[str, ...] = (), *, raw: bytes | None = None) -> RankHta:
    """HTA's per-rank views of the trace at `path` as rank `rank`. `step_names`: every ProfilerStep name in
    the window's HTA ranks (HTA's step filter depends on how many there are across ranks); `raw`: the
    file's stored bytes when the caller has read them already."""
    trace, loader = quietly(lambda: load_rank_trace(path, rank, step_names, raw=raw))
    analysis = analysis_of(trace)
    frames, errors = {}, {}
    for name, view in _views(rank).items():
        try:
            frames[name] = quietly(lambda view=view: view(analysis))
        except Exception as error:  # noqa: BLE001 - HTA raises anything from asserts to KeyErrors
            errors[name] = one_line(error)
    frame = trace.traces[rank]
    return RankHta(rank=rank, frames=frames, errors=errors, straggler_rows=_straggler_rows(frame, trace),
                   min_ts=trace.min_ts, loader=loader)


def load_rank_trace(path: str | Path, rank: int, step_names: tuple[str, ...] = (), *, raw: bytes | None = None):
    """(hta Trace holding only `rank`, aligned and step-filtered as HTA's load_traces does, loader name)."""
    from hta.common.trace import Trace, transform_correlation_to_index
    from hta.common.trace_symbol_table import TraceSymbolTable

    logging.getLogger("hta").setLevel(logging.ERROR)
    built = decode_hta_frame(decompress(read_raw(Path(path)) if raw is None else raw, Path(path)))
    table = TraceSymbolTable()
    if built is not None:
        frame, meta, loader = built.frame, built.meta, "fleetscope"
        table.add_symbols(built.symbols)
        frame = transform_correlation_to_index(frame, table)
        add_iterations(frame, built.symbols)
        frame["end"] = frame["ts"] + frame["dur"]
    else:
        from hta.common.trace import parse_trace_file

        meta, frame, local = parse_trace_file(str(path))
        table.add_symbols(local.get_sym_table())
        loader = "hta"
    for column in ("cat", "name"):  # HTA's global re-encoding leaves int64 ids
        frame[column] = frame[column].astype("int64")
    table.add_symbols(step_names)
    trace = _trace_shell(Trace, table)
    trace.traces, trace.meta_data, trace.trace_files = {rank: frame}, {rank: meta}, {rank: str(path)}
    trace.align_and_filter_trace(include_last_profiler_step=True)
    aligned = trace.traces[rank].set_index("index", drop=False)
    aligned.index.names = [None]
    trace.traces[rank] = aligned
    trace.is_parsed = True
    return trace, loader


def _trace_shell(trace_class, table):
    """A Trace with no files behind it (its constructor checks files on disk)."""
    from hta.configs.parser_config import ParserConfig

    trace = trace_class.__new__(trace_class)
    trace.trace_path, trace.parser_config, trace.symbol_table = "", ParserConfig.get_default_cfg(), table
    trace.min_ts, trace.is_parsed = 0, False
    return trace


def trace_of(frames: dict[int, Any], symbols: list[str]):
    """A Trace over already aligned per-rank frames (the cross-rank straggler view)."""
    from hta.common.trace import Trace
    from hta.common.trace_symbol_table import TraceSymbolTable

    table = TraceSymbolTable()
    table.add_symbols(symbols)
    trace = _trace_shell(Trace, table)
    trace.traces, trace.meta_data, trace.trace_files = dict(sorted(frames.items())), {}, {}
    trace.is_parsed = True
    return trace


def analysis_of(trace):
    """HTA's TraceAnalysis facade over an already loaded Trace."""
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis.__new__(TraceAnalysis)
    analysis.t = trace
    return analysis


def _views(rank: int) -> dict[str, Callable[[Any], Any]]:
    """View name -> its computation on a one-rank TraceAnalysis: HTA's own calls, and for the three
    kernel-type views HTA's steps with the kernel type looked up per name (hta_kernel_views.py)."""
    def on_frame(view):
        return lambda a: view(a.t.traces[rank], a.t.symbol_table.get_sym_table(), rank)

    return {
        "temporal_breakdown": on_frame(temporal_breakdown),
        "idle_time_breakdown": lambda a: a.get_idle_time_breakdown(
            ranks=[rank], visualize=False, show_idle_interval_stats=True),
        "comm_comp_overlap": on_frame(comm_comp_overlap),
        "kernel_breakdown": on_frame(kernel_breakdown),
        "cuda_launch_stats": lambda a: a.get_cuda_kernel_launch_stats(
            ranks=[rank], runtime_cutoff=LAUNCH_RUNTIME_CUTOFF_US, launch_delay_cutoff=LAUNCH_DELAY_CUTOFF_US,
            visualize=False)[rank],
    }


def _straggler_rows(frame, trace):
    """The rows HTA's straggler view can read from this rank, in frame order (its `groupby().last()`
    depends on it): ProfilerStep rows, device rows of communication kernels inside a step, and per step
    the rows holding its earliest start and latest end (they set HTA's time base and iteration length)."""
    import numpy as np

    symbols = trace.symbol_table.get_sym_table()
    names = frame["name"].to_numpy()
    is_step = np.array([isinstance(s, str) and s.startswith("ProfilerStep") for s in symbols])[names]
    is_comm = np.array([isinstance(s, str) and s.startswith(("ncclKernel", "ncclDevKernel")) for s in symbols])[names]
    iteration = frame["iteration"].to_numpy()
    in_step = iteration >= 0
    keep = is_step | (is_comm & in_step & (frame["stream"].to_numpy() > 0))
    ts = frame["ts"].to_numpy()
    end = ts + frame["dur"].to_numpy()
    for number in np.unique(iteration[in_step]):
        rows = np.flatnonzero(iteration == number)
        keep[rows[np.argmin(ts[rows])]] = True
        keep[rows[np.argmax(end[rows])]] = True
    rows = frame.loc[keep, list(STRAGGLER_COLUMNS)].copy()
    rows["name"] = [symbols[i] for i in rows["name"].to_numpy()]
    return rows


def quietly(call: Callable[[], Any]) -> Any:
    """Run `call` with HTA's prints and progress output kept off the user's terminal, and SIGTERM's default
    action while it runs (default_termination)."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings(), \
            default_termination():
        warnings.simplefilter("ignore")
        return call()


@contextlib.contextmanager
def default_termination():
    """SIGTERM's default action in the main thread for the duration: HTA parses ranks in a forked process pool and
    ends it with SIGTERM (Pool.terminate), and a worker that inherits a Python handler from the program that
    called fleetscope (TorchX's local scheduler installs one, a trainer's stop handler another) can outlive it,
    leaving the load waiting on it for ever."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
