"""manifest.json: the list of every trace of a run, written by gather, read by every consumer."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .capture import CaptureRecord
from .layout import RunLayout
from .safe_read import InputRefused, read_metadata
from .validate import relative_path_problem, rank_problem, world_size_problem
from .writer import write_bytes_atomically
from .jsontext import strict_dumps

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
    missing_total: int | None = None
    """How many ranks are missing in all when `missing` lists only the first ones (validate.py)."""
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
    def from_json(cls, data: Any) -> "Manifest":
        """A manifest from its JSON form, trusting nothing: an entry of the wrong shape, a path that leaves
        the run directory or an absurd rank becomes a TraceProblem naming the entry; a manifest whose
        top level is unusable raises ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"top level is {type(data).__name__}, expected an object")
        version = data.get("version")
        if version != MANIFEST_VERSION:
            raise ValueError(f"manifest version {version!r} is not supported (expected {MANIFEST_VERSION})")
        problem = world_size_problem(data.get("world_size"))
        if problem:
            raise ValueError(problem)
        traces, problems = _entries(data, "traces", TraceRecord, _record_problem)
        listed, more = _entries(data, "problems", TraceProblem, lambda p: None)
        missing, bad_missing = _entries(data, "missing", MissingRank, lambda m: rank_problem(m.rank))
        captures, bad_captures = _entries(data, "captures", CaptureRecord, _capture_problem)
        kept, duplicates = split_duplicates(traces)
        return cls(run_dir=str(data.get("run_dir", "")), created_at=str(data.get("created_at", "")),
                   world_size=data.get("world_size"), traces=kept,
                   problems=problems + more + bad_missing + bad_captures + listed + duplicates, missing=missing,
                   captures=captures,
                   missing_total=data.get("missing_total") if type(data.get("missing_total")) is int else None)

    def resolve(self, record: TraceRecord) -> Path:
        path = Path(record.path)
        return path if path.is_absolute() else Path(self.run_dir) / path


_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _entries(data: dict, key: str, kind: type, check) -> tuple[list, list["TraceProblem"]]:
    """The entries of list `key` that convert to `kind` and pass `check`; the rest as problems."""
    entries = data.get(key, [])
    if not isinstance(entries, list):
        return [], [TraceProblem(path=f"manifest.json {key}", reason=f"{key} is not a list: ignored")]
    good, bad = [], []
    for index, entry in enumerate(entries):
        try:
            item = msgspec.convert(entry, kind)
            why = check(item)
        except msgspec.ValidationError as error:
            why = f"wrong shape ({error})"
        if why is None:
            good.append(item)
        else:
            named = entry.get("path") if isinstance(entry, dict) and isinstance(entry.get("path"), str) else None
            bad.append(TraceProblem(path=(named or f"manifest.json {key}[{index}]")[:300],
                                    reason=f"manifest entry {key}[{index}]: {why}: not used"))
    return good, bad


def _capture_problem(record: CaptureRecord) -> str | None:
    """An unplanned window's record names a window and (when limited) real ranks, bounded in number."""
    if record.window < 0:
        return f"window {record.window} is negative"
    if record.ranks is not None and len(record.ranks) > MAX_CAPTURE_RANKS:
        return f"{len(record.ranks)} ranks listed (at most {MAX_CAPTURE_RANKS})"
    return next((why for why in map(rank_problem, record.ranks or []) if why), None)


MAX_CAPTURE_RANKS = 1 << 20
"""As many ranks as a believable world size (validate.py)."""


def _record_problem(record: "TraceRecord") -> str | None:
    return (relative_path_problem(record.path) or rank_problem(record.rank)
            or (None if record.bytes >= 0 and _SHA256_RE.match(record.sha256) else "bytes or sha256 malformed")
            or world_size_problem(record.world_size))


def split_duplicates(records: list["TraceRecord"]) -> tuple[list["TraceRecord"], list["TraceProblem"]]:
    """One trace per (window, rank, attempt): the first by path is kept, the others are problems (two
    files claiming one rank's place cannot both be it; merging or averaging both would be wrong)."""
    kept: dict[tuple, TraceRecord] = {}
    duplicates = []
    for record in sorted(records, key=lambda r: r.path):
        key = (record.window, record.rank, record.attempt)
        if key in kept:
            duplicates.append(TraceProblem(path=record.path, rank=record.rank, window=record.window,
                                           reason=f"duplicate rank {record.rank} in window {record.window}: "
                                                  f"{kept[key].path} is used instead"))
        else:
            kept[key] = record
    return [r for r in records if kept.get((r.window, r.rank, r.attempt)) is r], duplicates


def save_manifest(manifest: Manifest, layout: RunLayout) -> Path:
    text = strict_dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n"
    write_bytes_atomically(text.encode(), layout.manifest_file)
    return layout.manifest_file


def load_manifest(layout: RunLayout) -> Manifest:
    """Read manifest.json; the run directory it names is replaced by where it was found. Raises
    ValueError (naming the file) for one that cannot be read or has an unusable top level."""
    try:
        data = json.loads(read_metadata(layout.manifest_file, within=layout.root))
        manifest = Manifest.from_json(data)
    except (InputRefused, ValueError, RecursionError, UnicodeDecodeError) as error:
        reason = error.reason if isinstance(error, InputRefused) else f"{type(error).__name__}: {error}"
        raise ValueError(f"{layout.manifest_file}: cannot read manifest: {str(reason)[:300]}") from error
    manifest.run_dir = str(layout.root)
    return manifest
