"""The per-rank stage over many traces: `analyze_trace` for each, in worker processes when worthwhile.

Both readers of traces (the report and the merged trace) get their per-rank model here, through the
parsed-trace cache, so a trace is parsed once per content and its rules are applied in one place.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

from fleetscope.analysis.per_rank.cache import ResultCache
from fleetscope.analysis.per_rank.rank import RankResult, TraceFailure, TraceSource, analyze_trace

PARALLEL_THRESHOLD = 4
"""Below this many traces, a process pool costs more than it saves."""

Progress = Callable[[int, int], None]
"""progress(done, total), called as traces finish."""


def parse_traces(sources: list[TraceSource], *, workers: int | None = None, progress: Progress | None = None,
                    cache: ResultCache | None = None) -> list[RankResult | TraceFailure]:
    """analyze_trace over every source, in parallel when worthwhile; results in input order."""
    workers = workers or min(len(sources), os.cpu_count() or 1)
    one = functools.partial(analyze_trace, cache=cache)
    if len(sources) < PARALLEL_THRESHOLD or workers <= 1:
        return _with_progress(map(one, sources), len(sources), progress)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return _with_progress(pool.map(one, sources, chunksize=1), len(sources), progress)



def _with_progress(outcomes, total: int, progress: Progress | None) -> list:
    collected = []
    for outcome in outcomes:
        collected.append(outcome)
        if progress is not None:
            progress(len(collected), total)
    return collected


