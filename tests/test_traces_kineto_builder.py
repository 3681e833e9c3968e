"""The hand-built Kineto traces of the tests (tests/helpers/kineto.py) are valid traces."""

from __future__ import annotations

from fleetscope.traces.kineto import distributed_rank, profiler_steps, read_trace
from helpers.kineto import KinetoBuilder, gpu_rank


def test_builder_writes_a_trace_that_fleetscope_reads(tmp_path):
    path = gpu_rank(3, world_size=4).write(tmp_path / "rank3.json.gz")
    document = read_trace(path)
    assert distributed_rank(document) == (3, 4)
    assert profiler_steps(document["traceEvents"]) == [1, 2]


def test_builder_without_rank_leaves_out_distributed_info(tmp_path):
    path = KinetoBuilder(rank=None).step(1, 0, 10).write(tmp_path / "a.json")
    assert distributed_rank(read_trace(path)) == (None, None)
