"""The dependency model of a data-parallel job's steps, built from its Kineto traces (a fleetscope run directory or
a folder of traces), and the what-if it answers: how long would a step take were a rank's compute its peers'?

Per profiled step and rank, the ops are the rank's own time around the step's collectives:
  compute k     from the later of the step's start and the end of collective k-1 to the start of collective k
                (the rank's arrival): its own work, idle host time included (a sleep or an input wait delays
                the collective as much as a kernel does)
  collective k  matched across ranks by cross_rank/matching.py's keys; its transfer starts when the last rank
                arrives and its own time is the shortest any rank spent in it (the last to arrive waited least):
                each rank's own clock only, so no cross-host clock alignment is needed
  tail          from the end of the last collective to the end of the rank's step (the optimizer)
On each rank the ops form a chain; every collective spans all ranks (an OpGroup across replicas: the model's
replica axis is the rank). One model per step, since steps may issue different collectives (a window's last
step, a step with a checkpoint).

A step with pipeline sends and receives is laid out by trace_pipeline.py instead: every rank's own chain on one
replica, joined by its transfers and collectives (StepModel.node_rank says which rank runs each node).

Limits: a collective issued while an earlier one is in flight (DDP's gradient buckets) is chained after it, so
compute a rank did during a wait is not seen as its own (letting such buckets transfer side by side made the
replay of two buckets 0.5 ms apart match its measured step, 10.0 ms where the chain gives 10.5, but put the
2-rank gloo ground truth's what-if at 217 ms against 256 ms measured without the fault, 0.85, where the chain
gives 0.98-1.07: not done); trace_pipeline.py says what its model does not hold.

Built from a run's traces (`read_rank_results`, the CLI) or from results already parsed, placed and matched
(`model_window`: the report's, so nothing is parsed twice).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from fleetscope.analysis.cross_rank.matching import match_by_window
from fleetscope.analysis.quantities import trace_step_times
from fleetscope.analysis.cross_rank.placement import place_traces
from fleetscope.analysis.inputs.resolve import resolve_input
from fleetscope.analysis.per_rank.cache import open_cache
from fleetscope.analysis.per_rank.parse import parse_traces
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.analysis.per_rank.steps import StepTiming

from .model import DependencyModel, ModelError, OpGroup, build_model
from .trace_pipeline import COLLECTIVE, COMPUTE, model_pipeline_step, pipelined


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepModel:
    """One profiled step of one window on its dependency model; per-op arrays are [node, 1, rank index], or
    [node, 1, 1] for a pipeline step (node_rank)."""
    window: int | None
    step: int
    ranks: tuple[int, ...]
    model: DependencyModel
    own_s: np.ndarray
    """Each op's own time (module docstring), seconds."""
    node_names: tuple[str, ...]
    measured_s: float
    """The slowest rank's step time (quantities.py's trace step time)."""
    node_rank: np.ndarray | None = None
    """A pipeline step (trace_pipeline.py): the index into `ranks` of the rank each node runs on, all on one
    replica; None: every node runs on every rank (the replica axis is the rank)."""

    @property
    def compute_nodes(self) -> np.ndarray:
        return self.model.node_type == COMPUTE

    def rank_cells(self, index: int) -> tuple[np.ndarray, int]:
        """(nodes, replica) of the rank at `index` of `ranks`: where its ops sit in the per-op arrays."""
        if self.node_rank is None:
            return np.arange(self.model.nodes), index
        return np.flatnonzero(self.node_rank == index), 0

    def compute_mask(self, index: int) -> np.ndarray:
        """[node, 1, replica]: the compute ops of the rank at `index`."""
        mask = np.zeros(self.own_s.shape, dtype=bool)
        nodes, replica = self.rank_cells(index)
        mask[nodes[self.compute_nodes[nodes]], :, replica] = True
        return mask


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TraceModel:
    source: str
    steps: tuple[StepModel, ...]
    skipped: tuple[str, ...] = ()
    """Steps left out, each with why."""


def read_rank_results(path: str | Path) -> tuple[list[RankResult], list[str]]:
    """Every usable trace behind `path` parsed (through the parsed-trace cache), placed and with its
    collectives matched across ranks; and notes on the traces that could not be used."""
    inputs = resolve_input(path)
    cache, _ = open_cache()
    outcomes = parse_traces(inputs.sources, cache=cache)
    placement = place_traces(inputs, outcomes)
    notes = [f"{failure.label}: {failure.reason}" for failure in inputs.failures + placement.failures]
    return match_by_window(placement.results), notes + placement.notes


def model_traces(results: list[RankResult], source: str) -> TraceModel:
    """A model of every step all ranks of a window profiled; raises ModelError where nothing can be modeled."""
    modeled, skipped = [], []
    for window, ranks in sorted(_by_window(results).items(), key=lambda item: (item[0] is None, item[0] or 0)):
        steps, why = model_window(window, ranks)
        modeled += steps
        skipped += why.values()
    if not modeled:
        raise ModelError(f"{source}: no step could be modeled" + (f" ({skipped[0]})" if skipped else
                                                                   " (no step that every rank profiled)"))
    return TraceModel(source=source, steps=tuple(modeled), skipped=tuple(skipped))


def model_window(window: int | None, results: list[RankResult],
                 steps: set[int] | None = None) -> tuple[list[StepModel], dict[int, str]]:
    """One window's results, their collectives matched across ranks (cross_rank/matching.py): a model of each
    step every rank profiled (only `steps` where given), and step -> why for each step left out."""
    ranks = [r for r in results if r.rank is not None]
    wanted = [step for step in _common_steps(ranks) if steps is None or step in steps]
    modeled, skipped = [], {}
    for step in wanted:
        try:
            modeled.append(model_step(window, step, ranks))
        except ModelError as error:
            skipped[step] = str(error)
    return modeled, skipped


def model_step(window: int | None, step: int, ranks: list[RankResult]) -> StepModel:
    """The step's ops on every rank laid out on one chain model, or a pipeline step's on trace_pipeline.py's
    (module docstring); ModelError where the ranks issued different collectives or a transfer is unmatched."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    names = _collective_names(window, step, ranks)
    measured_ms = trace_step_times([_Window(window, [_OneStep(_step_of(r, step)) for r in ranks])])[(window, step)]
    if pipelined(ranks, step):
        layout = model_pipeline_step(window, step, ranks, names)
        return StepModel(window=window, step=step, ranks=tuple(r.rank for r in ranks), model=layout.model,
                         own_s=layout.own_s, node_names=layout.node_names, measured_s=measured_ms / 1e3,
                         node_rank=layout.node_rank)
    own = np.stack([_rank_own_times(r, step, len(names)) for r in ranks], axis=-1)[:, None, :]
    transfer = own[1::2].min(axis=2, keepdims=True)   # the last rank to arrive waited least
    own[1::2] = np.broadcast_to(transfer, own[1::2].shape)
    node_names = tuple(name for pair in zip([f"compute before {n}" for n in names], names) for name in pair)
    node_names += ("compute after the last collective" if names else "compute (no collectives)",)
    return StepModel(window=window, step=step, ranks=tuple(r.rank for r in ranks),
                     model=_chain_model(step, names, len(ranks)), own_s=own, node_names=node_names,
                     measured_s=measured_ms / 1e3)


@dataclasses.dataclass(frozen=True, slots=True)
class _OneStep:
    """A rank with one step, as quantities.trace_step_times reads ranks."""
    timing: StepTiming

    @property
    def steps(self) -> list[StepTiming]:
        return [self.timing]


@dataclasses.dataclass(frozen=True, slots=True)
class _Window:
    window: int | None
    ranks: list[_OneStep]


def _by_window(results: list[RankResult]) -> dict[int | None, list[RankResult]]:
    found: dict[int | None, list[RankResult]] = {}
    for result in results:
        if result.rank is not None:
            found.setdefault(result.window, []).append(result)
    return found


def _common_steps(ranks: list[RankResult]) -> list[int]:
    common = set.intersection(*({s.step for s in r.steps} for r in ranks)) if ranks else set()
    return sorted(common)


def _step_of(result: RankResult, step: int) -> StepTiming:
    return next(s for s in result.steps if s.step == step)


def _calls_in(result: RankResult, step: int) -> np.ndarray:
    """Indices of the rank's collectives of the step, in issue order."""
    return np.asarray([i for i, key in enumerate(result.collectives.keys) if key[0] == step], dtype=np.int64)


def _collective_names(window: int | None, step: int, ranks: list[RankResult]) -> list[str]:
    """The step's collectives as every rank issued them: "name #ordinal" in issue order."""
    orders = [[f"{key[1]} #{key[2]}" for key in (r.collectives.keys[i] for i in _calls_in(r, step))] for r in ranks]
    for result, order in zip(ranks[1:], orders[1:]):
        if order != orders[0]:
            where = f"window {window} step {step}" if window is not None else f"step {step}"
            raise ModelError(f"{where}: rank {result.rank} issued {len(order)} collectives, rank {ranks[0].rank} "
                             f"{len(orders[0])}, not the same ones in the same order")
    return orders[0]


def _rank_own_times(result: RankResult, step: int, count: int) -> np.ndarray:
    """[compute 0, collective 0, ..., compute K] of one rank, seconds; a collective's entry is its duration here
    (model_step replaces it with the transfer time)."""
    timing = _step_of(result, step)
    calls = _calls_in(result, step)
    starts, ends = result.collectives.start_us[calls], result.collectives.end_us[calls]
    previous_end = np.concatenate([[timing.span_start_us], ends])
    own = np.empty(2 * count + 1)
    own[0:-1:2] = np.maximum(starts - np.maximum(previous_end[:-1], timing.span_start_us), 0.0)
    own[1::2] = ends - starts
    own[-1] = max(timing.span_end_us - max(previous_end[-1], timing.span_start_us), 0.0)
    return own / 1e6


def _chain_model(step: int, names: list[str], ranks: int) -> DependencyModel:
    nodes = 2 * len(names) + 1
    node_type = np.tile([COMPUTE, COLLECTIVE], len(names) + 1)[:nodes]
    groups = [OpGroup(np.array([node]), collective=bool(node_type[node]), across_replicas=bool(node_type[node]))
              for node in range(nodes)]
    return build_model(node_stage=np.zeros(nodes, dtype=np.int64), node_type=node_type,
                       node_seq=np.arange(nodes) // 2, edges=[(node, node + 1) for node in range(nodes - 1)],
                       groups=groups, steps=np.array([step]), replicas=ranks, describe=lambda node: f"op {node}")
