"""The MoE EP-degree rule: all-to-alls that cost more than the experts, and a degree that moves fewer tokens."""

from __future__ import annotations

import numpy as np
from fleetscope.analysis.cross_rank.bandwidth import INTER_NODE, INTRA_NODE, PEAK_BUSBW_GBPS
from fleetscope.analysis.cross_rank.moe import MoeReport
from fleetscope.traces.validate import MAX_WORLD_SIZE

from ..model import Change, Evidence, Finding, step_gain
from .section import MOE_RULES_SOURCE, expert_ms

ALL_TO_ALL_VS_EXPERTS = 1.0
"""The MoE all-to-alls' transfer time at least this many times the experts' compute: the exchange, not
the experts, sets the MoE layers' time."""
ALL_TO_ALL_STEP_SHARE = 0.25
"""... and at least this share of the step (both are needed: a cheap exchange is not worth a new EP degree)."""


def _a2a_and_experts_ms(moe: MoeReport) -> tuple[float, float] | None:
    """(forward dispatch + combine transfer, expert compute), ms per step: mean over ranks, summed over
    layers. None when no layer has both."""
    a2a, experts = 0.0, 0.0
    for layer in moe.layers:
        transfer = [r.dispatch_transfer_ms + r.combine_transfer_ms for r in layer.ranks
                    if r.dispatch_transfer_ms is not None and r.combine_transfer_ms is not None]
        compute = [x for x in (expert_ms(r) for r in layer.ranks) if x is not None]
        if transfer and compute:
            a2a += float(np.mean(transfer))
            experts += float(np.mean(compute))
    return (a2a, experts) if experts > 0 else None


def _ep_spans_nodes(e: Evidence) -> bool:
    groups = e.moe.ep_groups if e.moe else []
    return any(len({e.rank_hosts.get(r) for r in group if r in e.rank_hosts}) > 1 for group in groups)


def _ranks_per_node(e: Evidence) -> int:
    counts: dict[str, int] = {}
    for host in e.rank_hosts.values():
        counts[host] = counts.get(host, 0) + 1
    return min(counts.values()) if counts else 0


def _smaller_ep(ep: int, experts: int, fit: int) -> int:
    """The largest divisor of ep (so it still divides the data-parallel ranks) that divides the experts
    and is at most `fit` (< ep)."""
    # bounded by `fit` (never by ep, which a forged report.json may make 10**15)
    return max((d for d in range(1, min(ep, fit + 1)) if ep % d == 0 and experts % d == 0), default=1)


def moe_ep_degree(e: Evidence) -> Finding | None:
    """GPU basis, ep > 1: the MoE all-to-alls' transfer (dispatch + combine, mean over ranks, summed over
    layers; backward runs the reverse exchanges, counted as much again) at least ALL_TO_ALL_VS_EXPERTS
    times the experts' compute and ALL_TO_ALL_STEP_SHARE of the step. The change: an EP degree that fits
    one node where the ep groups span nodes, else half the degree. Gain: exchange time scales with the
    share of tokens that leave the rank ((ep - 1) / ep) over the link's bus bandwidth (bandwidth.py
    PEAK_BUSBW_GBPS: NVLink inside a node, the NIC across nodes): saved = exchange x (1 - new/old). CPU
    traces are left out: gloo's exchange time there is the processes' scheduling, not a link. Confidence
    low: fewer ranks per group also hold more experts (memory) and the grouped GEMMs grow."""
    moe = e.moe
    if moe is None or type(moe.ep) is not int or not 1 < moe.ep <= MAX_WORLD_SIZE or e.basis != "gpu" or not e.step_ms:
        return None
    if type(moe.num_experts) is not int or moe.num_experts < 1:
        return None
    times = _a2a_and_experts_ms(moe)
    if times is None:
        return None
    forward_ms, experts_ms = times
    exchange_ms = 2.0 * forward_ms
    if forward_ms < ALL_TO_ALL_VS_EXPERTS * experts_ms or exchange_ms < ALL_TO_ALL_STEP_SHARE * e.step_ms:
        return None
    spans = _ep_spans_nodes(e)
    per_node = _ranks_per_node(e)
    fit = per_node if spans and 1 <= per_node < moe.ep else moe.ep // 2
    new_ep = _smaller_ep(moe.ep, moe.num_experts, fit)
    old_cost = (moe.ep - 1) / moe.ep / PEAK_BUSBW_GBPS[INTER_NODE if spans else INTRA_NODE]
    new_cost = (new_ep - 1) / new_ep / PEAK_BUSBW_GBPS[INTRA_NODE if new_ep <= per_node or not spans else INTER_NODE]
    gain, pct = step_gain(e, exchange_ms * (1.0 - new_cost / old_cost))
    where = "across nodes" if spans else "inside a node"
    return Finding(rule="moe_ep_degree", title=f"the MoE all-to-alls cost more than the experts (ep {moe.ep}, {where})",
                   evidence={"source": MOE_RULES_SOURCE, "ep": moe.ep, "num_experts": moe.num_experts,
                             "all_to_all_forward_ms": round(forward_ms, 3), "expert_compute_ms": round(experts_ms, 3),
                             "all_to_all_step_pct": round(100 * exchange_ms / e.step_ms, 1),
                             "ep_spans_nodes": str(spans), "ranks_per_node": per_node},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="low",
                   change=f"--set parallel.ep={new_ep}", apply=Change(train_args=("--set", f"parallel.ep={new_ep}")),
                   why=(f"the dispatch and combine all-to-alls move tokens for {forward_ms:.2f} ms per step in forward "
                        f"(about as much again in backward) while the experts compute for {experts_ms:.2f} ms; "
                        + (f"ep {new_ep} keeps every exchange on one node's links" if spans and new_ep <= per_node
                           else f"ep {new_ep} keeps {100 / new_ep:.0f}% of the tokens on their rank instead of "
                                f"{100 / moe.ep:.0f}%")
                        + (" (ep 1: every rank holds every expert)" if new_ep == 1 else "")))
