"""Publishing a finished trace into the run directory: compressed, atomic, never overwriting.

A rank writes its trace to node-local temporary storage first, then this module gzips it into a
hidden temporary file next to its final name on shared storage and links it into place. Readers
therefore see either no file or a complete one, and an existing trace (an earlier attempt of a
requeued job) is never replaced: the new one gets the next free attempt number.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

from .atomic import write_bytes_atomically  # noqa: F401  (re-exported for callers of this module)
from .layout import RunLayout

_COPY_CHUNK_BYTES = 1 << 20


def publish_trace(
    source: Path, layout: RunLayout, *, window: int, rank: int, host: str, attempt: int = 0
) -> Path:
    """Gzip `source` (a Kineto JSON file) into the run directory; returns the published path."""
    layout.window_dir(window).mkdir(parents=True, exist_ok=True)
    staging = _stage_compressed(source, layout.window_dir(window), rank)
    try:
        while True:
            destination = layout.trace_file(window, rank, host, attempt)
            if _link_without_overwrite(staging, destination):
                return destination
            attempt += 1
    finally:
        staging.unlink(missing_ok=True)


def _stage_compressed(source: Path, directory: Path, rank: int) -> Path:
    staging = directory / f".rank{rank}.{os.getpid()}.tmp"
    if source.name.endswith(".gz"):
        shutil.copyfile(source, staging)
    else:
        with open(source, "rb") as raw, open(staging, "wb") as out:
            # mtime=0 keeps the bytes (and so the sha256) a function of the trace alone.
            with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as packed:
                shutil.copyfileobj(raw, packed, _COPY_CHUNK_BYTES)
    with open(staging, "rb+") as handle:
        os.fsync(handle.fileno())
    return staging


def _link_without_overwrite(staging: Path, destination: Path) -> bool:
    """Atomically give `staging` the name `destination` unless that name exists."""
    try:
        os.link(staging, destination)
        return True
    except FileExistsError:
        return False
    except OSError:
        # Some shared file systems have no hard links; fall back to check-then-rename.
        if destination.exists():
            return False
        os.replace(staging, destination)
        return True
