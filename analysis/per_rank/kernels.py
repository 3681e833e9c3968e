"""Where GPU time goes by kernel: total time and launches of each kernel name."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from fleetscope.analysis.per_rank.events import Kind, TraceEvents
from fleetscope.analysis.per_rank.names import kernel_category

TOP_KERNELS_KEPT = 15


@dataclass(frozen=True, kw_only=True)
class KernelTotal:
    name: str
    count: int
    total_us: float
    """Sum of the kernel's durations (overlapping launches each count)."""
    ranks: int = 1
    """How many ranks ran it (in a window's aggregate)."""
    category: str = ""
    """names.kernel_category of its name."""


def top_kernels(events: TraceEvents, keep: int = TOP_KERNELS_KEPT) -> list[KernelTotal]:
    """The `keep` kernel names with the most total time on this rank."""
    kernels = events.of_kind(Kind.KERNEL)
    if not kernels.any():
        return []
    ids = events.name_id[kernels]
    totals = np.bincount(ids, weights=events.dur_us[kernels], minlength=len(events.names))
    counts = np.bincount(ids, minlength=len(events.names))
    order = np.argsort(-totals)[:keep]
    return [KernelTotal(name=events.names[i], count=int(counts[i]), total_us=float(totals[i]),
                        category=kernel_category(events.names[i]))
            for i in order if counts[i] > 0]


def combine(per_rank: list[list[KernelTotal]], keep: int = TOP_KERNELS_KEPT) -> list[KernelTotal]:
    """Sum of the ranks' top kernels (a kernel outside a rank's top list counts 0 for that rank)."""
    count, total, ranks = defaultdict(int), defaultdict(float), defaultdict(int)
    for kernels in per_rank:
        for kernel in kernels:
            count[kernel.name] += kernel.count
            total[kernel.name] += kernel.total_us
            ranks[kernel.name] += 1
    names = sorted(total, key=lambda n: -total[n])[:keep]
    return [KernelTotal(name=n, count=count[n], total_us=total[n], ranks=ranks[n], category=kernel_category(n))
            for n in names]
