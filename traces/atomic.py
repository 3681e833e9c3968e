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


@contextmanager
def atomic_output(destination: Path, *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """A binary handle whose content replaces `destination` when the block ends without an error;
    on an error the destination is untouched and the temporary file removed."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(destination)
    try:
        with open(staging, "wb") as handle:
            yield handle
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(staging, destination)
    finally:
        staging.unlink(missing_ok=True)


def write_bytes_atomically(data: bytes, destination: Path) -> None:
    """Replace `destination` with `data` (for small files: metadata, reports, cache entries)."""
    with atomic_output(destination) as handle:
        handle.write(data)
