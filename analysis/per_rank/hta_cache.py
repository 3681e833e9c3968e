"""A cache of HTA's per-rank views (RankViews), so analyzing a run again does not compute them again.

It lives in the parsed-trace cache's directory (per_rank/cache.py: same location, same directory checks,
made by `open_cache`) as its own kind of entry (`*.hta.msgpack`), under the same safety rules:
  - found by the trace file's content (a BLAKE2b digest of its stored bytes), the rank, the window's
    ProfilerStep names it was computed with, the engine (native or HTA's), the versions of the libraries
    doing the work, and a digest of the source of every fleetscope module that computes a RankViews
    (hta_rank_views.py and what it imports, and this module): another HTA, another fleetscope, other
    bytes are all misses; entries the parse stored from its own decode (store_parsed_views) are keyed by
    what of the step names the views depend on (hta_native.step_filter_key) and found only by the native
    engine;
  - an entry is a checksum and a msgpack document of plain rows (JSON scalars) and columns of numbers
    and names: decoding builds nothing else, no pickle, so a planted entry can at worst be a wrong table
    for identical bytes, never code;
  - read without following links, only when it is a regular file of ours that nobody else can write
    (cache.read_private_file); written atomically. Any failed check or damage is a miss, then replaced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Union

import msgspec
from fleetscope.analysis.per_rank.cache import PRIVATE_MODE, read_private_file, result_source_files
from fleetscope.analysis.per_rank.hta_native import UnfilteredFrame, frames_by_filter_key, step_filter_key
from fleetscope.analysis.per_rank.hta_rank_views import (
    ENGINE_NATIVE,
    RankViews,
    native_views,
    rank_views,
)
from fleetscope.traces.atomic import write_bytes_atomically
from fleetscope.traces.kineto import read_raw

ENTRY_SUFFIX = ".hta.msgpack"
_FORMAT = b"fleetscope-rank-hta-3"
"""-3: entries also stored by the parse (store_parsed_views), under the step filter's key; -2: plain rows from
either engine (RankViews); -1 held pandas frames of HTA's (RankHta)."""
_CHECKSUM_BYTES = 16
HTA_MODULES = ("fleetscope.analysis.per_rank.hta_rank_views", "fleetscope.analysis.per_rank.hta_rank", __name__)
"""What computes a RankViews (and how it is stored): the key covers them and the fleetscope modules they import."""
Scalar = Union[str, int, float, bool, None]
ENGINE_PARSED = "native, from the parse"
"""The key's engine of views the parse stored (store_parsed_views): keyed by the step filter's key."""


class _Straggler(msgspec.Struct, forbid_unknown_fields=True):
    index: list[int]
    name: list[str]
    ts: list[int | float]
    dur: list[int | float]
    stream: list[int]
    iteration: list[int | float]
    ts_dtype: str
    dur_dtype: str
    iteration_dtype: str


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    rank: int
    tables: dict[str, list[dict[str, Scalar]]]
    errors: dict[str, str]
    straggler_rows: _Straggler | None
    min_ts: int | float
    engine: str
    note: str


def cached_rank_views(path: str | Path, rank: int, step_names: tuple[str, ...] = (),
                      cache_dir: str | None = None, code_digest: str | None = None,
                      engine: str = ENGINE_NATIVE) -> RankViews:
    """rank_views, through the cache in `cache_dir` when given (a directory open_cache accepted).
    `code_digest`: hta_code_digest() when the caller has it (each worker would compute it again)."""
    if cache_dir is None:
        return rank_views(path, rank, step_names, engine=engine)
    raw = read_raw(Path(path))
    entry = _entry(Path(cache_dir), raw, rank, step_names, code_digest, engine)
    cached = _cached(raw, entry, rank, step_names, Path(cache_dir), code_digest, engine)
    if cached is not None:
        return cached
    result = rank_views(path, rank, step_names, raw=raw, engine=engine)
    with contextlib.suppress(OSError, NotImplementedError):  # a cache failure only costs the cache
        write_bytes_atomically(encode_entry(result), entry, mode=PRIVATE_MODE)
    return result


def views_if_cached(path: str | Path, rank: int, step_names: tuple[str, ...], cache_dir: str | Path,
                    code_digest: str | None = None, engine: str = ENGINE_NATIVE) -> RankViews | None:
    """The rank's views when the cache holds them (as cached_rank_views finds them), else None: a miss, or a
    trace that cannot be read here (cached_rank_views then says why). Cheap (one read and one hash of the
    trace's stored bytes), so a caller can find the hits itself and hand only the misses to workers."""
    try:
        raw = read_raw(Path(path))
    except (OSError, ValueError):  # TraceReadError is a ValueError: the worker's path reports it
        return None
    entry = _entry(Path(cache_dir), raw, rank, step_names, code_digest, engine)
    return _cached(raw, entry, rank, step_names, Path(cache_dir), code_digest, engine)


def _entry(cache_dir: Path, raw: bytes, rank: int, step_names: tuple[str, ...], code_digest: str | None,
           engine: str) -> Path:
    return cache_dir / f"{hta_key(raw, rank, step_names, code_digest, engine)}{ENTRY_SUFFIX}"


def _cached(raw: bytes, entry: Path, rank: int, step_names: tuple[str, ...], cache_dir: Path,
            code_digest: str | None, engine: str) -> RankViews | None:
    """The entry computed for these exact step names, or (native engine) the one the parse stored."""
    cached = _load(entry, rank)
    if cached is None and engine == ENGINE_NATIVE:
        cached = _load(_parsed_entry(cache_dir, raw, rank, step_filter_key(step_names), code_digest), rank)
    return cached


def store_parsed_views(cache_dir: str | Path, raw: bytes, rank: int, unfiltered: UnfilteredFrame,
                       code_digest: str | None = None) -> None:
    """Store the native views of the frame the parse built from its own decode of `raw` (rank.DecodedTrace),
    under each step filter key they hold for (hta_native.frames_by_filter_key), so the HTA stage finds them
    without decoding the trace again. Only the parse's views are found this way: views the HTA stage
    computed itself, maybe by HTA's own loader, stay under the exact step names they were computed with."""
    computed: dict[int, bytes] = {}
    for key, frame in frames_by_filter_key(unfiltered).items():
        if id(frame) not in computed:
            try:
                computed[id(frame)] = encode_entry(native_views(frame, rank))
            except NotImplementedError:
                return
        with contextlib.suppress(OSError, NotImplementedError):
            write_bytes_atomically(computed[id(frame)], _parsed_entry(Path(cache_dir), raw, rank, key, code_digest),
                                   mode=PRIVATE_MODE)


def _parsed_entry(cache_dir: Path, raw: bytes, rank: int, filter_key: tuple[str, ...],
                  code_digest: str | None) -> Path:
    return _entry(cache_dir, raw, rank, filter_key, code_digest, ENGINE_PARSED)


def _load(entry: Path, rank: int) -> RankViews | None:
    data = read_private_file(entry)
    cached = decode_entry(data) if data is not None else None
    return cached if cached is not None and cached.rank == rank else None


def hta_key(raw: bytes, rank: int, step_names: tuple[str, ...], code_digest: str | None = None,
            engine: str = ENGINE_NATIVE) -> str:
    digest = hashlib.blake2b(_FORMAT, digest_size=20)
    digest.update((code_digest or hta_code_digest()).encode())
    digest.update(repr((rank, tuple(step_names), engine)).encode())
    digest.update(hashlib.blake2b(raw, digest_size=32).digest())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def hta_code_digest() -> str:
    """The source of the modules that compute a RankViews, and the versions of the libraries doing the work."""
    digest = hashlib.blake2b(digest_size=16)
    for package in ("HolisticTraceAnalysis", "traceinsight", "pandas", "numpy", "msgspec"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            digest.update(f"{package}={importlib.metadata.version(package)}".encode())
    files: dict[str, Path] = {}
    for module in HTA_MODULES:
        files.update(result_source_files(module))
    for name, path in sorted(files.items()):
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def encode_entry(result: RankViews) -> bytes:
    """Checksum + msgpack payload; NotImplementedError for a value the format does not hold (not cached)."""
    try:
        rows = None if result.straggler_rows is None else _Straggler(**result.straggler_rows)
        payload = msgspec.msgpack.encode(_Entry(
            rank=int(result.rank), tables=result.tables, errors=dict(result.errors), straggler_rows=rows,
            min_ts=result.min_ts, engine=result.engine, note=result.note))
    except (TypeError, msgspec.EncodeError) as error:
        raise NotImplementedError(str(error)) from None
    return hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest() + payload


def decode_entry(data: bytes) -> RankViews | None:
    """The RankViews an entry holds, or None when it fails its checksum or does not decode exactly."""
    checksum, payload = data[:_CHECKSUM_BYTES], data[_CHECKSUM_BYTES:]
    if hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest() != checksum:
        return None
    try:
        entry = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, OverflowError, RecursionError):
        return None
    rows = None if entry.straggler_rows is None else msgspec.structs.asdict(entry.straggler_rows)
    return RankViews(rank=entry.rank, tables=entry.tables, errors=entry.errors, straggler_rows=rows,
                     min_ts=entry.min_ts, engine=entry.engine, note=entry.note)


_DECODER = msgspec.msgpack.Decoder(_Entry)
