"""Putting every rank on rank 0's clock: measured offsets, refined from collectives.

Two sources of a host's offset to the reference host (the host of the lowest rank):
  - measured: `clock/rank<R>.json` written at startup (traces/clock.py), offset +/- uncertainty;
  - collectives: a collective ends at nearly the same instant on every rank, so for each matched instance
    d = (median end on the host's ranks) - (median end on the reference host's ranks) is a sample of the
    offset. The estimate is the median of d, its spread 1.4826 x the median absolute deviation.
Ranks on one host share its wall clock, so offsets are per host; ranks on the reference host get 0.

Choice per host: with nothing measured, the collective estimate (any number of instances); with a
measurement, the collective estimate only when it has at least MIN_SAMPLES instances and a spread below the
measured uncertainty (it is then both tighter and closer in time to the profiled steps, so clock drift
since startup does not enter); else the measurement; with neither, 0.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.cross_rank.arrivals import ArrivalMatrix
from fleetscope.analysis.inputs.sources import MeasuredOffset

MIN_SAMPLES = 3
MAD_TO_SIGMA = 1.4826

SOURCE_REFERENCE_HOST = "reference host"
SOURCE_MEASURED = "measured"
SOURCE_COLLECTIVES = "collectives"
SOURCE_NONE = "none"


@dataclass(frozen=True, kw_only=True)
class HostClock:
    """One host's clock relative to the reference host."""

    host: str
    ranks: list[int]
    offset_us: float
    """Used offset: t_reference = t_host - offset_us."""
    source: str
    measured_offset_us: float | None = None
    measured_uncertainty_us: float | None = None
    collective_offset_us: float | None = None
    collective_spread_us: float | None = None
    collective_samples: int = 0


@dataclass(frozen=True, kw_only=True)
class ClockAlignment:
    reference_rank: int | None = None
    reference_host: str | None = None
    hosts: list[HostClock] = field(default_factory=list)

    def offsets_us(self) -> dict[int, float]:
        """Rank -> offset to subtract from its (base-aligned) trace times."""
        return {rank: host.offset_us for host in self.hosts for rank in host.ranks}


def align_clocks(matrix: ArrivalMatrix | None, ranks_by_host: dict[str, list[int]],
                 measured: dict[int, MeasuredOffset]) -> ClockAlignment:
    """Per-host offsets for a window. `ranks_by_host` covers every analyzed rank (with or without
    collectives); `measured` holds the clock files' offsets by rank."""
    if not ranks_by_host:
        return ClockAlignment()
    reference_rank = min(r for ranks in ranks_by_host.values() for r in ranks)
    reference_host = next(h for h, ranks in ranks_by_host.items() if reference_rank in ranks)
    hosts = [
        _host_clock(host, sorted(ranks), reference_host, matrix, measured)
        for host, ranks in sorted(ranks_by_host.items(), key=lambda kv: min(kv[1]))
    ]
    return ClockAlignment(reference_rank=reference_rank, reference_host=reference_host, hosts=hosts)


def _host_clock(host: str, ranks: list[int], reference_host: str, matrix: ArrivalMatrix | None,
                measured: dict[int, MeasuredOffset]) -> HostClock:
    if host == reference_host:
        return HostClock(host=host, ranks=ranks, offset_us=0.0, source=SOURCE_REFERENCE_HOST)
    measured_here = [measured[r] for r in ranks if r in measured]
    m_offset = float(np.median([m.offset_us for m in measured_here])) if measured_here else None
    m_uncertainty = float(np.median([m.uncertainty_us for m in measured_here])) if measured_here else None
    c_offset, c_spread, samples = _collective_estimate(matrix, host, reference_host)
    if m_offset is None:
        use_collectives = samples > 0
    else:
        use_collectives = samples >= MIN_SAMPLES and c_spread < m_uncertainty
    if use_collectives:
        offset, source = c_offset, SOURCE_COLLECTIVES
    elif m_offset is not None:
        offset, source = m_offset, SOURCE_MEASURED
    else:
        offset, source = 0.0, SOURCE_NONE
    return HostClock(host=host, ranks=ranks, offset_us=offset, source=source, measured_offset_us=m_offset,
                     measured_uncertainty_us=m_uncertainty, collective_offset_us=c_offset,
                     collective_spread_us=c_spread, collective_samples=samples)


def _collective_estimate(matrix: ArrivalMatrix | None, host: str,
                         reference_host: str) -> tuple[float | None, float | None, int]:
    if matrix is None:
        return None, None, 0
    rows = defaultdict(list)
    for row, row_host in enumerate(matrix.hosts):
        rows[row_host].append(row)
    if not rows.get(host) or not rows.get(reference_host):
        return None, None, 0
    here = _column_medians(matrix.end_us[rows[host]])
    there = _column_medians(matrix.end_us[rows[reference_host]])
    samples = (here - there)[~np.isnan(here) & ~np.isnan(there)]
    if samples.size == 0:
        return None, None, 0
    center = float(np.median(samples))
    spread = float(MAD_TO_SIGMA * np.median(np.abs(samples - center)))
    return center, spread, int(samples.size)


def _column_medians(values: np.ndarray) -> np.ndarray:
    """nanmedian per column; NaN for columns with no value (instances these ranks lack)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(values, axis=0)
