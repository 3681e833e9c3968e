"""Where GPU time goes by kernel: total time and launches of each kernel name."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from fleetscope.analysis.per_rank.events import Kind, TraceEvents
from fleetscope.analysis.per_rank.names import is_comm_cpu_op, is_comm_kernel, is_gloo_span, kernel_category

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


@dataclass(frozen=True, kw_only=True)
class OpDuration:
    """The typical duration of one compute kernel (name and launch shape) or, in a CPU-only trace, one host
    op name."""

    name: str
    count: int
    median_us: float
    launch_shape: str = ""
    """The kernels' grid and block ("grid [x, y, z] block [x, y, z]"); "" where the trace does not say."""


def op_durations(events: TraceEvents) -> list[OpDuration]:
    """Median duration of every non-communication kernel, per name and launch shape; host ops (minus
    collectives) for a trace without kernels. Ranks doing the same work run the same kernels with the same
    grids: a rank whose medians of those are all longer has a slower device, not more work; a bigger grid of
    the same name is more work (cross_rank/causes.py)."""
    kernels = events.of_kind(Kind.KERNEL)
    if kernels.any():
        chosen = kernels & ~events.names_matching(is_comm_kernel)
    else:
        chosen = events.of_kind(Kind.CPU_OP) & ~events.names_matching(lambda n: is_comm_cpu_op(n) or is_gloo_span(n))
    shape_ids = (events.launch_shape_id[chosen].astype(np.int64) if events.launch_shape_id is not None
                 else np.full(int(chosen.sum()), -1, dtype=np.int64))
    keys = events.name_id[chosen].astype(np.int64) * (len(events.launch_shapes) + 1) + (shape_ids + 1)
    durations = events.dur_us[chosen]
    order = np.lexsort((durations, keys))
    keys, durations = keys[order], durations[order]
    firsts = np.flatnonzero(np.r_[True, np.diff(keys) != 0]) if keys.size else np.empty(0, dtype=np.int64)
    counts = np.diff(np.r_[firsts, keys.size])
    shapes = [""] + list(events.launch_shapes)
    width = len(events.launch_shapes) + 1
    return [OpDuration(name=events.names[key // width], count=count, median_us=median,
                       launch_shape=shapes[key % width])
            for key, count, median in zip(keys[firsts].tolist(), counts.tolist(),
                                          _sorted_medians(durations, firsts, counts).tolist())]


def _sorted_medians(values: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """np.median of each group of `values` (sorted within each group; group g is `counts[g]` values from
    `firsts[g]`), in one pass: the middle value, or the mean of the two middle ones, as np.median takes them."""
    upper = firsts + counts // 2
    lower = np.where(counts % 2 == 1, upper, upper - 1)
    return (values[lower] + values[upper]) / 2
