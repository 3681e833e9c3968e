"""One rank's HTA views as plain rows (RankViews), what a worker process sends back.

Two engines give the same RankViews: `native` (the default: hta_native.py's frame and
hta_native_views.py's numpy views; no pandas, no HTA) and `hta` (stock HTA's analyzers through
hta_rank.py: the oracle behind `--hta-oracle`, and the fallback for a file the native frame does not
reproduce, when HTA is installed). Results are lists of dicts of JSON scalars, so the parent joining the
ranks needs no pandas either (cross_rank/hta_views.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetscope.analysis.per_rank import hta_native_views as views
from fleetscope.analysis.per_rank.hta_native import NotComputable, decode_rank_frame
from fleetscope.traces.kineto import decompress, read_raw

ENGINE_NATIVE = "native"
ENGINE_HTA = "hta"

Table = list[dict[str, Any]]

VIEW_PARTS = {
    "temporal_breakdown": ("temporal_breakdown",),
    "idle_time_breakdown": ("idle_time_breakdown", "idle_interval_stats"),
    "comm_comp_overlap": ("comm_comp_overlap",),
    "kernel_breakdown": ("kernel_type_time", "kernel_breakdown"),
    "cuda_launch_stats": ("cuda_launch_stats",),
}
"""Per-rank view -> the tables it leaves in RankViews.tables (kernel_type_time: before the cross-rank sum)."""


@dataclass(frozen=True, kw_only=True)
class RankViews:
    """HTA's views of one rank as plain data."""

    rank: int
    tables: dict[str, Table] = field(default_factory=dict)
    """Table name (VIEW_PARTS) -> rows, HTA's columns."""
    errors: dict[str, str] = field(default_factory=dict)
    """View name -> why it could not be computed on this rank (HTA's error, or why not natively)."""
    straggler_rows: dict[str, list] | None = None
    """Columns of the rows HTA's cross-rank straggler view reads (hta_native_views.straggler_rows)."""
    min_ts: int | float = 0
    """The rank's earliest `ts` (HTA aligns every rank by the global minimum of these)."""
    engine: str = ENGINE_NATIVE
    note: str = ""
    """Why this rank's views came from another engine than asked, if they did."""


def hta_installed() -> bool:
    return importlib.util.find_spec("hta") is not None


def rank_views(path: str | Path, rank: int, step_names: tuple[str, ...] = (), *, raw: bytes | None = None,
               engine: str = ENGINE_NATIVE) -> RankViews:
    """HTA's per-rank views of the trace at `path` as rank `rank` by `engine`. `step_names`: every
    ProfilerStep name of the ranks HTA runs on (HTA's step filter counts them); `raw`: the file's bytes
    when the caller has read them. Never raises for a bad file: what cannot be computed is in `errors`."""
    raw = read_raw(Path(path)) if raw is None else raw
    if engine == ENGINE_HTA:
        return oracle_rank_views(path, rank, step_names, raw=raw)
    try:
        frame = decode_rank_frame(decompress(raw, Path(path)), step_names)
    except NotComputable as why:
        if hta_installed():
            return _with_note(oracle_rank_views(path, rank, step_names, raw=raw), f"HTA's loader: {why}")
        return RankViews(rank=rank, errors={view: f"not computable: {why}" for view in VIEW_PARTS}, note=str(why))
    return native_views(frame, rank)


def native_views(frame, rank: int) -> RankViews:
    tables: dict[str, Table] = {}
    errors: dict[str, str] = {}
    computations = {
        "temporal_breakdown": lambda: (views.temporal_breakdown(frame, rank),),
        "idle_time_breakdown": lambda: views.idle_time_breakdown(frame, rank),
        "comm_comp_overlap": lambda: (views.comm_comp_overlap(frame, rank),),
        "kernel_breakdown": lambda: views.kernel_breakdown(frame, rank),
        "cuda_launch_stats": lambda: (views.cuda_launch_stats(frame, rank),),
    }
    for view, compute in computations.items():
        try:
            tables.update(zip(VIEW_PARTS[view], compute()))
        except views.ViewError as error:
            errors[view] = str(error)
    return RankViews(rank=rank, tables=tables, errors=errors, straggler_rows=views.straggler_rows(frame),
                     min_ts=frame.min_ts, engine=ENGINE_NATIVE)


def _with_note(result: RankViews, note: str) -> RankViews:
    return RankViews(rank=result.rank, tables=result.tables, errors=result.errors,
                     straggler_rows=result.straggler_rows, min_ts=result.min_ts, engine=result.engine, note=note)


def oracle_rank_views(path: str | Path, rank: int, step_names: tuple[str, ...] = (), *,
                      raw: bytes | None = None) -> RankViews:
    """Stock HTA's analyzers on this rank (hta_rank.py), converted to plain rows; never raises."""
    from fleetscope.analysis.per_rank.hta_rank import one_line, rank_hta

    try:
        result = rank_hta(path, rank, step_names, raw=raw)
    except Exception as error:  # noqa: BLE001 - HTA raises anything from asserts to KeyErrors
        reason = f"HTA could not load the trace: {one_line(error)}"
        return RankViews(rank=rank, errors={view: reason for view in VIEW_PARTS}, engine=ENGINE_HTA)
    tables: dict[str, Table] = {}
    for view, frames in result.frames.items():
        if view == "cuda_launch_stats":
            tables[view] = _launch_table(rank, frames)
            continue
        parts = frames if isinstance(frames, tuple) else (frames,)
        for name, part in zip(VIEW_PARTS[view], parts):
            if part is not None:
                tables[name] = frame_rows(part)
    return RankViews(rank=rank, tables=tables, errors=dict(result.errors),
                     straggler_rows=_plain_straggler_rows(result.straggler_rows),
                     min_ts=result.min_ts.item() if hasattr(result.min_ts, "item") else result.min_ts,
                     engine=ENGINE_HTA)


def _launch_table(rank: int, frame) -> Table:
    def column(name):
        return frame[name].to_numpy()

    return [views.launch_row(rank, column("cpu_duration"), column("gpu_duration"), column("launch_delay"))]


def frame_rows(frame) -> Table:
    """DataFrame -> list of dicts with JSON-safe scalars (NaN/inf become None)."""
    frame = frame.reset_index(drop=True)
    return [{str(k): views.python_scalar(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def _plain_straggler_rows(rows) -> dict[str, list] | None:
    if rows is None:
        return None
    return {"index": rows.index.tolist(), "name": rows["name"].tolist(), "ts": rows["ts"].tolist(),
            "dur": rows["dur"].tolist(), "stream": rows["stream"].tolist(), "iteration": rows["iteration"].tolist(),
            "ts_dtype": str(rows["ts"].dtype), "dur_dtype": str(rows["dur"].dtype),
            "iteration_dtype": str(rows["iteration"].dtype)}
