"""The MoE view: hand-built traces and records with known answers (fast), the real H200 MoE fixture, and
real gloo runs of the trainer under expert parallelism with and without the hot-expert fault (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO
from helpers.kineto import KinetoBuilder

from fleetscope.analysis import analyze, render_terminal
from fleetscope.analysis.cross_rank.arrivals import arrival_matrix
from fleetscope.analysis.cross_rank.moe import HOT_EXPERT_MIN_RATIO, moe_report, moe_window
from fleetscope.analysis.per_rank.names import is_all_to_all_call
from fleetscope.analysis.per_rank.parse import parse_traces
from fleetscope.analysis.inputs.resolve import resolve_input
from fleetscope.analysis.render.html import render_html
from fleetscope.traces.formats import MoeRecord, moe_range

GPU_FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "h200-small-moe"
COMBINE_LATE_US = 50.0
"""In the hand-built traces rank 1 starts every combine all-to-all this much after rank 0."""


def _gloo_ep_rank(rank: int) -> KinetoBuilder:
    """Two steps of one MoE layer on a 2-rank ep group; rank 1 computes its experts 50 us longer, so it
    starts the combine all-to-all 50 us late; both end it at the same instant."""
    builder = KinetoBuilder(rank=rank, world_size=2, backend="gloo")
    late = COMBINE_LATE_US if rank == 1 else 0.0
    for index, s in enumerate((0.0, 1000.0)):
        builder.step(index, s, 1000.0)
        builder.annotation(moe_range("router", 0), s + 10, 20.0)
        builder.annotation(moe_range("dispatch", 0), s + 40, 200.0)
        builder.gloo(s + 50, 40.0, name="gloo:all_to_all")
        builder.annotation(moe_range("split_sizes_d2h", 0), s + 100, 10.0)
        builder.gloo(s + 120, 100.0, name="gloo:all_to_all")
        builder.annotation(moe_range("experts", 0), s + 250, 100.0 + late)
        builder.annotation(moe_range("combine", 0), s + 360 + late, 200.0 - late)
        builder.gloo(s + 370 + late, 130.0 - late, name="gloo:all_to_all")
        builder.gloo(s + 700, 50.0, name="gloo:all_to_all")   # backward: outside every MoE range
    return builder


def _records(rank: int, hot: bool) -> list[MoeRecord]:
    """4 experts over ep 2; with `hot`, expert 3 (ep rank 1) gets 300 of every rank's 400 copies."""
    counts = [40, 30, 30, 300] if hot else [100, 110, 90, 100]
    sent = [counts[0] + counts[1], counts[2] + counts[3]]
    return [MoeRecord(step=step, layer=0, rank=rank, ep=2, ep_rank=rank, ep_ranks=[0, 1], tokens_per_expert=counts,
                      send_tokens=sent, send_bytes=[n * 128 for n in sent], recv_tokens=[sent[rank]] * 2,
                      recv_bytes=[sent[rank] * 128] * 2, split_sizes_d2h_ms=0.25) for step in (0, 1)]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-gloo")
    for rank in (0, 1):
        _gloo_ep_rank(rank).write(root / f"rank{rank}.pt.trace.json")
    return [r for r in parse_traces(resolve_input(root).sources)]


def _view(results, hot: bool):
    records = _records(0, hot) + _records(1, hot)
    return moe_report(records, [moe_window(results, arrival_matrix(results), records)])


def test_per_rank_times_and_attributed_all_to_alls(gloo_results):
    by_rank = {r.rank: r.moe for r in gloo_results}
    layer = by_rank[1].layers[0]
    assert by_rank[1].steps == 2 and layer.calls["dispatch"] == 2
    assert layer.host_us["experts"] == pytest.approx(2 * (100.0 + COMBINE_LATE_US))
    assert layer.host_us["split_sizes_d2h"] == pytest.approx(20.0)
    kinds = [(a.kind, a.layer) for a in by_rank[0].all_to_alls]
    assert kinds.count(("dispatch", 0)) == 4 and kinds.count(("combine", 0)) == 2 and len(kinds) == 6


def test_hot_expert_names_its_rank_and_cost(gloo_results):
    view = _view(gloo_results, hot=True)
    (finding,) = view.findings
    assert (finding.layer, finding.expert, finding.ep_rank, finding.ranks) == (0, 3, 1, [1])
    assert finding.tokens_vs_mean == pytest.approx(600 / 200)
    assert finding.holder_last_pct == 100.0
    assert finding.cost_ms_per_step == pytest.approx(COMBINE_LATE_US / 1000, abs=1e-9)
    assert "lives on rank 1" in finding.sentence and "100% of the time" in finding.sentence
    layer = view.layers[0]
    assert layer.split_ranks == [0, 1] and layer.split_tokens == [[70.0, 330.0], [70.0, 330.0]]
    assert layer.tokens_per_rank == {0: 140.0, 1: 660.0}
    assert layer.rank_max_over_mean == pytest.approx(660 / 400)
    rank0, rank1 = layer.ranks
    assert rank0.combine_wait_ms == pytest.approx(COMBINE_LATE_US / 1000) and rank1.combine_wait_ms == 0.0
    assert rank1.combine_transfer_ms == pytest.approx((130.0 - COMBINE_LATE_US) / 1000)
    assert rank0.dispatch_wait_ms == 0.0 and rank0.split_sizes_d2h_ms == pytest.approx(0.010)
    assert rank0.split_sizes_d2h_record_ms == 0.25


def test_no_finding_below_the_threshold(gloo_results):
    view = _view(gloo_results, hot=False)
    assert view.findings == [] and view.layers[0].expert_max_over_mean == pytest.approx(110 / 100)
    assert HOT_EXPERT_MIN_RATIO == 1.5


def test_all_to_all_is_recognized_by_collective_name():
    assert is_all_to_all_call("nccl:SendRecv [mesh_ep pg 2]", "all_to_all")
    assert not is_all_to_all_call("nccl:SendRecv [pg 2]", "send_recv")
    for name in ("c10d::alltoall_base_", "gloo:all_to_all", "_c10d_functional::all_to_all_single", "all_to_allv"):
        assert is_all_to_all_call(name)
    assert not is_all_to_all_call("gloo:all_reduce")


def test_gpu_ranges_grouped_gemm_and_nccl_all_to_all(tmp_path):
    """A GPU rank: the experts range holds two GEMM kernels (30 + 20 us) and one elementwise kernel; the
    combine range holds a SendRecv kernel whose `Collective name` says all-to-all."""
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=2)
        builder.step(0, 0.0, 1000.0)
        builder.annotation(moe_range("experts", 0), 100.0, 50.0)
        builder.complete(moe_range("experts", 0), "gpu_user_annotation", 200.0, 80.0, pid=0, tid=7)
        builder.kernel("cutlass_grouped_gemm_bf16", 200.0, 30.0, launch_ts=110.0)
        builder.kernel("elementwise_kernel", 235.0, 10.0, launch_ts=115.0)
        builder.kernel("cutlass_grouped_gemm_bf16", 250.0, 20.0, launch_ts=120.0)
        builder.annotation(moe_range("combine", 0), 160.0, 40.0)
        builder.complete(moe_range("combine", 0), "gpu_user_annotation", 300.0, 100.0, pid=0, tid=20)
        builder.kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 300.0 + 10 * rank, 90.0 - 10 * rank,
                       launch_ts=170.0, stream=20, args={"Collective name": "all_to_all", "In msg nelems": 64,
                                                         "Out msg nelems": 64, "dtype": "BFloat16", "Group size": 2})
        builder.write(tmp_path / f"rank{rank}.pt.trace.json")
    report = analyze(tmp_path, write_default_outputs=False, use_hta=False, use_cache=False)
    assert report.moe.status == "not recorded"
    rank0, rank1 = report.moe.layers[0].ranks
    assert rank0.grouped_gemm_ms == pytest.approx(0.050) and rank0.gpu_ms["experts"] == pytest.approx(0.080)
    assert rank0.combine_wait_ms == pytest.approx(0.010) and rank1.combine_last_pct == 100.0


def test_h200_fixture_names_expert_3_hottest_in_every_layer():
    report = analyze(GPU_FIXTURE, write_default_outputs=False, use_hta=False, use_cache=False)
    moe = report.moe
    assert moe.status == "ok" and moe.ep == 1 and moe.num_experts == 16 and len(moe.layers) == 8
    assert all(layer.hottest_expert == 3 for layer in moe.layers)
    assert [(f.layer, f.expert, f.ranks) for f in moe.findings] == [(layer, 3, []) for layer in range(8)]
    assert all(f.tokens_vs_mean >= HOT_EXPERT_MIN_RATIO and f.cost_ms_per_step is None for f in moe.findings)
    for layer in moe.layers:
        (rank,) = layer.ranks
        assert rank.grouped_gemm_ms > 0 and rank.host_ms["experts"] > 0 and rank.split_sizes_d2h_ms is None
    assert "expert 3 received" in render_terminal(report) and "split matrix" not in render_html(report)


# --- real gloo runs of the trainer (slow) ------------------------------------------------------------

RUNS = {
    # conftest.MOE_EP_RUNS' case: (hot expert, ranks holding it)
    "ep4_hot": (3, [3]),            # parallel.ep=4, faults.hot_expert=3
    "ep2_dp2_hot": (2, [1, 3]),     # parallel.ep=2, faults.hot_expert=2
    "ep4_none": (None, None),       # parallel.ep=4
}
HOT_RATIO_RANGE = (1.9, 2.0)
"""4 experts top-2 with a +4 logit on one: nearly every token picks it once, at most 2x the mean."""


@pytest.fixture(scope="module")
def ep_reports(moe_ep_runs):
    """The shared expert-parallel runs (conftest.moe_ep_runs: RUNS' cases), analyzed."""
    return {name: analyze(moe_ep_runs / name, use_hta=False, use_cache=False) for name in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, (hot, _) in RUNS.items() if hot is not None])
def test_real_hot_expert_is_named_with_its_ranks_and_cost(ep_reports, name):
    hot, holders = RUNS[name]
    moe = ep_reports[name].moe
    assert moe.status == "ok" and moe.num_experts == 4 and len(moe.layers) == 2
    assert [(f.layer, f.expert, f.ranks) for f in moe.findings] == [(0, hot, holders), (1, hot, holders)]
    for finding, layer in zip(moe.findings, moe.layers):
        assert HOT_RATIO_RANGE[0] <= finding.tokens_vs_mean <= HOT_RATIO_RANGE[1] + 1e-9
        assert 0.0 <= finding.holder_last_pct <= 100.0 and finding.cost_ms_per_step >= 0.0
        by_rank = {r.rank: r for r in layer.ranks}
        assert all(r.combine_wait_ms is not None and r.split_sizes_d2h_ms > 0 for r in layer.ranks)
        # the holders' experts receive the most rows (host times are too noisy on shared CPUs to compare)
        others = [r.recv_tokens for rank, r in by_rank.items() if rank not in holders]
        assert min(by_rank[h].recv_tokens for h in holders) > max(others)
        assert all(r.host_ms["experts"] > 0 for r in layer.ranks)
        # every rank receives what the others sent it
        for column, rank in enumerate(layer.split_ranks):
            assert sum(row[column] for row in layer.split_tokens) == pytest.approx(layer.tokens_per_rank[rank])
    text = render_terminal(ep_reports[name])
    assert f"expert {hot} received" in text and "combine all-to-all" in text


@pytest.mark.slow
def test_real_ep2_split_matrix_stays_inside_each_ep_group(ep_reports):
    layer = ep_reports["ep2_dp2_hot"].moe.layers[0]
    assert layer.split_ranks == [0, 1, 2, 3]
    assert all(layer.split_tokens[src][dst] == 0 for src in range(4) for dst in range(4) if src // 2 != dst // 2)
    assert "dispatch split matrix" in render_html(ep_reports["ep2_dp2_hot"])


@pytest.mark.slow
def test_real_run_without_fault_has_no_imbalance_finding(ep_reports):
    moe = ep_reports["ep4_none"].moe
    assert moe.status == "ok" and moe.findings == []
    assert all(layer.expert_max_over_mean < HOT_EXPERT_MIN_RATIO for layer in moe.layers)
    data = json.loads(Path(ep_reports["ep4_none"].source_path, "report", "report.json").read_text())
    assert data["moe"]["layers"][0]["split_tokens"] and data["moe"]["findings"] == []


def _dispatch_set(directory, kernel: str) -> None:
    """Dispatch kernels named `kernel` in the dispatch range: rank 1's starts 30 us after rank 0's, both end
    together."""
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=2)
        builder.step(0, 0.0, 1000.0)
        builder.annotation(moe_range("dispatch", 0), 100.0, 50.0)
        builder.complete(moe_range("dispatch", 0), "gpu_user_annotation", 200.0, 100.0, pid=0, tid=20)
        builder.kernel(kernel, 200.0 + 30 * rank, 80.0 - 30 * rank, launch_ts=110.0, stream=20)
        builder.kernel("sm90_xmma_gemm_bf16", 400.0, 100.0, launch_ts=160.0)
        builder.write(directory / f"rank{rank}.pt.trace.json")


def _exchanged(report) -> bool:
    rank0, rank1 = report.moe.layers[0].ranks
    return rank0.dispatch_wait_ms == pytest.approx(0.030) and rank1.dispatch_wait_ms == 0.0 \
        and report.ranks[0].comm_pct > 0


def test_a_known_family_of_comm_kernels_is_the_exchange_by_default(tmp_path):
    # DeepEP's kernels are a known family (names.KNOWN_COMM_KERNEL_FAMILIES): communication with no flag
    _dispatch_set(tmp_path, "deep_ep::intranode::dispatch<8, 768>")
    assert _exchanged(analyze(tmp_path, write_default_outputs=False, use_hta=False, use_cache=False))


def test_a_configured_comm_kernel_pattern_counts_other_kernels_as_the_exchange(tmp_path):
    _dispatch_set(tmp_path, "my_ep::fast_dispatch<8, 768>")
    plain = analyze(tmp_path, write_default_outputs=False, use_hta=False, use_cache=False)
    assert plain.moe.layers[0].ranks[0].dispatch_wait_ms is None and plain.ranks[0].comm_pct == 0
    # named as a suspect, with the flag that counts it
    hints = [note for note in plain.windows[0].notes if "look like communication" in note]
    assert len(hints) == 1 and hints[0].startswith("ranks 0-1: ")        # one note for the ranks that share it
    assert "my_ep::fast_dispatch" in hints[0] and "--comm-kernel-pattern 'my_ep::fast_dispatch'" in hints[0]
    custom = analyze(tmp_path, write_default_outputs=False, use_hta=False, use_cache=False,
                     comm_kernel_pattern=r"my_ep::.*dispatch")
    assert _exchanged(custom)
    with pytest.raises(ValueError, match="comm_kernel_pattern"):
        analyze(tmp_path, write_default_outputs=False, comm_kernel_pattern="(")


def test_the_cache_key_covers_the_comm_kernel_pattern(tmp_path):
    from fleetscope.analysis.per_rank.cache import ResultCache

    source = resolve_input(_gloo_ep_rank(0).write(tmp_path / "rank0.pt.trace.json")).sources[0]
    cache = ResultCache(tmp_path)
    assert cache.key(source, b"x") != cache.key(source, b"x", "deep_ep")
    assert cache.key(source, b"x") == cache.key(source, b"x", None)


def test_merge_view_counts_what_each_local_expert_received(tmp_path):
    from fleetscope.analysis.inputs.records import read_run_records
    from fleetscope.analysis.merge.moe_overlays import moe_merge_views
    from fleetscope.analysis.report.model import Report
    from fleetscope.traces.layout import RunLayout

    layout = RunLayout.at(tmp_path)
    layout.metrics_dir.mkdir(parents=True)
    records = _records(0, hot=True) + _records(1, hot=True)
    for rank in (0, 1):
        layout.moe_file(rank).write_text("".join(json.dumps(r.to_json()) + "\n" for r in records if r.rank == rank))
    report = {"moe": {"ep": 2, "findings": [{"layer": 0, "expert": 3, "ranks": [1], "sentence": "s",
                                             "tokens_vs_mean": 3.0, "cost_ms_per_step": 0.05}]}}
    views = moe_merge_views(read_run_records(layout), Report.from_json_lenient(report)[0], [0, 1])
    assert views[0].expert_tokens == {0: {0: 80.0, 1: 60.0}, 1: {0: 80.0, 1: 60.0}}
    assert views[1].expert_tokens[1] == {2: 60.0, 3: 600.0}
    assert views[0].findings == [] and [m[1] for m in views[1].marks(5)] == ["hot expert 3 (layer 0)"]
    ((key, unit, samples), _) = views[1].counters([(0, 100, 200), (1, 200, 300)])
    assert key[2] == "tokens: expert 2" and unit == "tokens" and samples == [(100, 60.0), (200, 60.0)]


def test_moe_fields_are_in_the_documented_schema(gloo_results):
    import dataclasses
    import re

    from fleetscope.analysis.report import model as report_module

    def keys(value):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from ([key] if isinstance(key, str) else [])
                yield from keys(item)
        elif isinstance(value, list):
            for item in value:
                yield from keys(item)

    found = set(keys(dataclasses.asdict(_view(gloo_results, hot=True))))
    assert {"split_tokens", "combine_cost_ms", "holder_last_pct"} <= found
    assert {k for k in found if not re.search(rf"\b{k}\b", report_module.__doc__)} == set()


@pytest.mark.slow
def test_real_merge_has_expert_counters_and_hot_expert_marks(ep_reports, tmp_path):
    from fleetscope.analysis.merge.perfetto.check import check_trace
    from fleetscope.analysis.merge.run import merge
    from fleetscope.traces.formats import read_moe_records

    run = Path(ep_reports["ep2_dp2_hot"].source_path)
    check = check_trace(merge(run, tmp_path / "out.perfetto-trace").output)
    assert check.ok, check.problems[:5]
    records = [r for rank in range(4) for r in read_moe_records(run / "metrics" / f"rank{rank}.moe.jsonl")]
    for process in check.processes():
        if not process.name.startswith("rank "):   # the whole run's counters (every rank, every step)
            continue
        rank = int(process.name.split()[1])
        counters = {t.name: [v for _, v in check.counter_values[t.uuid]] for t in check.tracks.values()
                    if t.is_counter and check.process_of(t.uuid).uuid == process.uuid and t.name.startswith("tokens")}
        local = [2 * (rank % 2), 2 * (rank % 2) + 1]
        assert sorted(counters) == [f"tokens: expert {e}" for e in local]
        profiled = ep_reports["ep2_dp2_hot"].windows[0].steps
        own = [sum(sum(r.recv_tokens) for r in records if r.rank == rank and r.step == step) for step in profiled]
        assert [sum(values) for values in zip(*counters.values())] == own
        marks = [i.name for i in check.instants if check.process_of(i.track_uuid).uuid == process.uuid
                 and i.name.startswith("hot expert")]
        assert marks == (["hot expert 2 (layer 0)", "hot expert 2 (layer 1)"] if rank in (1, 3) else [])


def test_the_straggler_verdict_names_the_moe_imbalance_of_the_rank_waited_for(gloo_results):
    from fleetscope.analysis.cross_rank.moe import moe_imbalance_hints
    from fleetscope.analysis.cross_rank.stragglers import find_stragglers

    hints = moe_imbalance_hints(_records(0, hot=True) + _records(1, hot=True))
    assert list(hints) == [1] and hints[1].startswith("moe_imbalance (expert 3")
    late = find_stragglers(gloo_results, arrival_matrix(gloo_results), min_lateness_us=1.0, cause_hints=hints)
    assert late.waited_for_rank == 1 and "likely cause: moe_imbalance (expert 3" in late.verdict
    assert moe_imbalance_hints(_records(0, hot=False) + _records(1, hot=False)) == {}
