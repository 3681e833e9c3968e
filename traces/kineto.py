"""Reading Kineto (torch.profiler) trace files, with errors that say what is wrong.

Shared by gather (verification) and analysis (loading) so both judge a file the same way.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import orjson

from .formats import parse_step_marker
from .layout import CHECKPOINTS_DIR, CLOCK_DIR, JOB_FILE, LOGS_DIR, MANIFEST_FILE, MEMORY_DIR, METRICS_DIR, REPORT_DIR

TRACE_GLOBS = ("*.json", "*.json.gz")


class TraceReadError(ValueError):
    """A trace file that cannot be used; the message names the file and the reason."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def read_raw(path: Path) -> bytes:
    """The bytes of a trace file as stored (possibly gzip)."""
    try:
        return path.read_bytes()
    except OSError as error:
        raise TraceReadError(path, f"cannot read file: {error.strerror or error}") from error


def decompress(raw: bytes, path: Path) -> bytes:
    """The JSON bytes of a stored `.json` or `.json.gz` trace."""
    if not raw:
        raise TraceReadError(path, "empty file")
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise TraceReadError(path, f"corrupt or truncated gzip: {error}") from error


def parse_json(data: bytes, path: Path) -> Any:
    """orjson for speed; the stdlib parser for what orjson refuses but is valid JSON
    (integers beyond 64 bits); invalid UTF-8 in names is replaced, not fatal."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as fast_error:
        try:
            return json.loads(data.decode("utf-8", errors="replace"))
        except (json.JSONDecodeError, RecursionError) as error:
            where = f"line {error.lineno} column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
            raise TraceReadError(path, f"invalid JSON {where}: {fast_error}".replace("  ", " ")) from error


def read_trace(path: Path) -> dict[str, Any]:
    """Parse one trace file and check it has the shape of a Kineto trace."""
    return decode_trace(read_raw(path), path)


def decode_trace(raw: bytes, path: Path) -> dict[str, Any]:
    """Parse stored trace bytes (`path` only names them in errors)."""
    document = parse_json(decompress(raw, path), path)
    if isinstance(document, list):
        document = {"traceEvents": document}
    if not isinstance(document, dict):
        raise TraceReadError(path, f"top level is {type(document).__name__}, expected an object")
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise TraceReadError(path, "no traceEvents list: not a Chrome/Kineto trace")
    return document


def distributed_rank(document: dict[str, Any]) -> tuple[int | None, int | None]:
    """(rank, world_size) from the trace's `distributedInfo`, if present and sane."""
    info = document.get("distributedInfo")
    if not isinstance(info, dict):
        return None, None
    rank, world = info.get("rank"), info.get("world_size")
    rank = rank if isinstance(rank, int) and rank >= 0 else None
    world = world if isinstance(world, int) and world > 0 else None
    return rank, world


def profiler_steps(events: list[Any]) -> list[int]:
    """Step numbers of the `ProfilerStep#N` annotations, sorted."""
    steps = set()
    for event in events:
        name = event.get("name") if isinstance(event, dict) else None
        step = parse_step_marker(name) if isinstance(name, str) else None
        if step is not None:
            steps.add(step)
    return sorted(steps)


def find_trace_files(directory: Path) -> list[Path]:
    """Every `*.json` / `*.json.gz` under `directory` that is not fleetscope's own output."""
    found: set[Path] = set()
    for pattern in TRACE_GLOBS:
        found.update(p for p in directory.rglob(pattern) if p.is_file())
    return sorted(p for p in found if not _is_fleetscope_output(p, directory))


def _is_fleetscope_output(path: Path, root: Path) -> bool:
    relative = path.relative_to(root).parts
    hidden = any(part.startswith(".") for part in relative)
    own_dirs = {REPORT_DIR, METRICS_DIR, CLOCK_DIR, LOGS_DIR, CHECKPOINTS_DIR, MEMORY_DIR}
    own = len(relative) > 1 and relative[0] in own_dirs
    top_level_meta = len(relative) == 1 and relative[0] in {JOB_FILE, MANIFEST_FILE}
    return hidden or own or top_level_meta
