"""Small run directories and trace folders for the hostile-input and fuzz tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fleetscope.traces.gather import gather
from fleetscope.traces.layout import RunLayout
from helpers.kineto import KinetoBuilder


def good_rank(rank: int, world_size: int = 2) -> KinetoBuilder:
    builder = KinetoBuilder(rank=rank, world_size=world_size, backend="gloo").step(1, 0, 1000)
    return builder.op("aten::mm", 10, 500).op("c10d::allreduce_", 600, 5).gloo(605, 100)


def make_run(root: Path, world_size: int = 2, *, ranks: int | None = None, gathered: bool = True) -> RunLayout:
    """A run directory of a `world_size` job whose first `ranks` (default: all) CPU ranks have a trace in
    window 0, with a manifest when `gathered`."""
    layout = RunLayout.at(root)
    for rank in range(world_size if ranks is None else ranks):
        good_rank(rank, world_size).write(layout.trace_file(0, rank, "node0"))
    if gathered:
        gather(layout.root)
    return layout


def make_trace_dir(root: Path, world_size: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        good_rank(rank, world_size).write(root / f"rank{rank}.json")
    return root


def edit_manifest(layout: RunLayout, change) -> None:
    data = json.loads(layout.manifest_file.read_text())
    change(data)
    layout.manifest_file.write_text(json.dumps(data))


def digests(root: Path) -> dict[str, str]:
    """sha256 of every regular file under `root` that is not an output of the tools (report/)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file() or "report" in path.relative_to(root).parts:
            continue
        found[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


# --- a recorded job (tune), MoE records (advise, analyze), all-to-all message args (comm bytes) ---------


def make_recorded_run(root: Path) -> RunLayout:
    """A run `fleetscope launch` recorded (job.json with its spec) whose step metrics show data loading taking
    30 of 100 ms, so `advise` finds `data_workers` (finding 1, which `tune --apply 1` can relaunch). No traces."""
    from fleetscope.launcher.spec import JobSpec, spec_record
    from fleetscope.traces.jobfile import write_job_record
    from fleetscope.trainer.config import TrainConfig, apply_overrides

    layout = RunLayout.at(root)
    root.mkdir(parents=True)
    train = apply_overrides(TrainConfig(run_dir=str(root)), ["performance.device=cpu", "seed=7", "steps=14"])
    write_job_record(layout, **spec_record(JobSpec(train=train)))
    layout.metrics_dir.mkdir()
    for rank in (0, 1):
        lines = [dict(step=step, rank=rank, loss=1.0, step_time_ms=100.0, data_ms=30.0, forward_ms=30.0,
                      backward_ms=30.0, optimizer_ms=10.0, tokens_per_s=100.0, profiled=False) for step in range(6)]
        layout.metrics_file(rank).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return layout


def moe_line(rank: int, step: int, layer: int = 0, **changed) -> str:
    """One metrics/rank<R>.moe.jsonl line of a 2-rank expert-parallel job with 4 experts."""
    record = dict(step=step, layer=layer, rank=rank, ep=2, ep_rank=rank, ep_ranks=[0, 1],
                  tokens_per_expert=[10, 20, 30, 40], send_tokens=[30, 70], send_bytes=[300, 700],
                  recv_tokens=[30, 70], recv_bytes=[300, 700], split_sizes_d2h_ms=0.1)
    record.update(changed)
    return json.dumps(record)


def write_moe_records(layout: RunLayout, ranks=(0, 1), steps: int = 4, extra: dict[int, list[str]] | None = None) -> None:
    layout.metrics_dir.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        lines = [moe_line(rank, step) for step in range(steps)] + list((extra or {}).get(rank, []))
        layout.moe_file(rank).write_text("\n".join(lines) + "\n")


A2A_KERNEL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


def alltoall_rank(rank: int, calls: list[dict]) -> KinetoBuilder:
    """One step of a 2-rank job whose NCCL all-to-alls carry the message args of `calls` (each a dict of arg
    changes over an uneven 2-peer split of 800 rows of 16 bf16 elements)."""
    builder = KinetoBuilder(rank=rank, world_size=2).step(1, 0.0, 10000.0)
    for index, changed in enumerate(calls):
        args = {"Collective name": "all_to_allv", "In msg nelems": 800 * 16, "Out msg nelems": 800 * 16,
                "dtype": "BFloat16", "Group size": 2, "In split size": "[300, 500]", "Out split size": "[300, 500]",
                "Process Group Name": "1", "Process Group Description": "mesh_ep", **changed}
        builder.kernel(A2A_KERNEL, 100.0 + 50 * index, 20.0, launch_ts=50.0 + 50 * index, stream=20, args=args)
    return builder
