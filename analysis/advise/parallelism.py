"""The parallelism family: one rank that holds the others back, and why."""

from __future__ import annotations

import numpy as np
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, CAUSE_SLOW_DEVICE, CAUSE_WORK
from fleetscope.analysis.cross_rank.whole_run import EVIDENCE_SOURCE, SIGNAL_DATA
from fleetscope.analysis.quantities import (BASIS_STEP_METRICS, SLOWEST_RANK, bounded_gain, clamp_caused_wait_ms,
                                            metrics_floor_ms, step_ranges, whole_run_gain)

from .moe.balance import balance_change
from .input import RECOMMENDED_WORKERS, data_workers_change, data_workers_in_code, recommended_workers
from .model import STRAGGLER_SHARE, Evidence, Finding, Rule, trainer_change

INPUT_WAIT_SHARE = 0.5
"""A host-side straggler whose extra DataLoader time is at least this share of its mean lateness waits for input."""

CPU_SLOW_CHANGE = ("look at that rank's process and its host's load: on a CPU rank the same ops taking longer means "
                   "its process gets less CPU (other processes or ranks on its cores, more threads than cores: "
                   "OMP_NUM_THREADS / torch.set_num_threads); e.g. top -H -p PID, and pin each rank to its own cores")
SHARED_HOST_SLOW_CHANGE = ("check that rank's GPU, not its node (its host also runs ranks at full speed): its clocks, "
                           "power and thermals (nvidia-smi -q -d PERFORMANCE -i GPU) and other processes on it "
                           "(nvidia-smi; its process's CPU load)")
"""A slow device on a CPU rank, or on a host shared with fast ranks: no node remedy (`straggler`)."""
CONFIDENCE_ORDER = ("low", "medium", "high")

_STRAGGLER_CHANGES = {
    CAUSE_SLOW_DEVICE: "take the rank's GPU or node out of the pool (e.g. sbatch --exclude=HOST) and check its "
                       "clocks, power and thermals (nvidia-smi -q -d PERFORMANCE)",
    CAUSE_WORK: "balance the work across ranks: give each the same tokens per step (pack or bucket sequences by "
                "length so every rank's batch holds as many) and the same share of the model (pipeline stages, "
                "expert placement)",
    CAUSE_HOST: "find the host-side delay on that rank (its CPU threads in the merged trace: syncs, Python, "
                "other processes on its CPUs) and pin its CPUs",
}


def _from_whole_run(e: Evidence, slow) -> Finding:
    """The whole run's episode that stands out (Evidence.whole_run_straggler: its per-step excess over its peers
    against its own step-to-step spread, the significance rule of the profiled steps, on every steady step of the
    episode). Gain: analysis/quantities.py "gain, whole run", bounded by the steady steps' floor. The change: the
    trace's cause for that rank where a window found one; else by the signal that names it (an input wait gets
    data workers; a late arrival the rank's process and a window over those steps), never a GPU or node remedy
    without a cause that calls for one."""
    basis = (f"whole run: step metrics (timeline), the episode's steps {slow.from_step}-{slow.to_step} "
             f"({slow.steps} steady), {SLOWEST_RANK}")
    gain = whole_run_gain(slow.excess_ms, slow.step_ms, basis, _metrics_floor_ms(e))
    own = [f for f in e.stragglers if f.rank == slow.rank and f.cause in _STRAGGLER_CHANGES]
    top = max(own, key=lambda f: f.wait_share, default=None)
    evidence = {"rank": slow.rank, "source": EVIDENCE_SOURCE, "steady_steps": slow.steps,
                "from_step": slow.from_step, "to_step": slow.to_step, "signal": slow.signal,
                "excess_ms": round(slow.excess_ms, 3), "lateness_t": round(slow.significance.t or 0.0, 2),
                "needed_t": round(slow.significance.needed_t or 0.0, 2)}
    change, kind = (_cause_change(top, e), top.cause) if top is not None else _signal_change(slow, e, evidence)
    why = (f"over {slow.steps} steady steps ({slow.from_step}-{slow.to_step}) rank {slow.rank} was "
           f"{slow.signal} by {slow.excess_ms:.1f} ms more than its peers' median each step, and stands out from "
           f"its step-to-step spread ({slow.significance.evidence()}): the others wait for it"
           + (f"; the profiled steps give the cause: {top.explanation}" if top is not None else ""))
    return Finding(rule="straggler", title=f"rank {slow.rank} holds the others back ({kind}; whole run, "
                                           f"{slow.steps} steady steps)", evidence=evidence,
                   expected_gain_ms=gain.ms if gain else None, expected_gain_pct=gain.pct if gain else None,
                   gain_of_ms=gain.of_ms if gain else None, gain_basis=gain.basis if gain else "",
                   confidence=slow.significance.confidence, **change, why=why, recovers=_straggler_recovers(kind),
                   ranks=[slow.rank], windows=[])


def _signal_change(slow, e: Evidence, evidence: dict) -> tuple[dict, str]:
    """The change for a whole-run straggler without a cause from the traces: by the signal that names it."""
    if slow.signal == SIGNAL_DATA:
        if e.setting("data", "num_workers", 0) < recommended_workers(e):
            evidence["recommended_workers"] = recommended_workers(e)
            return trainer_change(data_workers_change(e), note="its input pipeline is the delay"), "input wait"
        return {"change": "its input pipeline is the delay although it has workers: more workers, or a faster "
                          "source (local copy, pre-tokenized data)"}, "input wait"
    look = CPU_SLOW_CHANGE if e.basis == "cpu" else (
        f"find what rank {slow.rank} does before its first collective that its peers do not (its process, its "
        f"host's load, its share of the work)")
    return {"change": f"{look}; a window over those steps shows which ops take longer ({slow.to_record})"}, slow.signal


def straggler(e: Evidence) -> Finding | None:
    """The rank the whole run proves the others wait for (`_from_whole_run`), where its timelines do; else the
    rank the verdict names the straggler (analysis/quantities.py job_straggler: most waiting caused over
    all windows, consistently) when it causes >= STRAGGLER_SHARE of the waiting for a cause with a remedy. Its cause: its cause finding
    in the window where it causes the largest share. Gain: the mean what-if saving (the step less its what-if:
    replayed, or arithmetic where the model cannot hold the step; quantities.py "what-if") over its steps in every
    window (causes.py, clamped to the step's compute floor, and to the step metrics' floor where the run has
    them: analysis/quantities.py "compute floor"), as a share of those steps' mean time. A host-side
    delay that is its DataLoader (INPUT_WAIT_SHARE of its lateness) gets data workers as the change; data
    workers are never suggested when its DataLoader takes no longer than its peers'."""
    slow = e.whole_run_straggler
    if slow is not None and slow.significance is not None and slow.significance.stands_out:
        return _from_whole_run(e, slow)
    job = e.job_straggler
    if job is None or not job.consistent or job.share < STRAGGLER_SHARE:
        return None             # the verdict names no straggler (no single rank the others wait for): neither does advise
    own = [(f, w) for f, w in zip(e.stragglers, _padded(e.straggler_windows, len(e.stragglers))) if f.rank == job.rank]
    top, _ = max(own, key=lambda fw: fw[0].wait_share, default=(None, None))
    if top is None or top.cause not in _STRAGGLER_CHANGES:
        return None
    what_if = [(w, step) for f, w in own for step in f.what_if]
    floor = _metrics_floor_ms(e)
    saved = [clamp_caused_wait_ms(step.step_time_ms - step.projected_step_ms, step.step_time_ms,
                                  max(step.floor_ms, floor)) for _, step in what_if]
    of_ms = float(np.mean([step.step_time_ms for _, step in what_if])) if what_if else None
    bounded = bounded_gain(float(np.mean(saved)) if saved else None, of_ms, _what_if_basis(what_if))
    windows = sorted({w for _, w in own}, key=lambda w: -1 if w is None else w)
    evidence = {"rank": job.rank, "wait_share": round(job.share, 3), "windows": _windows_text(windows),
                "mean_lateness_ms": round(top.mean_lateness_us / 1000, 3)}
    change, kind = _cause_change(top, e), top.cause
    if top.significance is not None:
        evidence.update(profiled_steps=top.significance.steps, lateness_t=round(top.significance.t or 0.0, 2),
                        needed_t=round(top.significance.needed_t or 0.0, 2))
    excess = top.data_loader_excess_ms
    if top.cause == CAUSE_HOST and excess is not None and excess > 0 and excess >= INPUT_WAIT_SHARE * top.mean_lateness_us / 1000:
        evidence["data_loader_excess_ms"] = round(excess, 3)
        if e.setting("data", "num_workers", 0) < recommended_workers(e):
            evidence["recommended_workers"] = recommended_workers(e)
            change = trainer_change(data_workers_change(e), note="its input pipeline is the delay")
        else:
            change = {"change": "its input pipeline is the delay although it has workers: more workers, or a faster "
                                "source (local copy, pre-tokenized data)"}
        kind = "input wait"
    return Finding(rule="straggler", title=f"rank {job.rank} holds the others back ({kind})", evidence=evidence,
                   expected_gain_ms=bounded.ms if bounded else None, expected_gain_pct=bounded.pct if bounded else None,
                   gain_of_ms=bounded.of_ms if bounded else None, gain_basis=bounded.basis if bounded else "",
                   confidence=_confidence(top),
                   **change, why=top.explanation, recovers=_straggler_recovers(kind), ranks=[job.rank],
                   windows=windows)


def _confidence(top) -> str:
    """The lower of the cause's ("high" when it explains >= 80% of the lateness, else "medium") and the significance
    rule's (stragglers.py straggler_confidence: profiled steps and ranks); the latter unknown in older reports."""
    by_cause = "high" if top.explained_share >= 0.8 else "medium"
    by_steps = top.significance.confidence if top.significance is not None else ""
    if by_steps not in CONFIDENCE_ORDER:
        return by_cause
    return min(by_cause, by_steps, key=CONFIDENCE_ORDER.index)


def _cause_change(top, e: Evidence) -> dict:
    """The remedy of the straggler's cause, as the finding's change (and apply where it is a setting)."""
    if top.cause == CAUSE_SLOW_DEVICE:
        return {"change": _slow_device_change(top, e)}
    if top.cause == CAUSE_WORK:
        return _work_change(top, e)
    return {"change": _STRAGGLER_CHANGES[top.cause]}


def _work_change(top, e: Evidence) -> dict:
    """More work on one rank: routing's change only where the MoE view holds a hot expert on that rank (the
    router's balancing, as moe_load_balance applies it); else the kernels that hold the extra work, and the
    work's balance across ranks, with no word of routing the MoE section does not support."""
    if top.routing:
        text, apply = balance_change(e)
        return {"change": f"{top.routing}: {text}", "apply": apply}
    named = (top.concentrated_kernels or top.extra_kernels)[:2]
    where = f" (its extra time sits in {'; '.join(named)})" if named else ""
    return {"change": _STRAGGLER_CHANGES[CAUSE_WORK] + where}


def _slow_device_change(top, e: Evidence) -> str:
    """A slow device's remedy: the node out of the pool only for a GPU rank alone on its host among the ranks seen;
    a CPU rank (no GPU activity in its trace) gets its process and host load, a GPU rank sharing its host with fast
    ranks its GPU."""
    cpu = top.has_gpu is False or (top.has_gpu is None and e.basis == "cpu")
    if cpu:
        return CPU_SLOW_CHANGE
    host = e.rank_hosts.get(top.rank) if e.rank_hosts else None
    shares_host = bool(top.host_peers) or (host is not None and any(
        h == host for rank, h in e.rank_hosts.items() if rank != top.rank))
    return SHARED_HOST_SLOW_CHANGE if shares_host else _STRAGGLER_CHANGES[CAUSE_SLOW_DEVICE]


def _metrics_floor_ms(e: Evidence) -> float:
    """The unprofiled steady steps' floor (0 without step metrics: the trace's own floors hold then)."""
    if not e.step_basis.startswith(BASIS_STEP_METRICS):
        return 0.0
    return metrics_floor_ms(e.step_ms, e.comm_exposed_ms) or 0.0


def _padded(windows: list, count: int) -> list:
    return list(windows) + [None] * (count - len(windows))


def _windows_text(windows: list[int | None]) -> str:
    return ", ".join("-" if w is None else str(w) for w in windows) or "-"


def _what_if_basis(what_if: list) -> str:
    by_window: dict = {}
    for window, step in what_if:
        by_window.setdefault(window, []).append(step.step)
    parts = [f"window {'-' if w is None else w} steps {step_ranges(steps)}" for w, steps in by_window.items()]
    return f"trace, the steps it was late in ({'; '.join(parts)}), slowest rank per step"


def _straggler_recovers(kind: str) -> str:
    return {"input wait": "input wait", CAUSE_HOST: "host-side time"}.get(kind, f"straggler ({kind})")


def _straggler_in_user_code(finding: Finding) -> str | None:
    """A rank waiting for its input: the data workers in code. Every other cause's change is an action already."""
    if "input wait" not in finding.title:
        return None
    workers = finding.evidence.get("recommended_workers")
    workers = workers if isinstance(workers, int) and not isinstance(workers, bool) else RECOMMENDED_WORKERS
    return f"{data_workers_in_code(workers)} on that rank: its input pipeline is the delay"


RULES = (
    Rule(find=straggler, in_user_code=_straggler_in_user_code),
)
