"""Which trace files a merge reads, per rank, and each rank's clock offset.

Two kinds of input:

* a run directory: its `manifest.json` (or, when gather has not run, a manifest built in memory
  without writing it) says rank, host and window of every trace; `clock/rank<R>.json` holds the
  measured offset of a rank's clock to rank 0's;
* any directory of Kineto traces (`*.json`, `*.json.gz`): a file's rank comes from its
  `distributedInfo.rank`, else from a `rank<N>` in its name, else from its position in name order.
  Only the head of each file is read to find these; the events are read once, when merged.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fleetscope.traces.gather import build_manifest
from fleetscope.traces.kineto import find_trace_files
from fleetscope.traces.layout import RunLayout, parse_trace_file_name
from fleetscope.traces.manifest import Manifest, load_manifest

HEAD_BYTES = 1 << 18
"""How much of a trace is read to find its rank and host (Kineto writes them before the events)."""

CLOCK_GIVEN = "given"
CLOCK_FILE = "clock file"
CLOCK_REPORT = "analysis report"
CLOCK_NONE = "none"
"""Where a rank's clock offset came from: the caller, `clock/rank<R>.json`, the analysis report
(which may refine the measured offsets from collectives), or nowhere (offset 0)."""

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_OFFSET_KEYS_NS = ("offset_ns", "offset_to_rank0_ns", "clock_offset_ns")
_OFFSET_KEYS_US = ("offset_us", "offset_to_rank0_us", "clock_offset_us")


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeProblem:
    """Something the merge could not use or had to repair, and why."""

    reason: str
    path: str | None = None
    rank: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceFile:
    path: Path
    window: int | None
    bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSource:
    """Everything merged into one rank's process."""

    rank: int
    host: str
    files: tuple[TraceFile, ...]
    """In window order (name order when windows are unknown)."""
    clock_offset_ns: int = 0
    """This rank's clock minus rank 0's; subtracted from its timestamps."""
    clock_source: str = CLOCK_NONE

    @property
    def process_name(self) -> str:
        return f"rank {self.rank} ({self.host})"


@dataclass(kw_only=True)
class MergeInputs:
    root: Path
    run_layout: RunLayout | None
    """Set when the input is a run directory."""
    ranks: list[RankSource]
    problems: list[MergeProblem] = field(default_factory=list)

    @property
    def input_bytes(self) -> int:
        return sum(f.bytes for source in self.ranks for f in source.files)


def find_merge_inputs(path: str | Path, *, offsets_ns: Mapping[int, int] | None = None) -> MergeInputs:
    """The traces under `path` grouped by rank, sorted by rank; `offsets_ns` overrides clock files."""
    root = Path(path).expanduser().absolute()
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such file or directory")
    layout = RunLayout.at(root)
    if root.is_dir() and layout.is_run_dir():
        inputs = _run_dir_inputs(layout)
    else:
        inputs = _plain_inputs(root)
    measured = read_clock_offsets(layout, inputs.problems) if inputs.run_layout else {}
    chosen = {rank: (offset, CLOCK_FILE) for rank, offset in measured.items()}
    chosen.update({rank: (offset, CLOCK_GIVEN) for rank, offset in dict(offsets_ns or {}).items()})
    inputs.ranks = [_with_offset(source, *chosen.get(source.rank, (0, CLOCK_NONE))) for source in inputs.ranks]
    if not inputs.ranks:
        inputs.problems.append(MergeProblem(path=str(root), reason="no readable Kineto trace found"))
    return inputs


def _with_offset(source: RankSource, offset_ns: int, clock_source: str) -> RankSource:
    return RankSource(rank=source.rank, host=source.host, files=source.files, clock_offset_ns=int(offset_ns),
                      clock_source=clock_source)


def _run_dir_inputs(layout: RunLayout) -> MergeInputs:
    manifest = load_manifest(layout) if layout.manifest_file.is_file() else build_manifest(layout)
    problems = [MergeProblem(path=p.path, rank=p.rank, reason=p.reason) for p in manifest.problems]
    problems += [MergeProblem(rank=m.rank, reason=f"no trace for rank {m.rank} in window {m.window}")
                 for m in manifest.missing]
    return MergeInputs(root=layout.root, run_layout=layout, ranks=_ranks_from_manifest(manifest), problems=problems)


def _ranks_from_manifest(manifest: Manifest) -> list[RankSource]:
    by_rank: dict[int, list] = defaultdict(list)
    for record in manifest.traces:
        by_rank[record.rank].append(record)
    sources = []
    for rank in sorted(by_rank):
        records = sorted(by_rank[rank], key=lambda r: (r.window if r.window is not None else -1, r.attempt, r.path))
        files = tuple(TraceFile(path=manifest.resolve(r), window=r.window, bytes=r.bytes) for r in records)
        sources.append(RankSource(rank=rank, host=records[0].host, files=files))
    return sources


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceHead:
    """What the first bytes of a Kineto trace say about it."""

    rank: int | None = None
    host: str | None = None


def _plain_inputs(root: Path) -> MergeInputs:
    paths = [root] if root.is_file() else find_trace_files(root)
    problems: list[MergeProblem] = []
    identified: list[tuple[Path, int | None, str | None]] = []
    for path in sorted(paths, key=_natural_key):
        try:
            head = read_trace_head(path)
        except OSError as error:
            problems.append(MergeProblem(path=str(path), reason=f"cannot read: {error}"))
            continue
        rank = head.rank if head.rank is not None else _rank_from_name(path.name)
        identified.append((path, rank, head.host or _host_from_name(path.name)))
    return MergeInputs(root=root, run_layout=None, ranks=_group_plain(identified), problems=problems)


def _group_plain(identified: list[tuple[Path, int | None, str | None]]) -> list[RankSource]:
    """Files without a known rank take the lowest ranks not otherwise used, in name order."""
    used = {rank for _, rank, _ in identified if rank is not None}
    spare = (r for r in range(len(identified) + len(used) + 1) if r not in used)
    by_rank: dict[int, list[tuple[Path, str | None]]] = defaultdict(list)
    for path, rank, host in identified:
        by_rank[rank if rank is not None else next(spare)].append((path, host))
    return [
        RankSource(
            rank=rank,
            host=next((h for _, h in by_rank[rank] if h), "unknown-host"),
            files=tuple(TraceFile(path=p, window=None, bytes=p.stat().st_size) for p, _ in by_rank[rank]),
        )
        for rank in sorted(by_rank)
    ]


def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _rank_from_name(name: str) -> int | None:
    match = _RANK_IN_NAME.search(name)
    return int(match.group(1)) if match else None


def _host_from_name(name: str) -> str | None:
    parsed = parse_trace_file_name(name)
    return parsed.host if parsed else None


def read_trace_head(path: Path, *, head_bytes: int = HEAD_BYTES) -> TraceHead:
    """Rank and host from the top-level keys Kineto writes before `traceEvents`.

    Reads at most `head_bytes` of (decompressed) JSON. A file whose head cannot be decoded gives an
    empty head: the full read during the merge reports what is wrong with it.
    """
    text = _head_text(path, head_bytes)
    events_at = text.find('"traceEvents"')
    header = text if events_at < 0 else text[:events_at]
    info = _json_value_after(header, '"distributedInfo"')
    host = _json_value_after(header, '"host_name"')
    rank = info.get("rank") if isinstance(info, dict) else None
    return TraceHead(
        rank=rank if isinstance(rank, int) and rank >= 0 else None,
        host=host if isinstance(host, str) and host else None,
    )


def _head_text(path: Path, head_bytes: int) -> str:
    with open(path, "rb") as handle:
        raw = handle.read(head_bytes)
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(raw, head_bytes)
        except zlib.error:
            return ""
    return raw.decode("utf-8", errors="replace")


def _json_value_after(text: str, quoted_key: str) -> Any:
    at = text.find(quoted_key)
    if at < 0:
        return None
    colon = text.find(":", at + len(quoted_key))
    if colon < 0:
        return None
    start = colon + 1
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        value, _ = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    return value


def read_clock_offsets(layout: RunLayout, problems: list[MergeProblem]) -> dict[int, int]:
    """rank -> offset (ns) of that rank's clock to rank 0's, from `clock/rank<R>.json`."""
    offsets = {}
    if not layout.clock_dir.is_dir():
        return offsets
    for path in sorted(layout.clock_dir.glob("rank*.json")):
        rank = _rank_from_name(path.name)
        if rank is None:
            continue
        try:
            offset = clock_offset_ns(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            problems.append(MergeProblem(path=str(path), rank=rank, reason=f"clock offset not used: {error}"))
            continue
        if offset is None:
            problems.append(MergeProblem(path=str(path), rank=rank, reason="clock offset not used: no offset_ns field"))
        else:
            offsets[rank] = offset
    return offsets


def clock_offset_ns(document: Any) -> int | None:
    """The offset in a clock file: `offset_ns` (or `offset_us`), at the top level or under `offset`."""
    if not isinstance(document, dict):
        return None
    for key in _OFFSET_KEYS_NS:
        if _is_number(document.get(key)):
            return round(document[key])
    for key in _OFFSET_KEYS_US:
        if _is_number(document.get(key)):
            return round(document[key] * 1000)
    nested = document.get("offset")
    return clock_offset_ns(nested) if isinstance(nested, dict) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


