"""Collective times of every rank of a window, matched by collective instance: a ranks x instances matrix.

Built on a shared time base (each trace's `baseTimeNanoseconds` brought to the window's earliest) but
without clock offsets; `shifted` applies those once they are known (clock_align.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.per_rank.collectives import CollectiveKey
from fleetscope.analysis.per_rank.rank import RankResult


@dataclass(frozen=True)
class ArrivalMatrix:
    ranks: list[int]
    hosts: list[str]
    keys: list[CollectiveKey]
    start_us: np.ndarray
    """ranks x instances; NaN where a rank has no such instance."""
    end_us: np.ndarray
    interval_compute_us: np.ndarray
    sources: list[str]
    """Where the collective times came from (collectives.py), over all ranks."""
    previous_end_us: np.ndarray | None = None
    """ranks x instances: end of the rank's previous collective in its issue order (-inf: none)."""
    phases: list[str] = field(default_factory=list)
    """Per instance, the phase that issued it on the first rank that has it (collectives.py)."""
    compute_before_us: np.ndarray | None = None
    """ranks x instances: computation in the rank's step before it arrived (collectives.py)."""
    base_time_ns: int = 0
    """Time zero of the matrix: the earliest `baseTimeNanoseconds` of its ranks."""

    def to_common_us(self, result: RankResult, trace_us: float, offsets_us: dict[int, float]) -> float:
        """A time of `result`'s trace on this matrix's time base, moved by the rank's clock offset."""
        return trace_us + (result.base_time_ns - self.base_time_ns) / 1000.0 - offsets_us.get(result.rank, 0.0)

    @property
    def present(self) -> np.ndarray:
        return ~np.isnan(self.start_us)

    def shifted(self, offsets_us: dict[int, float]) -> "ArrivalMatrix":
        """Times moved onto the reference clock: t - offset of the row's rank."""
        shift = np.asarray([offsets_us.get(rank, 0.0) for rank in self.ranks])[:, None]
        previous = self.previous_end_us - shift if self.previous_end_us is not None else None
        return ArrivalMatrix(self.ranks, self.hosts, self.keys, self.start_us - shift, self.end_us - shift,
                             self.interval_compute_us, self.sources, previous, self.phases, self.compute_before_us,
                             self.base_time_ns)

    def columns(self, keep: np.ndarray) -> "ArrivalMatrix":
        """The instances where `keep` is true."""
        previous = self.previous_end_us[:, keep] if self.previous_end_us is not None else None
        return ArrivalMatrix(self.ranks, self.hosts, [k for k, on in zip(self.keys, keep) if on],
                             self.start_us[:, keep], self.end_us[:, keep], self.interval_compute_us[:, keep],
                             self.sources, previous, [p for p, on in zip(self.phases, keep) if on],
                             self.compute_before_us[:, keep] if self.compute_before_us is not None else None,
                             self.base_time_ns)


def arrival_matrix(results: list[RankResult]) -> ArrivalMatrix | None:
    """The matrix of the ranks that have collectives; None when fewer than two do."""
    with_calls = sorted((r for r in results if len(r.collectives)), key=lambda r: r.rank)
    if len(with_calls) < 2:
        return None
    base_ns = min(r.base_time_ns for r in with_calls)
    keys = sorted({key for r in with_calls for key in r.collectives.keys})
    column = {key: index for index, key in enumerate(keys)}
    shape = (len(with_calls), len(keys))
    starts, ends, compute = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    previous, before = np.full(shape, np.nan), np.full(shape, np.nan)
    phases = [""] * len(keys)
    for row, result in enumerate(with_calls):
        calls = result.collectives
        columns = np.fromiter((column[k] for k in calls.keys), dtype=np.int64, count=len(calls))
        base_shift_us = (result.base_time_ns - base_ns) / 1000.0
        starts[row, columns] = calls.start_us + base_shift_us
        ends[row, columns] = calls.end_us + base_shift_us
        compute[row, columns] = calls.interval_compute_us
        if calls.previous_end_us.size == len(calls):
            previous[row, columns] = calls.previous_end_us + base_shift_us
            before[row, columns] = calls.compute_before_us
        for key, phase in zip(calls.keys, calls.phases):
            phases[column[key]] = phases[column[key]] or phase
    sources = sorted({r.collectives.source for r in with_calls if r.collectives.source})
    return ArrivalMatrix([r.rank for r in with_calls], [r.host for r in with_calls], keys, starts, ends,
                         compute, sources, previous, phases, before, base_ns)
