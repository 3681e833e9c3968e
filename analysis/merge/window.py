"""The types one merged window is planned with, shared by the planner, its flows and its overlays."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.tracks import Slice
from fleetscope.analysis.per_rank.collectives import CollectiveKey

if TYPE_CHECKING:
    from fleetscope.analysis.cross_rank.stragglers import CollectiveInstance, RankWait
    from fleetscope.analysis.report.model import RankSummary

StepRange = tuple[int, int, int]
"""(step, start_ns, end_ns)."""


@dataclass(frozen=True, kw_only=True)
class ReportView:
    """What the analysis report says about one rank in one window (report_view.py)."""

    rank_summary: "RankSummary | None" = None
    """The report's `ranks[]` entry; set for the rank's first window only."""
    report_verdict: str = ""
    window_verdict: str = ""
    waited_for: bool = False
    slowest: bool = False
    wait: "RankWait | None" = None
    """This rank's `by_wait[]` entry in the window."""
    late_instances: "list[CollectiveInstance]" = field(default_factory=list)
    """`worst_instances[]` of the window where this rank arrived last."""
    critical_path: Any = None
    """This rank's segments of the window's critical path (critical_path_overlays.RankPath) or None."""
    evidence: Any = None
    """Per-step evidence for counters and marks (evidence_overlays.RankEvidence) or None."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowClock:
    """How a window's `ts` (microseconds) maps onto the merged clock (nanoseconds)."""

    base_ns: int
    offset_ns: int = 0

    @property
    def shift_ns(self) -> int:
        return self.base_ns - self.offset_ns

    def to_ns(self, ts_us: float) -> int:
        return self.base_ns + round(ts_us * 1000) - self.offset_ns


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowContext:
    clock: WindowClock
    options: MergeOptions = MergeOptions()
    window_key: int = 0
    """The window's index (its position in the rank's files when the run directory does not say)."""
    origin_ns: int | None = None
    """Where `options.time_window_s` counts from; None: this window's first event."""
    report: ReportView | None = None
    steps: tuple[StepRange, ...] = ()
    """(step, start_ns, end_ns) of the host's step ranges on the merged clock, from the per-rank parse (what
    the filters and host-sync marks go by)."""
    step_spans: tuple[StepRange, ...] = ()
    """(step, start_ns, end_ns) of the span each step is timed by (sources.WindowModel.step_spans: the
    report's step), on the merged clock: what the analysis track draws."""
    collectives: tuple[tuple[int, CollectiveKey], ...] = ()
    """(start_ns, instance key) on the merged clock, from the per-rank parse."""
    collective_ends_ns: tuple[int, ...] = ()
    """The end of each of `collectives` (same order), on the merged clock."""
    collective_source: str | None = None
    p2p: tuple[tuple[int, tuple, str], ...] = ()
    """(start_ns, transfer key, send|recv) of the sends / receives with a known peer (sources.WindowModel)."""
    moe: Any = None
    """The rank's MoE overlay data (moe_overlays.MoeMergeView), None without MoE records or findings."""
    idle_gaps: tuple[tuple[int, int, str], ...] = ()
    """(start_ns, end_ns, cause) of every idle gap inside the steps, from the per-rank analysis
    (host_stalls.find_idle_gaps: the one rule for idle gaps and their causes)."""
    idle_basis: str | None = None
    """"gpu" | "cpu": what the gaps are idle time of; None when the analysis found none to measure."""


@dataclass(kw_only=True)
class GroupedEvents:
    """One window's events sorted into what each becomes."""

    slices: dict[tuple, list[Slice]] = field(default_factory=lambda: defaultdict(list))
    instants: dict[tuple, list[tuple[int, str, str, int]]] = field(default_factory=lambda: defaultdict(list))
    counters: dict[tuple, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    memory: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    """Counter label -> (ts_ns, MiB) from Kineto's `[memory]` events."""
    flow_events: list[tuple] = field(default_factory=list)
    """(phase, category, id, thread, ts_ns, binds_to_enclosing) of the trace's own flow events."""
    gpu_threads: dict[tuple, tuple[Any, Any]] = field(default_factory=dict)
    """(pid, tid) -> (device, stream) for tracks that hold device activity."""
    thread_names: dict[tuple, list[str]] = field(default_factory=lambda: defaultdict(list))
    process_names: dict[Any, str] = field(default_factory=dict)
    correlation_of: dict[int, int] = field(default_factory=dict)
    """ident -> CUDA correlation id, for events that carry one."""
    group_of: dict[int, str] = field(default_factory=dict)
    """ident -> process group label (names.process_group_label), for events whose args name one."""
    skipped: Counter = field(default_factory=Counter)
    negative_durations: int = 0
    filtered: int = 0

    def is_gpu(self, thread: tuple) -> bool:
        return thread in self.gpu_threads

    def first_ts_ns(self) -> int | None:
        starts = [s[0][0] for s in self.slices.values() if s]
        starts += [i[0][0] for i in self.instants.values() if i]
        return min(starts, default=None)
