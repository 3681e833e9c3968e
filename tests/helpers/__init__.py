"""Shared by the tests: running real processes and reading what a run leaves behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
REFERENCE_STEPS = 5
"""Steps of the unsharded reference run the parallel layouts are compared with (conftest.families_reference)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(nproc: int, *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """A real `torchrun --standalone`-like launch (fixed free port: tests may run side by side)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def fleetscope(*args: str, timeout: int = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetscope.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def metrics(run_dir: Path, rank: int) -> list[dict]:
    path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean_losses(run_dir: Path, world_size: int) -> list[float]:
    """Per step, the mean of every rank's loss (equal batches: the global batch's mean loss)."""
    per_rank = [[row["loss"] for row in metrics(run_dir, rank)] for rank in range(world_size)]
    return [sum(step) / world_size for step in zip(*per_rank)]


def trace_processor():
    """The trace processor binary the suite uses (perfetto/sql.py's lookup), or None."""
    from fleetscope.analysis.merge.perfetto.sql import find_trace_processor
    return find_trace_processor()


requires_trace_processor = pytest.mark.skipif(
    trace_processor() is None,
    reason="no trace_processor_shell (set FLEETSCOPE_TRACE_PROCESSOR or put it at <repo>/../shared/tools/)")


def check_in_engine(trace: Path, result=None) -> None:
    """Every merged trace the suite writes goes through here: loaded in Perfetto's trace processor and
    compared with the merge's counts (`result`, a MergeResult) or with the file's read-back. Skips
    when no binary is found."""
    from fleetscope.analysis.merge.verify import verify_merge, verify_trace_file
    binary = trace_processor()
    if binary is None:
        pytest.skip("no trace_processor_shell (set FLEETSCOPE_TRACE_PROCESSOR)")
    problems = verify_merge(result, trace_processor=binary) if result is not None else verify_trace_file(trace, binary)
    assert problems == [], f"{trace}: {problems}"


SYNTHETIC_SOURCE = Path(__file__).parent.parent / "fixtures" / "gpu" / "h200-small-fleetscope-fast-2steps.json.gz"
"""A real H200 rank trace of fleetscope's trainer (2 steps): the source of synthetic run directories."""


def synthetic_run_dir(root: Path, ranks: int, *, ranks_per_host: int = 4, late_rank: int | None = None,
                      late_us: float = 0.0) -> Path:
    """A run directory of `ranks` ranks made from SYNTHETIC_SOURCE by analysis/synthetic.py (one window,
    hosts node0, node1, ...; a late rank when asked), laid out as the trainer writes it (no manifest yet)."""
    from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set
    from fleetscope.traces.layout import RunLayout

    layout = RunLayout.at(root)
    staging = root.parent / f"{root.name}.staging"
    spec = TraceSetSpec(ranks=ranks, ranks_per_host=ranks_per_host, late_rank=late_rank, late_us=late_us)
    for rank, path in enumerate(make_trace_set(SYNTHETIC_SOURCE, staging, spec)):
        destination = layout.trace_file(0, rank, f"node{rank // ranks_per_host}")
        destination.parent.mkdir(parents=True, exist_ok=True)
        path.rename(destination)
    staging.rmdir()
    return root


def hta_parity_traces(gpu_fixtures: Path) -> list[Path]:
    """The GPU fixture traces the HTA oracle sweeps: all but the held-out sets (heldout4/, heldout5/, ...), which
    the planted-program harness recorded with the same torch and profiler options as corpus/ (that sweep holds
    their trace shapes) and which took most of the sweep's time."""
    return sorted(path for path in gpu_fixtures.rglob("*.json.gz")
                  if not path.relative_to(gpu_fixtures).parts[0].startswith("heldout"))


def confusion_module():
    """bench/planted/confusion.py, the scorer of the recorded program sets (a script, not a package module)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("confusion", REPO / "bench" / "planted" / "confusion.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scored_set(folder: Path) -> dict[str, dict]:
    """Each recorded program of a set (a folder per program with its planted.json), scored by confusion.py."""
    confusion = confusion_module()
    return {d.name: confusion.score(d) for d in sorted(folder.iterdir()) if (d / "planted.json").is_file()}


def assert_set_score(rows: dict[str, dict], counts: tuple[int, int, int], right: tuple[int, int, int]) -> None:
    """The set holds `counts` (one-problem, two-problem, healthy programs), every one read, and at least `right`
    of each are right: the planted cause first, both causes in the top three, no finding above 5%."""
    kinds = ([r for r in rows.values() if len(r["causes"]) == 1], [r for r in rows.values() if len(r["causes"]) == 2],
             [r for r in rows.values() if not r["causes"]])
    assert tuple(len(kind) for kind in kinds) == counts
    assert not [r for r in rows.values() if "error" in r]
    for kind, least in zip(kinds, right):
        assert sum(r["right"] for r in kind) >= least, [(r["program"], r["findings"]) for r in kind if not r["right"]]
