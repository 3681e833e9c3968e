"""Replay a step through its dependency model with chosen op times: every op starts when what it waits for
has ended (no launch delays, no gaps the model does not explain) and takes the time given for it.

`own_s[node, step, replica]` is each op's own time: a duration for an op on its own, the transfer time (from
the last member's arrival to its end) for a member of a collective. Steps and replicas are simulated
together as array axes, so one pass over the model's groups replays the whole trace.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .model import DependencyModel


@dataclasses.dataclass(frozen=True, slots=True)
class Replay:
    """A simulated timeline, times in seconds from each step's start."""
    ready_s: np.ndarray
    """[node, step, replica]: when the op could start (everything it waits for had ended)."""
    end_s: np.ndarray
    """[node, step, replica]: when it ended."""

    @property
    def step_time_s(self) -> np.ndarray:
        """Each step's time: the end of its last op (every replica, every stage)."""
        return self.end_s.max(axis=(0, 2))


def replay(model: DependencyModel, own_s: np.ndarray) -> Replay:
    """The timeline of every step with each op taking `own_s`."""
    ready = np.zeros_like(own_s)
    end = np.zeros_like(own_s)
    for group_index in model.group_order:
        group = model.groups[group_index]
        for node in group.members:
            deps = model.node_deps[node]
            if len(deps):
                ready[node] = end[deps].max(axis=0)
        if not group.collective:
            node = group.members[0]
            end[node] = ready[node] + own_s[node]
            continue
        transfer_start = ready[group.members].max(axis=0)
        if group.across_replicas:
            transfer_start = np.broadcast_to(transfer_start.max(axis=1, keepdims=True), transfer_start.shape)
        end[group.members] = transfer_start + own_s[group.members]
    return Replay(ready_s=ready, end_s=end)


def own_times(model: DependencyModel, start_s: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """Each op's own time in a recorded timeline: its duration, or for a collective's member its end less the
    last member's start (the time spent waiting for the others is not its own); never below zero (a send
    may end before its receive is posted)."""
    own = end_s - start_s
    for group in model.groups:
        if not group.collective:
            continue
        last_start = start_s[group.members].max(axis=0)
        if group.across_replicas:
            last_start = last_start.max(axis=1, keepdims=True)
        own[group.members] = np.maximum(end_s[group.members] - last_start, 0.0)
    return own
