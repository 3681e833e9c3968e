"""Unplanned profiling windows: on-demand requests, their status, and why each such window was recorded.

    requests/request<N>.json         written once by `fleetscope profile` (numbered without overwriting);
                                     untrusted input to the trainer: `parse_request` validates every field
    requests/request<N>.status.json  written by rank 0: accepted -> published, or aborted / not_served
    captures/window<NNN>.json        written by rank 0 when the ranks agree to record an unplanned window:
                                     kind "requested" (by whom, when) or "triggered" (which trigger, the values)

gather copies the capture records into manifest.json (`captures`); the report reads them from there.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import stat
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from .atomic import write_bytes_atomically
from .layout import RunLayout
from .safe_read import InputRefused, read_input, read_metadata
from .jsontext import strict_dumps

REQUEST_RE = re.compile(r"^request(?P<number>\d{1,9})\.json$")
MAX_REQUEST_NUMBER = 1 << 24
"""The per-step agreement carries a request's number in a float32 tensor: exact up to 2^24. A file
numbered beyond it is not a request (never taken, never numbered after, never blocks the ones below)."""
MAX_REQUEST_BYTES = 16 * 1024
MAX_REQUEST_STEPS = 1000
MAX_REQUEST_RANKS = 1 << 20
STATES = ("accepted", "published", "aborted", "not_served")
"""accepted: a start step was agreed; published: every chosen rank's trace is in the run directory;
aborted: the job ended or failed inside the window; not_served: the job ended before agreeing a start."""
FINAL_STATES = frozenset({"published", "aborted", "not_served"})
KINDS = ("requested", "triggered")


class RequestError(ValueError):
    """A request file that cannot be honoured; the message says which field."""


def now_iso_ms() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass(frozen=True, kw_only=True)
class CaptureRequest:
    """One on-demand window: `warmup` discarded steps then `steps` recorded ones, on `ranks` (None: all)."""

    number: int
    steps: int
    warmup: int
    ranks: list[int] | None
    requested_by: str
    """user@host of whoever asked."""
    requested_at: str
    """ISO 8601 UTC."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["number"]  # the file name carries it
        return data


def parse_request(number: int, data: Any, *, world_size: int | None = None) -> CaptureRequest:
    """Validate a request document (any JSON value); raises RequestError naming the bad field."""
    if not isinstance(data, dict):
        raise RequestError("request: not a JSON object")
    steps, warmup = data.get("steps"), data.get("warmup", 0)
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if type(value) is not int or not low <= value <= MAX_REQUEST_STEPS:
            raise RequestError(f"{name}: expected an integer in [{low}, {MAX_REQUEST_STEPS}], got {value!r}")
    ranks = data.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, list) or not ranks or len(ranks) > MAX_REQUEST_RANKS:
            raise RequestError(f"ranks: expected a non-empty list of ranks or null, got {type(ranks).__name__}")
        if any(type(r) is not int or r < 0 or (world_size is not None and r >= world_size) for r in ranks):
            raise RequestError(f"ranks: every rank must be an integer in [0, {world_size or 'world size'})")
        ranks = sorted(set(ranks))
    texts = {name: data.get(name, "") for name in ("requested_by", "requested_at")}
    for name, value in texts.items():
        if not isinstance(value, str) or len(value) > 200 or not value.isprintable():
            raise RequestError(f"{name}: expected a short printable string")
    return CaptureRequest(number=number, steps=steps, warmup=warmup, ranks=ranks, **texts)


def read_request(layout: RunLayout, number: int, *, world_size: int | None = None) -> CaptureRequest:
    path = layout.request_file(number)
    try:  # untrusted: never follow a link out of the run, never open a FIFO, bounded size
        if stat.S_ISREG(os.lstat(path).st_mode) and os.lstat(path).st_size > MAX_REQUEST_BYTES:
            raise RequestError(f"{path}: larger than {MAX_REQUEST_BYTES} bytes")
        raw = read_input(path, within=layout.root, max_bytes=MAX_REQUEST_BYTES)
    except (OSError, InputRefused) as error:
        raise RequestError(f"{path}: cannot read: {getattr(error, 'reason', error)}") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(f"{path}: not JSON") from None
    return parse_request(number, data, world_size=world_size)


def request_numbers(layout: RunLayout) -> list[int]:
    """Numbers of the request files present, ascending (status files and strays ignored)."""
    try:
        names = os.listdir(layout.requests_dir)
    except OSError:
        return []
    numbers = (int(m["number"]) for m in map(REQUEST_RE.match, names) if m)
    return sorted(n for n in numbers if 0 < n <= MAX_REQUEST_NUMBER)


def submit_request(layout: RunLayout, *, steps: int, warmup: int, ranks: list[int] | None) -> CaptureRequest:
    """Write the next free `requests/request<N>.json` atomically, never replacing an existing one."""
    document = {"steps": steps, "warmup": warmup, "ranks": sorted(set(ranks)) if ranks else None,
                "requested_by": f"{getpass.getuser()}@{socket.gethostname()}"[:200], "requested_at": now_iso_ms()}
    parse_request(0, document)  # the writer checks what the reader will
    _requests_dir_ready(layout)
    staging = layout.requests_dir / f".request.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        staging.unlink(missing_ok=True)
        with os.fdopen(os.open(staging, flags, 0o644), "wb") as handle:
            handle.write((strict_dumps(document, indent=1) + "\n").encode())
    except OSError as error:
        raise RequestError(f"{staging}: cannot write the request: {error.strerror or error}") from None
    try:
        number = (request_numbers(layout) or [0])[-1] + 1
        while True:
            if number > MAX_REQUEST_NUMBER:
                raise RequestError(f"{layout.requests_dir}: no request number left (at most {MAX_REQUEST_NUMBER})")
            try:
                os.link(staging, layout.request_file(number))
                return parse_request(number, document)
            except FileExistsError:
                number += 1
    finally:
        staging.unlink(missing_ok=True)


def _requests_dir_ready(layout: RunLayout, *, what: str = "request") -> None:
    """Create requests/ as a real folder of the run; refuse one that is a symlink or leads out of the run."""
    directory = layout.requests_dir
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise RequestError(f"{directory}: not a folder of the run (a symlink or a file): no {what} written")
    directory.mkdir(exist_ok=True)
    if os.path.realpath(directory) != os.path.join(os.path.realpath(layout.root), directory.name):
        raise RequestError(f"{directory}: resolves outside the run directory: no {what} written")


@dataclass(frozen=True, kw_only=True)
class RequestStatus:
    state: str
    """One of STATES."""
    at: str
    window: int | None = None
    warmup_start: int | None = None
    active_start: int | None = None
    end: int | None = None
    """Steps of the window (end exclusive)."""
    ranks: list[int] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)
    """Published trace files, relative to the run directory."""
    reason: str = ""

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def write_status(layout: RunLayout, number: int, status: RequestStatus) -> None:
    """Rank 0's answer to request `number`, in the run's own requests/ folder (RequestError: it is a symlink,
    a file, or leads out of the run: nothing is written)."""
    _requests_dir_ready(layout, what="request status")
    write_bytes_atomically((strict_dumps(asdict(status), indent=1) + "\n").encode(), layout.request_status_file(number))


def read_status(layout: RunLayout, number: int) -> RequestStatus | None:
    """The status rank 0 wrote for request `number`; None when there is none (yet) or it is unreadable."""
    try:
        data = json.loads(read_metadata(layout.request_status_file(number), within=layout.root))
        return RequestStatus(**data) if isinstance(data, dict) and data.get("state") in STATES else None
    except (OSError, ValueError, TypeError, RecursionError):
        return None


@dataclass(frozen=True, kw_only=True)
class CaptureRecord:
    """Why one unplanned window was recorded (captures/window<NNN>.json, and manifest.json `captures`)."""

    window: int
    kind: str
    """requested | triggered."""
    agreed_at_step: int
    """The step after which the ranks agreed the start."""
    warmup_start: int
    active_start: int
    end: int
    ranks: list[int] | None
    """Ranks that record (None: all)."""
    at: str
    request: int | None = None
    requested_by: str = ""
    requested_at: str = ""
    trigger: str = ""
    """The trigger as configured, e.g. `step_time>2x`."""
    reason: str = ""
    """Plain words: the measured value against its threshold, and on which rank(s)."""


def write_capture_record(layout: RunLayout, record: CaptureRecord) -> None:
    write_bytes_atomically((strict_dumps(asdict(record), indent=1) + "\n").encode(), layout.capture_record(record.window))


def read_capture_records(layout: RunLayout) -> tuple[list[CaptureRecord], list[str]]:
    """Every readable capture record, by window; and one line per record that could not be used."""
    records, problems = [], []
    for path in sorted(layout.captures_dir.glob("window*.json")):
        try:
            data = json.loads(read_metadata(path, within=layout.root))
            record = CaptureRecord(**data)
            if record.kind not in KINDS or type(record.window) is not int:
                raise ValueError(f"kind {record.kind!r}")
        except (OSError, ValueError, TypeError, RecursionError) as error:
            problems.append(f"{layout.relative(path)}: unusable capture record ({error})")
            continue
        records.append(record)
    return sorted(records, key=lambda r: r.window), problems


def capture_from_json(data: dict[str, Any]) -> CaptureRecord:
    return CaptureRecord(**data)

