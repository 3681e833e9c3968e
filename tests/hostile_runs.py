"""Small run directories and trace folders for the hostile-input and fuzz tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fleetscope.traces.gather import gather
from fleetscope.traces.layout import RunLayout
from test_analysis_helpers import KinetoBuilder


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
