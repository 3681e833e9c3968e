"""The one reader of files inside a run directory (traces, manifest, job.json, clock and metrics files).

On a shared cluster file system any of these may be replaced by another user or a broken job: a symlink
to another job's trace, a FIFO that blocks every open, a directory or a symlink loop named like a trace,
a trace swapped after gather. Every consumer reads through `read_input`, which
  - looks at the entry itself first (lstat), so a FIFO or a device is named and never opened;
  - resolves symlinks and refuses a path that lands outside the directory it must stay in;
  - opens with O_NOFOLLOW | O_NONBLOCK and checks the opened descriptor again (nothing is gained by
    swapping the file between the check and the open);
  - checks the size before reading and the sha256 while reading when the manifest recorded them.
A refusal is an InputRefused (a ValueError) whose `reason` says what is wrong; the caller names the file.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from .validate import is_inside

MAX_INPUT_BYTES = 64 << 30
"""Larger than any trace file of a real job: a file beyond it is refused before it is read."""
MAX_METADATA_BYTES = 256 << 20
"""manifest.json, job.json, clock files, metrics files: far smaller in any real run."""

OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
"""How a run file is opened: never through a final symlink, never waiting on a FIFO (whole_run reads with it too)."""
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class InputRefused(ValueError):
    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def entry_problem(path: Path, *, within: Path | None = None) -> str | None:
    """Why `path` is not a readable regular file (inside `within` when given), or None. Opens nothing."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "no such file"
    except OSError as error:
        return f"cannot stat: {error.strerror or error}"
    if stat.S_ISLNK(info.st_mode):
        try:
            info = os.stat(path)
        except OSError as error:
            return f"broken symlink or symlink loop ({error.strerror or error})"
    if within is not None and not is_inside(path, within):
        return f"resolves outside {within} (symlink or path escape): not read"
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        return f"{kind}, not a regular file: not read"
    return None


def read_input(path: Path, *, within: Path | None = None, max_bytes: int = MAX_INPUT_BYTES,
               expected_size: int | None = None, expected_sha256: str | None = None) -> bytes:
    """The bytes of `path`, after the checks of the module docstring; raises InputRefused."""
    problem = entry_problem(path, within=within)
    if problem:
        raise InputRefused(path, problem)
    real = os.path.realpath(path)
    try:
        descriptor = os.open(real, OPEN_FLAGS)
    except OSError as error:
        raise InputRefused(path, f"cannot open: {error.strerror or error}") from error
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise InputRefused(path, "not a regular file when opened (replaced while being read): not read")
        _check_size(path, info.st_size, max_bytes, expected_size)
        try:
            # st_size + 1: a file that grows while being read shows it (read(n) allocates n bytes)
            data = handle.read(info.st_size + 1)
        except OSError as error:
            raise InputRefused(path, f"cannot read: {error.strerror or error}") from error
    if len(data) != info.st_size:
        raise InputRefused(path, "changed size while being read (still being written?): not read")
    if expected_sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256:
            raise InputRefused(path, f"changed since gather: sha256 {actual[:16]}... differs from the manifest's "
                                     f"{str(expected_sha256)[:16]}...: not analyzed (run `fleetscope gather` again)")
    return data


def _check_size(path: Path, size: int, max_bytes: int, expected: int | None) -> None:
    if expected is not None and size != expected:
        raise InputRefused(path, f"changed since gather: {size} bytes, the manifest says {expected}: not analyzed "
                                 "(run `fleetscope gather` again)")
    if size > max_bytes:
        raise InputRefused(path, f"{size} bytes is beyond the {max_bytes}-byte limit for this kind of file: not read")


def read_metadata(path: Path, *, within: Path | None = None) -> bytes:
    """A small metadata file of a run directory (manifest, job.json, clock and metrics files)."""
    return read_input(path, within=within, max_bytes=MAX_METADATA_BYTES)
