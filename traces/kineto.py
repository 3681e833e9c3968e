"""Reading Kineto (torch.profiler) trace files, with errors that say what is wrong.

Shared by gather (verification) and analysis (loading) so both judge a file the same way.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Iterable

import msgspec
import orjson

from .formats import STEP_MARKER_PREFIX, parse_step_marker
from .kineto_schema import IdentityDocument, metadata_value
from .safe_read import InputRefused, read_input
from .validate import checked_world_size, rank_problem
from .layout import CHECKPOINTS_DIR, CLOCK_DIR, JOB_FILE, LOGS_DIR, MANIFEST_FILE, MEMORY_DIR, METRICS_DIR, REPORT_DIR

TRACE_GLOBS = ("*.json", "*.json.gz")


class TraceReadError(ValueError):
    """A trace file that cannot be used; the message names the file and the reason."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class NotATrace(TraceReadError):
    """Valid JSON that is no trace document (no `traceEvents` list): a config or metrics file beside the traces."""


def read_raw(path: Path, *, within: Path | None = None, expected_size: int | None = None,
             expected_sha256: str | None = None) -> bytes:
    """The bytes of a trace file as stored (possibly gzip), read by the one safe reader (safe_read.py):
    inside `within`, and matching the manifest's size and sha256 when given."""
    try:
        return read_input(path, within=within, expected_size=expected_size, expected_sha256=expected_sha256)
    except InputRefused as error:
        raise TraceReadError(path, error.reason) from error


try:  # ISA-L's inflate: the same API and output as zlib's, ~3x faster (every stage inflates every trace)
    from isal import isal_zlib as _inflate_library

    _INFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error, _inflate_library.error)
except ImportError:  # pragma: no cover - isal is a dependency; zlib keeps working without it
    _inflate_library = zlib
    _INFLATE_ERRORS = (zlib.error,)

MAX_INFLATE_RATIO = 200
"""Kineto JSON compresses 5-30x; a file that inflates far more is a decompression bomb, not a trace."""
MIN_INFLATE_LIMIT = 256 << 20


def decompress(raw: bytes, path: Path) -> bytes:
    """The JSON bytes of a stored `.json` or `.json.gz` trace; gzip output is bounded by
    MAX_INFLATE_RATIO times the stored size (at least MIN_INFLATE_LIMIT)."""
    if not raw:
        raise TraceReadError(path, "empty file")
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return _inflate_bounded(raw, path, max(MIN_INFLATE_LIMIT, MAX_INFLATE_RATIO * len(raw)))
    except _INFLATE_ERRORS as error:
        raise TraceReadError(path, f"corrupt or truncated gzip: {error}") from error


def _inflate_bounded(raw: bytes, path: Path, limit: int) -> bytes:
    """gzip.decompress (every member, zero padding between them skipped) that stops past `limit` bytes."""
    members, total, data = [], 0, raw
    while data:
        inflater = _inflate_library.decompressobj(wbits=31)
        member = inflater.decompress(data, limit - total + 1)
        total += len(member)
        if total > limit:
            raise TraceReadError(path, f"gzip inflates beyond {limit} bytes ({MAX_INFLATE_RATIO}x its size): "
                                       "a decompression bomb, not read")
        if not inflater.eof:
            raise TraceReadError(path, "corrupt or truncated gzip: the stream ends early")
        members.append(member)
        data = inflater.unused_data.lstrip(b"\x00")
    return b"".join(members)


def parse_json(data: bytes, path: Path) -> Any:
    """orjson for speed; the stdlib parser for what orjson refuses but is valid JSON
    (integers beyond 64 bits); invalid UTF-8 in names is replaced, not fatal."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as fast_error:
        try:
            return json.loads(data.decode("utf-8", errors="replace"))
        except RecursionError as error:
            raise TraceReadError(path, "JSON nested too deeply to be a trace") from error
        except json.JSONDecodeError as error:
            where = f"line {error.lineno} column {error.colno}"
            raise TraceReadError(path, f"invalid JSON {where}: {fast_error}") from error


def read_trace(path: Path) -> dict[str, Any]:
    """Parse one trace file and check it has the shape of a Kineto trace."""
    return decode_trace(read_raw(path), path)


def decode_trace(raw: bytes, path: Path) -> dict[str, Any]:
    """Parse stored trace bytes (`path` only names them in errors)."""
    return _document_of(decompress(raw, path), path)


def _document_of(data: bytes, path: Path) -> dict[str, Any]:
    """The Kineto document of inflated JSON bytes."""
    document = parse_json(data, path)
    if isinstance(document, list):
        document = {"traceEvents": document}
    if not isinstance(document, dict):
        raise NotATrace(path, f"top level is {type(document).__name__}, expected an object")
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise NotATrace(path, "no traceEvents list: not a Chrome/Kineto trace")
    return document


def distributed_rank(document: dict[str, Any]) -> tuple[int | None, int | None]:
    """(rank, world_size) from the trace's `distributedInfo`, if present and sane."""
    info = document.get("distributedInfo")
    if not isinstance(info, dict):
        return None, None
    rank, world = info.get("rank"), checked_world_size(info.get("world_size"))
    return (rank if rank_problem(rank) is None else None), world


def profiler_steps(events: list[Any]) -> list[int]:
    """Step numbers of the `ProfilerStep#N` annotations, sorted."""
    steps = set()
    for event in events:
        name = event.get("name") if isinstance(event, dict) else None
        step = parse_step_marker(name) if isinstance(name, str) else None
        if step is not None:
            steps.add(step)
    return sorted(steps)


@dataclass(frozen=True, kw_only=True)
class TraceIdentity:
    """What identifies a trace file without holding its events: who wrote it and what it covers."""

    rank: int | None
    """From `distributedInfo`, when present and sane."""
    world_size: int | None
    host_name: str | None
    """The trace's `host_name` when it is a non-empty string (anything else names no host)."""
    steps: list[int]
    """ProfilerStep numbers, sorted (profiler_steps)."""
    event_count: int


_IDENTITY_DECODER = msgspec.json.Decoder(IdentityDocument)


def identify_trace(raw: bytes, path: Path) -> TraceIdentity:
    """The identity of stored trace bytes, judged as strictly as decode_trace (every byte inflated, the
    whole document parsed as JSON) but materializing only the event names and the identifying fields:
    several times cheaper than building every event. Anything that typed decoder refuses (an event that
    is not an object, a list at the top level, invalid UTF-8, deep nesting, invalid JSON) goes through
    decode_trace itself, so a bad file is named with the same reason either way."""
    data = decompress(raw, path)
    try:
        fields = _IDENTITY_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _identity_of(_document_of(data, path))
    return identity_of_fields(distributed_info=metadata_value(fields, "distributedInfo"),
                              host_name=metadata_value(fields, "host_name"),
                              event_names=_distinct_names(fields.traceEvents),
                              event_count=len(fields.traceEvents))


def identity_of_fields(*, distributed_info: Any, host_name: Any, event_names: Iterable[Any],
                       event_count: int) -> TraceIdentity:
    """The identity of a trace from its decoded identifying fields and the names of all its events (any
    phase): what identify_trace says of the same file."""
    rank, world_size = distributed_rank({"distributedInfo": distributed_info})
    return TraceIdentity(rank=rank, world_size=world_size, host_name=_host_name(host_name),
                         steps=_steps_of_names(event_names), event_count=event_count)


def _distinct_names(events: list[Any]) -> Iterable[Any]:
    """The `name` attribute of decoded events, each value once (a trace has ~1,000 names for ~100,000
    events); every name as it is when one is unhashable (a list in a hostile file)."""
    try:
        return set(map(attrgetter("name"), events))
    except TypeError:
        return [event.name for event in events]


def _identity_of(document: dict[str, Any]) -> TraceIdentity:
    rank, world_size = distributed_rank(document)
    events = document["traceEvents"]
    return TraceIdentity(rank=rank, world_size=world_size, host_name=_host_name(document.get("host_name")),
                         steps=profiler_steps(events), event_count=len(events))


def _host_name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _steps_of_names(names) -> list[int]:
    steps = set()
    for name in names:
        if isinstance(name, str) and name.startswith(STEP_MARKER_PREFIX):
            step = parse_step_marker(name)
            if step is not None:
                steps.add(step)
    return sorted(steps)


def find_trace_files(directory: Path) -> list[Path]:
    """Every regular `*.json` / `*.json.gz` file under `directory` that is not fleetscope's own output
    (what else is named like a trace: `find_trace_like_entries`)."""
    return [p for p in find_trace_like_entries(directory) if _is_regular(p)]


def find_trace_like_entries(directory: Path) -> list[Path]:
    """Every entry named `*.json` / `*.json.gz` under `directory` outside fleetscope's own folders,
    whatever it is: FIFOs, directories and symlinks too, so a reader can name those instead of
    skipping them without a word. Never opens anything."""
    found: set[Path] = set()
    for pattern in TRACE_GLOBS:
        found.update(directory.rglob(pattern))
    return sorted(p for p in found if not _is_fleetscope_output(p, directory))


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)  # stat: a symlink counts by what it points to
    except (OSError, RuntimeError):
        return False


def _is_fleetscope_output(path: Path, root: Path) -> bool:
    relative = path.relative_to(root).parts
    hidden = any(part.startswith(".") for part in relative)
    own_dirs = {REPORT_DIR, METRICS_DIR, CLOCK_DIR, LOGS_DIR, CHECKPOINTS_DIR, MEMORY_DIR}
    own = len(relative) > 1 and relative[0] in own_dirs
    top_level_meta = len(relative) == 1 and relative[0] in {JOB_FILE, MANIFEST_FILE}
    return hidden or own or top_level_meta
