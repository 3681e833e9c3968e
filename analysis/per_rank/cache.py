"""A cache of per-trace results, so analyzing traces again (another threshold, a compare, a re-render,
`merge` after `analyze`) skips parsing them.

What is kept: the RankResult of one trace file, the compact product of parsing (steps, utilization,
collective times, top kernels; kilobytes, never the events). An entry is found by
  - the file's content (a BLAKE2b digest of its stored bytes): any change to the file is a miss, however
    quickly it was rewritten, and the same file copied elsewhere is a hit;
  - what was known about the file before reading it (label, window, and rank and host from a manifest);
  - the analysis code: a digest of the source files that compute a RankResult, so results of another
    fleetscope version are never read.
Where: $FLEETSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/fleetscope/analysis, else ~/.cache/fleetscope/analysis
(the default is never inside the analyzed directory; a Slurm fan-out puts its shared cache under the run
directory, launcher/fanout.py, because every node sees that filesystem). Entries are a checksum and a msgpack document of the RankResult
dataclasses (numpy arrays as dtype + shape + raw bytes, from a short list of dtypes): decoding one can
build those types and nothing else, so a planted entry can at worst be a wrong result for identical
bytes, never code, and a damaged one fails its checksum. Even so,
the directory must belong to the user and be writable by nobody else (otherwise the cache stays off and the
report says why), and every entry is opened without following links and checked on the opened descriptor
(a regular file of ours that nobody else can write). Entries are written atomically (temporary file, then
rename); an entry that fails any check or does not decode to a RankResult is a miss and is replaced.
Deleting the directory at any time is safe.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from fleetscope.traces.atomic import write_bytes_atomically

if TYPE_CHECKING:
    from fleetscope.analysis.inputs.sources import TraceSource
    from fleetscope.analysis.per_rank.rank import RankResult

CACHE_DIR_ENV = "FLEETSCOPE_CACHE_DIR"
ENTRY_SUFFIX = ".rank.msgpack"
_FORMAT = b"fleetscope-rank-result-2"
MAX_ENTRY_BYTES = 64 << 20
"""A RankResult is kilobytes; anything far larger is not an entry this code wrote."""
_ARRAY_DTYPES = frozenset({"<f8", "<i8", "<i4", "|i1", "|b1"})
"""The dtypes a RankResult's arrays have; an entry naming another is damaged (no object arrays)."""
RESULT_MODULE = "fleetscope.analysis.per_rank.rank"
"""The module that computes a RankResult: the cache key covers it and every fleetscope module it imports."""


def default_cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "fleetscope" / "analysis"


PRIVATE_MODE = 0o600
"""Cache entries are written readable and writable by their owner alone, whatever the umask: an entry others
can write is never read (read_private_file), so under umask 000 the cache would be written and never used."""


@dataclass(frozen=True)
class ResultCache:
    directory: Path

    def key(self, source: "TraceSource", raw: bytes, comm_kernel_pattern: str | None = None, *,
            verified_sha256: str | None = None) -> str:
        """Also keyed by the parse's one option, `comm_kernel_pattern` (names.comm_kernel_rule).
        `verified_sha256`: the sha256 of `raw` when the caller has just checked it (the manifest's, as
        read_raw checks it), which spares hashing the bytes a second time."""
        digest = hashlib.blake2b(_FORMAT, digest_size=20)
        digest.update(code_digest().encode())
        digest.update(repr((source.label, source.window, source.rank, source.host)).encode())
        if comm_kernel_pattern:
            digest.update(repr(("comm_kernel_pattern", comm_kernel_pattern)).encode())
        digest.update((verified_sha256 or hashlib.sha256(raw).hexdigest()).encode())
        return digest.hexdigest()

    def load(self, key: str) -> "RankResult | None":
        """The cached result, or None (absent, unsafe or undecodable: then it is replaced on store)."""
        data = read_private_file(self.directory / f"{key}{ENTRY_SUFFIX}")
        return decode_entry(data) if data is not None else None

    def contains(self, key: str) -> bool:
        """An entry is there (not checked: `load` may still find it damaged and miss)."""
        return (self.directory / f"{key}{ENTRY_SUFFIX}").is_file()

    def store(self, key: str, result: "RankResult") -> None:
        """Write the entry atomically; a failure (disk full, permissions) only costs the cache. A planted
        symlink in the entry's place is replaced by the rename, never followed."""
        with contextlib.suppress(OSError):
            write_bytes_atomically(encode_entry(result), self.directory / f"{key}{ENTRY_SUFFIX}", mode=PRIVATE_MODE)


def read_private_file(path: Path) -> bytes | None:
    """The bytes of `path` if it is a regular file of ours that nobody else can write, else None.

    The checks run on the opened descriptor (O_NOFOLLOW: a symlink is refused, not followed;
    O_NONBLOCK: a FIFO planted in its place cannot block us), so swapping the file after a check wins
    nothing."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if _unsafe_entry(info):
            return None
        try:
            return handle.read(info.st_size) if info.st_size <= MAX_ENTRY_BYTES else None
        except OSError:
            return None


def _unsafe_entry(info: os.stat_result) -> bool:
    if not stat.S_ISREG(info.st_mode):
        return True
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return True
    return bool(info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


_CHECKSUM_BYTES = 16


def encode_entry(result: "RankResult") -> bytes:
    """A checksum of the payload, then the payload: a flipped bit in a number would still decode to a
    RankResult, only a wrong one."""
    payload = _ENCODER.encode(result)
    return hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest() + payload


def decode_entry(data: bytes) -> "RankResult | None":
    """The RankResult an entry holds, or None when it is not exactly one (any damage is a miss)."""
    checksum, payload = data[:_CHECKSUM_BYTES], data[_CHECKSUM_BYTES:]
    if hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest() != checksum:
        return None
    try:
        return _decoder().decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError):
        return None


def _encode_hook(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"dtype": value.dtype.str, "shape": list(value.shape), "data": np.ascontiguousarray(value).tobytes()}
    raise NotImplementedError(f"cannot cache a {type(value).__name__}")


def _decode_hook(kind: type, value: Any) -> Any:
    if kind is not np.ndarray:
        raise NotImplementedError(f"no decoder for {kind}")
    if not isinstance(value, dict) or value.get("dtype") not in _ARRAY_DTYPES:
        raise ValueError("not an array of a known dtype")
    shape, data = value.get("shape"), value.get("data")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and isinstance(data, bytes)):
        raise ValueError("damaged array")
    # frombuffer never unpickles; reshape checks the element count against the bytes
    return np.frombuffer(data, dtype=np.dtype(value["dtype"])).reshape(shape).copy()


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_hook)


@functools.lru_cache(maxsize=1)
def _decoder() -> msgspec.msgpack.Decoder:
    from fleetscope.analysis.per_rank.rank import RankResult  # rank.py imports this module

    return msgspec.msgpack.Decoder(RankResult, dec_hook=_decode_hook)


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
    for node in _import_nodes(path.read_bytes()):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module or ""
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return [n for n in names if n.startswith("fleetscope.")]


_IMPORT_START = re.compile(rb"^[ \t]*(?:import|from)[ \t]", re.MULTILINE)


def _import_nodes(source: bytes) -> list[ast.AST]:
    """The import statements of a module's source, each parsed on its own: every digest is computed at
    the start of a command, and parsing whole modules was most of that. A line that only looks like an
    import (in a docstring) does not parse and is skipped; one inside a string that does parse can only
    add a module to the digest, never leave one out."""
    nodes: list[ast.AST] = []
    for match in _IMPORT_START.finditer(source):
        try:
            tree = ast.parse(_import_statement(source, match.start()).decode("utf-8", "replace"))
        except SyntaxError:
            continue
        nodes += [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    return nodes


def _import_statement(source: bytes, start: int) -> bytes:
    """The statement starting at `start`, without comments (an import holds no string, so `#` always
    starts one), followed over open parentheses and trailing backslashes."""
    lines, depth, position = [], 0, start
    while position < len(source):
        end = source.find(b"\n", position)
        end = len(source) if end < 0 else end
        line = source[position:end].split(b"#", 1)[0].rstrip()
        lines.append(line.rstrip(b"\\"))
        depth += line.count(b"(") - line.count(b")")
        position = end + 1
        if depth <= 0 and not line.endswith(b"\\"):
            break
    return b" ".join(lines).strip()
