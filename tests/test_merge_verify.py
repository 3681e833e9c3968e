"""verify_merge, and the optional trace processor checks (skipped without a trace_processor_shell)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.verify import expected_slices_by_process, verify_merge
from fleetscope.analysis.merge.perfetto.sql import check_with_trace_processor, slices_by_process
from test_merge import gpu_rank_events, kineto_document, write_trace

TRACE_PROCESSOR = os.environ.get("FLEETSCOPE_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")


@pytest.fixture
def merged(tmp_path: Path):
    for rank in (0, 1):
        write_trace(tmp_path / "t" / f"rank{rank}.json",
                    kineto_document(rank, gpu_rank_events(shift_us=3.0 * rank), host=f"n{rank}"))
    return merge(tmp_path / "t", tmp_path / "out.perfetto-trace")


def test_a_sound_merge_verifies(merged):
    assert verify_merge(merged) == []
    assert list(expected_slices_by_process(merged)) == ["rank 0 (n0)", "rank 1 (n1)"]


def test_a_damaged_output_does_not_verify(merged):
    data = merged.output.read_bytes()
    merged.output.write_bytes(data[: len(data) // 2 + 1])
    with pytest.raises(ValueError):
        verify_merge(merged)


def test_an_output_missing_a_rank_does_not_verify(merged, tmp_path):
    rank0_only = merge(tmp_path / "t" / "rank0.json", tmp_path / "r0.perfetto-trace")
    merged.output.write_bytes(rank0_only.output.read_bytes())
    problems = verify_merge(merged)
    assert any("processes" in p for p in problems) and any("rank 1 (n1): 0 slices" in p for p in problems)


def test_slices_are_counted_per_process_through_track_parents():
    slices = [{"track_id": 11, "slices": 5}, {"track_id": 12, "slices": 2}, {"track_id": 30, "slices": 9}]
    tracks = [{"id": 10, "parent_id": None}, {"id": 11, "parent_id": 10}, {"id": 12, "parent_id": 11},
              {"id": 30, "parent_id": None}]
    assert slices_by_process(slices, tracks, [{"id": 10, "upid": 1}], [{"upid": 1, "name": "rank 0 (n0)"}]) == {
        "rank 0 (n0)": 7}


@pytest.mark.skipif(TRACE_PROCESSOR is None, reason="no trace_processor_shell (set FLEETSCOPE_TRACE_PROCESSOR)")
def test_trace_processor_sees_what_the_merge_wrote(merged):
    check = check_with_trace_processor(merged.output, TRACE_PROCESSOR, expected_slices=expected_slices_by_process(merged))
    assert check.ok, check.problems
    assert check.flow_count >= 4
