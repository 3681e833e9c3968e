"""A cache of per-trace results, so analyzing traces again (another threshold, a compare, a re-render,
`merge` after `analyze`) skips parsing them.

What is kept: the RankResult of one trace file, the compact product of parsing (steps, utilization,
collective times, top kernels; kilobytes, never the events). An entry is found by
  - the file's content (a BLAKE2b digest of its stored bytes): any change to the file is a miss, however
    quickly it was rewritten, and the same file copied elsewhere is a hit;
  - what was known about the file before reading it (label, window, and rank and host from a manifest);
  - the analysis code: a digest of the source files that compute a RankResult, so results of another
    fleetscope version are never read.
Where: $FLEETSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/fleetscope/analysis, else ~/.cache/fleetscope/analysis;
never inside the analyzed directory. Entries are pickles, so the directory must belong to the user and
be writable by nobody else; otherwise the cache stays off and the report says why. Entries are written
atomically (temporary file, then rename); an unreadable entry is a miss and is replaced. Deleting the
directory at any time is safe.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import pickle
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleetscope.traces.atomic import write_bytes_atomically

if TYPE_CHECKING:
    from fleetscope.analysis.inputs.sources import TraceSource
    from fleetscope.analysis.per_rank.rank import RankResult

CACHE_DIR_ENV = "FLEETSCOPE_CACHE_DIR"
ENTRY_SUFFIX = ".rank.pickle"
_FORMAT = b"fleetscope-rank-result-1"
RESULT_MODULE = "fleetscope.analysis.per_rank.rank"
"""The module that computes a RankResult: the cache key covers it and every fleetscope module it imports."""


def default_cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "fleetscope" / "analysis"


@dataclass(frozen=True)
class ResultCache:
    directory: Path

    def key(self, source: "TraceSource", raw: bytes) -> str:
        digest = hashlib.blake2b(_FORMAT, digest_size=20)
        digest.update(code_digest().encode())
        digest.update(repr((source.label, source.window, source.rank, source.host)).encode())
        digest.update(hashlib.blake2b(raw, digest_size=32).digest())
        return digest.hexdigest()

    def load(self, key: str) -> "RankResult | None":
        """The cached result, or None (absent, or unreadable: then it is replaced on store)."""
        try:
            with open(self.directory / f"{key}{ENTRY_SUFFIX}", "rb") as handle:
                return pickle.load(handle)
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001  (a damaged entry of any shape is only a miss)
            return None

    def store(self, key: str, result: "RankResult") -> None:
        """Write the entry atomically; a failure (disk full, permissions) only costs the cache."""
        with contextlib.suppress(OSError):
            write_bytes_atomically(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL),
                                   self.directory / f"{key}{ENTRY_SUFFIX}")


def open_cache(directory: Path | None = None) -> tuple[ResultCache | None, str | None]:
    """The cache at `directory` (default: default_cache_dir()), created if needed; or (None, why not)."""
    directory = (directory or default_cache_dir()).absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = directory.stat()
    except OSError as error:
        return None, f"parsed-trace cache off: cannot create {directory}: {error.strerror or error}"
    problem = _unsafe(info)
    if problem:
        return None, f"parsed-trace cache off: {directory} {problem}"
    return ResultCache(directory), None


def _unsafe(info: os.stat_result) -> str | None:
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return "belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by other users"
    return None


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of the source of every module a RankResult is computed by: RESULT_MODULE and the
    fleetscope modules it imports, transitively (found by reading the imports, not a folder listing, so a
    new module is covered and an edit to the renderer or the merge invalidates nothing)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, path in sorted(result_source_files().items()):
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def result_source_files(root: str = RESULT_MODULE) -> dict[str, Path]:
    """module name -> source file, for `root` and the fleetscope modules it imports, transitively."""
    found: dict[str, Path] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, AttributeError, ValueError):  # `from module import function`: not a module
            continue
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        found[name] = Path(spec.origin)
        pending += _fleetscope_imports(found[name], name, spec.submodule_search_locations is not None)
    return found


def _fleetscope_imports(path: Path, module: str, is_package: bool) -> list[str]:
    """The fleetscope modules a source file imports (absolute or relative). Parent packages are not
    followed: their `__init__` re-exports for users and computes nothing a result depends on."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module or ""
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return [n for n in names if n.startswith("fleetscope.")]
