"""A cache of HTA's per-rank views (RankHta), so analyzing a run again does not run HTA's analyzers again.

It lives in the parsed-trace cache's directory (per_rank/cache.py: same location, same directory checks,
made by `open_cache`) as its own kind of entry (`*.hta.msgpack`), under the same safety rules:
  - found by the trace file's content (a BLAKE2b digest of its stored bytes), the rank and the window's
    ProfilerStep names it was computed with, the versions of HTA, pandas and numpy, and a digest of the
    source of every fleetscope module that computes a RankHta (hta_rank.py and what it imports, and
    this module): another HTA, another fleetscope, other bytes are all misses;
  - an entry is a checksum and a msgpack document of plain columns (numbers as dtype + raw bytes from a
    short list of dtypes, strings as lists): decoding builds DataFrames from those and nothing else, no
    pickle, so a planted entry can at worst be a wrong table for identical bytes, never code;
  - read without following links, only when it is a regular file of ours that nobody else can write
    (cache.read_private_file); written atomically. Any failed check or damage is a miss, then replaced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any, Union

import msgspec
import numpy as np

from fleetscope.analysis.per_rank.cache import read_private_file, result_source_files
from fleetscope.analysis.per_rank.hta_rank import RankHta, rank_hta
from fleetscope.traces.atomic import write_bytes_atomically
from fleetscope.traces.kineto import read_raw

ENTRY_SUFFIX = ".hta.msgpack"
_FORMAT = b"fleetscope-rank-hta-1"
_CHECKSUM_BYTES = 16
HTA_MODULES = ("fleetscope.analysis.per_rank.hta_rank", __name__)
"""What computes a RankHta (and how it is stored): the key covers them and the fleetscope modules they import."""
_NUMERIC_DTYPES = frozenset({"<f8", "<f4", "<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1", "|b1"})
_TEXT_DTYPES = frozenset({"str", "object"})
Scalar = Union[str, int, float, bool, None]


class _Column(msgspec.Struct, forbid_unknown_fields=True):
    name: Union[str, None]
    dtype: str
    data: Union[bytes, None] = None
    """Numeric columns: the raw little-endian values."""
    values: Union[list[Scalar], None] = None
    """Text columns: the values (missing ones as None)."""


class _Frame(msgspec.Struct, forbid_unknown_fields=True):
    rows: int
    columns: list[_Column]
    index: Union[_Column, None] = None
    """None: a RangeIndex 0..rows."""


class _View(msgspec.Struct, forbid_unknown_fields=True):
    pair: bool
    """HTA returns some views as a (frame, frame or None) pair."""
    parts: list[Union[_Frame, None]]


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    rank: int
    frames: dict[str, _View]
    errors: dict[str, str]
    straggler_rows: Union[_Frame, None]
    min_ts: Union[int, float]
    loader: str


def cached_rank_hta(path: str | Path, rank: int, step_names: tuple[str, ...] = (),
                    cache_dir: str | None = None, code_digest: str | None = None) -> RankHta:
    """rank_hta, through the cache in `cache_dir` when given (a directory open_cache accepted).
    `code_digest`: hta_code_digest() when the caller has it (each worker would compute it again)."""
    if cache_dir is None:
        return rank_hta(path, rank, step_names)
    raw = read_raw(Path(path))
    entry = Path(cache_dir) / f"{hta_key(raw, rank, step_names, code_digest)}{ENTRY_SUFFIX}"
    data = read_private_file(entry)
    cached = decode_entry(data) if data is not None else None
    if cached is not None and cached.rank == rank:
        return cached
    result = rank_hta(path, rank, step_names, raw=raw)
    with contextlib.suppress(OSError, NotImplementedError):  # a cache failure only costs the cache
        write_bytes_atomically(encode_entry(result), entry)
    return result


def hta_key(raw: bytes, rank: int, step_names: tuple[str, ...], code_digest: str | None = None) -> str:
    digest = hashlib.blake2b(_FORMAT, digest_size=20)
    digest.update((code_digest or hta_code_digest()).encode())
    digest.update(repr((rank, tuple(step_names))).encode())
    digest.update(hashlib.blake2b(raw, digest_size=32).digest())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def hta_code_digest() -> str:
    """The source of the modules that compute a RankHta, and the versions of the libraries doing the work."""
    digest = hashlib.blake2b(digest_size=16)
    for package in ("HolisticTraceAnalysis", "pandas", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            digest.update(f"{package}={importlib.metadata.version(package)}".encode())
    files: dict[str, Path] = {}
    for module in HTA_MODULES:
        files.update(result_source_files(module))
    for name, path in sorted(files.items()):
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# --- encoding -----------------------------------------------------------------------------------------


def encode_entry(result: RankHta) -> bytes:
    """Checksum + msgpack payload; NotImplementedError for a value the format does not hold (not cached)."""
    entry = _Entry(
        rank=int(result.rank),
        frames={name: _view(value) for name, value in result.frames.items()},
        errors={str(k): str(v) for k, v in result.errors.items()},
        straggler_rows=None if result.straggler_rows is None else _frame(result.straggler_rows),
        min_ts=_number(result.min_ts),
        loader=str(result.loader),
    )
    payload = msgspec.msgpack.encode(entry)
    return hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest() + payload


def _view(value: Any) -> _View:
    if isinstance(value, tuple):
        return _View(pair=True, parts=[None if part is None else _frame(part) for part in value])
    return _View(pair=False, parts=[_frame(value)])


def _frame(frame) -> _Frame:
    import pandas as pd

    if not isinstance(frame, pd.DataFrame) or frame.columns.nlevels != 1:
        raise NotImplementedError("not a flat DataFrame")
    index = frame.index
    plain_range = isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1 and index.name is None
    return _Frame(rows=len(frame), columns=[_column(frame[name], name) for name in frame.columns],
                  index=None if plain_range else _column(index.to_series(), index.name))


def _column(series, name: Any) -> _Column:
    if name is not None and not isinstance(name, str):
        raise NotImplementedError("a column name that is not text")
    dtype = str(series.dtype)
    if dtype in _TEXT_DTYPES:
        values = series.tolist()
        if dtype == "str":  # pandas' text dtype holds a missing value as NaN
            values = [None if _missing(v) else v for v in values]
        if not all(v is None or isinstance(v, (str, int, float, bool)) for v in values):
            raise NotImplementedError("an object column of other values")
        return _Column(name=name, dtype=dtype, values=values)
    array = np.asarray(series.to_numpy())
    if array.dtype.str not in _NUMERIC_DTYPES:
        raise NotImplementedError(f"dtype {array.dtype}")
    return _Column(name=name, dtype=array.dtype.str, data=np.ascontiguousarray(array).tobytes())


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def _number(value: Any) -> int | float:
    value = value.item() if hasattr(value, "item") else value
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise NotImplementedError("min_ts is not a number")
    return value


# --- decoding -----------------------------------------------------------------------------------------


def decode_entry(data: bytes) -> RankHta | None:
    """The RankHta an entry holds, or None when it fails its checksum or does not decode exactly."""
    checksum, payload = data[:_CHECKSUM_BYTES], data[_CHECKSUM_BYTES:]
    if hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest() != checksum:
        return None
    try:
        entry = _DECODER.decode(payload)
        return RankHta(rank=entry.rank, frames={name: _unview(view) for name, view in entry.frames.items()},
                       errors=dict(entry.errors),
                       straggler_rows=None if entry.straggler_rows is None else _unframe(entry.straggler_rows),
                       min_ts=np.int64(entry.min_ts) if isinstance(entry.min_ts, int) else np.float64(entry.min_ts),
                       loader=entry.loader)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, OverflowError, RecursionError):
        return None


_DECODER = msgspec.msgpack.Decoder(_Entry)


def _unview(view: _View) -> Any:
    parts = [None if part is None else _unframe(part) for part in view.parts]
    if view.pair:
        if len(parts) != 2 or parts[0] is None:
            raise ValueError("damaged pair")
        return tuple(parts)
    if len(parts) != 1 or parts[0] is None:
        raise ValueError("damaged view")
    return parts[0]


def _unframe(frame: _Frame):
    import pandas as pd

    if frame.rows < 0:
        raise ValueError("negative row count")
    index = pd.RangeIndex(frame.rows) if frame.index is None else pd.Index(_values(frame.index, frame.rows),
                                                                             name=frame.index.name)
    columns = {}
    for column in frame.columns:
        if column.name in columns:
            raise ValueError("a column twice")
        columns[column.name] = pd.Series(_values(column, frame.rows), index=index, name=column.name)
    return pd.DataFrame(columns, index=index, columns=[c.name for c in frame.columns])


def _values(column: _Column, rows: int):
    import pandas as pd

    if column.dtype in _TEXT_DTYPES:
        if column.values is None or len(column.values) != rows:
            raise ValueError("damaged text column")
        return pd.array(column.values, dtype=column.dtype) if column.dtype == "str" else \
            np.array(column.values, dtype=object)
    if column.dtype not in _NUMERIC_DTYPES or column.data is None:
        raise ValueError("damaged numeric column")
    values = np.frombuffer(column.data, dtype=np.dtype(column.dtype))  # never unpickles
    if len(values) != rows:
        raise ValueError("a column of another length")
    return values.copy()
