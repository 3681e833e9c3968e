"""Pipeline-parallel analysis: sends paired with receives across ranks, bubble time per stage, the slowest stage.

Inputs are the per-rank point-to-point records (per_rank/p2p.py). Definitions:
  - a **transfer** pairs a send on rank A to peer B with the receive on B from peer A of the same step,
    direction and micro-batch (from the stage markers); without markers, the k-th send A -> B with the k-th
    receive on B of the same step is not decidable and nothing is paired;
  - a stage's **bubble** in a step is the time it spends in receives (recv spans / kernels): waiting for the
    previous stage's activations (forward) or the next stage's gradients (backward); its share is bubble over
    the step's wall time. The schedule's **theoretical bubble** is (p - 1) / (m + p - 1) for GPipe and 1F1B
    (p stages, m micro-batches) and (p - 1) / (v m + p - 1) interleaved (v stages per rank);
  - a stage's **compute per micro-batch** is its `pp_forward` + `pp_backward` time over the step, divided by
    the micro-batches it ran; the **slowest stage** has the largest. Every other stage waits for it, so in a
    pipeline the waits at sends / receives (and at the collectives after the schedule) point away from the
    slow stage, not at it: the slow stage is named by compute, never by who waited.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from fleetscope.analysis.per_rank.names import P2P_RECV, P2P_SEND
from fleetscope.analysis.per_rank.p2p import OUTSIDE_STEPS
from fleetscope.analysis.per_rank.rank import RankResult

SLOW_STAGE_FACTOR = 1.2
"""A stage is called out as the bottleneck when its compute per micro-batch is this much above the median."""


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One send paired with its receive; absolute times (microseconds since the epoch, each rank's clock)."""

    step: int
    direction: str
    microbatch: int
    src_rank: int
    dst_rank: int
    send_start_us: float
    recv_end_us: float
    recv_wait_us: float
    """How long the receive was open (the receiver's wait for this transfer)."""


@dataclass(frozen=True, kw_only=True)
class StageReport:
    rank: int
    stages: list[int]
    """Pipeline stages this rank holds (from its schedule marker; [] without one)."""
    steps: int
    """Steps with pipeline traffic averaged over."""
    step_ms: float
    """Mean wall time of those steps."""
    bubble_ms: float
    """Mean time per step in receives (module docstring)."""
    bubble_pct: float
    forward_wait_ms: float
    """Of bubble_ms: waiting for activations from the previous stage (needs markers; else 0)."""
    backward_wait_ms: float
    """Of bubble_ms: waiting for gradients from the next stage (needs markers; else 0)."""
    compute_per_microbatch_ms: float | None
    """pp_forward + pp_backward time per micro-batch (None: no stage ranges in the trace)."""
    sends: int
    recvs: int


@dataclass(frozen=True, kw_only=True)
class PipelineReport:
    schedule: str | None
    stages: int | None
    microbatches: int | None
    theoretical_bubble_pct: float | None
    """The schedule's own bubble (module docstring); None when the schedule is not known."""
    p2p_source: str | None
    ranks: list[StageReport] = field(default_factory=list)
    transfers: int = 0
    """Sends paired with their receive."""
    unpaired: int = 0
    """Sends and receives left without a partner."""
    slowest_rank: int | None = None
    slowest_stages: list[int] = field(default_factory=list)
    verdict: str = ""


def theoretical_bubble(schedule: str, stages: int, microbatches: int) -> float:
    """Share of a step a stage idles in an ideal pipeline (equal stages, no transfer time)."""
    per_rank = 2 if schedule == "interleaved_1f1b" else 1
    ranks = stages // per_rank
    return (ranks - 1) / (per_rank * microbatches + ranks - 1)


def pair_transfers(results: list[RankResult]) -> tuple[list[Transfer], int]:
    """Sends matched with receives by (step, direction, micro-batch, sender, receiver); (transfers, unpaired)."""
    sends, recvs = {}, {}
    for result in results:
        for call in result.p2p.calls:
            if call.peer is None or call.step == OUTSIDE_STEPS:
                continue
            if call.kind == P2P_SEND:
                sends[(call.step, call.direction, call.microbatch, result.rank, call.peer)] = (result, call)
            elif call.kind == P2P_RECV:
                recvs[(call.step, call.direction, call.microbatch, call.peer, result.rank)] = (result, call)
    transfers = []
    for key in sorted(sends.keys() & recvs.keys()):
        (sender, send), (receiver, recv) = sends[key], recvs[key]
        transfers.append(Transfer(step=key[0], direction=key[1], microbatch=key[2], src_rank=key[3], dst_rank=key[4],
                                  send_start_us=sender.absolute_us(send.start_us),
                                  recv_end_us=receiver.absolute_us(recv.end_us),
                                  recv_wait_us=recv.end_us - recv.start_us))
    return transfers, len(sends.keys() ^ recvs.keys())


def stage_report(result: RankResult) -> StageReport | None:
    """One rank's bubble and compute per micro-batch, averaged over its steps with pipeline traffic."""
    p2p = result.p2p
    step_ms = {s.step: s.step_time_ms for s in result.steps}
    recv_us, forward_us, backward_us = defaultdict(float), defaultdict(float), defaultdict(float)
    for call in p2p.calls:
        if call.kind == P2P_RECV and call.step in step_ms:
            wait = call.end_us - call.start_us
            recv_us[call.step] += wait
            if call.direction == "forward":
                forward_us[call.step] += wait
            elif call.direction == "backward":
                backward_us[call.step] += wait
    steps = sorted({c.step for c in p2p.calls if c.step in step_ms})
    if not steps:
        return None
    compute = defaultdict(float)
    forwards = defaultdict(int)
    for chunk in p2p.compute:
        if chunk.step in step_ms:
            compute[chunk.step] += chunk.duration_us
            forwards[chunk.step] += chunk.direction == "forward"
    per_microbatch = [compute[s] / forwards[s] / 1000.0 for s in steps if forwards[s]]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    step_mean = mean([step_ms[s] for s in steps])
    bubble = mean([recv_us[s] / 1000.0 for s in steps])
    return StageReport(
        rank=result.rank, stages=list(p2p.schedule.rank_stages) if p2p.schedule else [], steps=len(steps),
        step_ms=step_mean, bubble_ms=bubble, bubble_pct=100.0 * bubble / step_mean if step_mean > 0 else 0.0,
        forward_wait_ms=mean([forward_us[s] / 1000.0 for s in steps]),
        backward_wait_ms=mean([backward_us[s] / 1000.0 for s in steps]),
        compute_per_microbatch_ms=mean(per_microbatch) if per_microbatch else None,
        sends=sum(c.kind == P2P_SEND for c in p2p.calls), recvs=sum(c.kind == P2P_RECV for c in p2p.calls),
    )


def analyze_pipeline(results: list[RankResult]) -> PipelineReport | None:
    """The pipeline view of one window's ranks; None when no rank sends or receives point-to-point."""
    if not any(r.p2p.calls for r in results):
        return None
    schedule = next((r.p2p.schedule for r in results if r.p2p.schedule is not None), None)
    stages = [s for s in (stage_report(r) for r in results if r.rank is not None) if s is not None]
    transfers, unpaired = pair_transfers(results)
    theory = (100.0 * theoretical_bubble(schedule.schedule, schedule.stages, schedule.microbatches)
              if schedule else None)
    report = PipelineReport(
        schedule=schedule.schedule if schedule else None, stages=schedule.stages if schedule else None,
        microbatches=schedule.microbatches if schedule else None, theoretical_bubble_pct=theory,
        p2p_source=next((r.p2p.source for r in results if r.p2p.source), None), ranks=stages,
        transfers=len(transfers), unpaired=unpaired,
    )
    return _with_verdict(report)


def _with_verdict(report: PipelineReport) -> PipelineReport:
    timed = [s for s in report.ranks if s.compute_per_microbatch_ms is not None]
    bubbles = ", ".join(f"rank {s.rank} {s.bubble_pct:.0f}%" for s in report.ranks)
    theory = (f" (the {report.schedule} schedule's own bubble at p={report.stages}, m={report.microbatches}: "
              f"{report.theoretical_bubble_pct:.0f}%)" if report.theoretical_bubble_pct is not None else "")
    sentence = f"pipeline bubble (time waiting in receives, share of the step): {bubbles}{theory}"
    if len(timed) < 2:
        return _replace(report, verdict=sentence)
    slowest = max(timed, key=lambda s: s.compute_per_microbatch_ms)
    others = [s.compute_per_microbatch_ms for s in timed if s is not slowest]
    median = statistics.median(others)
    stage_names = ", ".join(map(str, slowest.stages)) if slowest.stages else "?"
    if median > 0 and slowest.compute_per_microbatch_ms >= SLOW_STAGE_FACTOR * median:
        waiting = [s for s in report.ranks if s is not slowest]
        wait_text = ", ".join(f"rank {s.rank} {s.bubble_ms:.1f} ms" for s in waiting)
        sentence = (f"stage {stage_names} (rank {slowest.rank}) is the slowest pipeline stage: "
                    f"{slowest.compute_per_microbatch_ms:.2f} ms of compute per micro-batch vs "
                    f"{median:.2f} ms on the other stages ({slowest.compute_per_microbatch_ms / median:.1f}x); "
                    f"the other stages wait for it in receives ({wait_text} per step); {sentence}")
        return _replace(report, slowest_rank=slowest.rank, slowest_stages=slowest.stages, verdict=sentence)
    return _replace(report, verdict=f"no pipeline stage is much slower than the others; {sentence}")


def _replace(report: PipelineReport, **changes) -> PipelineReport:
    return dataclasses.replace(report, **changes)
