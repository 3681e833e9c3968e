"""The per-rank stage over many traces: `analyze_trace` for each, in worker processes when worthwhile.

Both readers of traces (the report and the merged trace) get their per-rank model here, through the
parsed-trace cache, so a trace is parsed once per content and its rules are applied in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from fleetscope.analysis.inputs.resolve import record_source
from fleetscope.analysis.inputs.sources import TraceFailure, TraceSource
from fleetscope.analysis.per_rank.cache import ResultCache, code_digest
from fleetscope.analysis.per_rank.hta_cache import hta_code_digest, store_parsed_views
from fleetscope.analysis.per_rank.rank import (
    RankResult,
    analyze_bytes,
    analyze_decoded,
    decode_identified,
    read_decoded,
)
from fleetscope.traces.kineto import NotATrace, TraceIdentity, TraceReadError, read_raw
from fleetscope.traces.manifest import TraceRecord

PARALLEL_THRESHOLD = 4
"""Below this many traces, a process pool costs more than it saves."""

Progress = Callable[[int, int], None]
"""progress(done, total), called as traces finish."""


def parse_traces(sources: list[TraceSource], *, workers: int | None = None, progress: Progress | None = None,
                 cache: ResultCache | None = None, comm_kernel_pattern: str | None = None,
                 fresh_workers: bool = False, hta_views: bool = False) -> list[RankResult | TraceFailure]:
    """analyze_trace over every source, in parallel when worthwhile; results in input order.
    `fresh_workers`: workers are new interpreters rather than forks of this process, for a caller that
    holds much memory already (forked workers would each carry it). `hta_views`: the HTA stage will
    want these ranks' views: each GPU trace's parse stores them in the cache from its own decode
    (hta_cache.store_parsed_views)."""
    if hta_views and cache is not None:
        hta_code_digest()  # computed here once: forked workers inherit it
    found = [_cached(source, cache, comm_kernel_pattern) if cache is not None else None for source in sources]
    hits = sum(result is not None for result in found)
    if progress is not None and hits:
        progress(hits, len(sources))
    missing = [source for source, result in zip(sources, found) if result is None]
    parsed = iter(_parse_all(missing, workers, cache, comm_kernel_pattern, fresh_workers,
                             offset_progress(progress, hits, len(sources)), hta_views))
    return [result if result is not None else next(parsed) for result in found]


def _parse_all(sources: list[TraceSource], workers: int | None, cache: ResultCache | None,
               comm_kernel_pattern: str | None, fresh_workers: bool, progress: Progress | None,
               hta_views: bool = False) -> list:
    workers = workers or min(len(sources), os.cpu_count() or 1)
    one = functools.partial(analyze_trace, cache=cache, comm_kernel_pattern=comm_kernel_pattern, hta_views=hta_views)
    if len(sources) < PARALLEL_THRESHOLD or workers <= 1:
        return _with_progress(map(one, sources), len(sources), progress)
    context = multiprocessing.get_context("spawn") if fresh_workers else None
    results: list = []
    for _attempt in range(WORKER_POOL_ATTEMPTS):
        pending = sources[len(results):]
        if not pending:
            return results
        # a worker that dies (killed by the system, out of memory) costs a second pool for the traces whose
        # results had not arrived, then this process: the results are the same whoever computes them
        with suppress(BrokenProcessPool), \
                ProcessPoolExecutor(max_workers=min(workers, len(pending)), mp_context=context) as pool:
            for result in pool.map(one, pending, chunksize=1):
                results.append(result)
                if progress is not None:
                    progress(len(results), len(sources))
    for source in sources[len(results):]:
        results.append(one(source))
        if progress is not None:
            progress(len(results), len(sources))
    return results


WORKER_POOL_ATTEMPTS = 2
"""Pools tried before the traces left are parsed in this process."""


def offset_progress(progress: Progress | None, done_before: int, total: int) -> Progress | None:
    """progress(done, total) over all sources, for the ones parsed after `done_before` cache hits."""
    if progress is None:
        return None
    return lambda done, _: progress(done_before + done, total)


def _cached(source: TraceSource, cache: ResultCache, comm_kernel_pattern: str | None) -> RankResult | None:
    """The source's cached result, read here: a cache entry is kilobytes, so this process reads hits
    faster than a worker pool starts (and forks none). None for a miss or a file that cannot be read
    (analyze_trace then parses it, or names what is wrong)."""
    try:
        raw = read_raw(source.path, within=source.within, expected_size=source.expected_bytes,
                       expected_sha256=source.expected_sha256)
        cached = cache.load(cache.key(source, raw, comm_kernel_pattern, verified_sha256=source.expected_sha256))
    except (TraceReadError, *_UNFORESEEN):
        return None
    return None if cached is None else _as_hit(cached, source)


def _as_hit(cached: RankResult, source: TraceSource) -> RankResult:
    # the same bytes may sit at another path (a copied run directory)
    return dataclasses.replace(cached, path=str(source.path), from_cache=True)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Parsing a trace allocates millions of objects, and Python's cyclic collector would walk the live
    ones again and again; a parse makes no reference cycles, so reference counting alone frees what it
    drops."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _with_progress(outcomes, total: int, progress: Progress | None) -> list:
    collected = []
    for outcome in outcomes:
        collected.append(outcome)
        if progress is not None:
            progress(len(collected), total)
    return collected


_UNFORESEEN = (ValueError, TypeError, KeyError, AttributeError, OverflowError, IndexError, RecursionError, MemoryError)
"""What a file shaped in a way no check foresaw can raise in the parse: that file's failure only."""


def analyze_trace(source: TraceSource, cache: ResultCache | None = None,
                  comm_kernel_pattern: str | None = None, hta_views: bool = False) -> RankResult | TraceFailure:
    """Read, parse and analyze one trace file (or find its result in `cache`); a bad file becomes a
    TraceFailure, never an exception. `hta_views`: see parse_traces."""
    try:
        with cyclic_gc_paused():
            return _cached_or_analyzed(source, cache, comm_kernel_pattern, hta_views)
    except TraceReadError as error:
        return TraceFailure(label=source.label, window=source.window, rank=source.rank, reason=error.reason,
                            not_a_trace=isinstance(error, NotATrace))
    except _UNFORESEEN as error:
        # A file shaped in a way no check above foresaw (or too deep or too large to hold): name it with
        # the error, analyze the other ranks.
        reason = f"could not be analyzed: {type(error).__name__}: {str(error)[:300]}"
        return TraceFailure(label=source.label, window=source.window, rank=source.rank, reason=reason)


def _cached_or_analyzed(source: TraceSource, cache: ResultCache | None, comm_kernel_pattern: str | None,
                        hta_views: bool = False) -> RankResult:
    raw = read_raw(source.path, within=source.within, expected_size=source.expected_bytes,
                   expected_sha256=source.expected_sha256)
    if cache is None:
        return analyze_bytes(source, raw, comm_kernel_pattern)
    key = cache.key(source, raw, comm_kernel_pattern, verified_sha256=source.expected_sha256)
    cached = cache.load(key)
    if cached is not None:
        return _as_hit(cached, source)
    if not hta_views:
        result = analyze_bytes(source, raw, comm_kernel_pattern)
    else:
        result = _analyzed_with_hta_views(source, raw, cache, comm_kernel_pattern)
    cache.store(key, result)
    return result


def _analyzed_with_hta_views(source: TraceSource, raw: bytes, cache: ResultCache,
                             comm_kernel_pattern: str | None) -> RankResult:
    """analyze_bytes, storing HTA's views of the rank from the same decode (one inflate, one decode)."""
    decoded = read_decoded(source.path, raw, with_hta_frame=True)
    result = analyze_decoded(source, decoded, comm_kernel_pattern)
    if decoded.hta_frame is not None and result.rank is not None:
        # the views are a saving, not the result: whatever goes wrong, the HTA stage computes them itself
        with suppress(*_UNFORESEEN):
            store_parsed_views(cache.directory, raw, result.rank, decoded.hta_frame, hta_code_digest())
    return result


@dataclass(frozen=True)
class ParsingInspector:
    """gather's TraceInspector for postprocess: each trace's per-rank parse in gather's own pass over its
    bytes, stored in the parsed-trace cache under the key analyze will look up (the source its manifest
    record gives), so each file is inflated and decoded once for both stages. A file the fast decoder does
    not take, or whose parse fails, is left to identify_trace and to analyze, which explain it."""

    cache_directory: Path
    """An already opened (checked) cache directory (cache.open_cache)."""
    comm_kernel_pattern: str | None = None

    def __post_init__(self) -> None:
        code_digest()  # computed here once, so gather's forked workers inherit it instead of each reading the sources

    def identify(self, raw: bytes, path: Path) -> tuple[TraceIdentity, Any] | None:
        try:
            with cyclic_gc_paused():
                decoded = decode_identified(path, raw)
        except (TraceReadError, *_UNFORESEEN):
            return None
        return None if decoded is None else (decoded[0], (raw, decoded[1]))

    def keep(self, record: TraceRecord, state: Any, root: Path) -> None:
        raw, decoded = state
        cache, source = ResultCache(self.cache_directory), record_source(record, root)
        key = cache.key(source, raw, self.comm_kernel_pattern, verified_sha256=record.sha256)
        if cache.contains(key):
            return
        try:
            with cyclic_gc_paused():
                result = analyze_decoded(source, decoded, self.comm_kernel_pattern)
        except (TraceReadError, *_UNFORESEEN):
            return
        cache.store(key, dataclasses.replace(result, parsed_while_gathering=True))
