"""A window's slices as columns: what plan.py keeps per thread as lists of tuples (GroupedEvents.slices),
one row per kept complete event, in trace order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fleetscope.analysis.merge.evidence_overlays import SYNC_CATEGORIES, is_blocking
from fleetscope.analysis.merge.window import GroupedEvents


@dataclass(kw_only=True)
class SliceTable:
    idents: np.ndarray
    """int64: the event's index in the trace's event list (rows are in this order)."""
    starts: np.ndarray
    """int64 ns on the merged clock."""
    ends: np.ndarray
    names: list[str]
    name_ids: np.ndarray
    categories: list[str]
    category_ids: np.ndarray
    threads: list[tuple]
    """(pid, tid) of each thread, by first appearance (plan.py's dict order, kept after filters)."""
    thread_ids: np.ndarray
    correlations: np.ndarray
    """int64 CUDA correlation id, where `has_correlation`."""
    has_correlation: np.ndarray
    sorted_threads: set[int] = field(default_factory=set)
    """Threads whose slices plan.py's flow binding sorted in place by (start, -end): what it reads as a
    thread's first slice afterwards is its earliest."""

    def __len__(self) -> int:
        return len(self.idents)

    def first_ts_ns(self, grouped: GroupedEvents) -> int | None:
        """GroupedEvents.first_ts_ns over these slices and `grouped`'s instants: each thread's first
        slice (the earliest for a sorted thread) and first instant, the least of them."""
        firsts = self._first_rows()
        starts = [int(self.starts[row]) for row in firsts]
        starts += [i[0][0] for i in grouped.instants.values() if i]
        return min(starts, default=None)

    def _first_rows(self) -> list[int]:
        if not len(self):
            return []
        _, first = np.unique(self.thread_ids, return_index=True)
        rows = first.tolist()
        for thread in self.sorted_threads:
            mine = np.flatnonzero(self.thread_ids == thread)
            if len(mine):
                rows.append(int(mine[np.lexsort((-self.ends[mine], self.starts[mine]))[0]]))
        return rows

    def keep_overlapping(self, spans: list[tuple[int, int]]) -> int:
        """Keep the slices that overlap a span of [start, end) (plan._overlaps); returns how many left."""
        keep = np.zeros(len(self), dtype=bool)
        reach = np.maximum(self.ends, self.starts + 1)
        for span_start, span_end in spans:
            keep |= (self.starts < span_end) & (reach > span_start)
        for name in ("idents", "starts", "ends", "name_ids", "category_ids", "thread_ids", "correlations",
                     "has_correlation"):
            setattr(self, name, getattr(self, name)[keep])
        return int((~keep).sum())

    def nonempty_threads(self) -> set[tuple]:
        """The threads with a slice, as plan.py's set of them (built in first-appearance order)."""
        present = np.zeros(len(self.threads), dtype=bool)
        present[self.thread_ids] = True
        return {self.threads[thread] for thread in np.flatnonzero(present).tolist()}

    def on_gpu(self, grouped: GroupedEvents) -> np.ndarray:
        """Per row: whether its thread is a GPU stream."""
        gpu_threads = np.array([thread in grouped.gpu_threads for thread in self.threads], dtype=bool)
        return gpu_threads[self.thread_ids] if len(self.threads) else np.zeros(0, dtype=bool)

    def row_slice(self, row: int) -> tuple:
        """plan.py's Slice tuple of one row."""
        return (int(self.starts[row]), int(self.ends[row]), self.names[self.name_ids[row]],
                self.categories[self.category_ids[row]], int(self.idents[row]), None)

    def overlay_view(self, grouped: GroupedEvents) -> "OverlayView":
        """What overlays.py reads of the grouped events: the first timestamp, and the host slices that are
        host syncs (evidence_overlays.sync_marks), per thread in the order plan.py holds them."""
        sync_category = np.array([c in SYNC_CATEGORIES for c in self.categories], dtype=bool)
        verdicts: dict[str, bool] = {}
        blocking = np.array([is_blocking(name, verdicts) for name in self.names], dtype=bool)
        host = ~self.on_gpu(grouped)
        rows = np.flatnonzero(sync_category[self.category_ids] & blocking[self.name_ids] & host) \
            if len(self.categories) else []
        slices: dict[tuple, list] = {}
        for thread in np.unique(self.thread_ids[rows]).tolist() if len(rows) else []:
            mine = rows[self.thread_ids[rows] == thread]
            if thread in self.sorted_threads:
                mine = mine[np.lexsort((-self.ends[mine], self.starts[mine]))]
            slices[self.threads[thread]] = [self.row_slice(row) for row in mine.tolist()]
        return OverlayView(slices=slices, first_ns=self.first_ts_ns(grouped))


@dataclass(kw_only=True)
class OverlayView:
    """GroupedEvents as overlays.py reads it (first_ts_ns, and sync_marks' host slices)."""

    slices: dict[tuple, list]
    first_ns: int | None

    def first_ts_ns(self) -> int | None:
        return self.first_ns

    def is_gpu(self, thread: Any) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class SliceOps:
    """The begins and ends of the window's slices in emission order: `rows` index the SliceTable, a
    begin where `begins` is set (its start), else an end (its end); `uuids` is the lane's track."""

    rows: np.ndarray
    begins: np.ndarray
    uuids: np.ndarray
