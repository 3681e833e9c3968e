"""traces/timeline.py: the whole-run timeline's writer and reader, and what they do with damaged files."""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest

from fleetscope.traces.timeline import (
    FLAG_FIRST,
    FLAG_PROFILED,
    FLUSH_EVERY,
    HEADER,
    TIMELINE_DTYPE,
    TimelineWriter,
    read_timeline,
)

START_US = 1.7e15


def write_steps(path, rank, steps, *, step_ms=10.0):
    writer = TimelineWriter(path, rank)
    for step in steps:
        writer.append(step=step, start_us=START_US + step * step_ms * 1000, step_ms=step_ms, data_ms=1.0,
                      profiled=step in (5, 6), first=step == 0)
    writer.close()


def test_records_round_trip_with_their_flags_and_unknowns(tmp_path):
    path = tmp_path / "rank3.timeline"
    write_steps(path, 3, range(FLUSH_EVERY * 2 + 5))
    timeline = read_timeline(path, expected_rank=3)
    records = timeline.records
    assert timeline.rank == 3 and not timeline.problems
    assert list(records["step"]) == list(range(FLUSH_EVERY * 2 + 5))
    assert records["flags"][0] == FLAG_FIRST and records["flags"][5] == FLAG_PROFILED and records["flags"][7] == 0
    assert records["start_us"][1] - records["start_us"][0] == pytest.approx(10_000.0)
    assert np.isnan(records["first_collective_ms"]).all() and np.isnan(records["exposed_comm_ms"]).all()
    assert os.path.getsize(path) == HEADER.size + len(records) * TIMELINE_DTYPE.itemsize


def test_a_resumed_process_appends_after_the_steps_already_there(tmp_path):
    path = tmp_path / "rank0.timeline"
    write_steps(path, 0, range(10))
    write_steps(path, 0, range(10, 20))
    assert list(read_timeline(path).records["step"]) == list(range(20))


@pytest.mark.parametrize("cut", [1, 5, 13, 17, 24, 31])
def test_a_record_cut_by_a_crash_is_left_out_and_later_appends_stay_aligned(tmp_path, cut):
    path = tmp_path / "rank0.timeline"
    write_steps(path, 0, range(10))
    path.write_bytes(path.read_bytes()[:-cut])
    cut_alone = read_timeline(path)
    assert any("partial last record" in p for p in cut_alone.problems)
    assert list(cut_alone.records["step"]) == list(range(9))
    write_steps(path, 0, [10, 11])
    steps = list(read_timeline(path).records["step"])
    # the cut record is either whole up to its unknown last fields (kept) or left out, never misread
    assert steps in (list(range(12)), [*range(9), 10, 11])


def test_impossible_values_are_left_out_and_named(tmp_path):
    path = tmp_path / "rank0.timeline"
    writer = TimelineWriter(path, 0)
    writer.append(step=0, start_us=START_US, step_ms=10.0)
    writer.append(step=1, start_us=START_US, step_ms=-3.0)
    writer.append(step=2, start_us=math.inf, step_ms=10.0)
    writer.append(step=3, start_us=START_US, step_ms=10.0, data_ms=50.0)
    writer.append(step=4, start_us=START_US, step_ms=1e12)
    writer.append(step=5, start_us=START_US, step_ms=10.0, first_collective_ms=4.0, exposed_comm_ms=2.0)
    writer.append(step=6, start_us=-1e15, step_ms=10.0)   # before 1970
    writer.append(step=7, start_us=1e300, step_ms=10.0)   # no int64 of ns holds it
    writer.close()
    timeline = read_timeline(path)
    assert list(timeline.records["step"]) == [0, 5]
    assert timeline.problems == ["rank0.timeline: 6 record(s) with impossible values left out (first: record 1, step 1)"]


def test_another_ranks_file_is_neither_appended_to_nor_read_as_this_rank(tmp_path):
    path = tmp_path / "rank1.timeline"
    write_steps(path, 2, range(3))
    with pytest.raises(ValueError, match="written by rank 2, its name says rank 1: not appended to"):
        TimelineWriter(path, 1)
    with pytest.raises(ValueError, match="written by rank 2, its name says rank 1"):
        read_timeline(path, expected_rank=1)


@pytest.mark.parametrize("content, reason", [(b"", "shorter than"), (b"x" * 40, "bad magic"),
                                             (b"FSTLINE1" + (16).to_bytes(4, "little") + bytes(20), "record size 16")])
def test_a_file_that_is_not_a_timeline_is_refused_with_the_reason(tmp_path, content, reason):
    path = tmp_path / "rank0.timeline"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=reason):
        read_timeline(path)


def test_a_symlink_out_of_the_run_and_a_fifo_are_refused_without_being_opened(tmp_path):
    outside = tmp_path / "outside.timeline"
    write_steps(outside, 0, range(3))
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    link = run / "metrics" / "rank0.timeline"
    link.symlink_to(outside)
    with pytest.raises(ValueError, match="outside"):
        read_timeline(link, within=run)
    fifo = run / "metrics" / "rank1.timeline"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="FIFO"):
        read_timeline(fifo, within=run)
    with pytest.raises(OSError):
        TimelineWriter(link, 0)  # never written through a symlink


class _Waited(Exception):
    pass


def test_the_writer_refuses_a_fifo_at_once_rather_than_waiting_for_a_reader(tmp_path):
    fifo = tmp_path / "rank0.timeline"
    os.mkfifo(fifo)

    def waited(*_):
        raise _Waited

    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(5)
    try:
        with pytest.raises((OSError, ValueError)):
            TimelineWriter(fifo, 0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_sparse_file_of_a_huge_size_is_read_up_to_the_bound(tmp_path, monkeypatch):
    """A timeline claiming a terabyte (mostly holes) costs what the bound allows, not the file's size: the records
    past it are named as left out, the holes (zero records) as impossible values."""
    from fleetscope.traces import timeline as module

    monkeypatch.setattr(module, "MAX_TIMELINE_RECORDS", 1 << 16)
    monkeypatch.setattr(module, "VALIDATE_CHUNK", 1 << 12)
    path = tmp_path / "rank0.timeline"
    write_steps(path, 0, range(10))
    with open(path, "r+b") as handle:
        handle.truncate(1 << 40)
    timeline = read_timeline(path, expected_rank=0)
    assert list(timeline.records["step"]) == list(range(10))
    assert any("the rest left out" in problem for problem in timeline.problems)
    assert any("impossible values" in problem for problem in timeline.problems)
