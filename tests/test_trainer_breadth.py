"""Real torchrun/gloo runs of the parallel breadth: gradient accumulation, HSDP, pipeline parallel, each
against the same trainer on one process with the whole global batch of 8 sequences (fp32 on CPU).

Every layout here sees the same 8 sequences per optimizer step (data.py's strided shards), so only the
order of floating-point reductions differs: step-0 loss within 1e-5, a 5-step trajectory within 5e-4
(the tolerances of test_trainer_parallel.py).
"""

from __future__ import annotations

import json

import pytest
from helpers import REPO, mean_losses, torchrun

from fleetscope.trainer.families import FAMILIES as ALL_FAMILIES

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "dist_scripts" / "train_cases.py")
FAMILIES = ("qwen3_moe", "mixtral")
STEPS = 5
STEP0_TOLERANCE = 1e-5
TRAJECTORY_TOLERANCE = 5e-4
PP = "parallel.pp=2,data.batch_size=8"  # 2 stages, 4 micro-batches of 2 sequences
FOUR_BLOCKS = "{out}/four_blocks"  # a 4-block qwen3_moe config: interleaving 2 stages per rank needs 4 blocks
# processes -> {case: overrides}; each process count is one torchrun training every case. `case@f+g` limits the
# families of a case.
CASES = {
    1: {
        f"reference@{'+'.join(ALL_FAMILIES)}": "parallel.mode=ddp,data.batch_size=8",
        "reference_four_blocks@qwen3_moe": f"data.batch_size=8,model.path={FOUR_BLOCKS}",
    },
    2: {
        # 2 ranks x 2 micro-batches x 2 sequences = 8 sequences per optimizer step.
        "ddp_accumulation": "parallel.mode=ddp,data.batch_size=2,optim.accumulation_steps=2",
        "fsdp_accumulation": "parallel.mode=fsdp,data.batch_size=2,optim.accumulation_steps=2",
        "fsdp_accumulation_traced@qwen3_moe": "parallel.mode=fsdp,data.batch_size=2,optim.accumulation_steps=2,"
                                              "profiler.enabled=true",
        "pp_gpipe": f"{PP},parallel.pp_schedule=gpipe",
        f"pp_1f1b@{'+'.join(ALL_FAMILIES)}": f"{PP},parallel.pp_schedule=1f1b",
        "pp_interleaved@qwen3_moe": f"{PP},parallel.pp_schedule=interleaved_1f1b,model.path={FOUR_BLOCKS}",
    },
    4: {
        # HSDP 2 x 2: 4 ranks x 2 sequences.
        "hsdp": "parallel.mode=fsdp,parallel.dp_replicate=2,data.batch_size=2",
        "hsdp_knobs": "parallel.mode=fsdp,parallel.dp_replicate=2,parallel.dp_shard=2,parallel.reshard_every=2,"
                      "parallel.forward_prefetch=1,parallel.backward_prefetch=1,parallel.reduce_dtype=fp32,"
                      "data.batch_size=2",
        # (dp_replicate 2, dp_shard 1, tp 2): 2 data-parallel ranks x 4 sequences.
        "hsdp_tp": "parallel.mode=fsdp_tp,parallel.tp=2,parallel.dp_replicate=2,data.batch_size=4",
        # 2 stages x 2 data-parallel ranks x 4 sequences (2 micro-batches of 2).
        "pp_fsdp": "parallel.pp=2,parallel.mode=fsdp,parallel.pp_microbatches=2,data.batch_size=4",
        "pp_ddp": "parallel.pp=2,parallel.mode=ddp,parallel.pp_schedule=gpipe,parallel.pp_microbatches=2,"
                  "data.batch_size=4",
        # 4 stages of one block each (the 4-block model), both schedules, 4 micro-batches of 2 sequences.
        "pp4_gpipe@qwen3_moe": f"parallel.pp=4,data.batch_size=8,parallel.pp_schedule=gpipe,model.path={FOUR_BLOCKS}",
        "pp4_1f1b@qwen3_moe": f"parallel.pp=4,data.batch_size=8,parallel.pp_schedule=1f1b,model.path={FOUR_BLOCKS}",
    },
}
NPROC = {case.partition("@")[0]: nproc for nproc, cases in CASES.items() for case in cases}
CASE_FAMILIES = {case.partition("@")[0]: tuple(case.partition("@")[2].split("+")) if "@" in case else FAMILIES
                 for cases in CASES.values() for case in cases}


def write_four_block_config(path) -> None:
    from fleetscope.trainer.config import ModelConfig
    from fleetscope.trainer.models import build_config

    config = build_config(ModelConfig(family="qwen3_moe"))
    config.num_hidden_layers = 4
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * 4
    config.save_pretrained(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("breadth")
    write_four_block_config(FOUR_BLOCKS.format(out=out))
    for nproc, cases in CASES.items():
        arguments = [f"--case={name}={overrides.format(out=out)}" for name, overrides in cases.items()]
        completed = torchrun(nproc, SCRIPT, "--out", str(out), "--steps", str(STEPS),
                             "--families", ",".join(FAMILIES), *arguments, timeout=900)
        assert completed.returncode == 0, f"{nproc} ranks:\n{completed.stderr[-4000:]}"
    return out


def losses(runs, case: str, family: str) -> list[float]:
    return mean_losses(runs / case / family, NPROC[case])


COMPARED = [(case, family) for case in NPROC if not case.startswith("reference") for family in CASE_FAMILIES[case]]


@pytest.mark.parametrize("case, family", COMPARED)
def test_layout_matches_the_large_batch_step(runs, case, family):
    four_blocks = case == "pp_interleaved" or case.startswith("pp4_")
    reference = losses(runs, "reference_four_blocks" if four_blocks else "reference", family)
    sharded = losses(runs, case, family)
    assert len(reference) == len(sharded) == STEPS
    assert len(set(round(x, 6) for x in reference)) == STEPS, "the reference must learn"
    assert abs(sharded[0] - reference[0]) < STEP0_TOLERANCE, (sharded[0], reference[0])
    worst = max(abs(a - b) for a, b in zip(sharded, reference))
    assert worst < TRAJECTORY_TOLERANCE, (sharded, reference)


def test_accumulation_and_pipeline_count_optimizer_steps(runs):
    """One metrics record per optimizer step, its tokens the whole accumulated batch of the rank; a pipeline
    stage's tokens are its share of its data-parallel rank's batch."""
    for case, tokens in (("ddp_accumulation", 2 * 2 * 32), ("pp_1f1b", 8 * 32 / 2)):
        rows = [json.loads(line) for line in (runs / case / "qwen3_moe" / "metrics" / "rank0.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(STEPS))
        assert all(abs(r["tokens_per_s"] * r["step_time_ms"] / 1e3 - tokens) < 1e-6 * tokens for r in rows)


def test_inner_micro_batches_skip_the_gradient_all_reduce(runs):
    """DDP's comm hook fires once per bucket all-reduce: the tiny model's gradients fit one 25 MiB bucket, so one
    all-reduce per optimizer step means the first micro-batch's backward ran under no_sync (else: 2)."""
    for rank in (0, 1):
        path = runs / "ddp_accumulation" / "qwen3_moe" / "metrics" / f"rank{rank}.jsonl"
        assert [json.loads(line)["comm_buckets"] for line in path.read_text().splitlines()] == [1] * STEPS


def test_fsdp_reduce_scatters_on_the_last_micro_batch_only(runs):
    """In the profiled steps, FSDP2's gradient reduce-scatters (one per block, one for the root) all run inside
    the last micro-batch's range; the first micro-batch's backward issues none."""
    import gzip

    (trace,) = (runs / "fsdp_accumulation_traced" / "qwen3_moe" / "traces").glob("window000/rank0.*.json.gz")
    events = [e for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e["name"] in ("microbatch[0]", "microbatch[1]")]
    scatters = [e for e in events if e["name"] == "c10d::_reduce_scatter_base_"]
    inside = {name: 0 for name in ("microbatch[0]", "microbatch[1]")}
    for scatter in scatters:
        for span in ranges:
            if span["ts"] <= scatter["ts"] <= span["ts"] + span["dur"] and span["tid"] == scatter["tid"]:
                inside[span["name"]] += 1
    profiled_steps = sum(1 for e in events if e["name"].startswith("ProfilerStep#"))
    blocks = 2  # the tiny preset
    assert inside == {"microbatch[0]": 0, "microbatch[1]": (blocks + 1) * profiled_steps}, inside
