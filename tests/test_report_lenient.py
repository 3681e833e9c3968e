"""Report.from_json_lenient: what parses of a report written by another version or by hand, a note per field that
did not; strict from_json unchanged."""

from __future__ import annotations

import pytest

from fleetscope.analysis.report.model import Report

BASE = {"schema_version": 2, "created_at": "t", "source_path": "p", "source_kind": "trace_dir", "world_size": 2,
        "complete": True}
SEGMENT = {"kind": "compute", "rank": 1, "collective": "c #0", "start_us": 0.0, "duration_us": 1.0, "share": 1.0}


def window(**fields) -> dict:
    return {"window": 0, "steps": [], "ranks": [], "clock": {}, "stragglers": {}, "top_kernels": [],
            "hta": {"status": "skipped"}, **fields}


def test_a_whole_report_reads_as_strictly_with_no_notes():
    data = {**BASE, "windows": [window(critical_path={"steps": [{"step": 1, "length_us": 1.0, "segments": [SEGMENT]}]})]}
    assert Report.from_json_lenient(data) == (Report.from_json(data), [])


def test_a_mistyped_field_takes_its_default_and_a_bad_item_is_left_out_each_with_a_note():
    bad_segment = {**SEGMENT, "rank": "one"}
    data = {**BASE, "verdict": 7, "windows": [window(critical_path={"steps": [
        {"step": 1, "length_us": 1.0, "segments": [SEGMENT, bad_segment]}]}), "junk"]}
    report, notes = Report.from_json_lenient(data)
    assert report.verdict == "" and len(report.windows) == 1
    assert [s.rank for s in report.windows[0].critical_path.steps[0].segments] == [1]
    assert notes == ["verdict: expected str, got int; left at its default",
                     "windows[0].critical_path.steps[0].segments[1].rank: expected int, got str; item left out",
                     "windows[1]: expected an object, got str; item left out"]
    with pytest.raises(TypeError):
        Report.from_json(data)


def test_a_missing_number_is_not_invented_a_missing_string_or_section_is_empty():
    report, notes = Report.from_json_lenient({**BASE, "windows": [{"window": 0}], "ranks": [{"host": "h"}]})
    assert report.ranks == [] and "ranks[0].rank: missing; item left out" in notes
    (only,) = report.windows
    assert only.steps == [] and only.stragglers.waited_for_rank is None
    assert "windows[0].stragglers: missing; read as an empty section" in notes


def test_an_unknown_schema_version_is_read_with_a_note_and_refused_strictly():
    report, notes = Report.from_json_lenient({**BASE, "schema_version": 99, "verdict": "v"})
    assert report.verdict == "v" and notes[0].startswith("schema_version 99 is not one this version reads")
    with pytest.raises(ValueError, match="schema_version 99"):
        Report.from_json({**BASE, "schema_version": 99})


def test_no_object_at_all_is_refused():
    with pytest.raises(ValueError, match="expected an object"):
        Report.from_json_lenient([BASE])
