"""Pure checks of the parallel breadth: degrees and mesh axes (ParallelDims), refusals that name the field,
stage splits, FSDP2 per-block knobs, micro-batch range names and gradient-sync switching."""

from __future__ import annotations

import pytest
import torch

from fleetscope.launcher.spec import JobSpec
from fleetscope.traces.formats import microbatch_range, parse_microbatch_range
from fleetscope.trainer.accumulation import gradient_sync
from fleetscope.trainer.config import ConfigError, FaultConfig, TrainConfig, apply_overrides
from fleetscope.trainer.parallel import ParallelDims, mixed_precision, reshard_block, set_prefetch
from fleetscope.trainer.pipeline_parallel import rank_stages, stage_layer_ranges


def config(*assignments: str) -> TrainConfig:
    return apply_overrides(TrainConfig(run_dir="/r"), list(assignments))


def test_hsdp_and_pipeline_degrees_own_the_mesh():
    dims = ParallelDims.from_config(config("parallel.mode=fsdp", "parallel.dp_replicate=2").parallel, 8)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard, dims.pp) == (8, 2, 4, 1)
    assert dims.mesh_shape == (1, 2, 4, 1) and dims.mesh_names == ("pp", "dp_replicate", "dp_shard", "tp")
    pipeline = ParallelDims.from_config(config("parallel.pp=2", "parallel.mode=fsdp").parallel, 8)
    assert (pipeline.dp, pipeline.pp) == (4, 2)
    # pp is the slowest mesh axis: ranks 0-3 are stage 0, 4-7 stage 1; dp ranks repeat per stage.
    assert [pipeline.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [pipeline.dp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    plain = ParallelDims.from_config(config("parallel.mode=fsdp_tp", "parallel.tp=2").parallel, 4)
    assert plain.mesh_names == ("dp", "tp") and plain.mesh_shape == (2, 2)


def test_fsdp_shards_over_the_two_dimensional_mesh_under_hsdp():
    class Mesh(dict):
        def __getitem__(self, key):
            return key
    hsdp = ParallelDims.from_config(config("parallel.mode=fsdp", "parallel.dp_replicate=2").parallel, 4)
    fsdp = ParallelDims.from_config(config("parallel.mode=fsdp").parallel, 4)
    assert hsdp.fsdp_mesh(Mesh()) == ("dp_replicate", "dp_shard") and fsdp.fsdp_mesh(Mesh()) == "dp"


@pytest.mark.parametrize("assignments, world, field", [
    (["parallel.dp_replicate=2"], 4, "parallel.dp_replicate:"),  # ddp has no sharding to hybridize
    (["parallel.mode=fsdp", "parallel.dp_replicate=3"], 4, "parallel.dp_replicate:"),
    (["parallel.mode=fsdp", "parallel.dp_replicate=2", "parallel.dp_shard=4"], 4, "parallel.dp_shard:"),
    (["parallel.pp=3"], 4, "parallel.pp:"),
    (["parallel.pp=2", "parallel.mode=fsdp_tp", "parallel.tp=2"], 4, "parallel.pp:"),
    (["parallel.pp=4", "parallel.pp_microbatches=2"], 4, "parallel.pp_microbatches:"),
    (["parallel.pp=2", "parallel.pp_microbatches=3"], 2, "parallel.pp_microbatches:"),  # 3 does not divide 4
    (["parallel.pp=2", "optim.accumulation_steps=2"], 2, "optim.accumulation_steps:"),
    (["parallel.pp=2", "checkpoint.every=2"], 2, "checkpoint.every:"),
    (["parallel.pp=2", "faults.slow_stage=2"], 2, "faults.slow_stage:"),
    (["parallel.pp=2", "faults.stage_work_ms=-1"], 2, "faults.stage_work_ms:"),
    (["parallel.pp=2", "faults.stage_work_ms=inf"], 2, "faults.stage_work_ms:"),
    (["faults.stage_work_ms=10"], 2, "faults.stage_work_ms:"),  # per pipeline micro-batch: needs pp > 1
    (["optim.accumulation_steps=0"], 2, "optim.accumulation_steps:"),
    (["parallel.mode=fsdp", "parallel.reshard_to=3"], 4, "parallel.reshard_to:"),
    (["parallel.reduce_dtype=fp16"], 2, "parallel.reduce_dtype:"),
])
def test_impossible_layouts_are_refused_before_any_process_group(assignments, world, field):
    with pytest.raises(ConfigError, match=field):
        JobSpec(train=config(*assignments), nproc_per_node=world)


def test_stage_work_is_finite_even_when_built_without_the_overrides():
    with pytest.raises(ConfigError, match="faults.stage_work_ms:"):
        FaultConfig(stage_work_ms=float("nan"))
    assert config("parallel.pp=2", "faults.stage_work_ms=40").faults.stage_work_ms == 40.0


def test_stages_split_the_blocks_evenly_and_interleave_round_robin():
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ConfigError, match="parallel.pp:"):
        stage_layer_ranges(2, 4)
    assert rank_stages(1, 2, 2) == [1, 3] and rank_stages(0, 4, 1) == [0]


def test_fsdp_knobs_per_block():
    parallel = config("parallel.mode=fsdp", "parallel.reshard_every=2").parallel
    assert [reshard_block(parallel, i) for i in range(4)] == [True, False, True, False]
    to_node = config("parallel.mode=fsdp", "parallel.reshard_to=2").parallel
    assert reshard_block(to_node, 0) == 2
    assert reshard_block(config("parallel.reshard_after_forward=false").parallel, 0) is False
    assert mixed_precision("auto", bf16_compute=False) is None
    assert mixed_precision("fp32", bf16_compute=True) == {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    assert mixed_precision("bf16", bf16_compute=False) == {"reduce_dtype": torch.bfloat16}


def test_prefetch_lists_the_following_and_preceding_blocks():
    class Block:
        def __init__(self, name):
            self.name, self.forward, self.backward = name, None, None
        def set_modules_to_forward_prefetch(self, modules):
            self.forward = [m.name for m in modules]
        def set_modules_to_backward_prefetch(self, modules):
            self.backward = [m.name for m in modules]
    blocks = [Block(i) for i in range(4)]
    set_prefetch(blocks, forward=2, backward=1)
    assert [b.forward for b in blocks] == [[1, 2], [2, 3], [3], None]
    assert [b.backward for b in blocks] == [None, [0], [1], [2]]


def test_microbatch_range_names_round_trip():
    assert microbatch_range(3) == "microbatch[3]" and parse_microbatch_range("microbatch[3]") == 3
    assert parse_microbatch_range("microbatch[x]") is None and parse_microbatch_range("Forward 3") is None


def test_plain_modules_accumulate_without_sync_switching():
    model = torch.nn.Linear(2, 1)
    for enabled in (False, True):
        with gradient_sync(model, enabled=enabled):
            model(torch.ones(1, 2)).sum().backward()
    assert torch.equal(model.weight.grad, 2 * torch.ones(1, 2))
