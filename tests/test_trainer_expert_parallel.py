"""Expert parallelism: refusals before any process group (fast), and real torchrun/gloo runs (slow) in which
every family under ep x {DDP, FSDP2, FSDP2 x TP} starts from the unsharded model's loss and follows its
trajectory, the gradients and their global norm equal the unsharded model's, and the hot-expert fault shows in
the MoE records."""

from __future__ import annotations

import pytest
from helpers import REFERENCE_STEPS, REPO, mean_losses, torchrun

from fleetscope.traces.formats import MOE_RECORD_FIELDS, parse_moe_range, moe_range, read_moe_records
from fleetscope.trainer.config import (ConfigError, FaultConfig, ModelConfig, ParallelConfig, TrainConfig,
                                       apply_overrides)
from fleetscope.trainer.expert_parallel import tp_share
from fleetscope.trainer.families import FAMILIES
from fleetscope.trainer.models import build_model, check_model_support, decoder_layers
from fleetscope.trainer.parallel import ParallelDims
from fleetscope.trainer.tp_plan import tensor_parallel_plan, without_modules

SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_families.py")
GRADS_SCRIPT = str(REPO / "tests" / "dist_scripts" / "expert_grads.py")
STEPS = 5
ONE_FAMILY = "qwen3_moe"
# (processes, mode, ep, tp, sequences per data-parallel rank, families): a global batch of 8 in every layout.
LAYOUTS = {
    "reference": (1, "ddp", 1, 1, 8, ",".join(FAMILIES)),    # conftest.families_reference
    "ep2": (2, "ddp", 2, 1, 4, ",".join(FAMILIES)),
    "ep2_fsdp": (2, "fsdp", 2, 1, 4, ",".join(FAMILIES)),
    "ep4": (4, "ddp", 4, 1, 2, ONE_FAMILY),
    "ep2_fsdp_dp2": (4, "fsdp", 2, 1, 2, ONE_FAMILY),
    "ep2_tp2": (4, "fsdp_tp", 2, 2, 4, ",".join(FAMILIES)),  # dp 2 = ep 2 (edp 1) x tp 2
}
STEP0_TOLERANCE = 1e-5
TRAJECTORY_TOLERANCE = 5e-4
HOT_EXPERT = 3


# --- refusals (no processes) -----------------------------------------------------------------------


def test_ep_must_divide_the_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 4 does not divide the 6 data-parallel ranks"):
        ParallelDims.from_config(ParallelConfig(mode="fsdp", ep=4), world_size=6)


def test_ep_must_divide_the_experts():
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 8 does not divide the 4 routed experts of qwen3_moe"):
        ParallelDims.from_config(ParallelConfig(mode="ddp", ep=8), world_size=8, num_experts=4,
                                 model_type="qwen3_moe", name="qwen3_moe")
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 8 does not divide the 4 routed experts"):
        check_model_support(ModelConfig(family="mixtral"), ParallelConfig(mode="ddp", ep=8))


def test_ep_refuses_an_unsupported_moe_block():
    with pytest.raises(ConfigError, match=r"^parallel\.ep: .*model_type 'jamba'.* no expert-parallel support"):
        ParallelDims.from_config(ParallelConfig(mode="ddp", ep=2), world_size=2, num_experts=4, model_type="jamba",
                                 name="some/jamba")


def test_ep_refuses_tp_mode_which_leaves_no_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"^parallel\.ep: is 2 but parallel\.mode 'tp' .* no data-parallel ranks "
                                          r".*use fsdp_tp"):
        ParallelConfig(mode="tp", tp=2, ep=2)
    with pytest.raises(ConfigError, match=r"^parallel\.ep: must be >= 1"):
        ParallelConfig(ep=0)


def test_ep_with_tp_must_divide_the_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 4 does not divide the 2 data-parallel ranks "
                                          r"\(world size 4, tp 2\)"):
        ParallelDims.from_config(ParallelConfig(mode="fsdp_tp", tp=2, ep=4), world_size=4)
    with pytest.raises(ConfigError, match=r"^parallel\.tp: 2 does not divide the world size 3"):
        ParallelDims.from_config(ParallelConfig(mode="fsdp_tp", tp=2, ep=2), world_size=3)


def test_ep_with_tp_checks_experts_and_heads_against_the_model():
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 8 does not divide the 4 routed experts of olmoe"):
        check_model_support(ModelConfig(family="olmoe"), ParallelConfig(mode="fsdp_tp", tp=2, ep=8))
    # tiny preset: 4 query heads, 2 key/value heads
    with pytest.raises(ConfigError, match=r"^parallel\.tp: 4 does not divide num_key_value_heads=2 of mixtral"):
        check_model_support(ModelConfig(family="mixtral"), ParallelConfig(mode="fsdp_tp", tp=4, ep=2))
    check_model_support(ModelConfig(family="mixtral"), ParallelConfig(mode="fsdp_tp", tp=2, ep=2))


def test_ep_with_tp_refuses_hsdp_and_pipeline_axes():
    for extra in (["parallel.dp_replicate=2"], ["parallel.pp=2", "parallel.tp=1", "parallel.mode=fsdp"]):
        with pytest.raises(ConfigError, match=r"^parallel\.ep: expert parallelism composes with DDP, FSDP2 and "
                                              r"FSDP2 x TP without pipeline or HSDP axes"):
            apply_overrides(TrainConfig(run_dir="/tmp/x"), ["parallel.mode=fsdp_tp", "parallel.tp=2",
                                                            "parallel.ep=2", *extra])


def test_ep_tp_mesh_axes():
    """tp fastest, then ep, then the edp replicas; an ep group is one TP lane (same tp index) of adjacent
    data-parallel ranks."""
    dims = ParallelDims.from_config(ParallelConfig(mode="fsdp_tp", tp=2, ep=2), world_size=8)
    assert (dims.dp, dims.ep, dims.edp, dims.tp) == (4, 2, 2, 2)
    assert dims.mesh_shape == (2, 2, 2) and dims.mesh_names == ("edp", "ep", "tp")
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.ep_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.ep_group_ranks(r) for r in (0, 1, 2, 5)] == [[0, 2], [1, 3], [0, 2], [5, 7]]


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 93, 128])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_tp_shares_cover_the_tokens_once(num_tokens, tp):
    shares = [tp_share(num_tokens, tp, rank) for rank in range(tp)]
    assert [start for start, _ in shares] == [sum(rows for _, rows in shares[:rank]) for rank in range(tp)]
    assert sum(rows for _, rows in shares) == num_tokens
    assert max(rows for _, rows in shares) - min(rows for _, rows in shares) <= 1
    assert shares[0][1] == max(rows for _, rows in shares)  # the gather pads to the first share


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3"])
def test_tp_plan_leaves_the_routed_experts_whole(family):
    """The plan fleetscope applies, less the routed experts under EP; attention, shared experts and embeddings
    keep theirs."""
    causal_lm = build_model(ModelConfig(family=family), seed=0)
    experts = [layer.mlp.experts for layer in decoder_layers(causal_lm)]
    full = tensor_parallel_plan(causal_lm)
    plan = without_modules(full, causal_lm, experts)
    assert full["model.layers.1.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert not any(".mlp.experts" in key for key in plan)
    assert {key: style for key, style in full.items() if ".mlp.experts" not in key} == plan
    assert "model.embed_tokens" in plan
    if family == "deepseek_v3":
        assert plan["model.layers.0.mlp.shared_experts.down_proj"] == "rowwise"
    else:
        assert plan["model.layers.1.self_attn.o_proj"] in ("rowwise", "rowwise_split_input")


def test_router_faults_are_allowed_under_ep_with_tp():
    config = apply_overrides(TrainConfig(run_dir="/tmp/x"), ["parallel.mode=fsdp_tp", "parallel.tp=2",
                                                             "parallel.ep=2", "faults.hot_expert=1"])
    assert config.faults.hot_expert == 1


def test_ep_refuses_checkpoints():
    with pytest.raises(ConfigError, match=r"^checkpoint\.every: checkpoints of expert-parallel runs"):
        apply_overrides(TrainConfig(run_dir="/tmp/x"), ["parallel.ep=2", "checkpoint.every=5"])


def test_ep_mesh_axes():
    dims = ParallelDims.from_config(ParallelConfig(mode="fsdp", ep=2), world_size=8)
    assert (dims.dp, dims.ep, dims.edp, dims.tp) == (8, 2, 4, 1)
    assert dims.mesh_shape == (4, 2, 1) and dims.mesh_names == ("edp", "ep", "tp")
    assert [dims.ep_rank(r) for r in range(4)] == [0, 1, 0, 1]
    plain = ParallelDims.from_config(ParallelConfig(mode="fsdp"), world_size=8)
    assert plain.mesh_shape == (8, 1) and plain.mesh_names == ("dp", "tp") and plain.ep == 1


def test_router_faults_refuse_tensor_parallel():
    with pytest.raises(ConfigError, match=r"^faults\.hot_expert: the router faults"):
        apply_overrides(TrainConfig(run_dir="/tmp/x"), ["parallel.mode=tp", "parallel.tp=2", "faults.hot_expert=1"])


def test_router_faults_are_validated():
    with pytest.raises(ConfigError, match=r"^faults\.hot_expert: must be >= -1"):
        FaultConfig(hot_expert=-2)
    with pytest.raises(ConfigError, match=r"^faults\.hot_expert_bias: must be > 0"):
        FaultConfig(hot_expert=1, hot_expert_bias=0)
    with pytest.raises(ConfigError, match=r"^faults\.expert_skew: must be >= 0"):
        FaultConfig(expert_skew=-1)
    with pytest.raises(ConfigError, match=r"^faults\.hot_expert: 4 is not an expert of olmoe \(4 experts\)"):
        check_model_support(ModelConfig(family="olmoe"), ParallelConfig(), FaultConfig(hot_expert=4))


def test_moe_range_names_round_trip():
    assert moe_range("dispatch", 5) == "moe/dispatch[layer 5]"
    for kind in ("router", "dispatch", "experts", "combine", "split_sizes_d2h"):
        assert parse_moe_range(moe_range(kind, 12)) == (kind, 12)
    assert parse_moe_range("moe/dispatch[layer x]") is None and parse_moe_range("forward") is None


# --- real runs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory, families_reference):
    assert STEPS == REFERENCE_STEPS
    out = tmp_path_factory.mktemp("expert-parallel")
    (out / "reference").symlink_to(families_reference, target_is_directory=True)
    for name, (nproc, mode, ep, tp, batch, families) in LAYOUTS.items():
        if name == "reference":
            continue
        completed = torchrun(nproc, SCRIPT, "--out", str(out / name), "--mode", mode, "--ep", str(ep),
                             "--tp", str(tp), "--batch", str(batch), "--steps", str(STEPS), "--families", families,
                             timeout=900)
        assert completed.returncode == 0, f"{name}:\n{completed.stderr[-4000:]}"
    return out


def _layout_cases():
    return [(layout, family) for layout, spec in LAYOUTS.items() if layout != "reference"
            for family in spec[5].split(",")]


@pytest.mark.slow
@pytest.mark.parametrize("layout,family", _layout_cases())
def test_expert_parallel_matches_the_unsharded_model(runs, layout, family):
    reference = mean_losses(runs / "reference" / family, 1)
    sharded = mean_losses(runs / layout / family, LAYOUTS[layout][0])
    assert len(reference) == len(sharded) == STEPS
    assert abs(sharded[0] - reference[0]) < STEP0_TOLERANCE, (sharded[0], reference[0])
    worst = max(abs(a - b) for a, b in zip(sharded, reference))
    assert worst < TRAJECTORY_TOLERANCE, (sharded, reference)


@pytest.mark.slow
def test_moe_records_hold_the_split_matrix(runs):
    """Per (step, layer) on every rank: whole lists, sends equal to the expert counts per peer, and what each
    rank received equal to what its peers sent it."""
    nproc = LAYOUTS["ep4"][0]
    records = {rank: read_moe_records(runs / "ep4" / ONE_FAMILY / "metrics" / f"rank{rank}.moe.jsonl")
               for rank in range(nproc)}
    assert all(len(rows) == STEPS * 2 for rows in records.values())  # tiny preset: 2 MoE layers
    by_key = {(r.rank, r.step, r.layer): r for rows in records.values() for r in rows}
    for (rank, step, layer), record in by_key.items():
        assert record.ep == 4 and record.ep_ranks == [0, 1, 2, 3] and record.ep_rank == rank
        assert len(record.tokens_per_expert) == 4 and record.send_tokens == record.tokens_per_expert
        assert sum(record.send_tokens) == 2 * 32 * 2  # sequences x seq_len x top-k
        for peer in range(4):
            assert record.recv_tokens[peer] == by_key[(peer, step, layer)].send_tokens[rank]
        assert record.send_bytes == [n * 64 * 4 for n in record.send_tokens]  # hidden 64, fp32


@pytest.mark.slow
def test_moe_records_under_tp_count_each_token_once(runs):
    """tp 2 x ep 2: each TP rank dispatches its share of the replicated tokens, so the records of all ranks add
    up to the global batch's token copies once (not tp times), and each ep group (one TP lane) is consistent."""
    nproc = LAYOUTS["ep2_tp2"][0]
    records = {rank: read_moe_records(runs / "ep2_tp2" / ONE_FAMILY / "metrics" / f"rank{rank}.moe.jsonl")
               for rank in range(nproc)}
    by_key = {(r.rank, r.step, r.layer): r for rows in records.values() for r in rows}
    assert len(by_key) == nproc * STEPS * 2
    for step in range(STEPS):
        for layer in range(2):
            sent = sum(sum(by_key[(rank, step, layer)].send_tokens) for rank in range(nproc))
            assert sent == 8 * 32 * 2  # global sequences x seq_len x top-k
    for (rank, step, layer), record in by_key.items():
        assert record.ep_ranks == [rank % 2, rank % 2 + 2]  # the TP lane: same tp index, adjacent dp ranks
        for peer_rank, peer in enumerate(record.ep_ranks):
            assert record.recv_tokens[peer_rank] == by_key[(peer, step, layer)].send_tokens[record.ep_rank]


# (mode, processes, tp, family, global sequences, sequence length); under tp the odd token counts per rank
# (3 x 31 = 93 with 4 ranks, 31 with 8) give the TP ranks uneven shares.
GRADIENT_CASES = [
    ("ddp", 2, 1, "qwen3_moe", 8, 32),
    ("fsdp", 4, 1, "gpt_oss", 8, 32),
    ("fsdp_tp", 4, 2, "deepseek_v3", 6, 31),  # tp 2 x ep 2: shared experts under the TP plan
    ("fsdp_tp", 8, 2, "qwen3_moe", 4, 31),  # tp 2 x ep 2 x edp 2: experts on the 2-D (edp, tp) FSDP mesh
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,nproc,tp,family,sequences,seq_len", GRADIENT_CASES)
def test_expert_gradients_equal_the_unsharded_model(tmp_path, mode, nproc, tp, family, sequences, seq_len):
    completed = torchrun(nproc, GRADS_SCRIPT, "--out", str(tmp_path), "--mode", mode, "--ep", "2",
                         "--tp", str(tp), "--family", family, "--sequences", str(sequences),
                         "--seq-len", str(seq_len), timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "grads match" in completed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode,nproc,tp", [("ddp", 2, 1), ("fsdp_tp", 4, 2)])
def test_hot_expert_fault_draws_the_most_tokens(tmp_path, mode, nproc, tp):
    """Under EP x TP too: the router (replicated, outside the TP plan) carries the fault's bias on every rank."""
    completed = torchrun(nproc, SCRIPT, "--out", str(tmp_path), "--mode", mode, "--ep", "2", "--tp", str(tp),
                         "--batch", "4", "--steps", "2", "--families", ONE_FAMILY,
                         "--set", f"faults.hot_expert={HOT_EXPERT}", timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    for rank in range(nproc):
        records = read_moe_records(tmp_path / ONE_FAMILY / "metrics" / f"rank{rank}.moe.jsonl")
        assert records and set(MOE_RECORD_FIELDS) <= set(records[0].to_json())
        for record in records:
            counts = record.tokens_per_expert
            # top-2 of 4 experts: unbiased, an expert draws about half the tokens; the hot one draws ~all of them
            tokens = sum(counts) // 2
            assert counts.index(max(counts)) == HOT_EXPERT and counts[HOT_EXPERT] >= 0.9 * tokens, counts
