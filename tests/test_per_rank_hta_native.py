"""HTA's views computed natively (per_rank/hta_native*.py) equal stock HTA's, table for table.

Every GPU fixture trace is computed both ways on one rank: natively, and by stock HTA's analyzers on
HTA's frame (engine `hta`, the oracle behind --hta-oracle); whole windows are compared with HTA's own
multi-rank load (run_stock_hta). Floats to 1e-9, everything else exactly; rows sorted, since HTA numbers
symbols in set-iteration order. Hand-made traces cover what real ones rarely hold: no kernels, no
ProfilerStep, one step, kernels launched outside the steps.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import msgspec
import pytest
from helpers import hta_parity_traces

from fleetscope.analysis.cross_rank.hta_views import compare_tables, run_hta, run_stock_hta
from fleetscope.analysis.per_rank.hta_native_views import kernel_type
from fleetscope.analysis.per_rank.hta_rank_views import ENGINE_HTA, rank_views
from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set

pytest.importorskip("hta")

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"
LARGE = GPU / "large" / "h200-medium-eager-stack-3steps.json.gz"
TRACES = [p for p in hta_parity_traces(GPU) if p != LARGE]
TOLERANCE = 1e-9


def _id(path: Path) -> str:
    return str(path.relative_to(GPU)).replace("/traces", "").replace(".json.gz", "")


def _key(row: dict) -> str:
    return repr(sorted((k, round(v, 6) if isinstance(v, float) else v) for k, v in row.items()))


def assert_same_tables(mine: dict[str, list], theirs: dict[str, list]) -> None:
    assert sorted(mine) == sorted(theirs)
    for name in theirs:
        a, b = sorted(mine[name], key=_key), sorted(theirs[name], key=_key)
        assert len(a) == len(b), name
        for x, y in zip(a, b):
            assert set(x) == set(y), name
            for column in x:
                assert _close(x[column], y[column]), (name, column, x, y)


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is None and b is None
        return math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)
    return a == b


def _kind(error: str) -> str:
    return error.split(":")[0]


def assert_same_rank_views(path: Path, step_names: tuple[str, ...] = ()) -> None:
    native = rank_views(path, 0, step_names)
    oracle = rank_views(path, 0, step_names, engine=ENGINE_HTA)
    assert native.engine == "native", native.note
    assert {v: _kind(e) for v, e in native.errors.items()} == {v: _kind(e) for v, e in oracle.errors.items()}
    assert_same_tables(native.tables, oracle.tables)
    assert native.straggler_rows == oracle.straggler_rows
    assert native.min_ts == oracle.min_ts


@pytest.mark.parametrize("path", TRACES, ids=_id)
def test_every_gpu_fixture_trace_equals_htas_views(path):
    assert_same_rank_views(path)


PUBLIC = Path(__file__).resolve().parent / "fixtures" / "public"
PUBLIC_TRACES = sorted(p for p in PUBLIC.rglob("*") if p.name.endswith((".json", ".json.gz")))


@pytest.mark.parametrize("path", PUBLIC_TRACES, ids=lambda p: str(p.relative_to(PUBLIC).parent))
def test_every_public_trace_equals_htas_views_where_htas_loader_takes_it(path):
    """Traces other projects publish (HTA's, Kineto's, TraceLens' test data: CUDA and ROCm, 2021-era
    categories, ns resolution, huge ids): the native views equal stock HTA's wherever HTA's own loader reads
    the file, and still come out where it cannot (its int8 column overflows under pandas 3 on one of them)."""
    native = rank_views(path, 0, ())
    oracle = rank_views(path, 0, (), engine=ENGINE_HTA)
    if native.engine != "native":  # a value the native frame does not reproduce: HTA's loader decided
        assert native.tables == oracle.tables and native.errors == oracle.errors
        return
    loader_failed = [e for e in oracle.errors.values() if e.startswith("HTA could not load the trace")]
    if loader_failed:
        assert {"temporal_breakdown", "kernel_breakdown", "cuda_launch_stats"} <= set(native.tables), native.errors
        return
    assert_same_rank_views(path)


@pytest.mark.slow
def test_the_large_trace_equals_htas_views():
    assert_same_rank_views(LARGE)


def test_the_step_filter_counts_step_names_of_other_ranks():
    # one step here, but two over the ranks: HTA's filter applies (it does not with one name)
    path = GPU / "h200-small-fleetscope-fast-2steps.json.gz"
    assert_same_rank_views(path, ("ProfilerStep#900", "ProfilerStep#901"))


class _Event(msgspec.Struct):
    cat: object = None
    name: object = None


class _NamesOnly(msgspec.Struct):
    """A trace's events' categories and names, decoded without the rest (the fixtures hold ~90 traces)."""
    traceEvents: list[_Event] = []


def test_kernel_types_match_htas_function_on_every_fixture_kernel_name():
    from hta.utils.utils import get_kernel_type

    names = set()
    for path in sorted(GPU.rglob("*.json.gz")):   # every set's kernel names, the held-out sets' too
        for event in msgspec.json.decode(gzip.decompress(path.read_bytes()), type=_NamesOnly).traceEvents:
            if event.cat in ("kernel", "gpu_memcpy", "gpu_memset") and isinstance(event.name, str):
                names.add(event.name)
    names |= {"ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "Memset (Device)",
              "dma_copy", "cudaStreamSynchronize Sync", "void foo<Memcpy>()", "ncclKernelX"}
    assert len(names) > 100
    assert {n: kernel_type(n) for n in names} == {n: get_kernel_type(n) for n in names}


SETS = {
    "late rank 2 of 3, two hosts": TraceSetSpec(ranks=3, ranks_per_host=2, late_rank=2, late_us=300.0,
                                                inserted_allreduce_us=5000.0, host_offsets_us={1: 1500.0}),
    "late rank 0 of 4": TraceSetSpec(ranks=4, late_rank=0, late_us=900.0, inserted_allreduce_us=3000.0),
    "no late rank": TraceSetSpec(ranks=2, inserted_allreduce_us=4000.0),
    "late rank 3 of 4, slow device": TraceSetSpec(ranks=4, late_rank=3, late_us=2000.0, late_cause="slow kernels",
                                                  inserted_allreduce_us=3000.0),
    "short all-reduces": TraceSetSpec(ranks=2, late_rank=1, late_us=200.0, inserted_allreduce_us=10.0),
}


@pytest.mark.parametrize("case", sorted(SETS))
def test_synthetic_sets_equal_htas_own_load(tmp_path, case):
    paths = dict(enumerate(make_trace_set(GPU / "h200-small-hf-eager-2steps.json.gz", tmp_path, SETS[case])))
    native = run_hta(paths, has_comm_kernels=True, workers=1)
    stock = run_stock_hta(paths, has_comm_kernels=True)
    assert native.status == stock.status, (native.errors, stock.errors)
    assert {v: _kind(e) for v, e in native.errors.items()} == {v: _kind(e) for v, e in stock.errors.items()}
    assert_same_tables(native.tables, stock.tables)


def test_the_oracle_records_every_table_within_tolerance(tmp_path):
    paths = {0: GPU / "h200-small-fleetscope-fast-2steps.json.gz"}
    views = run_hta(paths, has_comm_kernels=False, workers=1, oracle=True)
    assert set(views.oracle) == set(views.tables) | set(views.errors)
    assert all(entry["within_tolerance"] and entry["max_abs_diff"] <= TOLERANCE for entry in views.oracle.values())


def test_the_oracle_reports_a_difference():
    rows = [{"rank": 0, "idle_time(us)": 10.0}]
    mine = run_hta({}, has_comm_kernels=False)
    import dataclasses

    a = dataclasses.replace(mine, tables={"t": rows})
    b = dataclasses.replace(mine, tables={"t": [{"rank": 0, "idle_time(us)": 10.5}]})
    assert compare_tables(a, b)["t"] == {"max_abs_diff": 0.5, "within_tolerance": False, "tolerance": TOLERANCE}
    assert compare_tables(a, dataclasses.replace(mine, tables={}))["t"]["within_tolerance"] is False


# --- hand-made traces ---------------------------------------------------------------------------------


def _event(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


def _launch(correlation, ts, kernel_ts, kernel_dur=5.0, name="gemm_kernel", stream=7):
    return [_event("cudaLaunchKernel", "cuda_runtime", ts, 2.0, correlation=correlation),
            _event(name, "kernel", kernel_ts, kernel_dur, correlation=correlation, stream=stream, device=0)]


def _write(tmp_path: Path, events: list) -> Path:
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def _steps(*spans):
    return [_event(f"ProfilerStep#{n}", "user_annotation", start, end - start) for n, start, end in spans]


HAND_MADE = {
    "no kernels": _steps((1, 100.0, 200.0), (2, 200.0, 300.0)) + [_event("aten::add", "cpu_op", 110.0, 5.0)],
    "no ProfilerStep": _launch(1, 100.0, 103.0) + _launch(2, 110.0, 120.5) + _launch(3, 111.0, 125.0, 40.0),
    "one step": _steps((4, 100.0, 200.0)) + _launch(1, 101.0, 104.0) + _launch(2, 150.0, 151.2, 0.3),
    "kernels outside steps": _steps((1, 100.0, 200.0), (2, 200.0, 300.0)) + _launch(1, 120.0, 125.0)
    + _launch(2, 210.0, 290.0, 20.0) + _launch(3, 350.0, 351.0) + _launch(4, 50.0, 52.0)
    + _launch(5, 220.0, 230.0, 60.0, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", stream=9),
    "tied starts": _steps((1, 0.0, 100.0), (2, 100.0, 200.0)) + _launch(1, 1.0, 10.4, 0.2) + _launch(2, 1.5, 10.6, 0.3)
    + _launch(3, 2.0, 10.5, 9.0) + _launch(4, 120.0, 130.0, 1.0, name="Memcpy DtoH (Device -> Pinned)"),
}


@pytest.mark.parametrize("case", sorted(HAND_MADE))
def test_hand_made_traces_equal_htas_views_or_its_errors(tmp_path, case):
    assert_same_rank_views(_write(tmp_path, HAND_MADE[case]))


def test_a_trace_without_kernels_reports_why_instead_of_raising(tmp_path):
    views = rank_views(_write(tmp_path, HAND_MADE["no kernels"]), 0)
    assert "temporal_breakdown" in views.errors and "idle_time_breakdown" in views.errors


def test_a_file_the_native_frame_cannot_take_goes_to_htas_loader_or_says_why(tmp_path, monkeypatch):
    from fleetscope.analysis.per_rank import hta_rank_views

    events = _launch(1, 100.0, 103.0) + [_event("odd", "kernel", 104.0, 1.0, correlation="x", stream=7)]
    path = _write(tmp_path, events)
    assert rank_views(path, 0).engine == ENGINE_HTA
    monkeypatch.setattr(hta_rank_views, "hta_installed", lambda: False)
    without = rank_views(path, 0)
    assert without.tables == {} and all(e.startswith("not computable") for e in without.errors.values())


def test_analyze_refuses_the_oracle_without_hta(monkeypatch, tmp_path, capsys):
    from fleetscope.analysis.per_rank import hta_rank_views
    from fleetscope.cli.main import main

    monkeypatch.setattr(hta_rank_views, "hta_installed", lambda: False)
    trace = tmp_path / "traces"
    trace.mkdir()
    (trace / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": HAND_MADE["one step"]}))
    assert main(["analyze", str(trace), "--hta-oracle", "--no-cache"]) == 2
    assert "--hta-oracle" in capsys.readouterr().err


def test_analyze_with_the_oracle_records_and_prints_it(tmp_path):
    from fleetscope.analysis import analyze
    from fleetscope.analysis.render.terminal import render_terminal

    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "rank0.pt.trace.json.gz").write_bytes((GPU / "h200-small-fleetscope-fast-2steps.json.gz").read_bytes())
    report = analyze(traces, hta_oracle=True, use_cache=False, write_default_outputs=False)
    hta = report.windows[0].hta
    assert hta.status == "ok" and hta.oracle and all(entry["within_tolerance"] for entry in hta.oracle.values())
    assert f"stock HTA beside it: {len(hta.oracle)} of {len(hta.oracle)} within 1e-9" in render_terminal(report)
    assert "oracle" in report.to_json()["windows"][0]["hta"]


def test_tables_stock_hta_did_not_compute_are_not_called_differences():
    from fleetscope.analysis.render.terminal import _oracle_line

    mine = run_hta({}, has_comm_kernels=False)
    import dataclasses

    ours = dataclasses.replace(mine, tables={"temporal_breakdown": [{"rank": 0, "idle_time(us)": 1.0}],
                                             "idle_time_breakdown": [{"rank": 0, "idle_time": 1.0}]}, errors={})
    failed = "HTA could not load the trace: TypeError: Invalid value for dtype 'int16'"
    stock = dataclasses.replace(mine, tables={}, errors={"temporal_breakdown": failed})
    compared = compare_tables(ours, stock)
    assert compared["temporal_breakdown"]["oracle_failed"] and compared["idle_time_breakdown"]["oracle_failed"]
    assert _oracle_line(compared) == ("stock HTA beside it: nothing compared; stock HTA did not compute "
                                      f"idle_time_breakdown, temporal_breakdown ({failed})")
    stock = dataclasses.replace(mine, tables={"temporal_breakdown": [{"rank": 0, "idle_time(us)": 2.0}]},
                                errors={"idle_time_breakdown": failed})
    assert _oracle_line(compare_tables(ours, stock)) == (
        "stock HTA beside it: 0 of 1 within 1e-9; differs: temporal_breakdown; stock HTA did not compute "
        f"idle_time_breakdown ({failed})")


def test_a_rank_the_step_filter_empties_keeps_htas_iteration_dtype():
    """A rank without ProfilerStep ranges beside ranks with two: HTA's step filter keeps none of its rows,
    and the empty iteration column keeps the dtype HTA gave it over the whole rank."""
    path = PUBLIC / "hta" / "alexnet_no_steps" / "benchmark_result_2869224_1695835535_trace.json.gz"
    assert_same_rank_views(path, ("ProfilerStep#1", "ProfilerStep#2"))
