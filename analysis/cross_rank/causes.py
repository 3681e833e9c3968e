"""Why a straggler is late: the cause of each rank's lateness at collectives, and what it costs per step.

For every rank that causes at least `MIN_WAIT_SHARE` of a window's waiting and whose lateness stands out from the
step-to-step spread (stragglers.py `significance`: no cause is given for noise), over the
collective instances where it was last (lateness >= min_lateness_us), per instance and against the median
of the other participants (times on the common clock, clock_align.py):
  - extra_compute_us: its computation since its previous collective, minus the others' (stragglers.py);
  - extra_idle_us: its gap from its previous collective's end to its arrival, minus the others' gap, minus
    extra_compute_us: time it spent neither computing nor communicating before arriving (GPU basis: the GPU
    idle while the host had not launched the collective yet; CPU basis: no op running);
  - carried_us: its previous collective's end minus the others' (it left the previous exchange late: its
    data movement is slower than its peers').
lateness ~= carried_us + extra_compute_us + extra_idle_us; each term's mean over the instances (those where
all three are known: a rank's first collective has no previous one), divided by the mean lateness over the
same instances, is its share: the long delays that cause most of the waiting weigh most. The cause is the term with the largest share, when that share is at
least `MIN_EXPLAINED_SHARE` (else "unexplained", with the shares):
  - carried -> CAUSE_NETWORK;
  - idle -> CAUSE_HOST (launch gaps, syncs, input wait, CPU contention on that rank);
  - compute -> the rank's kernels are matched to its peers' by identity (`match_kernels`: per compute kernel
    name and launch shape (grid and block: a bigger grid of the same name is more work), host op name on a
    CPU trace, its launch count and median duration against the peers' medians).
    The launches both ran (the lower count) give the same-kernel time: its duration there over the peers'
    is `op_duration_ratio` and the difference `same_kernel_excess_us`; launches beyond the peers' count
    (names the peers never run included) are extra work, `extra_kernel_us`, named in `extra_kernels`.
    CAUSE_SLOW_DEVICE when the same kernels take at least `SLOW_DEVICE_RATIO` as long, that excess is
    larger than the extra work, and the slow-down is uniform: the kernels it stretches hold at least
    `UNIFORM_SHARE` of the peers' time (a slow or throttled device, or contention, stretches most of its
    work, e.g. every GEMM under a power cap); a slow-down concentrated in a few kernels (`concentrated_kernels`,
    named) is more work in those kernels (data-dependent: tokens, sequence length), CAUSE_WORK; so is more or
    other kernels before the collective,
    and always CAUSE_WORK where the MoE view names a hot expert on the rank (more tokens make the same
    expert kernels longer).
Before all of that, CAUSE_CLOCK: when the clock offset between its host and its peers' hosts is uncertain by
at least half the median lateness (clock_align.py: the measured uncertainty or the spread of the collective
estimate; unknown when no offset could be found for a host other than the reference), nothing can be told.

A straggler in backward (DDP's gradient-bucket all-reduces are issued there): every rank's backward range
ends when the last bucket is reduced, so phase times look alike (`phase_vs_peers_pct` near 0) while the
arrival order at the bucket collectives still names the rank; `phase` is where its late instances were
issued (collectives.py).

What-if per step, arithmetic (analysis/quantities.py "what-if"): projected_step_ms = the step's time (slowest
rank's) minus the waiting it caused in that step, i.e. the step if this rank had arrived with the others and
nothing else changed. The report replaces it with the step replayed (analysis/whatif/report_what_if.py) wherever
the dependency model holds the step; caused_wait_ms stays the waiting measured. The waiting caused at
an instance is its lateness minus what it inherited: where it was also last at its previous collective, the
part of carried_us up to the lateness was already counted there (gloo spans end at different instants on
different ranks, so one delay would otherwise count at every following collective). Per step those stretches
(each ending at its arrival) add up as their union (stragglers.py caused_by_step): two gradient buckets in
flight together, both waiting for one late backward, are one wait. The floor: analysis/quantities.py
"compute floor".
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.cross_rank.arrivals import ArrivalMatrix
from fleetscope.analysis.cross_rank.clock_align import (
    SOURCE_COLLECTIVES,
    SOURCE_MEASURED,
    SOURCE_REFERENCE_HOST,
    ClockAlignment,
)
from fleetscope.analysis.cross_rank.stragglers import (
    Significance,
    Stragglers,
    caused_by_step,
    others_median,
    waiting_by_step,
)
from fleetscope.analysis.per_rank.names import short_kernel_name
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.analysis.quantities import WHAT_IF_ARITHMETIC, WHAT_IF_REPLAYED, clamp_caused_wait_ms, what_if_text
from fleetscope.traces.validate import finite

CAUSE_WORK = "work imbalance"
CAUSE_SLOW_DEVICE = "slow device"
CAUSE_HOST = "host-side delay"
CAUSE_NETWORK = "network"
CAUSE_CLOCK = "clock uncertainty"
CAUSE_UNEXPLAINED = "unexplained"
CAUSES = (CAUSE_WORK, CAUSE_SLOW_DEVICE, CAUSE_HOST, CAUSE_NETWORK, CAUSE_CLOCK, CAUSE_UNEXPLAINED)

MIN_WAIT_SHARE = 0.2
MIN_EXPLAINED_SHARE = 0.5
SLOW_DEVICE_RATIO = 1.02
UNIFORM_SHARE = 0.5
"""A slow-down is the device's when the kernels it stretches hold at least this share of the peers' time in the
shared launches: a slow or throttled GPU stretches most of its work by a similar factor."""
CLOCK_SHARE = 0.5
EQUALIZED_PCT = 5.0
"""A backward straggler's phase time within this of its peers' is called equalized in the explanation."""
MIXED_SHARE = 0.2
EXTRA_KERNELS_NAMED = 3
"""Another cause holding at least this share of a rank's lateness is named in its explanation."""


@dataclass(frozen=True, kw_only=True)
class StepWhatIf:
    step: int
    step_time_ms: float
    """The step's time on its slowest rank."""
    caused_wait_ms: float
    """The union of this rank's lateness stretches at the step's instances where it was last (less what it
    inherited), clamped to [0, step_time_ms - floor_ms] (analysis/quantities.py: clamp_caused_wait_ms)."""
    projected_step_ms: float
    """The step's what-if on `basis` (analysis/quantities.py "what-if"): replayed, or step_time_ms -
    caused_wait_ms; within [floor_ms, step_time_ms]."""
    floor_ms: float = 0.0
    """The step's compute floor (analysis/quantities.py): the larger of what its other ranks computed between its
    collectives and their step time less their waiting; 0 when not known."""
    basis: str = WHAT_IF_ARITHMETIC
    """quantities.WHAT_IF_REPLAYED or WHAT_IF_ARITHMETIC (reports before schema 2: arithmetic)."""
    not_replayed: str = ""
    """On the arithmetic basis in a report that replays: why the model could not hold the step."""


@dataclass(frozen=True, kw_only=True)
class StragglerCause:
    rank: int
    cause: str
    """One of CAUSES (module docstring)."""
    explained_share: float
    """cause_shares[cause]; without classifiable instances, the share of its mean lateness the cause's
    term accounts for (0 for clock/unexplained)."""
    cause_shares: dict[str, float] = field(default_factory=dict)
    """Each late instance whose terms are all known, classified on its own: cause -> share of their summed
    lateness (a rank can be late for two reasons, e.g. a sleep before forward and CPU contention in it)."""
    classified_lateness_us: float = 0.0
    """The summed lateness of those instances."""
    wait_share: float
    """Its share of all waiting caused in the window (stragglers.py score)."""
    late_instances: int
    median_lateness_us: float
    mean_lateness_us: float
    """Over the instances where every term is known (module docstring); the shares' denominator."""
    mean_extra_compute_us: float
    mean_extra_idle_us: float
    mean_carried_us: float
    op_duration_ratio: float | None
    """Its time in the kernel launches its peers also ran over the peers' time in them (match_kernels);
    None: no kernel (or host op) name shared."""
    ops_compared: int
    """Kernel (or host op) names both it and its peers ran."""
    same_kernel_excess_us: float = 0.0
    """Its time in those shared launches minus the peers' (the trace's profiled steps)."""
    extra_kernel_us: float = 0.0
    """Its time in launches beyond the peers' count of each name (names they never run included)."""
    extra_kernels: list[str] = field(default_factory=list)
    """The extra launches with the most time, "name (+N launches, T ms)", at most EXTRA_KERNELS_NAMED."""
    expected_slowdown_us: float | None
    """(op_duration_ratio - 1) x the peers' mean computation before the late instances."""
    clock_uncertainty_us: float | None
    """Median over peers of the uncertainty of the clock offset between its host and theirs (0: same host;
    None: unknown)."""
    phase: str
    """Phase whose collectives it kept the others waiting at longest, summed ("" when not annotated)."""
    phase_vs_peers_pct: float | None
    """Its mean time in that phase vs the peers' median (near 0 for a backward straggler: equalized)."""
    data_loader_excess_ms: float | None = None
    """Mean over steps of its DataLoader fetch time (steps.py) minus the peers' median: where a host-side
    delay is input wait, this is about the lateness. None: the traces record no DataLoader ranges."""
    what_if: list[StepWhatIf] = field(default_factory=list)
    concentrated_kernels: list[str] = field(default_factory=list)
    """The kernels a concentrated slow-down sits in (KernelMatch.concentrated_kernels): the same kernels as its
    peers', a few of them much longer: more work in them; empty for a uniform one."""
    routing: str = ""
    """What the MoE view knows about the rank's expert load ("uneven routing: expert E (layer L) on rank R",
    cross_rank/moe.py uneven_routing_hints); "" when it holds no hot expert or the run has no MoE records."""
    explanation: str = ""
    significance: Significance | None = None
    """Its lateness against the step-to-step spread (stragglers.py), with the confidence it allows; None in reports
    written before it was kept."""
    has_gpu: bool | None = None
    """Its trace holds GPU activity; False: a CPU rank (its "device" is its host's CPUs); None: not known."""
    host_peers: list[int] = field(default_factory=list)
    """The window's other ranks on its host: a node remedy (excluding the host) would take them out too."""


@dataclass(frozen=True, kw_only=True)
class CauseAnalysis:
    findings: list[StragglerCause] = field(default_factory=list)
    """One per rank causing >= MIN_WAIT_SHARE of the waiting that stands out, largest share first."""


def find_causes(results: list[RankResult], matrix: ArrivalMatrix | None, stragglers: Stragglers,
                clock: ClockAlignment, routing: dict[int, str] | None = None,
                floors_ms: dict[int, float] | None = None) -> CauseAnalysis:
    """Cause of each straggler's lateness; `matrix` on the common clock (the one stragglers were found on);
    `routing[rank]`: the MoE view's uneven routing on that rank, named in its explanation; `floors_ms[step]`:
    a known compute floor of the step, below which no what-if goes (besides the peers' own computation)."""
    if matrix is None or not stragglers.by_wait:
        return CauseAnalysis()
    shared = matrix.columns(matrix.present.sum(axis=0) >= 2)
    terms = _instance_terms(shared)
    findings = [dataclasses.replace(
                    _finding(rank_wait.rank, rank_wait.score, shared, terms, results, clock, stragglers.min_lateness_us,
                             (routing or {}).get(rank_wait.rank, ""), floors_ms or {}),
                    significance=rank_wait.significance, **_placement(results, rank_wait.rank))
                for rank_wait in stragglers.by_wait if rank_wait.times_last and rank_wait.score >= MIN_WAIT_SHARE
                and rank_wait.significance is not None and rank_wait.significance.stands_out]
    return CauseAnalysis(findings=[_with_explanation(f) for f in findings])


def _placement(results: list[RankResult], rank: int) -> dict:
    """has_gpu and host_peers of the rank (StragglerCause)."""
    own = next((r for r in results if r.rank == rank), None)
    if own is None:
        return {}
    return {"has_gpu": bool(own.has_gpu),
            "host_peers": sorted(r.rank for r in results if r.rank != rank and r.rank is not None and r.host == own.host)}


@dataclass(frozen=True)
class _Terms:
    """Per instance (columns of the shared matrix): the last row and the decomposition of its lateness."""

    last_row: np.ndarray
    lateness_us: np.ndarray
    extra_compute_us: np.ndarray
    extra_idle_us: np.ndarray
    carried_us: np.ndarray
    peer_compute_us: np.ndarray


def _instance_terms(m: ArrivalMatrix) -> _Terms:
    columns = np.arange(m.start_us.shape[1])
    last_row = np.nanargmax(m.start_us, axis=0)

    def late_minus_peers(values: np.ndarray) -> np.ndarray:
        return values[last_row, columns] - others_median(values, last_row)

    previous = m.previous_end_us if m.previous_end_us is not None else np.full(m.start_us.shape, np.nan)
    previous = np.where(np.isfinite(previous), previous, np.nan)
    extra_compute = late_minus_peers(m.interval_compute_us)
    return _Terms(last_row=last_row, lateness_us=late_minus_peers(m.start_us), extra_compute_us=extra_compute,
                  extra_idle_us=late_minus_peers(m.start_us - previous) - extra_compute,
                  carried_us=late_minus_peers(previous),
                  peer_compute_us=others_median(m.interval_compute_us, last_row))


def _nan_median(values: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        median = float(np.nanmedian(values)) if values.size else float("nan")
    return 0.0 if np.isnan(median) else median


def _finding(rank: int, share: float, m: ArrivalMatrix, terms: _Terms, results: list[RankResult],
             clock: ClockAlignment, min_lateness_us: float, routing: str = "",
             floors_ms: dict[int, float] | None = None) -> StragglerCause:
    row = m.ranks.index(rank)
    late = (terms.last_row == row) & (terms.lateness_us >= min_lateness_us)
    known = late & np.isfinite(terms.carried_us) & np.isfinite(terms.extra_idle_us) & np.isfinite(terms.extra_compute_us)
    basis = known if known.any() else late
    lateness, compute, idle, carried, peer_compute = (
        _mean(t[basis]) for t in (terms.lateness_us, terms.extra_compute_us, terms.extra_idle_us, terms.carried_us,
                                  terms.peer_compute_us))
    kernels = match_kernels(results, rank)
    ratio = kernels.ratio
    slowdown = (ratio - 1.0) * peer_compute if ratio is not None else None
    uncertainty = clock_uncertainty_us(clock, rank, [r for r in m.ranks if r != rank])
    slow = kernels.same_kernels_slower and not routing
    shares, classified = _cause_shares(terms, known, slow, uncertainty)
    if shares:
        cause = max(shares, key=lambda c: (shares[c], c))
        explained = shares[cause]
    else:
        cause, explained = _classify(lateness, compute, idle, carried, slow, uncertainty)
    phase = _main_phase(m, late, terms.lateness_us)
    finding = StragglerCause(
        rank=rank, cause=cause, explained_share=explained, cause_shares=shares, classified_lateness_us=classified,
        wait_share=share, late_instances=int(late.sum()),
        median_lateness_us=_nan_median(terms.lateness_us[late]), mean_lateness_us=lateness,
        mean_extra_compute_us=compute, mean_extra_idle_us=idle, mean_carried_us=carried, op_duration_ratio=ratio,
        ops_compared=kernels.names_compared, same_kernel_excess_us=kernels.same_kernel_excess_us,
        extra_kernel_us=kernels.extra_us, extra_kernels=kernels.extra_kernels, expected_slowdown_us=slowdown, clock_uncertainty_us=uncertainty, phase=phase,
        phase_vs_peers_pct=_phase_vs_peers_pct(results, rank, phase),
        data_loader_excess_ms=data_loader_excess_ms(results, rank), what_if=_what_if(m, terms, late, row, results, floors_ms or {}),
        routing=routing, concentrated_kernels=kernels.concentrated_kernels)
    return _with_explanation(finding)


def _cause_shares(terms: _Terms, known: np.ndarray, slow: bool,
                  uncertainty: float | None) -> tuple[dict[str, float], float]:
    """Each late instance with every term known classified on its own terms; (cause -> share of the summed
    lateness of those instances, that sum)."""
    caused: Counter[str] = Counter()
    for i in np.flatnonzero(known):
        cause, _ = _classify(float(terms.lateness_us[i]), float(terms.extra_compute_us[i]),
                             float(terms.extra_idle_us[i]), float(terms.carried_us[i]), slow, uncertainty)
        caused[cause] += float(terms.lateness_us[i])
    total = sum(caused.values())
    return ({c: v / total for c, v in caused.most_common()} if total > 0 else {}), total


def _mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else 0.0


def _classify(lateness: float, compute: float, idle: float, carried: float, slow: bool,
              uncertainty: float | None) -> tuple[str, float]:
    """`slow`: the rank runs the same kernels longer (match_kernels), so extra compute is a slow device."""
    if uncertainty is None or uncertainty >= CLOCK_SHARE * lateness:
        return CAUSE_CLOCK, 0.0
    shares = {"compute": compute / lateness, "idle": idle / lateness, "carried": carried / lateness} if lateness > 0 else {}
    if not shares or max(shares.values()) < MIN_EXPLAINED_SHARE:
        return CAUSE_UNEXPLAINED, 0.0
    term = max(shares, key=shares.get)
    explained = min(shares[term], 1.0)
    if term == "carried":
        return CAUSE_NETWORK, explained
    if term == "idle":
        return CAUSE_HOST, explained
    return (CAUSE_SLOW_DEVICE if slow else CAUSE_WORK), explained


@dataclass(frozen=True, kw_only=True)
class KernelMatch:
    """A rank's compute kernels matched to its peers' by name and launch count (module docstring)."""

    ratio: float | None
    """Its time in the launches both ran over the peers' time in them; None: no name shared."""
    names_compared: int
    same_kernel_excess_us: float
    extra_us: float
    extra_kernels: list[str]
    slowed_time_share: float | None = None
    """Of the peers' time in the shared launches, the share held by kernels the rank runs at least
    SLOW_DEVICE_RATIO as long: near 1 when the whole device is slower, small when a few kernels are."""
    concentrated_kernels: list[str] = field(default_factory=list)
    """Where the slow-down is concentrated (slowed_time_share < UNIFORM_SHARE): the kernels holding most of the
    same-kernel excess, with their ratio."""

    @property
    def uniform(self) -> bool:
        return self.slowed_time_share is None or self.slowed_time_share >= UNIFORM_SHARE

    @property
    def same_kernels_slower(self) -> bool:
        """A slow device: the same kernels take longer, the excess exceeds the extra work, and the slow-down is
        spread over the device's work (uniform); a few kernels much longer is more work in them (data-dependent:
        tokens, sequence length), not a slower device."""
        return (self.ratio is not None and self.ratio >= SLOW_DEVICE_RATIO
                and self.same_kernel_excess_us > self.extra_us and self.uniform)


def match_kernels(results: list[RankResult], rank: int) -> KernelMatch:
    """Per kernel (name and launch shape): the peers' median launch count and median duration against the
    rank's own."""
    mine = {_kernel_identity(o): o for r in results if r.rank == rank for o in r.op_durations}
    peer_ops: dict[tuple[str, str], list] = {}
    peers = [r for r in results if r.rank != rank]
    for result in peers:
        for op in result.op_durations:
            peer_ops.setdefault(_kernel_identity(op), []).append(op)
    shapes_of: dict[str, set[str]] = {}
    for name, shape in (*mine, *peer_ops):
        shapes_of.setdefault(name, set()).add(shape)
    own_us = peer_us = extra_us = slowed_peer_us = 0.0
    compared = 0
    extra: list[tuple[float, str, int]] = []
    excess: list[tuple[float, str, float]] = []
    for identity, op in mine.items():
        # the launch shape is named where it is what tells two kernels of one name apart
        name = _kernel_text(op, several_shapes=len(shapes_of[op.name]) > 1)
        theirs = peer_ops.get(identity, [])
        # a peer that never runs the name counts 0 launches
        peer_count = float(np.median([o.count for o in theirs] + [0] * (len(peers) - len(theirs)))) if peers else 0.0
        shared = min(float(op.count), peer_count)
        if theirs and shared > 0:
            compared += 1
            peer_median = float(np.median([o.median_us for o in theirs]))
            own_us += shared * op.median_us
            peer_us += shared * peer_median
            if peer_median > 0 and op.median_us >= SLOW_DEVICE_RATIO * peer_median:
                slowed_peer_us += shared * peer_median
                excess.append((shared * (op.median_us - peer_median), name, op.median_us / peer_median))
        if op.count > peer_count:
            surplus = op.count - peer_count
            extra_us += surplus * op.median_us
            extra.append((surplus * op.median_us, name, int(round(surplus))))
    named = [f"{name} (+{n} launches, {us / 1000:.2f} ms)"
             for us, name, n in sorted(extra, key=lambda e: (-e[0], e[1]))[:EXTRA_KERNELS_NAMED]]
    ratio = own_us / peer_us if compared and peer_us > 0 else None
    share = slowed_peer_us / peer_us if compared and peer_us > 0 else None
    concentrated = [] if share is None or share >= UNIFORM_SHARE else [
        f"{name} ({kernel_ratio:.2f}x, +{us / 1000:.2f} ms)"
        for us, name, kernel_ratio in sorted(excess, key=lambda e: (-e[0], e[1]))[:EXTRA_KERNELS_NAMED]]
    return KernelMatch(ratio=ratio, names_compared=compared, same_kernel_excess_us=own_us - peer_us,
                       extra_us=extra_us, extra_kernels=named, slowed_time_share=share,
                       concentrated_kernels=concentrated)


def _kernel_identity(op) -> tuple[str, str]:
    """The same kernel is the same name launched with the same grid and block: a bigger grid of one name is
    more work, not the same work done slower."""
    return op.name, op.launch_shape


def _kernel_text(op, *, several_shapes: bool) -> str:
    """A kernel as a reader tells it apart: its short name, and its launch shape where one name runs with
    several (its launching op's input shapes where recorded, else its grid)."""
    name = short_kernel_name(op.name)
    if not several_shapes or not op.launch_shape:
        return name
    shape = op.launch_shape
    return f"{name} ({shape[shape.index('inputs '):] if 'inputs ' in shape else shape})"


def clock_uncertainty_us(clock: ClockAlignment, rank: int, peers: list[int]) -> float | None:
    """Median over peers of the uncertainty of the offset between the rank's host and the peer's."""
    host_of = {r: h for h in clock.hosts for r in h.ranks}
    if rank not in host_of:
        return 0.0
    values = []
    for peer in peers:
        if peer not in host_of or host_of[peer].host == host_of[rank].host:
            values.append(0.0)
            continue
        mine, theirs = _host_uncertainty(host_of[rank]), _host_uncertainty(host_of[peer])
        values.append(float("inf") if mine is None or theirs is None else mine + theirs)
    median = float(np.median(values)) if values else 0.0
    return None if np.isinf(median) else median


def _host_uncertainty(host) -> float | None:
    if host.source == SOURCE_REFERENCE_HOST:
        return 0.0
    if host.source == SOURCE_COLLECTIVES:
        return host.collective_spread_us or 0.0
    if host.source == SOURCE_MEASURED:
        return host.measured_uncertainty_us or 0.0
    return None


def data_loader_excess_ms(results: list[RankResult], rank: int) -> float | None:
    """Mean over the rank's steps of its DataLoader time minus the peers' median for that step."""
    by_step: dict[int, dict[int, float]] = {}
    for result in results:
        for step in result.steps:
            if step.data_loader_ms is not None:
                by_step.setdefault(step.step, {})[result.rank] = step.data_loader_ms
    excess = [times[rank] - float(np.median([v for r, v in times.items() if r != rank]))
              for times in by_step.values() if rank in times and len(times) > 1]
    return float(np.mean(excess)) if excess else None


def _main_phase(m: ArrivalMatrix, late: np.ndarray, lateness_us: np.ndarray) -> str:
    """The phase whose late instances add up to the most lateness ("" for instances outside phases)."""
    caused: Counter[str] = Counter()
    for phase, on, amount in zip(m.phases, late, lateness_us):
        if on:
            caused[phase] += float(amount)
    return caused.most_common(1)[0][0] if caused else ""


def _phase_vs_peers_pct(results: list[RankResult], rank: int, phase: str) -> float | None:
    if not phase:
        return None
    means = {r.rank: float(np.mean([s.phases_ms[phase] for s in r.steps if phase in s.phases_ms]))
             for r in results if any(phase in s.phases_ms for s in r.steps)}
    peers = [v for r, v in means.items() if r != rank]
    if rank not in means or not peers or float(np.median(peers)) <= 0:
        return None
    return 100.0 * (means[rank] - float(np.median(peers))) / float(np.median(peers))


def _what_if(m: ArrivalMatrix, terms: _Terms, late: np.ndarray, row: int,
             results: list[RankResult], floors_ms: dict[int, float]) -> list[StepWhatIf]:
    step_times: dict[int, float] = {}
    for result in results:
        for step in result.steps:
            step_times[step.step] = max(step_times.get(step.step, 0.0), step.step_time_ms)
    columns = np.flatnonzero(late)
    caused = {step: us / 1000.0 for step, us in
              caused_by_step(m, columns, _caused_us(m, terms, late, row)[columns]).items()} if columns.size else {}
    peers, own = _peer_compute_ms(m, row), _peer_own_time_ms(m, results, m.ranks[row])
    what_if = []
    for step in sorted(step_times):
        if step not in caused:
            continue
        floor = min(max(floors_ms.get(step, 0.0), peers.get(step, 0.0), own.get(step, 0.0), 0.0), step_times[step])
        wait = clamp_caused_wait_ms(caused[step], step_times[step], floor)
        what_if.append(StepWhatIf(step=step, step_time_ms=step_times[step], caused_wait_ms=wait,
                                  projected_step_ms=step_times[step] - wait, floor_ms=floor))
    return what_if


def _peer_own_time_ms(m: ArrivalMatrix, results: list[RankResult], rank: int) -> dict[int, float]:
    """step -> the longest, over the other ranks, of their step time less their waiting in it: their own work,
    which stays were `rank` on time (analysis/quantities.py "compute floor")."""
    waiting = waiting_by_step(m)
    own: dict[int, float] = {}
    for result in results:
        if result.rank == rank:
            continue
        for step in result.steps:
            waited_ms = waiting.get(step.step, {}).get(result.rank, 0.0) / 1000.0
            own[step.step] = max(own.get(step.step, 0.0), step.step_time_ms - waited_ms)
    return own


def _peer_compute_ms(m: ArrivalMatrix, row: int) -> dict[int, float]:
    """step -> the computation its other ranks needed between the step's collectives (the median over them
    of each instance's interval compute, summed, less the step's first instance, whose interval starts in the
    step before): the step cannot be shorter were this rank on time."""
    others = np.delete(m.interval_compute_us, row, axis=0)
    if others.size == 0:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # an instance no other rank took part in
        medians = np.nanmedian(others, axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        starts = np.nanmedian(m.start_us, axis=0)
    first: dict[int, int] = {}   # each step's first collective: its interval reaches back into the step before
    for column, start in enumerate(starts):
        step = m.keys[column][0]
        if finite(start) is not None and (step not in first or start < starts[first[step]]):
            first[step] = column
    floors: dict[int, float] = {}
    for column, value in enumerate(medians):
        step = m.keys[column][0]
        if finite(value) is not None and value > 0 and first.get(step) != column:
            floors[step] = floors.get(step, 0.0) + float(value) / 1000.0
    return floors


def _caused_us(m: ArrivalMatrix, terms: _Terms, late: np.ndarray, row: int) -> np.ndarray:
    """Per instance, the rank's lateness minus what it inherited from a previous instance it was also last at."""
    column_ending_at = {float(end): column for column, end in enumerate(m.end_us[row]) if finite(end) is not None}
    previous = m.previous_end_us[row] if m.previous_end_us is not None else np.full(len(m.keys), np.nan)
    caused = terms.lateness_us.copy()
    for column in np.flatnonzero(late):
        before = column_ending_at.get(float(previous[column]))
        if before is not None and late[before] and finite(terms.carried_us[column]) is not None:
            caused[column] -= float(np.clip(terms.carried_us[column], 0.0, terms.lateness_us[column]))
    return caused


def _with_explanation(f: StragglerCause) -> StragglerCause:
    return dataclasses.replace(f, explanation=explain(f))


DATA_LOADER_MENTION_MS = 0.05
"""A DataLoader excess below this (or a tenth of the lateness) explains nothing and is not mentioned."""


def explain(f: StragglerCause) -> str:
    """One sentence: the cause and the figures it rests on."""
    head = (f"rank {f.rank} ({100 * f.wait_share:.0f}% of the waiting, last at {f.late_instances} collectives, "
            f"{f.mean_lateness_us / 1000:.2f} ms late on average)")
    ratio = f"{f.op_duration_ratio:.2f}x" if f.op_duration_ratio is not None else "n/a"
    reasons = {
        CAUSE_WORK: (f"computes {f.mean_extra_compute_us / 1000:.2f} ms more before each "
                     + (f"with kernels of the same speed ({ratio} the peers' durations)"
                        if f.op_duration_ratio is None or f.op_duration_ratio < SLOW_DEVICE_RATIO else
                        f"while the kernels its peers also run take {ratio} as long")
                     + (f": more work: {f.routing}" if f.routing else
                        f": the slow-down is in a few kernels, not the device's (the others run at its peers' "
                        f"speed): more work in {'; '.join(f.concentrated_kernels)} (data-dependent: tokens, "
                        "sequence length)" if f.concentrated_kernels else
                        f": more work, kernels its peers do not run as often: {'; '.join(f.extra_kernels)}"
                        if f.extra_kernels else ": more work, e.g. uneven expert routing")),
        CAUSE_SLOW_DEVICE: (f"runs the same host ops {ratio} as long as its peers ({f.ops_compared} names, the same "
                            f"counts), {f.mean_extra_compute_us / 1000:.2f} ms more compute for the same work: "
                            "its process gets less CPU (other processes or ranks on its cores, more threads than "
                            "cores) or runs on a slower core"
                            if f.has_gpu is False else
                            f"runs the same kernels {ratio} as long as its peers ({f.ops_compared} names, the same "
                            f"launch counts), {f.mean_extra_compute_us / 1000:.2f} ms more compute for the same "
                            "work: a slow or throttled device, or contention"),
        CAUSE_HOST: (f"is idle {f.mean_extra_idle_us / 1000:.2f} ms longer than its peers before each, not computing "
                     "more: host-side delay (launch gaps, syncs, input wait, CPU contention)"),
        CAUSE_NETWORK: (f"leaves the previous collective {f.mean_carried_us / 1000:.2f} ms after its peers: "
                        + ("its side of the exchange progresses more slowly (its ranks share one host: no network "
                           "between them, its collective thread's share of the CPU)" if shares_cpu_host(f) else
                           "its data movement is slower (network / link)")),
        CAUSE_CLOCK: (f"but the clock offset to its peers is uncertain by "
                      f"{'an unknown amount' if f.clock_uncertainty_us is None else f'{f.clock_uncertainty_us / 1000:.2f} ms'}: "
                      "too large to tell why"),
        CAUSE_UNEXPLAINED: (f"no single cause: extra compute {f.mean_extra_compute_us / 1000:.2f} ms, extra idle "
                            f"{f.mean_extra_idle_us / 1000:.2f} ms, carried {f.mean_carried_us / 1000:.2f} ms"),
    }
    sentence = f"{head} {reasons[f.cause]}"
    others = [f"{c} {100 * v:.0f}%" for c, v in f.cause_shares.items() if c != f.cause and v >= MIXED_SHARE]
    if others:
        sentence += f" (that is {100 * f.explained_share:.0f}% of its lateness; also {', '.join(others)})"
    if f.routing and f.cause != CAUSE_WORK:
        sentence += f"; the MoE view shows {f.routing}"
    if shares_cpu_host(f):
        sentence += "; " + SHARED_CPU_HOST_TEXT.format(ranks=len(f.host_peers) + 1,
                                                       carried=max(f.mean_carried_us, 0.0) / 1000)
    if f.cause == CAUSE_HOST and f.data_loader_excess_ms is not None and \
            f.data_loader_excess_ms >= max(DATA_LOADER_MENTION_MS, 0.1 * f.mean_lateness_us / 1000):
        sentence += f"; its DataLoader fetch takes {f.data_loader_excess_ms:.2f} ms per step more than its peers'"
    if f.phase == "backward" and f.phase_vs_peers_pct is not None:
        sentence += "; found from its late arrival at collectives issued in backward (gradient buckets)"
        sentence += (f", while its backward time is within {EQUALIZED_PCT:g}% of the peers' "
                     f"({f.phase_vs_peers_pct:+.1f}%: the all-reduces equalize it, phase times cannot tell)"
                     if abs(f.phase_vs_peers_pct) < EQUALIZED_PCT else
                     f"; its backward time is {f.phase_vs_peers_pct:+.1f}% vs the peers'")
    for basis in (WHAT_IF_REPLAYED, WHAT_IF_ARITHMETIC):
        steps = [w for w in f.what_if if w.basis == basis]
        if steps:
            before = float(np.mean([w.step_time_ms for w in steps]))
            after = float(np.mean([w.projected_step_ms for w in steps]))
            notes = sorted({w.not_replayed for w in steps if w.not_replayed})
            note = notes[0] + (f" (and {len(notes) - 1} other reasons)" if len(notes) > 1 else "") if notes else ""
            sentence += (f"; {what_if_text(f.rank, basis, note)}, {_count_steps(len(steps))} would take "
                         f"{after:.2f} ms instead of {before:.2f} ms (mean)")
    return sentence


SHARED_CPU_HOST_TEXT = (
    "all {ranks} ranks run on one host and share its CPU cores: contention there (the ranks' compute and "
    "collective threads, other processes) can keep whichever rank falls behind consistently late (on average it leaves "
    "a collective {carried:.2f} ms after its peers, so it starts what follows late), so this can be the "
    "host's load rather than this rank's: no node or device to exclude; give each rank its own cores (taskset, "
    "fewer ranks per host) and measure again")


def shares_cpu_host(f: StragglerCause) -> bool:
    """A CPU rank whose every peer runs on its host: a lateness not from more compute can be the ranks (and other
    processes) contending for that host's cores; nothing about the rank itself needs it."""
    ranks = f.significance.ranks if f.significance is not None else None
    return (f.has_gpu is False and ranks is not None and len(f.host_peers) + 1 >= ranks >= 2
            and f.cause in (CAUSE_HOST, CAUSE_NETWORK, CAUSE_UNEXPLAINED))


def _count_steps(count: int) -> str:
    return "the step it was late in" if count == 1 else f"the {count} steps it was late in"
