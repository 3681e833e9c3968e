"""The one guard in front of every file fleetscope writes from a read command (analyze, merge, advise --json,
hang --json, history --html, postprocess).

A report or merged trace pointed at an input (a trace, the manifest, a metrics file, anything the tool did
not write) would destroy it. `guard_output` refuses, before any work is done, to write
  - over one of the inputs, or anywhere inside the analyzed run's traces/;
  - through a symlink (the rename would replace the link, and the user meant what it points to);
  - over an existing file that is not one of fleetscope's own outputs (recognized by name and content:
    `is_own_output`), so rerunning a command still replaces its previous output.
"""

from __future__ import annotations

import os
import re
import stat
import zlib
from collections.abc import Iterable
from pathlib import Path

from .kineto import find_trace_like_entries
from .layout import MERGED_TRACE, RunLayout, run_holding_traces
from .validate import UsageError, is_inside

_HEAD_BYTES = 4096
_REPORT_HEAD_RE = re.compile(rb'^\{\s*"schema_version":\s*\d+,\s*"created_at":\s*"[^"]*",\s*"source_path":')
"""report.json: Report.to_json's first fields, in their order."""
_MERGED_JSON_HEAD = b'{"schemaVersion":1,"displayTimeUnit":"ms","baseTimeNanoseconds":'
"""merged.trace.json.gz: the Chrome JSON writer's header (Kineto's own traces are indented)."""
_HTML_MARKS = (b"<title>fleetscope report: ", b"<title>fleetscope history: ")
_COMMAND_JSON_HEAD_RE = re.compile(rb'^\{\n  "run": "(?:[^"\\\n]|\\.)*",\n  "findings": \[|^\{\n "dumped_ranks": \[')
"""advise --json (Advice: run, then findings) and hang --json (HangReport: dumped_ranks first)."""


class OutputRefused(UsageError):
    """An output path that would overwrite an input or a file fleetscope did not write."""


def is_own_output(path: Path) -> bool:
    """Whether `path` is a regular file that fleetscope wrote as a report or merged trace."""
    head = _head(path)
    if head is None:
        return False
    name = path.name
    if name.endswith(".gz"):
        head = _gunzip_head(head)
        return head is not None and head.startswith(_MERGED_JSON_HEAD)
    if name.endswith(".perfetto-trace"):
        # a Perfetto protobuf stream starts with packet field 1 (length-delimited); nothing else is checked
        return head[:1] == b"\x0a" or name == MERGED_TRACE and not head
    if name.endswith((".html", ".htm")):
        return any(mark in head for mark in _HTML_MARKS)
    if _COMMAND_JSON_HEAD_RE.match(head):
        return True
    return bool(_REPORT_HEAD_RE.match(head)) or _MERGED_JSON_HEAD in head[:len(_MERGED_JSON_HEAD)]


def guard_output(path: str | Path, *, analyzed: Path, inputs: Iterable[Path] = ()) -> Path:
    """`path` as an absolute Path if writing it is safe (module docstring); raises OutputRefused."""
    destination = Path(path).expanduser().absolute()
    problem = _output_problem(destination, Path(analyzed).absolute(), list(inputs))
    if problem:
        raise OutputRefused(f"refusing to write {destination}: {problem}")
    return destination


def _output_problem(destination: Path, analyzed: Path, inputs: list[Path]) -> str | None:
    if destination.is_symlink():
        return "it is a symlink (to " + os.readlink(destination) + "); give the real path"
    if _is_an_input(destination, analyzed, inputs):
        return "it is one of the inputs being read"
    layout = RunLayout.at(analyzed)
    if layout.traces_dir.is_dir() and is_inside(destination, layout.traces_dir):
        return f"it is inside the analyzed run's {layout.traces_dir.name}/"
    inside = run_holding_traces(destination)
    if inside:
        return f"it is inside the traces/ of the run {inside}"
    try:
        info = os.lstat(destination)
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"cannot check it: {error.strerror or error}"
    if not stat.S_ISREG(info.st_mode):
        return "it exists and is not a regular file"
    if not is_own_output(destination):
        return "it exists and is not a fleetscope output (remove it or choose another path)"
    return None


def _is_an_input(destination: Path, analyzed: Path, inputs: list[Path]) -> bool:
    real = os.path.realpath(destination)
    if real == os.path.realpath(analyzed):
        return True
    if not inputs and analyzed.is_dir() and not RunLayout.at(analyzed).is_run_dir():
        inputs = find_trace_like_entries(analyzed)
    return any(real == os.path.realpath(p) for p in inputs)


def _head(path: Path) -> bytes | None:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        descriptor = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        return handle.read(_HEAD_BYTES) if stat.S_ISREG(os.fstat(descriptor).st_mode) else None


def _gunzip_head(head: bytes) -> bytes | None:
    try:
        return zlib.decompressobj(wbits=31).decompress(head, len(_MERGED_JSON_HEAD) + 16)
    except zlib.error:
        return None
