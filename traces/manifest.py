"""manifest.json: the list of every trace of a run, written by gather, read by every consumer."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .capture import CaptureRecord
from .layout import RunLayout
from .writer import write_bytes_atomically

MANIFEST_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TraceRecord:
    """One readable trace file."""

    path: str
    """Relative to the run directory (or absolute for traces outside one)."""
    rank: int
    host: str
    window: int | None
    """Profiling window index; None for traces not written by fleetscope."""
    attempt: int = 0
    steps: list[int] = field(default_factory=list)
    """ProfilerStep numbers recorded in the trace (the training steps it covers)."""
    bytes: int
    sha256: str
    world_size: int | None = None
    event_count: int = 0


@dataclass(frozen=True, kw_only=True)
class TraceProblem:
    """A file that looked like a trace but could not be used, and why."""

    path: str
    reason: str
    rank: int | None = None
    window: int | None = None


@dataclass(frozen=True, kw_only=True)
class MissingRank:
    rank: int
    window: int | None


@dataclass(kw_only=True)
class Manifest:
    run_dir: str
    created_at: str
    world_size: int | None
    traces: list[TraceRecord] = field(default_factory=list)
    problems: list[TraceProblem] = field(default_factory=list)
    missing: list[MissingRank] = field(default_factory=list)
    captures: list[CaptureRecord] = field(default_factory=list)
    """Unplanned windows: requested (by whom, when) or triggered (why); traces/capture.py."""
    version: int = MANIFEST_VERSION

    @property
    def complete(self) -> bool:
        return not self.problems and not self.missing and bool(self.traces)

    @property
    def windows(self) -> list[int | None]:
        return sorted({t.window for t in self.traces}, key=lambda w: -1 if w is None else w)

    def traces_in_window(self, window: int | None) -> list[TraceRecord]:
        return sorted((t for t in self.traces if t.window == window), key=lambda t: t.rank)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Manifest":
        version = data.get("version")
        if version != MANIFEST_VERSION:
            raise ValueError(f"manifest version {version!r} is not supported (expected {MANIFEST_VERSION})")
        return cls(
            run_dir=data["run_dir"],
            created_at=data["created_at"],
            world_size=data.get("world_size"),
            traces=[TraceRecord(**t) for t in data.get("traces", [])],
            problems=[TraceProblem(**p) for p in data.get("problems", [])],
            missing=[MissingRank(**m) for m in data.get("missing", [])],
            captures=[CaptureRecord(**c) for c in data.get("captures", [])],
        )

    def resolve(self, record: TraceRecord) -> Path:
        path = Path(record.path)
        return path if path.is_absolute() else Path(self.run_dir) / path


def save_manifest(manifest: Manifest, layout: RunLayout) -> Path:
    text = json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n"
    write_bytes_atomically(text.encode(), layout.manifest_file)
    return layout.manifest_file


def load_manifest(layout: RunLayout) -> Manifest:
    """Read manifest.json; the run directory it names is replaced by where it was found."""
    try:
        data = json.loads(layout.manifest_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{layout.manifest_file}: cannot read manifest: {error}") from error
    manifest = Manifest.from_json(data)
    manifest.run_dir = str(layout.root)
    return manifest
