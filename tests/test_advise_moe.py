"""The advisor's MoE rules: synthetic MoE sections with known answers (fast), and real gloo runs of the
trainer under expert parallelism with and without the hot-expert fault (slow)."""

from __future__ import annotations

import pytest

from fleetscope.analysis.advise import (
    ALL_TO_ALL_STEP_SHARE,
    RANK_OVERLOAD_RATIO,
    Change,
    Evidence,
    advise,
    advise_evidence,
    plan_placement,
)
from fleetscope.analysis.cross_rank.moe import HOT_EXPERT_MIN_RATIO, MoeFinding, MoeLayerReport, MoeRankLayer, MoeReport

CONFIG = {"model": {"family": "qwen3_moe"}, "parallel": {"mode": "ddp", "ep": 4}, "faults": {"hot_expert": -1}}
HOT_TOKENS = [400.0, 400.0, 400.0, 1600.0]
"""4 experts over ep 4 (one per rank): expert 3 gets 2x the mean (700 of 2800 per expert on average)."""


def _rank(rank: int, experts_ms: float, *, a2a_ms: float = 0.5, last_pct: float = 0.0,
          gpu: bool = True) -> MoeRankLayer:
    times = {"experts": experts_ms}
    return MoeRankLayer(rank=rank, host_ms={"experts": experts_ms}, gpu_ms=times if gpu else {},
                        dispatch_transfer_ms=a2a_ms / 2, combine_transfer_ms=a2a_ms / 2,
                        dispatch_wait_ms=0.0, combine_wait_ms=0.0, combine_last_pct=last_pct,
                        combine_cost_ms=2.0 if last_pct else None)


def _section(tokens=HOT_TOKENS, *, hot_ms: float = 5.0, cold_ms: float = 2.0, a2a_ms: float = 0.5,
             last_pct: float = 90.0, ep: int = 4, gpu: bool = True, layers: int = 1) -> MoeReport:
    """A MoE section of `layers` identical layers: ep ranks 0..ep-1, one ep group; the hottest expert's ep rank
    computes hot_ms, the others cold_ms; a finding when the hottest expert gets >= 1.5x the mean."""
    per = len(tokens) // ep
    loads = [sum(tokens[k * per:(k + 1) * per]) for k in range(ep)]
    hottest = max(range(len(tokens)), key=lambda x: tokens[x])
    holder = hottest // per
    ratio = max(tokens) / (sum(tokens) / len(tokens))
    built, findings = [], []
    for index in range(layers):
        ranks = [_rank(r, hot_ms if r == holder else cold_ms, a2a_ms=a2a_ms,
                       last_pct=last_pct if r == holder else 0.0, gpu=gpu) for r in range(ep)]
        built.append(MoeLayerReport(layer=index, record_steps=4, tokens_per_expert=list(tokens),
                                    expert_max_over_mean=ratio, hottest_expert=hottest,
                                    tokens_per_rank=dict(enumerate(loads)),
                                    rank_max_over_mean=max(loads) / (sum(loads) / ep), split_tokens=[],
                                    split_bytes=[], split_ranks=list(range(ep)), ranks=ranks))
        if ratio >= HOT_EXPERT_MIN_RATIO:
            findings.append(MoeFinding(layer=index, expert=hottest, tokens_vs_mean=ratio, ep_rank=holder,
                                       ranks=[holder], holder_last_pct=last_pct, cost_ms_per_step=2.0,
                                       sentence=f"expert {hottest} received {ratio:.1f}x the mean tokens"))
    return MoeReport(status="ok", ep=ep, num_experts=len(tokens), layers=built, findings=findings,
                     ep_groups=[list(range(ep))])


def _rules(moe: MoeReport, *, basis: str = "gpu", step_ms: float = 100.0, config=CONFIG,
           hosts: dict[int, str] | None = None) -> dict:
    hosts = hosts if hosts is not None else {r: "node0" for r in range(moe.ep)}
    evidence = Evidence(step_ms=step_ms, basis=basis, config=config, moe=moe, rank_hosts=hosts)
    return {f.rule: f for f in advise_evidence(evidence).findings}


def test_a_hot_expert_gets_load_balancing_with_the_waiting_it_causes_as_gain():
    rules = _rules(_section(layers=2))
    finding = rules["moe_load_balance"]
    assert finding.evidence["expert"] == 3 and finding.evidence["ranks"] == "3"
    assert finding.title.startswith("uneven routing: expert 3 (layer 0) on rank 3")
    assert finding.expected_gain_ms == pytest.approx(2 * (5.0 - 2.0))      # 3 ms extra per layer, 2 layers
    assert finding.confidence == "high"
    assert finding.apply == Change(train_args=("--set", "model.router_aux_loss_coef=0.01"))
    assert finding.change.startswith("--set model.router_aux_loss_coef=0.01 (the trainer's router load-balancing")
    # the family decides the mechanism: DeepSeek-V3 balances with a router bias
    deepseek = {**CONFIG, "model": {"family": "deepseek_v3"}}
    assert "router_bias_update_rate" in _rules(_section(), config=deepseek)["moe_load_balance"].change


def test_the_load_balancing_loss_is_applied_where_the_trainer_can_add_it(tmp_path):
    def balance(**sections):
        config = {**CONFIG, **{name: {**CONFIG.get(name, {}), **value} for name, value in sections.items()}}
        return _rules(_section(), config=config)["moe_load_balance"]

    assert balance(model={"family": "mixtral"}).apply.train_args == ("--set", "model.router_aux_loss_coef=0.01")
    # a run that already has the loss: twice its coefficient
    raised = balance(model={"family": "olmoe", "router_aux_loss_coef": 0.01})
    assert raised.apply.train_args == ("--set", "model.router_aux_loss_coef=0.02")
    assert raised.change.startswith("--set model.router_aux_loss_coef=0.02 ")
    # layouts whose configuration refuses the loss (pipeline; TP without EP): advice in words only
    for refused in ({"pp": 2, "ep": 1}, {"mode": "fsdp_tp", "tp": 2, "ep": 1}):
        finding = balance(parallel=refused)
        assert finding.apply is None and "router_aux_loss_coef=0.01" in finding.change
    assert balance(parallel={"mode": "fsdp_tp", "tp": 2, "ep": 2}).apply is not None
    # DeepSeek-V3's mechanism is the router bias update
    deepseek = balance(model={"family": "deepseek_v3"})
    assert deepseek.apply.train_args == ("--set", "model.router_bias_update_rate=0.001")
    assert deepseek.change.startswith("--set model.router_bias_update_rate=0.001 (the trainer's auxiliary-loss-free")
    assert balance(model={"family": "deepseek_v3"}, parallel={"pp": 2}).apply is None
    # the relaunch takes the change: the recorded job with the coefficient set, and nothing else
    from fleetscope.launcher.relaunch import plan_relaunch
    from fleetscope.launcher.spec import JobSpec, spec_record
    from fleetscope.trainer.config import ModelConfig, TrainConfig
    recorded = spec_record(JobSpec(train=TrainConfig(run_dir=str(tmp_path / "run"))))["spec"]
    relaunch = plan_relaunch(recorded, source_run=tmp_path / "run", new_run_dir=tmp_path / "new",
                             train_args=balance().apply.train_args)
    assert relaunch.spec.train.model.router_aux_loss_coef == 0.01
    assert relaunch.assignments == ("model.router_aux_loss_coef=0.01",)
    recorded = spec_record(JobSpec(train=TrainConfig(run_dir=str(tmp_path / "run"),
                                                     model=ModelConfig(family="deepseek_v3"))))["spec"]
    relaunch = plan_relaunch(recorded, source_run=tmp_path / "run", new_run_dir=tmp_path / "new",
                             train_args=deepseek.apply.train_args)
    assert relaunch.spec.train.model.router_bias_update_rate == 0.001


def test_an_injected_router_fault_is_undone_by_the_relaunch():
    faulty = {**CONFIG, "faults": {"hot_expert": 3}}
    finding = _rules(_section(), config=faulty)["moe_load_balance"]
    assert finding.apply == Change(train_args=("--set", "faults.hot_expert=-1"))
    skewed = {**CONFIG, "faults": {"expert_skew": 1.0}}
    assert _rules(_section(), config=skewed)["moe_load_balance"].apply.train_args == ("--set", "faults.expert_skew=0")


def test_load_balance_fires_from_the_hot_expert_threshold_only():
    assert "moe_load_balance" in _rules(_section([300.0, 300.0, 300.0, 540.0]))     # 1.5x: at the threshold
    assert _rules(_section([300.0, 300.0, 300.0, 530.0])) == {}                     # 1.48x: below
    unobserved = _rules(_section(last_pct=10.0))["moe_load_balance"]
    assert unobserved.confidence == "medium"


def test_without_expert_parallelism_the_imbalance_has_no_time_estimate():
    moe = _section([200.0, 200.0, 200.0, 800.0], ep=1)
    finding = _rules(moe)["moe_load_balance"]
    assert finding.expected_gain_ms is None and finding.confidence == "low"
    assert "moe_expert_placement" not in _rules(moe)


def test_placement_replicates_a_lone_hot_expert_and_estimates_the_share_it_removes():
    finding = _rules(_section())["moe_expert_placement"]
    # loads 400/400/400/1600, mean 700: a copy on rank 0 leaves 800/400/400/1200 -> excess 500 of 900
    assert finding.evidence["plan"] == "replicate" and finding.change.startswith("replicate expert 3 on rank 0")
    assert finding.evidence["remaining_excess_share"] == pytest.approx(500 / 900, abs=1e-3)
    assert finding.expected_gain_ms == pytest.approx(3.0 * (1 - 500 / 900))
    assert finding.apply is None and finding.confidence == "medium"


def test_placement_swaps_when_ranks_hold_several_experts():
    # 8 experts over ep 2, loads 700 / 1000 (mean 850): swapping hot expert 7 (400) with expert 0 (250)
    # moves 150 tokens and balances both ranks; a copy of 7 on rank 0 would leave 900 / 800
    tokens = [250.0, 150.0, 150.0, 150.0, 200.0, 200.0, 200.0, 400.0]
    plan = plan_placement(tokens, 2, 7)
    assert (plan.action, plan.to_ep_rank, plan.swap_with, plan.remaining_excess) == ("swap", 0, 0, 0.0)
    # one much hotter expert: half of it elsewhere beats moving all of it (loads 400 / 900 -> 625 / 675)
    replicate = plan_placement([100.0, 100.0, 100.0, 100.0, 150.0, 150.0, 150.0, 450.0], 2, 7)
    assert replicate.action == "replicate" and replicate.remaining_excess == pytest.approx(25 / 250)
    assert plan_placement(tokens, 2, 1) is None            # expert 1's rank is not the heavier one


def test_placement_names_every_ep_groups_ranks():
    # ep 2 x dp 2: ep groups [0, 1] and [2, 3]; hot expert 3 lives on ep rank 1 = ranks 1 and 3
    from dataclasses import replace

    moe = _section([300.0, 300.0, 300.0, 1500.0], ep=2)
    moe = replace(moe, ep_groups=[[0, 1], [2, 3]], findings=[replace(f, ranks=[1, 3]) for f in moe.findings])
    finding = _rules(moe, hosts={r: "node0" for r in range(4)})["moe_expert_placement"]
    assert finding.title.startswith("ranks 1, 3 hold hot expert 3 (layer 0)")
    # loads 600 / 1800: a copy on ep rank 0 leaves 1350 / 1050 (swapping would only exchange the loads)
    assert finding.change.startswith("replicate expert 3 on ranks 0, 2")
    assert finding.evidence["remaining_excess_share"] == pytest.approx(150 / 600)


def test_placement_needs_an_overloaded_rank():
    # 8 experts over ep 4: the hot expert 7 (2x) shares rank 3 with the coldest expert: rank load 1.18x the mean
    tokens = [350.0, 350.0, 350.0, 350.0, 350.0, 350.0, 50.0, 800.0]
    moe = _section(tokens)
    assert moe.layers[0].rank_max_over_mean < RANK_OVERLOAD_RATIO
    rules = _rules(moe)
    assert "moe_load_balance" in rules and "moe_expert_placement" not in rules


def test_an_exchange_costlier_than_the_experts_asks_for_a_smaller_ep_degree():
    # 2 ranks per node, ep 4 spans two nodes: 14 ms forward exchange (28 per step) vs 2 ms of experts
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    balanced = [700.0, 700.0, 700.0, 700.0]
    finding = _rules(_section(balanced, hot_ms=2.0, a2a_ms=14.0), hosts=hosts)["moe_ep_degree"]
    assert finding.apply == Change(train_args=("--set", "parallel.ep=2")) and finding.evidence["ep_spans_nodes"] == "True"
    # off-rank share 3/4 over 50 GB/s -> 1/2 over 450 GB/s
    assert finding.expected_gain_ms == pytest.approx(28.0 * (1 - (0.5 / 450) / (0.75 / 50)))
    inside = _rules(_section(balanced, hot_ms=2.0, a2a_ms=14.0))["moe_ep_degree"]
    assert inside.change == "--set parallel.ep=2"
    assert inside.expected_gain_ms == pytest.approx(28.0 * (1 - 0.5 / 0.75))


def test_the_ep_degree_rule_stays_silent_below_its_thresholds_and_on_cpu_traces():
    balanced = [700.0, 700.0, 700.0, 700.0]
    share = ALL_TO_ALL_STEP_SHARE * 100.0 / 2          # forward ms that makes the step share exactly
    assert "moe_ep_degree" in _rules(_section(balanced, hot_ms=2.0, cold_ms=2.0, a2a_ms=share))
    assert _rules(_section(balanced, hot_ms=2.0, cold_ms=2.0, a2a_ms=share - 0.1)) == {}
    assert _rules(_section(balanced, hot_ms=20.0, cold_ms=20.0, a2a_ms=19.0)) == {}   # experts cost more
    assert _rules(_section(balanced, a2a_ms=30.0, gpu=False), basis="cpu") == {}


def test_a_run_without_moe_gets_no_moe_advice():
    assert advise_evidence(Evidence(step_ms=100.0, basis="gpu", config=CONFIG)).findings == []


def test_the_straggler_cause_of_a_hot_expert_rank_names_the_uneven_routing(tmp_path):
    """Hand-built 2-rank traces (test_cross_rank_moe): rank 1 computes its experts 50 us longer before each
    combine and holds hot expert 3 in the records."""
    from test_cross_rank_moe import _gloo_ep_rank, _records

    from fleetscope.analysis.cross_rank.arrivals import arrival_matrix
    from dataclasses import replace

    from fleetscope.analysis.cross_rank.causes import CAUSE_WORK, explain, find_causes
    from fleetscope.analysis.cross_rank.clock_align import align_clocks
    from fleetscope.analysis.cross_rank.moe import uneven_routing_hints
    from fleetscope.analysis.cross_rank.stragglers import find_stragglers
    from fleetscope.analysis.inputs.resolve import resolve_input
    from fleetscope.analysis.per_rank.parse import parse_traces

    for rank in (0, 1):
        _gloo_ep_rank(rank).write(tmp_path / f"rank{rank}.pt.trace.json")
    results = list(parse_traces(resolve_input(tmp_path).sources))
    matrix = arrival_matrix(results)
    clock = align_clocks(matrix, {"host": [0, 1]}, {})
    stragglers = find_stragglers(results, matrix, min_lateness_us=1.0)
    routing = uneven_routing_hints(_records(0, hot=True) + _records(1, hot=True))
    assert routing == {1: "uneven routing: expert 3 (layer 0) on rank 1"}
    (cause,) = [c for c in find_causes(results, matrix, stragglers, clock, routing=routing).findings if c.rank == 1]
    # the traces hold no ops, so its extra time reads as idle (host-side delay): the routing is added to it
    assert cause.routing == routing[1] and cause.cause != CAUSE_WORK
    assert "; the MoE view shows uneven routing: expert 3 (layer 0) on rank 1" in cause.explanation
    assert "more work: uneven routing: expert 3 (layer 0) on rank 1" in explain(replace(cause, cause=CAUSE_WORK))
    plain = [c for c in find_causes(results, matrix, stragglers, clock).findings if c.rank == 1]
    assert plain[0].routing == "" and "uneven routing" not in plain[0].explanation
    assert "e.g. uneven expert routing" in explain(replace(plain[0], cause=CAUSE_WORK))
    assert uneven_routing_hints(_records(0, hot=False) + _records(1, hot=False)) == {}


def test_the_h200_fixture_without_expert_parallelism_gets_balancing_without_a_time_estimate():
    """The real 1-GPU H200 MoE run (16 experts top-2, the router biased towards expert 3: 8x the mean)."""
    from helpers import REPO

    rules = {f.rule: f for f in advise(REPO / "tests" / "fixtures" / "gpu" / "h200-small-moe").findings}
    balance = rules["moe_load_balance"]
    assert (balance.evidence["expert"], balance.evidence["ep"], balance.evidence["ranks"]) == (3, 1, "all")
    assert balance.evidence["tokens_vs_mean"] == pytest.approx(8.0, abs=0.05)
    assert balance.expected_gain_ms is None and balance.confidence == "low"
    assert "moe_expert_placement" not in rules and "moe_ep_degree" not in rules


# --- real gloo runs of the trainer (slow): one run per case, shared by the tests below ------------------

@pytest.fixture(scope="module")
def ep_runs(moe_ep_runs):
    """The shared expert-parallel runs (conftest.moe_ep_runs), by the names these tests use."""
    return {"hot": moe_ep_runs / "ep4_hot", "none": moe_ep_runs / "ep4_none"}


@pytest.mark.slow
def test_real_hot_expert_run_gets_balance_and_placement_advice_naming_expert_and_rank(ep_runs, tmp_path, capsys):
    from fleetscope.cli.main import main

    rules = {f.rule: f for f in advise(ep_runs["hot"]).findings}
    balance, placement = rules["moe_load_balance"], rules["moe_expert_placement"]
    assert (balance.evidence["expert"], balance.evidence["ranks"]) == (3, "3")
    assert balance.title.startswith("uneven routing: expert 3 (layer ")
    assert balance.evidence["tokens_vs_mean"] == pytest.approx(2.0, abs=0.1)    # top-2 of 4 with +4 logit
    assert balance.apply == Change(train_args=("--set", "faults.hot_expert=-1"))
    assert balance.expected_gain_ms is not None and balance.expected_gain_ms > 0
    assert (placement.evidence["expert"], placement.evidence["ranks"]) == (3, "3")
    assert placement.change.startswith("replicate expert 3 on rank ")     # one expert per rank: no swap helps
    assert "moe_ep_degree" not in rules                                    # CPU trace: no EP-degree advice
    assert main(["advise", str(ep_runs["hot"])]) == 0
    assert "uneven routing: expert 3" in capsys.readouterr().out


@pytest.mark.slow
def test_real_run_without_fault_gets_no_moe_advice(ep_runs):
    assert [f.rule for f in advise(ep_runs["none"]).findings if f.rule.startswith("moe_")] == []


@pytest.mark.slow
def test_real_straggler_cause_of_the_hot_rank_names_the_uneven_routing(ep_runs):
    from fleetscope.analysis import analyze

    report = analyze(ep_runs["hot"], use_hta=False, use_cache=False, write_default_outputs=False)
    causes = [c for w in report.windows for c in w.causes.findings]
    assert all(c.routing == ("uneven routing: expert 3 (layers 0, 1) on rank 3" if c.rank == 3 else "") for c in causes)
    assert all(c.routing in c.explanation for c in causes)
    clean = analyze(ep_runs["none"], use_hta=False, use_cache=False, write_default_outputs=False)
    assert all(c.routing == "" for w in clean.windows for c in w.causes.findings)


@pytest.mark.slow
def test_real_moe_all_to_all_bytes_from_the_records_and_from_the_traces_split_sizes_agree(ep_runs, tmp_path):
    """Each rank dispatches 4 x 128 tokens x top-2 rows of 64 fp32 (256 bytes) and returns in combine what
    its experts received (the hot rank 3 the most); backward runs both exchanges in reverse. The records
    give the forward ones whole; the traces (record_shapes) list every c10d::alltoall_base_'s split sizes."""
    import json
    import shutil

    from fleetscope.analysis import analyze

    report = analyze(ep_runs["hot"], use_hta=False, use_cache=False, write_default_outputs=False)
    window = report.windows[0]
    (row,) = [r for r in window.bandwidth.rows if r.collective == "all_to_all" and r.bucket_min_bytes == 2**18]
    records = [json.loads(line) for rank in range(4)
               for line in (ep_runs["hot"] / "metrics" / f"rank{rank}.moe.jsonl").read_text().splitlines()]
    profiled = [r for r in records if r["step"] in window.steps]
    assert all(sum(r["send_bytes"]) == 4 * 128 * 2 * 256 for r in profiled)
    combine = {}
    for r in profiled:
        key = (r["step"], r["layer"])
        combine[key] = max(combine.get(key, 0), sum(r["recv_bytes"]))
    forward = len(combine) * 4 * 128 * 2 * 256 + sum(combine.values())
    assert row.split_status == {"trainer records": 2 * len(combine), "trace": 2 * len(combine)}
    assert row.total_bytes == 2 * forward                                     # backward moves as much again
    assert row.sender_max_over_mean == pytest.approx(2.0, abs=0.1)            # rank 3 returns ~2x the mean
    # without the records, the traces' own split sizes give the same bytes
    shutil.copytree(ep_runs["hot"], tmp_path / "run", ignore=shutil.ignore_patterns("*.moe.jsonl", "report"))
    alone = analyze(tmp_path / "run", use_hta=False, use_cache=False, write_default_outputs=False)
    (trace_row,) = [r for r in alone.windows[0].bandwidth.rows if r.collective == "all_to_all"
                    and r.bucket_min_bytes == 2**18]
    assert trace_row.split_status == {"trace": 4 * len(combine)} and trace_row.total_bytes == 2 * forward


def test_a_forged_ep_degree_neither_spins_nor_advises(monkeypatch):
    # report.json read back with moe.ep = 10**15: the divisor search was range(1, ep)
    import dataclasses
    import signal

    balanced = [700.0, 700.0, 700.0, 700.0]
    moe = dataclasses.replace(_section(balanced, hot_ms=2.0, a2a_ms=14.0), ep=10**15)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("advise spins on a forged ep"))
    signal.alarm(10)
    try:
        rules = _rules(moe, hosts={0: "a", 1: "a", 2: "b", 3: "b"})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert "moe_ep_degree" not in rules and "moe_expert_placement" not in rules


@pytest.mark.parametrize("expert", [99, -1])
def test_a_forged_hot_expert_outside_the_layer_gets_no_placement(expert):
    import dataclasses

    moe = _section([300.0, 300.0, 300.0, 1500.0], ep=2)
    moe = dataclasses.replace(moe, findings=[dataclasses.replace(f, expert=expert) for f in moe.findings])
    assert "moe_expert_placement" not in _rules(moe)
