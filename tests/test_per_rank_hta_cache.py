"""The cache of HTA's per-rank views: a second run reads every HTA rank from it with the same tables,
and an entry that is damaged, foreign, writable by others, a link or of another shape is a miss that is
computed again and replaced. Runs on real H200 kernels (synthetic ranks made from the fixture)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.cross_rank.hta_views import run_hta
from fleetscope.analysis.per_rank.cache import ENTRY_SUFFIX as RANK_SUFFIX, open_cache
from fleetscope.analysis.per_rank.hta_cache import ENTRY_SUFFIX, decode_entry, encode_entry
from fleetscope.analysis.per_rank.hta_rank_views import ENGINE_HTA, rank_views
from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set
from fleetscope.traces.layout import RunLayout

pytest.importorskip("hta")

SOURCE = Path(__file__).resolve().parent / "fixtures" / "gpu" / "h200-small-hf-eager-2steps.json.gz"
SPEC = TraceSetSpec(ranks=3, ranks_per_host=2, late_rank=2, late_us=300.0, inserted_allreduce_us=5000.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[int, Path]:
    paths = make_trace_set(SOURCE, tmp_path_factory.mktemp("traces"), SPEC)
    return dict(enumerate(paths))


@pytest.fixture
def cache(tmp_path) -> Path:
    directory, why_not = open_cache(tmp_path / "cache")
    assert why_not is None
    return directory.directory


def _entries(cache: Path) -> dict[str, int]:
    """entry name -> inode: a miss writes a new file in the entry's place (a new inode)."""
    return {p.name: p.stat().st_ino for p in sorted(cache.glob(f"*{ENTRY_SUFFIX}"))}


def _views(files, cache):
    return run_hta(files, has_comm_kernels=True, workers=1, cache_dir=cache)


def test_a_second_run_reads_every_rank_from_the_cache_with_the_same_tables(files, cache):
    cold = _views(files, cache)
    written = _entries(cache)
    assert cold.status == "ok" and "potential_stragglers" in cold.tables
    assert len(written) == len(files)
    warm = _views(files, cache)
    assert _entries(cache) == written  # every rank a hit: nothing rewritten
    assert warm == cold
    assert _views(files, None) == cold  # and the same as without a cache


@pytest.mark.parametrize("engine", ["native", ENGINE_HTA])
def test_an_entry_decodes_to_the_same_views(engine):
    result = rank_views(SOURCE, 0, engine=engine)
    assert result.tables and result.straggler_rows
    assert decode_entry(encode_entry(result)) == result


def _tampered_entries_are_misses(files, cache, tamper) -> None:
    expected = _views(files, cache)
    before = _entries(cache)
    for name in before:
        tamper(cache / name)
    assert _views(files, cache) == expected
    after = _entries(cache)
    assert sorted(after) == sorted(before) and all(after[n] != before[n] for n in before)  # each replaced
    for name in after:
        entry = cache / name
        assert entry.is_file() and not entry.is_symlink() and entry.stat().st_uid == os.getuid()
        assert not entry.stat().st_mode & 0o022


def _flip_last_byte(entry: Path) -> None:
    data = entry.read_bytes()
    entry.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))


def _wrong_shape(entry: Path) -> None:
    import hashlib

    payload = msgspec.msgpack.encode({"rank": 0, "tables": {"x": [{"a": b"\x80\x04N."}]},
        "errors": {}, "straggler_rows": None, "min_ts": 0, "engine": "native", "note": ""})
    entry.write_bytes(hashlib.blake2b(payload, digest_size=16).digest() + payload)


def _symlinked(entry: Path) -> None:
    planted = entry.with_name("planted")
    planted.write_bytes(entry.read_bytes())
    entry.unlink()
    entry.symlink_to(planted)


@pytest.mark.parametrize("tamper", [
    _flip_last_byte,
    lambda entry: entry.write_bytes(os.urandom(500)),
    lambda entry: entry.chmod(0o666),
    _wrong_shape,
    _symlinked,
], ids=["flipped-bit", "garbage", "writable-by-others", "object-dtype", "symlink"])
def test_a_damaged_or_unsafe_entry_is_a_miss_and_is_replaced(files, cache, tamper):
    _tampered_entries_are_misses(files, cache, tamper)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_an_entry_owned_by_another_user_is_a_miss_and_is_replaced(files, cache):
    _tampered_entries_are_misses(files, cache, lambda entry: os.chown(entry, 12345, 12345))


def test_other_step_names_or_other_bytes_are_other_entries(files, cache, tmp_path):
    one = {0: files[0]}
    run_hta(one, has_comm_kernels=False, workers=1, cache_dir=cache)
    run_hta(one, has_comm_kernels=False, workers=1, cache_dir=cache, step_names=("ProfilerStep#9",))
    assert len(_entries(cache)) == 2
    changed = tmp_path / "rank0.json.gz"
    changed.write_bytes(files[0].read_bytes() + b"\0")  # gzip padding: the same trace, other bytes
    run_hta({0: changed}, has_comm_kernels=False, workers=1, cache_dir=cache)
    assert len(_entries(cache)) == 3


def test_a_second_analyze_reads_hta_and_parse_results_from_the_cache(files, tmp_path):
    layout = RunLayout.at(tmp_path / "run")
    for rank, path in files.items():
        target = layout.trace_file(0, rank, f"node{rank // 2}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    cache = tmp_path / "cache"
    first = analyze(layout.root, cache_dir=cache, write_default_outputs=False)
    written = {p.name: p.stat().st_ino for p in cache.iterdir()}
    # the parse stores each rank's views for both outcomes of HTA's step filter
    assert sum(name.endswith(ENTRY_SUFFIX) for name in written) == 2 * len(files)
    assert sum(name.endswith(RANK_SUFFIX) for name in written) == len(files)
    second = analyze(layout.root, cache_dir=cache, write_default_outputs=False)
    assert {p.name: p.stat().st_ino for p in cache.iterdir()} == written
    assert [w.hta for w in second.windows] == [w.hta for w in first.windows]
    assert all(w.hta is not None and w.hta.status == "ok" for w in second.windows)


def test_hta_runs_with_sigterms_default_action_and_the_programs_handler_comes_back():
    # HTA ends its forked parse pool with SIGTERM: a worker that inherited a handler that does not exit (a
    # trainer's stop flag, TorchX's local scheduler's) can outlive Pool.terminate and hang the load for ever
    import signal
    from fleetscope.analysis.per_rank.hta_rank import quietly

    def keep_going(*_):
        pass

    previous = signal.signal(signal.SIGTERM, keep_going)
    try:
        assert quietly(lambda: signal.getsignal(signal.SIGTERM)) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is keep_going
    finally:
        signal.signal(signal.SIGTERM, previous)
