"""The dependency model of a training step: which op waits for which, and which ops run as one collective.

A step's ops are laid out as a template that repeats over every step and every data-parallel replica:
node n is one op of the template (a pipeline stage's k-th op of one type), and every per-op quantity is an
array [node, step, replica]. A node starts when the ops it depends on (on the same step and replica) have
ended. A group of nodes that is a collective (a pipeline send with its receive, an all-reduce across the
stages) starts its transfer when the last member is ready, on every replica at once where it also spans
the data-parallel replicas, and each member ends its own transfer time later; any other node is a group of
one that ends its own duration after it is ready.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np


class ModelError(ValueError):
    """A timeline the dependency model cannot be built from; the message says which op and why."""


@dataclasses.dataclass(frozen=True, slots=True)
class OpGroup:
    """Ops that start together (a collective) or one op on its own."""
    members: np.ndarray
    """Node indices."""
    collective: bool
    """True: the members' transfer starts when the last of them is ready."""
    across_replicas: bool = False
    """True: the collective also spans every data-parallel replica (a gradient reduce-scatter, say)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DependencyModel:
    """Nodes of one step's template, what each waits for, the groups they run in and an order to run them."""
    node_stage: np.ndarray
    """Pipeline stage of each node."""
    node_type: np.ndarray
    """Op type of each node (an index into the timeline's op types)."""
    node_seq: np.ndarray
    """The node's order among its stage's ops of its type."""
    node_deps: tuple[np.ndarray, ...]
    """For each node, the nodes that must end before it starts."""
    groups: tuple[OpGroup, ...]
    """Every node is in exactly one group."""
    group_order: tuple[int, ...]
    """The groups in an order that puts every group after the groups it depends on."""
    steps: np.ndarray
    """The step number of each index of the step axis."""
    replicas: int
    """Data-parallel replicas (the last axis)."""

    @property
    def nodes(self) -> int:
        return len(self.node_stage)

    @property
    def stages(self) -> int:
        return int(self.node_stage.max()) + 1


def build_model(*, node_stage: np.ndarray, node_type: np.ndarray, node_seq: np.ndarray, edges: list[tuple[int, int]],
                groups: list[OpGroup], steps: np.ndarray, replicas: int, describe) -> DependencyModel:
    """The model with its groups ordered; `edges` are (before, after) node pairs; `describe(node)` names a
    node in the error raised for a dependency cycle."""
    deps: list[set[int]] = [set() for _ in range(len(node_stage))]
    for before, after in edges:
        if before != after:
            deps[after].add(before)
    node_deps = tuple(np.array(sorted(d), dtype=np.int64) for d in deps)
    return DependencyModel(node_stage=node_stage, node_type=node_type, node_seq=node_seq, node_deps=node_deps,
                           groups=tuple(groups), group_order=_group_order(node_deps, groups, describe),
                           steps=steps, replicas=replicas)


def _group_order(node_deps: tuple[np.ndarray, ...], groups: list[OpGroup], describe) -> tuple[int, ...]:
    """Kahn's order over groups; a cycle (a model that cannot run) names one of its ops."""
    group_of = np.empty(len(node_deps), dtype=np.int64)
    for index, group in enumerate(groups):
        group_of[group.members] = index
    waits_on = [set() for _ in groups]
    for node, deps in enumerate(node_deps):
        waits_on[group_of[node]].update(int(g) for g in group_of[deps] if g != group_of[node])
    unblocks: list[list[int]] = [[] for _ in groups]
    for group, before in enumerate(waits_on):
        for other in before:
            unblocks[other].append(group)
    pending = [len(before) for before in waits_on]
    ready = deque(group for group, count in enumerate(pending) if count == 0)
    order = []
    while ready:
        group = ready.popleft()
        order.append(group)
        for after in unblocks[group]:
            pending[after] -= 1
            if pending[after] == 0:
                ready.append(after)
    if len(order) != len(groups):
        stuck = next(group for group, count in enumerate(pending) if count)
        raise ModelError(f"the ops' dependencies form a cycle through {describe(int(groups[stuck].members[0]))}")
    return tuple(order)
