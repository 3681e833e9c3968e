"""The merge reads the analysis report through its typed dataclasses (report/model.py), never through string keys of
its JSON form; a report.json of another version, or partly wrong, gives a merge with notes, not a traceback."""

from __future__ import annotations

import ast
import dataclasses
import json
import typing
from pathlib import Path

from fleetscope.analysis import analyze
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.verify import verify_merge
from fleetscope.analysis.report.model import Report
from test_critical_path import jumping_path_set

MERGE = Path(__file__).resolve().parents[1] / "analysis" / "merge"
READS_OF_OTHER_DATA: dict[str, frozenset[str]] = {
    # Kineto trace events and their args (trace JSON, not report JSON)
    "plan.py": frozenset({"name"}),
    "event_window.py": frozenset({"name", "device"}),
    # the merged trace read back: annotations of its own slices (verify compares them with the report's figures)
    "expectations.py": frozenset({"window", "step"}),
    "verify.py": frozenset({"step"}),
    # rows of the trace processor's query results
    "perfetto/sql.py": frozenset({"kind"}),
    # the timeline records' numpy fields (traces/timeline.py), not the report's whole_run section
    "whole_run_counters.py": frozenset({"step", "start_us", "step_ms"}),
    # the merge's own per-rank totals (a Counter of what it drew)
    "run.py": frozenset({"overlaps"}),
}
"""Module (under analysis/merge/) -> keys it may read by string that are also report field names: each reads
data other than the report, as said above."""


def report_field_names() -> set[str]:
    """Every field name of the Report dataclass tree, through the field type hints (lists, unions, dicts)."""
    found: set[str] = set()
    seen: set[type] = set()
    pending: list[type] = [Report]
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for item in dataclasses.fields(cls):
            found.add(item.name)
            hints_left = [hints[item.name]]
            while hints_left:
                hint = hints_left.pop()
                if dataclasses.is_dataclass(hint):
                    pending.append(hint)
                hints_left += typing.get_args(hint)
    return found


def string_key_reads(source: str, keys: set[str]) -> list[tuple[int, str]]:
    """(line, key) of each read `x["key"]` and call `x.get("key", ...)` in `source` whose key is in `keys`
    (writes, `x["key"] = ...`, build the merge's own annotations and are not reads)."""
    reads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            key = node.args[0]
        else:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value in keys:
            reads.append((node.lineno, key.value))
    return sorted(reads)


def test_the_report_s_field_names_are_collected_through_the_whole_tree():
    names = report_field_names()
    # top level, a window, a rank of a window, a nested section (critical path segments), a MoE finding
    assert {"windows", "verdict", "stragglers", "host_stalls", "duration_us", "tokens_vs_mean"} <= names


def test_the_scan_finds_string_key_reads_and_not_writes():
    source = 'w = report.get("windows") or []\nx = window["stragglers"]\nnotes["verdict"] = 1\ny = d["not a field"]\n'
    assert string_key_reads(source, report_field_names()) == [(1, "windows"), (2, "stragglers")]


def test_no_module_of_the_merge_reads_the_report_by_string_keys():
    keys = report_field_names()
    found = []
    for path in sorted(MERGE.rglob("*.py")):
        module = path.relative_to(MERGE).as_posix()
        allowed = READS_OF_OTHER_DATA.get(module, frozenset())
        found += [f"{module}:{line}: [{key!r}]" for line, key in string_key_reads(path.read_text(), keys)
                  if key not in allowed]
    assert found == [], "string-key reads of report fields in analysis/merge/ (read the typed Report):\n" + \
        "\n".join(found)


def test_a_report_object_is_used_as_it_is(tmp_path, monkeypatch):
    traces = jumping_path_set(tmp_path / "t")
    report = analyze(traces, use_hta=False, use_cache=False)
    monkeypatch.setattr(Report, "to_json", lambda self: (_ for _ in ()).throw(AssertionError("round trip")))
    result = merge(traces, tmp_path / "merged.perfetto-trace", report=report, use_cache=False)
    assert not result.problems and not result.notes


def test_an_old_partly_wrong_report_json_gives_a_merge_with_notes(tmp_path):
    traces = jumping_path_set(tmp_path / "t")
    data = analyze(traces, use_hta=False, use_cache=False).to_json()
    data["schema_version"] = 0                         # a version this one does not read strictly
    data["verdict"] = ["not", "a", "string"]
    data["windows"][0]["ranks"][0]["steps"][0]["step_time_ms"] = "slow"
    del data["created_at"]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    result = merge(traces, tmp_path / "merged.perfetto-trace", report=path, use_cache=False)
    assert not result.problems and check_trace(result.output).ok
    notes = [note.reason for note in result.notes if note.path == str(path)]
    assert any("schema_version 0" in note for note in notes)
    assert any(note.startswith("analysis report: verdict: expected str") for note in notes)
    assert any("windows[0].ranks[0].steps[0].step_time_ms" in note and "item left out" in note for note in notes)
    assert any("created_at: missing" in note for note in notes)


def test_a_field_of_the_wrong_type_leaves_the_other_overlays(tmp_path):
    traces = jumping_path_set(tmp_path / "t")
    report = analyze(traces, use_hta=False, use_cache=False)
    assert report.windows[0].critical_path.steps, "the set's report has a critical path to draw"
    data = report.to_json()
    data["ranks"] = "not a list"                        # the rank summaries: left out, with a note
    whole = merge(traces, tmp_path / "whole.perfetto-trace", report=report, use_cache=False)
    partial = merge(traces, tmp_path / "partial.perfetto-trace", report=data, use_cache=False)
    assert [note.reason for note in partial.notes] == ["analysis report: ranks: expected a list, got str; "
                                                       "left at its default"]
    assert verify_merge(partial) == [] and not partial.problems

    def analysis_marks(output: Path) -> dict[str, int]:
        check = check_trace(output)
        names: dict[str, int] = {}
        for instant in check.instants:
            if check.tracks[instant.track_uuid].name == "fleetscope analysis":
                names[instant.name] = names.get(instant.name, 0) + 1
        path_slices = sum(1 for s in check.slices if check.tracks[s.track_uuid].name.startswith("critical path"))
        return {**names, "critical path slices": path_slices}

    expected = analysis_marks(whole.output)
    assert expected.pop("rank summary") == len(report.ranks) and expected["critical path slices"] > 0
    assert analysis_marks(partial.output) == expected


def test_a_report_json_that_is_no_report_is_a_problem_not_an_error(tmp_path):
    traces = jumping_path_set(tmp_path / "t")
    for text in ("[1, 2]", "{not json"):
        path = tmp_path / "report.json"
        path.write_text(text)
        result = merge(traces, tmp_path / "merged.perfetto-trace", report=path, use_cache=False)
        assert [p.reason.split(":")[0] for p in result.problems] == ["analysis report not used"], text
