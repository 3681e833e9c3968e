"""HTA's views from fleetscope's own parse equal HTA's own load of the same real H200 traces.

Same tables, same rows, same values: strings and integers exactly, floats to a relative 1e-9 (both sides
do the same float operations on the same integer-microsecond times; the tolerance only absorbs summation
order). Rows are compared sorted, because HTA numbers symbols in set-iteration order, which changes the
order of tied rows from one run to the next.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from fleetscope.analysis.cross_rank.hta_views import run_hta, run_stock_hta
from fleetscope.analysis.per_rank.hta_rank import load_rank_trace, quietly
from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set

pytest.importorskip("hta")

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"
REL_TOLERANCE = 1e-9
SINGLE_RANK = [
    GPU / "h200-small-hf-eager-2steps.json.gz",
    GPU / "h200-small-fleetscope-fast-2steps.json.gz",
    GPU / "h200-fsdp-1rank/traces/window000/rank0.vm.pt.trace.json.gz",
    GPU / "h200-small-evidence/traces/window000/rank0.vm.pt.trace.json.gz",
]
GLOO_2RANK = {r: GPU / f"h200-ddp-gloo-2rank/traces/window000/rank{r}.vm.pt.trace.json.gz" for r in (0, 1)}


@pytest.mark.parametrize("path", SINGLE_RANK, ids=lambda p: p.parent.parent.name if "window" in str(p) else p.name)
def test_frame_equals_htas_own_frame(path):
    from hta.trace_analysis import TraceAnalysis

    mine, loader = load_rank_trace(path, 0)
    stock = quietly(lambda: TraceAnalysis(trace_files={0: str(path)}, trace_dir=str(path.parent),
                                          include_last_profiler_step=True)).t
    assert loader == "fleetscope"
    ours, theirs = _decoded(mine), _decoded(stock)
    assert set(ours.columns) == set(theirs.columns)
    theirs = theirs[list(ours.columns)]
    assert ours.index.equals(theirs.index)
    assert dict(ours.dtypes.astype(str)) == dict(theirs.dtypes.astype(str))
    for column in ours.columns:
        assert ours[column].astype(str).tolist() == theirs[column].astype(str).tolist(), column
    assert mine.min_ts == stock.min_ts


@pytest.mark.parametrize("path", SINGLE_RANK[:3], ids=lambda p: p.name)
def test_single_rank_views_equal_htas(path):
    _assert_same_views({0: path}, has_comm_kernels=False)


def test_two_rank_views_equal_htas():
    _assert_same_views(GLOO_2RANK, has_comm_kernels=False)


def test_straggler_and_multi_rank_views_equal_htas(tmp_path):
    # all-reduces long enough to pass HTA's significance test (1% of a step), one rank late, two hosts
    spec = TraceSetSpec(ranks=3, ranks_per_host=2, late_rank=2, late_us=300.0, inserted_allreduce_us=5000.0,
                        host_offsets_us={1: 1500.0})
    paths = make_trace_set(GPU / "h200-small-hf-eager-2steps.json.gz", tmp_path, spec)
    views = _assert_same_views(dict(enumerate(paths)), has_comm_kernels=True)
    assert "potential_stragglers" in views.tables


def _assert_same_views(files: dict[int, Path], *, has_comm_kernels: bool):
    fast = run_hta(files, has_comm_kernels=has_comm_kernels, workers=1)
    stock = run_stock_hta(files, has_comm_kernels=has_comm_kernels)
    assert fast.status == stock.status, (fast.errors, stock.errors)
    assert fast.errors == stock.errors
    assert fast.not_applicable == stock.not_applicable
    assert sorted(fast.tables) == sorted(stock.tables)
    for name in stock.tables:
        assert _sorted_rows(fast.tables[name]) == _sorted_rows(stock.tables[name]), name
        assert len(fast.tables[name]) == len(stock.tables[name])
    return fast


def _sorted_rows(rows: list[dict]) -> list[tuple]:
    return sorted((tuple(sorted((k, _Close(v)) for k, v in row.items())) for row in rows), key=repr)


class _Close:
    """A table value that compares floats to REL_TOLERANCE and everything else exactly."""

    def __init__(self, value) -> None:
        self.value = value

    def __eq__(self, other) -> bool:
        a, b = self.value, other.value
        if isinstance(a, float) or isinstance(b, float):
            return a is not None and b is not None and math.isclose(a, b, rel_tol=REL_TOLERANCE, abs_tol=1e-9)
        return a == b

    def __lt__(self, other) -> bool:
        return repr(self) < repr(other)

    def __repr__(self) -> str:
        return f"{self.value:.6g}" if isinstance(self.value, float) else repr(self.value)


def _decoded(trace):
    frame = trace.traces[min(trace.traces)].copy()
    table = trace.symbol_table.get_sym_table()
    for column in ("cat", "name"):
        frame[column] = [table[i] for i in frame[column]]
    return frame
