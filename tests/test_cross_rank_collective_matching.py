"""Collective instances matched across ranks: by the process group's sequence numbers (`Seq`, newer PyTorch)
where every member records them, else by issue order (cross_rank/matching.py), with ground truth where the
two disagree: one rank's window starts one collective later."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.cross_rank.matching import (
    METHOD_MIXED,
    METHOD_ORDER,
    METHOD_SEQUENCE,
    match_by_window,
    match_collectives,
)
from fleetscope.analysis.inputs.resolve import resolve_input
from fleetscope.analysis.merge.sources import find_merge_inputs
from fleetscope.analysis.per_rank import cache as result_cache
from fleetscope.analysis.per_rank.collectives import NO_STEP
from fleetscope.analysis.per_rank.names import SEQUENCE_ARG
from fleetscope.analysis.per_rank.parse import parse_traces
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal
from fleetscope.analysis.report.model import Report
from helpers.kineto import KinetoBuilder

RANKS = 3
LATE_RANK = 2          # arrives LATE_US after the others at every collective
LATE_START_RANK = 1    # its window starts one collective later: it has no call of sequence number 1
LATE_US = 200.0
COLLECTIVES = 6        # sequence numbers 1..6, 1000 us apart
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GROUP = "default_pg pg 0"


def nccl_args(rank: int, sequence: int | None) -> dict:
    """The collective args newer PyTorch writes on an NCCL kernel (Kineto's appendCollectiveArgs)."""
    args = {"Collective name": "allreduce", "In msg nelems": 1024, "Out msg nelems": 1024, "Group size": RANKS,
            "dtype": "Float", "Process Group Name": "0", "Process Group Description": "default_pg",
            "Process Group Ranks": "[0, 1, 2]", "Rank": rank}
    if sequence is not None:
        args.update({SEQUENCE_ARG: sequence, "Comms Id": 9_000_000_000_000_000_000 + sequence})
    return args


def late_start_set(directory: Path, *, sequence: bool = True, steps: bool = False,
                   unnumbered_rank: int | None = None) -> Path:
    """Three ranks, one all-reduce per 1000 us: rank LATE_RANK arrives LATE_US after the others at every one,
    all end together; rank LATE_START_RANK's trace starts one collective later. `steps`: two collectives
    per ProfilerStep (that rank's step 0 starts with its trace); `unnumbered_rank`: one rank records no
    sequence numbers."""
    for rank in range(RANKS):
        builder = KinetoBuilder(rank=rank, world_size=RANKS)
        first = 2 if rank == LATE_START_RANK else 1
        for number in range(first, COLLECTIVES + 1):
            t = 1000.0 * (number - 1)
            builder.kernel("sm90_xmma_gemm_bf16", t + 10, 80.0, launch_ts=t + 2)
            start = t + 100 + (LATE_US if rank == LATE_RANK else 0.0)
            builder.kernel(ALL_REDUCE, start, t + 800 - start, launch_ts=t + 5, stream=20,
                           args=nccl_args(rank, number if sequence and rank != unnumbered_rank else None))
        if steps:
            for step in range(COLLECTIVES // 2):
                begin = 2000.0 * step + (1000.0 if step == 0 and rank == LATE_START_RANK else 0.0)
                builder.step(step, begin, 2000.0 * (step + 1) - begin)
        builder.write(directory / f"rank{rank}.json")
    return directory


def arrivals_by_sequence(report: Report) -> dict[int, dict[int, float]]:
    """Rank -> arrival (us after the instance's first) at each instance, by the instance's ordinal."""
    stragglers = report.windows[0].stragglers
    return {d.ordinal: {rank: a for rank, a in zip(stragglers.detail_ranks, d.arrival_us) if a is not None}
            for d in stragglers.details}


@pytest.mark.parametrize("steps", [False, True], ids=["no steps", "two collectives per step"])
def test_sequence_numbers_pair_the_right_instances_when_a_window_starts_a_collective_later(tmp_path, steps):
    report = analyze(late_start_set(tmp_path / "set", steps=steps), use_hta=False, use_cache=False)
    window = report.windows[0]
    assert window.collective_matching.method == METHOD_SEQUENCE
    assert [(g.group, g.method, g.ranks, g.instances) for g in window.collective_matching.groups] == \
        [(GROUP, METHOD_SEQUENCE, RANKS, COLLECTIVES)]
    arrivals = arrivals_by_sequence(report)
    assert sorted(arrivals) == list(range(1, COLLECTIVES + 1))        # the ordinal is the sequence number
    assert sorted(arrivals[1]) == [0, 2]                                # rank 1 never saw number 1
    for number in range(2, COLLECTIVES + 1):
        assert arrivals[number] == {0: 0.0, 1: 0.0, 2: pytest.approx(LATE_US)}
    stragglers = window.stragglers
    assert stragglers.waited_for_rank == LATE_RANK and stragglers.consistent
    assert {i.last_rank for i in stragglers.worst_instances} == {LATE_RANK}
    assert all(i.lateness_us == pytest.approx(LATE_US) for i in stragglers.worst_instances)
    assert f"rank {LATE_RANK} is the straggler" in report.verdict


@pytest.mark.parametrize("steps", [False, True], ids=["no steps", "two collectives per step"])
def test_order_matching_pairs_the_wrong_instances_there(tmp_path, steps):
    """The same traces without sequence numbers: matched by order, rank 1's first call (number 2) is paired
    with the others' first (number 1), a collective apart (to the window's end without steps, within the
    first step with them)."""
    report = analyze(late_start_set(tmp_path / "set", sequence=False, steps=steps), use_hta=False, use_cache=False)
    window = report.windows[0]
    assert window.collective_matching.method == METHOD_ORDER
    assert window.collective_matching.groups[0].reason == "rank 0 records no sequence numbers"
    spreads = [i.arrival_spread_us for i in window.stragglers.worst_instances]
    assert max(spreads) > 900.0                                          # a collective apart, not LATE_US
    if not steps:
        assert window.stragglers.waited_for_rank == LATE_START_RANK     # the wrong straggler


def test_one_rank_without_sequence_numbers_keeps_the_group_on_order(tmp_path):
    report = analyze(late_start_set(tmp_path / "set", unnumbered_rank=2), use_hta=False, use_cache=False)
    (group,) = report.windows[0].collective_matching.groups
    assert (group.method, group.reason) == (METHOD_ORDER, "rank 2 records no sequence numbers")


def test_matching_is_one_rule_for_the_report_and_the_merge_and_applying_it_twice_changes_nothing(tmp_path):
    traces = late_start_set(tmp_path / "set", steps=True)
    inputs = find_merge_inputs(traces, cache=None)
    keys = {source.rank: [key for _, key in source.files[0].model.collectives] for source in inputs.ranks}
    assert [k[2] for k in keys[LATE_START_RANK]] == list(range(2, COLLECTIVES + 1))
    assert keys[0][1:] == keys[LATE_START_RANK] == keys[LATE_RANK][1:]     # numbers 2..6 on every rank
    assert keys[LATE_START_RANK][0] == (0, f"nccl:AllReduce [{GROUP}]", 2)   # in step 0 on every rank
    results = inputs.parsed.results
    again, matching = match_collectives(results)
    assert [r.collectives.keys for r in again] == [r.collectives.keys for r in results]
    assert matching.method == METHOD_SEQUENCE
    assert [r.collectives.keys for r in match_by_window(results)] == [r.collectives.keys for r in results]


def test_the_instance_step_is_the_one_most_ranks_give(tmp_path):
    traces = late_start_set(tmp_path / "set", steps=True)
    parsed = [o for o in parse_traces(resolve_input(traces).sources, cache=None)]
    moved = [dataclasses.replace(r, collectives=dataclasses.replace(
        r.collectives, keys=[(NO_STEP, name, n) for _, name, n in r.collectives.keys])) if r.rank == 0 else r
        for r in parsed]                                                  # rank 0 places none in a step
    matched, _ = match_collectives(moved)
    assert {k[0] for k in matched[0].collectives.keys} == {0, 1, 2}


def test_groups_matched_differently_make_a_mixed_window(tmp_path):
    traces = late_start_set(tmp_path / "set")
    results = parse_traces(resolve_input(traces).sources, cache=None)
    renamed = []
    for result in results:                                              # rank 0's calls of another group, unnumbered
        if result.rank == 0:
            sizes = dataclasses.replace(result.collectives.sizes, group=["pg 9"] * len(result.collectives))
            calls = dataclasses.replace(result.collectives, sizes=sizes,
                                        sequence=np.full(len(result.collectives), -1, dtype=np.int64))
            result = dataclasses.replace(result, collectives=calls)
        renamed.append(result)
    _, matching = match_collectives(renamed)
    assert matching.method == METHOD_MIXED
    assert [(g.group, g.method) for g in matching.groups] == [(GROUP, METHOD_SEQUENCE), ("pg 9", METHOD_ORDER)]


def test_the_report_shows_and_keeps_the_method(tmp_path):
    report = analyze(late_start_set(tmp_path / "set"), use_hta=False, use_cache=False)
    assert f"collectives matched across ranks by {METHOD_SEQUENCE} ({GROUP})" in render_terminal(report)
    assert f"collectives matched across ranks by {METHOD_SEQUENCE} ({GROUP})" in render_html(report)
    data = report.to_json()
    assert data["windows"][0]["collective_matching"]["method"] == METHOD_SEQUENCE
    assert Report.from_json(data).windows[0].collective_matching == report.windows[0].collective_matching
    gloo = analyze(_gloo_pair(tmp_path / "gloo"), use_hta=False, use_cache=False)
    assert "collectives matched across ranks by order (the trace names no process group)" in render_terminal(gloo)


def _gloo_pair(directory: Path) -> Path:
    for rank in range(2):
        builder = KinetoBuilder(rank=rank, backend="gloo")
        for step in range(2):
            builder.step(step, 1000.0 * step, 1000.0).gloo(1000.0 * step + 100 + 50 * rank, 500.0 - 50 * rank)
        builder.write(directory / f"rank{rank}.json")
    return directory


def test_cached_results_keep_the_sequence_numbers_and_the_code_digest_covers_them(tmp_path):
    traces = late_start_set(tmp_path / "set")
    cache = result_cache.ResultCache(tmp_path / "cache")
    (tmp_path / "cache").mkdir(mode=0o700)
    parsed = parse_traces(resolve_input(traces).sources, cache=cache)
    again = parse_traces(resolve_input(traces).sources, cache=cache)
    assert all(r.from_cache for r in again)
    for first, cached in zip(parsed, again):
        assert cached.collectives.sequence.tolist() == first.collectives.sequence.tolist() != []
    assert parsed[LATE_START_RANK].collectives.sequence.tolist() == list(range(2, COLLECTIVES + 1))
    covered = result_cache.result_source_files()
    assert {"fleetscope.analysis.per_rank.events", "fleetscope.analysis.per_rank.collectives",
            "fleetscope.analysis.per_rank.names"} <= set(covered)


@pytest.mark.parametrize("value", ["3", True, -1, 2.0, 2**70, None], ids=repr)
def test_a_sequence_number_that_is_no_int64_is_none(tmp_path, value):
    traces = late_start_set(tmp_path / "set")
    for path in traces.glob("rank*.json"):
        path.write_text(path.read_text().replace(f'"{SEQUENCE_ARG}": 3,', f'"{SEQUENCE_ARG}": {json_text(value)},'))
    results = parse_traces(resolve_input(traces).sources, cache=None)
    for result in results:
        numbers = result.collectives.sequence.tolist()
        assert numbers[numbers.index(-1) + 1:] == list(range(4, COLLECTIVES + 1)) and numbers.count(-1) == 1
    _, matching = match_collectives(results)
    assert matching.groups[0].reason == "rank 0 records no sequence numbers"


def json_text(value) -> str:
    import json
    return json.dumps(value)


def test_a_collectives_previous_end_is_the_last_one_ended_by_its_start_not_an_overlapping_bucket():
    """DDP's gradient buckets overlap: bucket 2 starts while bucket 1 runs. Its gap, idle and carried lateness are
    measured from the last collective that had ended (the previous step's), never from bucket 1's later end."""
    from fleetscope.analysis.per_rank.collectives import _previous_ends

    starts = np.array([0.0, 100.0, 110.0, 300.0])   # step end all-reduce, bucket 1, bucket 2 (overlaps 1), next
    ends = np.array([50.0, 200.0, 180.0, 350.0])
    assert _previous_ends(starts, ends).tolist() == [-np.inf, 50.0, 50.0, 200.0]
    gaps = starts - _previous_ends(starts, ends)
    assert (gaps[1:] >= 0).all()
