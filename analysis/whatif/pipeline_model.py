"""The dependency model of a pipeline-parallel (1F1B) x data-parallel step, built from an op timeline in the
schema of the OSDI'25 straggler artifact (traces/op_timeline.py), after the paper's model:

  on a worker   its forward and backward computes run one after another in the recorded order; each
                pipeline send waits for the compute that produced its activation (or gradient), each
                receive for the previous compute of its direction, and the compute it feeds waits for it;
                sends (receives) of one direction leave in order; the first parameter all-gather of a model
                chunk comes before the chunk's first forward; after the last compute: gc, then the
                layer-norm, embedding and gradient collectives, gradient clipping and the optimizer, in that order
  collectives   a forward (backward) send of stage s and the receive of stage s+1 (s-1) with the same index;
                parameter all-gathers and gradient reduce-scatters across the data-parallel replicas of a stage;
                the embedding all-reduce across the first and last stages; the clipping norm across all workers.

The template is one step of one data-parallel replica; every step and replica must hold the same ops.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...traces.op_timeline import OP_TYPES, OpTimeline
from .model import DependencyModel, ModelError, OpGroup, build_model

TYPE = {name: code for code, name in enumerate(OP_TYPES)}
COMMUNICATION_TYPES = frozenset(TYPE[name] for name in (
    "forward-send", "forward-recv", "backward-send", "backward-recv", "params-all-gather", "grads-reduce-scatter",
    "separate-grads-all-reduce", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
    "optimizer-clip-main-grad"))
"""Op types whose time is communication (their ideal is a median: the mean would carry the waits of a few
outliers); the rest are computation."""
_ACROSS_REPLICAS = ("params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce")
_POST_COMPUTE = ("layernorm-grads-all-reduce", "embedding-grads-all-reduce")
_RECV_EPS_S = 5e-5
"""Clock noise allowed when finding the compute a first receive was posted after."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModeledTimeline:
    """A timeline laid out on its dependency model: every per-op array is [node, step, replica]."""
    model: DependencyModel
    start_s: np.ndarray
    """Recorded start, seconds from the step's first op."""
    end_s: np.ndarray
    dp_ranks: np.ndarray
    """The DP rank of each replica index."""
    worker_rank: np.ndarray
    """[stage, replica]: the global rank of that worker."""
    step_start_s: np.ndarray
    """Each step's first recorded start, in the timeline's own clock."""
    node_micro_batch: np.ndarray
    node_chunk: np.ndarray
    source: str


def model_timeline(timeline: OpTimeline) -> ModeledTimeline:
    """The model of the timeline's steps, with its recorded times laid out on it; raises ModelError."""
    stages = np.unique(timeline.stage)
    if not np.array_equal(stages, np.arange(len(stages))):
        raise ModelError(f"{timeline.source}: stages {stages.tolist()} are not 0..{len(stages) - 1}")
    dp_ranks, replica = np.unique(timeline.dp_rank, return_inverse=True)
    steps, step_index = np.unique(timeline.step, return_inverse=True)
    worker_rank = _worker_ranks(timeline, len(stages), len(dp_ranks), replica)
    keys, node = np.unique(np.stack([timeline.stage, timeline.op_type, timeline.seq_id]), axis=1, return_inverse=True)
    node = node.ravel()
    shape = (keys.shape[1], len(steps), len(dp_ranks))
    slot = np.ravel_multi_index((node, step_index, replica), shape)
    _check_complete(timeline, keys, steps, dp_ranks, slot, shape)
    step_start = np.full(len(steps), np.inf)
    np.minimum.at(step_start, step_index, timeline.start_s)
    start = np.empty(shape)
    end = np.empty(shape)
    start.reshape(-1)[slot] = timeline.start_s - step_start[step_index]
    end.reshape(-1)[slot] = start.reshape(-1)[slot] + timeline.duration_s
    chunk = np.zeros(shape[0], dtype=np.int64)
    chunk[node] = timeline.model_chunk
    micro_batch = np.zeros(shape[0], dtype=np.int64)
    micro_batch[node] = timeline.micro_batch
    model = _pipeline_model(keys, chunk, np.median(start, axis=(1, 2)), np.median(end, axis=(1, 2)), steps,
                            len(dp_ranks), timeline.source)
    return ModeledTimeline(model=model, start_s=start, end_s=end, dp_ranks=dp_ranks, worker_rank=worker_rank,
                           step_start_s=step_start, node_micro_batch=micro_batch, node_chunk=chunk,
                           source=timeline.source)


def as_op_timeline(modeled: ModeledTimeline, start_s: np.ndarray, end_s: np.ndarray, source: str) -> OpTimeline:
    """[node, step, replica] times (from each step's start) as an op timeline, each step at its recorded start."""
    model = modeled.model
    node, step, replica = (axis.ravel() for axis in np.indices(start_s.shape))
    stage = model.node_stage[node]
    return OpTimeline(source=source, rank=modeled.worker_rank[stage, replica], dp_rank=modeled.dp_ranks[replica],
                      stage=stage, step=model.steps[step], op_type=model.node_type[node], seq_id=model.node_seq[node],
                      start_s=start_s.ravel() + modeled.step_start_s[step],
                      duration_s=(end_s - start_s).ravel(), micro_batch=modeled.node_micro_batch[node],
                      model_chunk=modeled.node_chunk[node])


def _worker_ranks(timeline: OpTimeline, stages: int, replicas: int, replica: np.ndarray) -> np.ndarray:
    ranks = np.full((stages, replicas), -1, dtype=np.int64)
    ranks[timeline.stage, replica] = timeline.rank
    clash = ranks[timeline.stage, replica] != timeline.rank
    if clash.any():
        row = int(np.flatnonzero(clash)[0])
        raise ModelError(f"{timeline.source}: DP rank {timeline.dp_rank[row]} stage {timeline.stage[row]} is recorded "
                         f"by ranks {ranks[timeline.stage[row], replica[row]]} and {timeline.rank[row]}: keep one rank "
                         "per worker (one tensor-parallel rank)")
    if (ranks < 0).any():
        stage, index = np.argwhere(ranks < 0)[0]
        raise ModelError(f"{timeline.source}: no ops of the worker at stage {stage} of a DP rank the other stages have")
    return ranks


def _check_complete(timeline, keys, steps, dp_ranks, slot, shape) -> None:
    """Every step and replica holds each op of the template exactly once."""
    counts = np.bincount(slot, minlength=int(np.prod(shape))).reshape(shape)
    if (counts == 1).all():
        return
    node, step, replica = np.argwhere(counts != 1)[0]
    stage, op_type, seq = keys[:, node]
    what = "twice" if counts[node, step, replica] > 1 else "missing"
    raise ModelError(f"{timeline.source}: step {steps[step]}, DP rank {dp_ranks[replica]}, stage {stage}: "
                     f"{OP_TYPES[op_type]} #{seq} is {what} ({int((counts == 0).sum())} ops missing, "
                     f"{int((counts > 1).sum())} repeated); every step and DP rank must record the same ops")


def _pipeline_model(keys, chunk, ref_start, ref_end, steps, replicas, source) -> DependencyModel:
    node_stage, node_type, node_seq = (np.asarray(row, dtype=np.int64) for row in keys)
    stages = int(node_stage.max()) + 1
    by_type = {}
    for node in range(len(node_stage)):
        by_type.setdefault((int(node_stage[node]), int(node_type[node])), []).append(node)
    ops = {key: sorted(nodes, key=lambda n: node_seq[n]) for key, nodes in by_type.items()}

    def of(stage: int, name: str) -> list[int]:
        return ops.get((stage, TYPE[name]), [])

    def describe(node: int) -> str:
        return f"stage {node_stage[node]} {OP_TYPES[node_type[node]]} #{node_seq[node]}"

    edges: list[tuple[int, int]] = []
    for stage in range(stages):
        computes = sorted(of(stage, "forward-compute") + of(stage, "backward-compute"), key=lambda n: ref_start[n])
        edges += _chain(computes)
        edges += _pipeline_edges(stage, of, computes, ref_start, ref_end, source)
        edges += _data_parallel_edges(stage, of, chunk, ref_start)
        edges += _post_compute_edges(stage, of, computes, ref_end)
    groups = _groups(stages, of, len(node_stage), source)
    return build_model(node_stage=node_stage, node_type=node_type, node_seq=node_seq, edges=edges, groups=groups,
                       steps=steps, replicas=replicas, describe=describe)


def _chain(nodes: list[int]) -> list[tuple[int, int]]:
    return list(zip(nodes[:-1], nodes[1:]))


def _pipeline_edges(stage, of, computes, ref_start, ref_end, source) -> list[tuple[int, int]]:
    edges = []
    for direction in ("forward", "backward"):
        produced = of(stage, f"{direction}-compute")
        for kind in ("send", "recv"):
            messages = of(stage, f"{direction}-{kind}")
            if not messages:
                continue
            if len(messages) != len(produced):
                raise ModelError(f"{source}: stage {stage} has {len(messages)} {direction}-{kind} ops for "
                                 f"{len(produced)} {direction}-computes: only 1F1B schedules without interleaving "
                                 "(one message per compute) are modeled")
            edges += _chain(messages)
            for index, (compute, message) in enumerate(zip(produced, messages)):
                if kind == "send":
                    edges.append((compute, message))
                    continue
                edges.append((message, compute))
                posted_after = produced[index - 1] if index else _last_ended_before(computes, ref_end,
                                                                                    ref_start[message])
                if posted_after is not None:
                    edges.append((posted_after, message))
    return edges


def _last_ended_before(computes: list[int], ref_end: np.ndarray, when: float) -> int | None:
    before = [node for node in computes if ref_end[node] <= when + _RECV_EPS_S]
    return max(before, key=lambda n: ref_end[n]) if before else None


def _data_parallel_edges(stage, of, chunk, ref_start) -> list[tuple[int, int]]:
    gathers, reductions = of(stage, "params-all-gather"), of(stage, "grads-reduce-scatter")
    edges = _chain(sorted(gathers + reductions, key=lambda n: ref_start[n]))
    forwards, backwards = of(stage, "forward-compute"), of(stage, "backward-compute")
    for model_chunk in sorted({int(chunk[n]) for n in gathers}):
        last_gather = [n for n in gathers if chunk[n] == model_chunk][-1]
        first_forward = [n for n in forwards if chunk[n] == model_chunk][:1]
        edges += [(last_gather, node) for node in first_forward]
    if of(stage, "separate-grads-all-reduce"):  # reduce-scatters overlap the backward: each after its chunk's last
        for model_chunk in sorted({int(chunk[n]) for n in reductions}):
            first_reduction = [n for n in reductions if chunk[n] == model_chunk][0]
            last_backward = [n for n in backwards if chunk[n] == model_chunk][-1:]
            edges += [(node, first_reduction) for node in last_backward]
    return edges


def _post_compute_edges(stage, of, computes, ref_end) -> list[tuple[int, int]]:
    last_compute = [max(computes, key=lambda n: ref_end[n])] if computes else []
    gc = of(stage, "gc")
    edges = _chain(last_compute[:1] + gc)
    done = gc[-1:] or last_compute
    tail = [node for name in _POST_COMPUTE for node in of(stage, name)]
    overlapped = of(stage, "separate-grads-all-reduce")
    if overlapped:
        done = done + of(stage, "grads-reduce-scatter")[-1:]
        tail += overlapped
    else:
        tail += of(stage, "grads-reduce-scatter")
    tail += of(stage, "optimizer-clip-main-grad") + of(stage, "optimizer")
    edges += _chain(tail)
    edges += [(node, tail[0]) for node in done] if tail else []
    return edges


def _groups(stages, of, nodes, source) -> list[OpGroup]:
    groups, grouped = [], np.zeros(nodes, dtype=bool)

    def add(members: list[int], across_replicas: bool) -> None:
        groups.append(OpGroup(np.array(members, dtype=np.int64), collective=True, across_replicas=across_replicas))
        grouped[members] = True

    for stage in range(stages):
        for direction, peer in (("forward", stage + 1), ("backward", stage - 1)):
            sends, recvs = of(stage, f"{direction}-send"), of(peer, f"{direction}-recv") if 0 <= peer < stages else []
            if sends and recvs and len(sends) != len(recvs):
                raise ModelError(f"{source}: stage {stage} sends {len(sends)} {direction} messages, stage {peer} "
                                 f"receives {len(recvs)}")
            for send, recv in zip(sends, recvs):
                add([send, recv], across_replicas=False)
        for name in _ACROSS_REPLICAS:
            for node in of(stage, name):
                add([node], across_replicas=True)
    for name, across_replicas in (("embedding-grads-all-reduce", False), ("optimizer-clip-main-grad", True)):
        by_seq: dict[int, list[int]] = {}
        for stage in range(stages):
            for index, node in enumerate(of(stage, name)):
                by_seq.setdefault(index, []).append(node)
        for members in by_seq.values():
            add(members, across_replicas=across_replicas)
    groups += [OpGroup(np.array([node]), collective=False) for node in np.flatnonzero(~grouped)]
    return groups
