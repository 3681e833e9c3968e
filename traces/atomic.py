"""Writing a file so that readers see either the old content or the whole new one, never a part.

The one atomic-write helper of the project: every output (metadata, reports, merged traces, cache
entries, checkpoints' markers) goes through it. The data is written to a hidden temporary file beside
the destination (same file system, so the final rename is atomic), flushed to disk, then renamed.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


def staging_path(destination: Path) -> Path:
    """The hidden temporary name beside `destination` that a writer fills before the rename."""
    return destination.with_name(f".{destination.name}.{os.getpid()}.tmp")


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@contextmanager
def atomic_output(destination: Path, *, fsync: bool = True, mode: int | None = None) -> Iterator[IO[bytes]]:
    """A binary handle whose content replaces `destination` when the block ends without an error;
    on an error the destination is untouched and the temporary file removed. `mode`: the file's permissions
    whatever the umask (a private cache entry stays 0o600 under umask 000); None: the umask's default."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(destination)
    # A leftover or planted entry in the staging name is removed, never followed: the file is created anew.
    staging.unlink(missing_ok=True)
    try:
        descriptor = os.open(staging, _CREATE_FLAGS, 0o666 if mode is None else mode)
        with os.fdopen(descriptor, "wb") as handle:
            if mode is not None:
                os.fchmod(descriptor, mode)
            yield handle
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(staging, destination)
    finally:
        staging.unlink(missing_ok=True)


def write_bytes_atomically(data: bytes, destination: Path, *, mode: int | None = None) -> None:
    """Replace `destination` with `data` (for small files: metadata, reports, cache entries); `mode` as
    atomic_output's."""
    with atomic_output(destination, mode=mode) as handle:
        handle.write(data)
