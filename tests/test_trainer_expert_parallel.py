"""Expert parallelism: refusals before any process group (fast), and real torchrun/gloo runs (slow) in which
every family under ep x {DDP, FSDP2} starts from the unsharded model's loss and follows its trajectory, the
gradients equal the unsharded model's, and the hot-expert fault shows in the MoE records."""

from __future__ import annotations

import pytest
from helpers import REPO, mean_losses, torchrun

from fleetscope.traces.formats import MOE_RECORD_FIELDS, parse_moe_range, moe_range, read_moe_records
from fleetscope.trainer.config import (ConfigError, FaultConfig, ModelConfig, ParallelConfig, TrainConfig,
                                       apply_overrides)
from fleetscope.trainer.families import FAMILIES
from fleetscope.trainer.models import check_model_support
from fleetscope.trainer.parallel import ParallelDims

SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_families.py")
GRADS_SCRIPT = str(REPO / "tests" / "dist_scripts" / "expert_grads.py")
STEPS = 5
ONE_FAMILY = "qwen3_moe"
# (processes, mode, ep, sequences per data-parallel rank, families): a global batch of 8 in every layout.
LAYOUTS = {
    "reference": (1, "ddp", 1, 8, ",".join(FAMILIES)),
    "ep2": (2, "ddp", 2, 4, ",".join(FAMILIES)),
    "ep2_fsdp": (2, "fsdp", 2, 4, ",".join(FAMILIES)),
    "ep4": (4, "ddp", 4, 2, ONE_FAMILY),
    "ep2_fsdp_dp2": (4, "fsdp", 2, 2, ONE_FAMILY),
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


def test_ep_refuses_tensor_parallel_modes():
    for mode in ("tp", "fsdp_tp"):
        with pytest.raises(ConfigError, match=r"^parallel\.ep: is 2 but parallel\.mode .* shards every expert"):
            ParallelConfig(mode=mode, tp=2, ep=2)
    with pytest.raises(ConfigError, match=r"^parallel\.ep: must be >= 1"):
        ParallelConfig(ep=0)


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
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert-parallel")
    for name, (nproc, mode, ep, batch, families) in LAYOUTS.items():
        completed = torchrun(nproc, SCRIPT, "--out", str(out / name), "--mode", mode, "--ep", str(ep),
                             "--batch", str(batch), "--steps", str(STEPS), "--families", families, timeout=900)
        assert completed.returncode == 0, f"{name}:\n{completed.stderr[-4000:]}"
    return out


def _layout_cases():
    return [(layout, family) for layout, spec in LAYOUTS.items() if layout != "reference"
            for family in spec[4].split(",")]


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
@pytest.mark.parametrize("mode,nproc,family", [("ddp", 2, "qwen3_moe"), ("fsdp", 4, "gpt_oss")])
def test_expert_gradients_equal_the_unsharded_model(tmp_path, mode, nproc, family):
    completed = torchrun(nproc, GRADS_SCRIPT, "--out", str(tmp_path), "--mode", mode, "--ep", "2",
                         "--family", family, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "grads match" in completed.stdout


@pytest.mark.slow
def test_hot_expert_fault_draws_the_most_tokens(tmp_path):
    completed = torchrun(2, SCRIPT, "--out", str(tmp_path), "--mode", "ddp", "--ep", "2", "--batch", "4",
                         "--steps", "2", "--families", ONE_FAMILY, "--set", f"faults.hot_expert={HOT_EXPERT}",
                         timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    for rank in range(2):
        records = read_moe_records(tmp_path / ONE_FAMILY / "metrics" / f"rank{rank}.moe.jsonl")
        assert records and set(MOE_RECORD_FIELDS) <= set(records[0].to_json())
        for record in records:
            counts = record.tokens_per_expert
            assert counts.index(max(counts)) == HOT_EXPERT and counts[HOT_EXPERT] > 2 * sorted(counts)[-2], counts
