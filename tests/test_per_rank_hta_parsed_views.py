"""HTA's frame from fleetscope's own decode (one inflate, one decode per trace) equals its own decode's,
under every step filter key, and the HTA stage finds the views the parse stored instead of decoding again."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import hta_parity_traces

from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.per_rank.hta_cache import ENTRY_SUFFIX
from fleetscope.analysis.per_rank.events import decode_selectively
from fleetscope.analysis.per_rank.hta_native import (
    FILTERED,
    NotComputable,
    decode_rank_frame,
    frames_by_filter_key,
    parsed_columns,
    step_filter_key,
    unfiltered_frame,
)

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"
TRACES = hta_parity_traces(GPU)
COLUMNS = ("index", "cat", "name", "ts", "dur", "end", "stream", "correlation", "index_correlation", "iteration")
STEP_NAMES_OF_KEY = {FILTERED: ("ProfilerStep#900", "ProfilerStep#901"), (): ()}


def _assert_same_frame(mine, theirs) -> None:
    assert mine.symbols == theirs.symbols and mine.min_ts == theirs.min_ts
    for column in COLUMNS:
        a, b = getattr(mine, column), getattr(theirs, column)
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), column


def _shared_frames(data: bytes):
    _, events = decode_selectively(data)
    return frames_by_filter_key(unfiltered_frame(parsed_columns(events)))


@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(GPU)))
def test_the_frame_from_fleetscopes_decode_equals_the_own_decodes_under_every_filter_key(path):
    data = gzip.decompress(path.read_bytes())
    for key, frame in _shared_frames(data).items():
        step_names = STEP_NAMES_OF_KEY.get(key, key)
        assert step_filter_key(step_names) == key
        _assert_same_frame(frame, decode_rank_frame(data, step_names))


def _document(events: list[dict]) -> bytes:
    return json.dumps({"traceEvents": events}).encode()


def test_missing_values_take_htas_defaults_and_explicit_nulls_are_not_computable():
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "ts": 1, "dur": 50, "args": {"correlation": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "no dur", "ts": 2},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 3, "dur": 2, "args": {"stream": 7, "correlation": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "no args", "ts": 4, "dur": 1},
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 2.5, "id": 7},
        {"ph": "M", "name": "thread_name", "args": {"name": "python"}},
    ]
    data = _document(events)
    _assert_same_frame(_shared_frames(data)[()], decode_rank_frame(data))
    events[3]["args"] = {"stream": None}
    for decode in (lambda: _shared_frames(_document(events)), lambda: decode_rank_frame(_document(events))):
        with pytest.raises(NotComputable):
            decode()


def test_a_row_of_another_phase_is_left_to_htas_stage():
    data = _document([{"ph": "X", "cat": "kernel", "name": "k", "ts": 3, "dur": 2, "args": {"stream": 7}},
                      {"ph": "b", "cat": "async", "name": "span", "ts": 1, "dur": 4}])
    _, events = decode_selectively(data)
    with pytest.raises(NotComputable):
        parsed_columns(events)


def test_the_hta_stage_reads_the_views_the_parse_stored(tmp_path):
    run = GPU / "planted_pairs"
    shared = analyze(run, write_default_outputs=False, cache_dir=tmp_path / "shared")
    entries = sorted((tmp_path / "shared").rglob("*" + ENTRY_SUFFIX))
    own = analyze(run, write_default_outputs=False, cache_dir=tmp_path / "own", hta_ranks=[0, 1, 2, 3])
    # the stage computed nothing itself (it would have stored one entry a rank under its own key)
    assert len(entries) == 2 * 4
    assert {w.hta.status for w in shared.windows} == {"ok"}
    assert [(w.hta.status, w.hta.tables, w.hta.errors) for w in shared.windows] == [
        (w.hta.status, w.hta.tables, w.hta.errors) for w in own.windows]


class _NoWorkers:
    def __init__(self, *args, **kwargs):
        raise AssertionError("HTA's stage started workers for views the cache holds")


def test_views_the_cache_holds_are_read_without_starting_workers(tmp_path, monkeypatch):
    import fleetscope.analysis.cross_rank.hta_views as hta_views

    run = GPU / "planted_pairs"
    started = []
    monkeypatch.setattr(hta_views, "ProcessPoolExecutor", _NoWorkers)
    monkeypatch.setattr(hta_views.multiprocessing.forkserver, "ensure_running", lambda: started.append(1))
    progress = []
    report = analyze(run, write_default_outputs=False, cache_dir=tmp_path / "cache", hta_ranks="all",
                     hta_progress=lambda done, total: progress.append((done, total)))
    assert {w.hta.status for w in report.windows} == {"ok"} and not started
    assert progress and all(done == total for done, total in progress)
    # a rank the cache lacks is still computed, by workers
    monkeypatch.undo()
    missing = sorted((tmp_path / "cache").rglob("*" + ENTRY_SUFFIX))[0]
    missing.unlink()
    again = analyze(run, write_default_outputs=False, cache_dir=tmp_path / "cache", hta_ranks="all")
    assert [(w.hta.tables, w.hta.errors) for w in again.windows] == [(w.hta.tables, w.hta.errors)
                                                                   for w in report.windows]


def test_a_trace_that_cannot_be_read_is_a_miss_for_the_workers_to_report(tmp_path):
    from fleetscope.analysis.per_rank.hta_cache import views_if_cached

    (tmp_path / "cache").mkdir()
    not_gzip = tmp_path / "rank0.json.gz"
    not_gzip.write_bytes(b"not a trace")
    assert views_if_cached(tmp_path / "missing.json", 0, (), tmp_path / "cache") is None
    assert views_if_cached(not_gzip, 0, (), tmp_path / "cache") is None
    link = tmp_path / "rank1.json.gz"
    link.symlink_to(not_gzip)
    assert views_if_cached(link, 1, (), tmp_path / "cache") is None
