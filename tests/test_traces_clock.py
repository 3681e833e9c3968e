"""The clock-offset estimate and its file (the multi-process measurement runs in test_e2e_analysis_real.py)."""

import pytest

from fleetscope.traces.clock import ClockOffset, RoundTrip, best_estimate, read_clock_offsets, write_clock_offset
from fleetscope.traces.layout import RunLayout


def test_the_shortest_round_trip_wins():
    samples = [
        RoundTrip(sent_ns=1_000, reference_ns=900_000, received_ns=2_000_000),     # slow: wide bound
        RoundTrip(sent_ns=5_000_000, reference_ns=4_037_500, received_ns=5_100_000),  # 100 us round trip
        RoundTrip(sent_ns=9_000_000, reference_ns=8_000_000, received_ns=9_300_000),
    ]
    offset = best_estimate(samples, rank=3, host="b", measured_at_ns=1)
    assert offset.best_round_trip_us == 100.0
    assert offset.uncertainty_us == 50.0
    assert offset.offset_us == pytest.approx((5_000_000 + 5_100_000) / 2000 - 4_037.5)
    assert offset.round_trips == 3


def test_clock_jumps_and_empty_measurements_are_refused():
    with pytest.raises(ValueError, match="no round trips"):
        best_estimate([], rank=1, host="h", measured_at_ns=0)
    with pytest.raises(ValueError, match="backwards"):
        best_estimate([RoundTrip(sent_ns=10, reference_ns=5, received_ns=3)], rank=1, host="h", measured_at_ns=0)


def test_clock_files_round_trip_and_bad_ones_are_named(tmp_path):
    layout = RunLayout.at(tmp_path)
    offset = ClockOffset(rank=2, offset_us=37_000.5, uncertainty_us=40.0, best_round_trip_us=80.0, round_trips=16,
                         host="node1", measured_at_ns=123)
    write_clock_offset(offset, layout.clock_file(2))
    layout.clock_file(3).write_text("{not json")
    offsets, problems = read_clock_offsets(layout)
    assert offsets == {2: offset}
    assert len(problems) == 1 and problems[0].startswith("clock/rank3.json: unreadable clock file")
