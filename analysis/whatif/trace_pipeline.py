"""The dependency model of a pipeline-parallel step from a job's traces: each rank's own chain of host work
between its sends, receives and collectives, joined across ranks by the pipeline messages and collectives.

Every rank is one pipeline stage here (node_rank: the rank's nodes on the one replica of the model). On each
rank, the step's communication ops (its point-to-point calls, per_rank/p2p.py, and its collectives) in issue
order split the step into
  compute j     host work from when the rank could go on (the previous issue, or the end of the receives and
                collectives it then waited for: those that ended before the next issue) to the issue of op j;
                the last one runs to the end of the rank's step
  op j          a send, a receive or a collective; a receive or collective blocks the rank's compute after it
                (the next compute waits for it: the data it reads, a synchronous collective); a send does not
                (the schedule's isend: the rank goes on computing, and nothing it does waits for the send)
Sends and receives are matched across ranks by (step, direction, micro-batch, sender, receiver) and their
order among equal keys (fleetscope's stage markers name them; a call without one cannot be matched and the
step is left out). A matched pair is one transfer that starts when both sides have issued their call: gloo's
TCP pairs hold a send until the receiver's "recv ready" notice arrives and NCCL's send and receive kernels move
data only while both run, so a receive cannot end before its send started and the send cannot end before the
receive was posted (rendezvous). Its own time is the receive's end less the later issue, on each rank's epoch
clock (exact for ranks on one host; across hosts their skew, bounded by either call's duration). A collective
spans every rank (the chain model's rule: its own time is the shortest any rank spent in it).

Limits: a receive posted early and waited for after some compute counts that compute as waiting; a job with
several data-parallel replicas per stage (its collectives span some ranks only) is not modeled.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from fleetscope.analysis.per_rank.names import P2P_RECV, P2P_SEND
from fleetscope.analysis.per_rank.rank import RankResult

from .model import DependencyModel, ModelError, OpGroup, build_model

COMPUTE, COLLECTIVE, TRANSFER = 0, 1, 2
"""node_type of the model's nodes (shared with trace_model.py's chain model)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Op:
    start_us: float
    end_us: float
    kind: str
    """P2P_SEND, P2P_RECV or "collective"."""
    name: str
    key: tuple
    """A transfer's match key, or the collective's position in the step."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineLayout:
    """A pipeline step laid out on one replica: per-node arrays, own times [node, 1, 1] in seconds."""
    model: DependencyModel
    own_s: np.ndarray
    node_rank: np.ndarray
    """Index (into the step's ranks) of the rank each node runs on."""
    node_names: tuple[str, ...]


def pipelined(ranks: list[RankResult], step: int) -> bool:
    """Whether any rank sent or received a point-to-point message in the step."""
    return any(call.step == step for r in ranks for call in r.p2p.calls)


def model_pipeline_step(window: int | None, step: int, ranks: list[RankResult],
                        collective_names: list[str]) -> PipelineLayout:
    """The step's pipeline model (module docstring); `ranks` sorted by rank, `collective_names` the step's
    collectives as every rank issued them. ModelError where the step cannot be modeled."""
    where = f"window {window} step {step}" if window is not None else f"step {step}"
    _check_one_stage_per_rank(ranks, where)
    chains = [_rank_ops(r, step, collective_names, where) for r in ranks]
    transfers = _match_transfers(ranks, chains, where)
    node_rank, node_type, node_names, own, edges, index_of = [], [], [], [], [], {}
    for position, (result, ops) in enumerate(zip(ranks, chains)):
        first = len(node_rank)
        computes, waits = _compute_times(result, step, ops)
        for j, op in enumerate(ops + [None]):
            compute = len(node_rank)
            node_rank.append(position)
            node_type.append(COMPUTE)
            node_names.append(f"compute before {op.name}" if op else "compute after the last op")
            own.append(computes[j])
            if j:
                edges.append((compute - 2, compute))             # after the previous compute
                edges += [(first + 2 * o + 1, compute) for o in waits[j]]  # and what it waited for
            if op is None:
                continue
            node_rank.append(position)
            node_type.append(COLLECTIVE if op.kind == "collective" else TRANSFER)
            node_names.append(op.name)
            own.append((op.end_us - op.start_us) / 1e6)
            edges.append((compute, compute + 1))
            index_of[(position, j)] = compute + 1
    groups, own = _groups(ranks, chains, transfers, index_of, node_type, np.array(own))
    node_rank_a = np.array(node_rank, dtype=np.int64)
    names = tuple(node_names)
    model = build_model(node_stage=node_rank_a, node_type=np.array(node_type, dtype=np.int64),
                        node_seq=np.arange(len(node_rank)), edges=edges, groups=groups, steps=np.array([step]),
                        replicas=1, describe=lambda node: f"rank {ranks[node_rank[node]].rank}'s {names[node]}")
    return PipelineLayout(model=model, own_s=own[:, None, None], node_rank=node_rank_a, node_names=names)


def _check_one_stage_per_rank(ranks: list[RankResult], where: str) -> None:
    marker = next((r.p2p.schedule for r in ranks if r.p2p.schedule is not None), None)
    if marker is not None and marker.stages // max(len(marker.rank_stages), 1) < len(ranks):
        raise ModelError(f"{where}: {len(ranks)} ranks run {marker.stages} pipeline stages: a pipeline with "
                         "data-parallel replicas per stage is not modeled from traces yet")


def _rank_ops(result: RankResult, step: int, collective_names: list[str], where: str) -> list[_Op]:
    """The rank's sends, receives and collectives of the step, in issue order."""
    ops, seen = [], Counter()
    for call in (c for c in result.p2p.calls if c.step == step):
        if call.kind not in (P2P_SEND, P2P_RECV) or call.peer is None or call.microbatch is None:
            raise ModelError(f"{where}: rank {result.rank}'s {call.kind} #{call.ordinal} names no peer or "
                             "micro-batch (no fleetscope stage marker): its transfer cannot be matched")
        src, dst = (result.rank, call.peer) if call.kind == P2P_SEND else (call.peer, result.rank)
        key = (call.direction, call.microbatch, src, dst)
        seen[key] += 1
        arrow = f"-> rank {dst}" if call.kind == P2P_SEND else f"<- rank {src}"
        ops.append(_Op(call.start_us, call.end_us, call.kind,
                       f"{call.kind} {call.direction} mb {call.microbatch} {arrow}", (*key, seen[key])))
    calls = [i for i, key in enumerate(result.collectives.keys) if key[0] == step]
    for position, (index, name) in enumerate(zip(calls, collective_names)):
        ops.append(_Op(float(result.collectives.start_us[index]), float(result.collectives.end_us[index]),
                       "collective", name, (position,)))
    return sorted(ops, key=lambda op: (op.start_us, op.end_us))


def _compute_times(result: RankResult, step: int, ops: list[_Op]) -> tuple[list[float], list[list[int]]]:
    """Each compute's own time (s) and the blocking ops it waited for (module docstring)."""
    timing = next(s for s in result.steps if s.step == step)
    issues = [timing.span_start_us] + [op.start_us for op in ops] + [max(timing.span_end_us, ops[-1].start_us
                                                                         if ops else timing.span_end_us)]
    waits: list[list[int]] = [[] for _ in range(len(ops) + 1)]
    for o, op in enumerate(ops):
        if op.kind == P2P_SEND:
            continue
        later = [j for j in range(o + 1, len(ops) + 1) if op.end_us <= issues[j + 1]]
        waits[later[0] if later else len(ops)].append(o)
    computes = []
    for j in range(len(ops) + 1):
        resumed = max([issues[j]] + [ops[o].end_us for o in waits[j]])
        computes.append(max(issues[j + 1] - resumed, 0.0) / 1e6)
    return computes, waits


def _match_transfers(ranks: list[RankResult], chains: list[list[_Op]], where: str) -> list[tuple]:
    """(sender index, its op index, receiver index, its op index) of every transfer; ModelError for a call
    whose other side is not in the traces."""
    position = {r.rank: i for i, r in enumerate(ranks)}
    sends, recvs = {}, {}
    for i, ops in enumerate(chains):
        for j, op in enumerate(ops):
            if op.kind in (P2P_SEND, P2P_RECV):
                (sends if op.kind == P2P_SEND else recvs)[op.key] = (i, j)
    unmatched = sorted(sends.keys() ^ recvs.keys(), key=str)
    if unmatched:
        direction, microbatch, src, dst, _ = unmatched[0]
        side = "receive" if unmatched[0] in sends else "send"
        missing = dst if side == "receive" else src
        why = "is not in the traces" if missing not in position else "has no such call"
        raise ModelError(f"{where}: the {direction} message of micro-batch {microbatch} from rank {src} to rank "
                         f"{dst} has no matching {side} (rank {missing} {why}; {len(unmatched)} unmatched)")
    return [(*sends[key], *recvs[key]) for key in sorted(sends, key=str)]


def _groups(ranks, chains, transfers, index_of, node_type, own) -> tuple[list[OpGroup], np.ndarray]:
    """The transfers and collectives as groups with their own times; every other node alone."""
    groups, grouped = [], np.zeros(len(node_type), dtype=bool)
    for sender, send_op, receiver, recv_op in transfers:
        send, recv = chains[sender][send_op], chains[receiver][recv_op]
        send_start = ranks[sender].absolute_us(send.start_us)
        recv_start, recv_end = (ranks[receiver].absolute_us(t) for t in (recv.start_us, recv.end_us))
        transfer = min(max(recv_end - max(send_start, recv_start), 0.0), recv.end_us - recv.start_us,
                       send.end_us - send.start_us)
        members = [index_of[(sender, send_op)], index_of[(receiver, recv_op)]]
        own[members] = transfer / 1e6
        groups.append(OpGroup(np.array(members), collective=True))
        grouped[members] = True
    collectives: dict[tuple, list[int]] = {}
    for i, ops in enumerate(chains):
        for j, op in enumerate(ops):
            if op.kind == "collective":
                collectives.setdefault(op.key, []).append(index_of[(i, j)])
    for members in collectives.values():
        own[members] = own[members].min()     # the last rank to arrive waited least
        groups.append(OpGroup(np.array(members), collective=True))
        grouped[members] = True
    groups += [OpGroup(np.array([node]), collective=False) for node in np.flatnonzero(~grouped)]
    return groups, own
