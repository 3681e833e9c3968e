"""The communication family: DDP's gradient buckets, and which way their size should move."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .model import STRAGGLER_SHARE, Evidence, Finding, Rule, settings_change, step_gain, trainer_change

EXPOSED_COMM_SHARE = 0.15
OVERLAP_RECOVERABLE = 0.5
"""Share of the exposed communication smaller buckets are assumed to hide behind backward."""
DEFAULT_BUCKET_MB = 25.0
"""DDP's default bucket_cap_mb: large enough that an all-reduce's fixed cost is small beside moving it."""
SMALL_BUCKET_MB = 1.0
"""Buckets below this (mean MiB per all-reduce) are latency-bound: each all-reduce costs a launch, a
rendezvous of the ranks and a few network round trips whatever it carries (NCCL and gloo reach their
bandwidth only at several MiB)."""
MANY_BUCKETS = 8
"""At least this many all-reduces per step of small buckets: the fixed costs add up."""
FEW_BUCKETS = 2
"""At most this many buckets, the last one holding LATE_BUCKET_SHARE of the gradients: nothing overlaps."""
LATE_BUCKET_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """Which way the DDP bucket size should move, and the evidence that says so."""

    direction: str
    """"raise" (many small, latency-bound all-reduces), "lower" (one large bucket ready at the end of
    backward, nothing to overlap it with) or "split" (exposed with several buckets: start earlier)."""
    bucket_mb: float
    """The proposed bucket_cap_mb."""
    buckets: float | None
    mean_bucket_mb: float | None
    new_buckets: float | None
    """Buckets per step expected at the proposed size."""


def plan_buckets(e: Evidence) -> BucketPlan | None:
    """The direction from the buckets themselves (step metrics: count and MiB per step; else the trace's
    collectives per step and, on NCCL, its all-reduce sizes). None: no change that would differ."""
    bucket = float(e.setting("parallel", "bucket_cap_mb", DEFAULT_BUCKET_MB))
    buckets = e.comm_buckets if e.comm_buckets is not None else e.trace_collectives_per_step
    mean_mb = (e.comm_mb / e.comm_buckets if e.comm_mb is not None and e.comm_buckets else e.trace_allreduce_mb)
    small = mean_mb < SMALL_BUCKET_MB if mean_mb is not None else bucket < SMALL_BUCKET_MB
    if buckets is not None and buckets >= MANY_BUCKETS and small:
        target = DEFAULT_BUCKET_MB if bucket < DEFAULT_BUCKET_MB else 4 * bucket
        return BucketPlan(direction="raise", bucket_mb=target, buckets=buckets, mean_bucket_mb=mean_mb,
                          new_buckets=_buckets_at(e, target, buckets, bucket))
    late_share = (e.comm_last_bucket_mb / e.comm_mb if e.comm_last_bucket_mb is not None and e.comm_mb else None)
    if buckets is not None and buckets <= FEW_BUCKETS and (late_share is None or late_share >= LATE_BUCKET_SHARE):
        target = max(SMALL_BUCKET_MB, min(bucket / 2, (e.comm_mb or 2 * bucket) / 4))
        new_buckets = _buckets_at(e, target, buckets, bucket)
        if target >= bucket or (new_buckets is not None and new_buckets <= buckets):
            return None                     # the gradients fit one small bucket: splitting cannot overlap
        return BucketPlan(direction="lower", bucket_mb=target, buckets=buckets, mean_bucket_mb=mean_mb,
                          new_buckets=new_buckets)
    if bucket / 2 < SMALL_BUCKET_MB:
        return None
    return BucketPlan(direction="split", bucket_mb=bucket / 2, buckets=buckets, mean_bucket_mb=mean_mb,
                      new_buckets=_buckets_at(e, bucket / 2, buckets, bucket))


def _buckets_at(e: Evidence, target_mb: float, buckets: float, bucket_mb: float) -> float | None:
    """Buckets per step at `target_mb`: the gradient MiB over it (at least 1), else scaled from now."""
    if e.comm_mb is not None:
        return float(max(1, math.ceil(e.comm_mb / target_mb)))
    return max(1.0, buckets * bucket_mb / target_mb) if buckets else None


def gradient_buckets(e: Evidence) -> Finding | None:
    """DDP with exposed communication over EXPOSED_COMM_SHARE of the span; the direction comes from the
    buckets (plan_buckets):
      raise  MANY_BUCKETS or more per step, SMALL_BUCKET_MB or less each: every all-reduce pays a fixed
             cost; larger buckets (DEFAULT_BUCKET_MB) pay it fewer times. Gain: the exposed time in
             proportion to the all-reduces removed (exposed x (1 - new/old buckets)); confidence medium.
             A straggler does not silence it: fewer all-reduces also means fewer rendezvous to wait at.
      lower  FEW_BUCKETS or fewer, the last holding LATE_BUCKET_SHARE of the gradients, overlap < 50%:
             that bucket is ready only when backward ends; smaller ones start during backward.
      split  exposed with several buckets and overlap < 50%: halve the bucket to start earlier.
    lower and split are assumed to hide OVERLAP_RECOVERABLE of the exposed time (confidence low), and stay
    silent when a straggler causes most of the waiting (then the exposed time is waiting for it)."""
    if e.setting("parallel", "mode") != "ddp" or e.exposed_comm_pct is None:
        return None
    if e.exposed_comm_pct < 100 * EXPOSED_COMM_SHARE:
        return None
    plan = plan_buckets(e)
    if plan is None:
        return None
    if plan.direction != "raise":
        if any(f.wait_share >= STRAGGLER_SHARE for f in e.stragglers) or (e.overlap_pct or 0.0) >= 50.0:
            return None             # the exposed time is then mostly waiting for that rank: buckets do not help
    bucket = float(e.setting("parallel", "bucket_cap_mb", DEFAULT_BUCKET_MB))
    exposed_ms = e.comm_exposed_ms if e.comm_exposed_ms is not None else (
        e.exposed_comm_pct / 100 * e.step_ms if e.step_ms else None)
    if plan.direction == "raise":
        kept = plan.new_buckets / plan.buckets if plan.new_buckets is not None and plan.buckets else 1.0
        gain_ms = exposed_ms * (1.0 - kept) if exposed_ms is not None else None
    else:
        gain_ms = OVERLAP_RECOVERABLE * exposed_ms if exposed_ms is not None else None
    gain, pct = step_gain(e, gain_ms)
    return Finding(rule="gradient_buckets", title=_BUCKET_TITLES[plan.direction],
                   evidence=_bucket_evidence(e, plan, bucket), expected_gain_ms=gain, expected_gain_pct=pct,
                   confidence="medium" if plan.direction == "raise" else "low",
                   **trainer_change(settings_change(f"parallel.bucket_cap_mb={plan.bucket_mb:g}")),
                   why=_bucket_why(e, plan, bucket))


_BUCKET_TITLES = {
    "raise": "many small gradient all-reduces: each pays a fixed cost",
    "lower": "the gradients all-reduce in one bucket after backward",
    "split": "gradient all-reduces are not hidden behind backward",
}


def _bucket_evidence(e: Evidence, plan: BucketPlan, bucket: float) -> dict[str, float | int | str]:
    evidence: dict[str, float | int | str] = {"exposed_comm_pct": round(e.exposed_comm_pct or 0.0, 1),
                                              "overlap_pct": round(e.overlap_pct or 0.0, 1), "bucket_cap_mb": bucket}
    known = {"buckets_per_step": plan.buckets, "mean_bucket_mb": plan.mean_bucket_mb,
             "grad_mb_per_step": e.comm_mb, "last_bucket_mb": e.comm_last_bucket_mb,
             "trace_collectives_per_step": e.trace_collectives_per_step, "expected_buckets": plan.new_buckets}
    evidence.update({k: round(v, 4) for k, v in known.items() if v is not None})
    return evidence


def _bucket_why(e: Evidence, plan: BucketPlan, bucket: float) -> str:
    exposed = f"{e.exposed_comm_pct:.0f}% of the step is communication nothing overlaps ({e.overlap_pct or 0:.0f}% overlap)"
    count = f"{plan.buckets:.0f} all-reduces per step" if plan.buckets is not None else "the all-reduces"
    size = f" of {plan.mean_bucket_mb:.3g} MiB on average" if plan.mean_bucket_mb is not None else ""
    if plan.direction == "raise":
        return (f"{exposed}; {count}{size} (bucket_cap_mb={bucket:g}): each pays a launch, a rendezvous of the "
                f"ranks and network round trips whatever it carries; {plan.bucket_mb:g} MiB buckets need "
                f"{plan.new_buckets or 1:.0f}")
    if plan.direction == "lower":
        return (f"{exposed}; {count}{size}, the last ready only when backward ends; {plan.bucket_mb:g} MiB "
                "buckets are ready, and sent, while backward still runs")
    return f"{exposed}; smaller buckets are ready, and sent, earlier in backward"


RULES = (
    Rule(find=gradient_buckets, recovers="exposed communication",
         in_user_code="DistributedDataParallel(model, bucket_cap_mb=...) as the finding's evidence suggests"),
)
