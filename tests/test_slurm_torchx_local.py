"""The TorchX AppDef of the Slurm path, run by TorchX's local_cwd scheduler: two "nodes" of one rank each,
rendezvous through c10d on this host, traces of both ranks in the run directory. No Slurm needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetscope.launcher.spec import JobSpec
from fleetscope.launcher.schedulers.torchx import plan_torchx_local, run_torchx_local
from fleetscope.trainer.config import TrainConfig, apply_overrides
from fleetscope.traces.layout import RunLayout, parse_trace_file_name

pytestmark = pytest.mark.slow


def test_torchx_appdef_runs_on_local_cwd(tmp_path: Path) -> None:
    from torchx.specs import AppState

    train = apply_overrides(TrainConfig(run_dir=str(tmp_path / "run")),
                            ["parallel.mode=fsdp", "performance.device=cpu", "steps=3", "profiler.wait=0"])
    spec = JobSpec(train=train, scheduler="torchx", nodes=2, nproc_per_node=1)
    plan = plan_torchx_local(spec)
    assert not plan.run_dir.exists(), "planning must not touch the run directory"

    status = run_torchx_local(plan)

    assert status is not None and status.state == AppState.SUCCEEDED, status
    layout = RunLayout.at(plan.run_dir)
    ranks = {parse_trace_file_name(path.name).rank for path in layout.traces_dir.rglob("*.json.gz")}
    assert ranks == {0, 1}
    assert layout.metrics_file(0).exists() and layout.metrics_file(1).exists()
