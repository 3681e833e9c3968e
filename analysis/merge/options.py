"""What a merge keeps and what it adds: one typed config, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fleetscope.analysis.merge.focus import FocusConfig


MAX_DEFAULT_WORKERS = 8
"""Each merge worker holds one decoded trace (a few hundred MB for a large one): more than this by default
would trade memory for little, as the parent appends every part to one file."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeOptions:
    ranks: frozenset[int] | None = None
    """Merge only these ranks, in full and without a summary (None: as `focus` and `shard_ranks` say)."""
    focus: FocusConfig | None = FocusConfig()
    """Draw in full only the focus set (focus.py) that fits its size budget, and a summary of every rank
    (summary.py). None: every rank in full and no summary (`--ranks all`)."""
    shard_ranks: int | None = None
    """Every rank in full, this many ranks per file (`<name>.ranks<A>-<B>.perfetto-trace`, the same clock),
    plus a summary file of every rank (`<name>.summary.perfetto-trace`); `focus` is not used."""
    steps: frozenset[int] | None = None
    """Keep only events that overlap these training steps (N of `ProfilerStep#N`); a step lasts from its
    start to the next step's start (its own end for the last one). None: every event."""
    time_window_s: tuple[float, float] | None = None
    """Keep only events that overlap [start, end), in seconds after the first event of the first merged
    rank. None: every event."""
    drop_python_functions: bool = False
    """Leave out `python_function` events (Python stack tracing: many, short, rarely what one looks for)."""
    flows: bool = True
    """Arrows from each CPU launch to its GPU work (CUDA correlation ids) and the trace's own flows."""
    collective_flows: bool = True
    """Arrows joining the same collective instance on every rank, in arrival order: the last arrow
    points at the rank that arrived last."""
    overlays: bool = True
    """A `fleetscope analysis` track per rank (steps, idle gaps by cause, straggler, host-sync and bandwidth
    marks), a `critical path` track where the report has one, and counters (step time, idle %, memory when
    the trace recorded it, the report's per-step evidence)."""
    event_args: bool = False
    """Copy each event's Kineto args into debug annotations (bigger output: about 2x for GPU traces)."""
    min_idle_gap_us: float = 0.0
    """Idle gaps shorter than this are counted in idle % (and a step slice's idle_ms) but not drawn. The
    default draws every gap, so a rank's `idle: <cause>` slices sum to the report's idle_by_cause_us (a
    CPU trace's gaps between ops are mostly a few us: 50 left out about 40% of its idle time)."""
    chrome_json: Path | None = None
    """Also write the merged events as Chrome JSON (gzip when the name ends in .gz) here."""
    workers: int | None = None
    """Processes that merge ranks at once (each holds one rank's trace in memory); None: one per usable
    core, at most MAX_DEFAULT_WORKERS. The output is the same for any number."""

    def __post_init__(self) -> None:
        if self.ranks is not None and any(r < 0 for r in self.ranks):
            raise ValueError(f"ranks must be >= 0, got {sorted(self.ranks)}")
        if self.time_window_s is not None:
            start, end = self.time_window_s
            if not end > start:
                raise ValueError(f"time_window_s must be (start, end) with end > start, got {self.time_window_s}")
        if self.shard_ranks is not None and self.shard_ranks < 1:
            raise ValueError(f"shard_ranks must be >= 1, got {self.shard_ranks}")
        if self.shard_ranks is not None and self.ranks is not None:
            raise ValueError("shard_ranks and ranks cannot be combined")
        if self.shard_ranks is not None and self.chrome_json is not None:
            raise ValueError("shard_ranks and chrome_json cannot be combined (one JSON file per merge)")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.min_idle_gap_us < 0:
            raise ValueError(f"min_idle_gap_us must be >= 0, got {self.min_idle_gap_us}")

    @property
    def worker_count(self) -> int:
        """`workers`, or the default: one per core this process may run on, at most MAX_DEFAULT_WORKERS."""
        if self.workers is not None:
            return self.workers
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(usable, MAX_DEFAULT_WORKERS))

    @property
    def filters_events(self) -> bool:
        return self.steps is not None or self.time_window_s is not None
