"""Checking a merge's output against what the merge says it wrote (for tests, the CLI and users).

`verify_merge(result)` reads the Perfetto trace back (perfetto_check.py: nesting, interning, flows)
and compares its processes and per-process slice counts with the `MergeResult`; with
`trace_processor=PATH` it also loads the trace in Perfetto's trace processor (perfetto_sql.py).
"""

from __future__ import annotations

from pathlib import Path

from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.perfetto.sql import check_with_trace_processor
from fleetscope.analysis.merge.run import MergeResult


def verify_merge(result: MergeResult, *, trace_processor: str | Path | None = None) -> list[str]:
    """Problems found in `result.output` (empty when it holds what the merge reported)."""
    check = check_trace(result.output)
    problems = list(check.problems)
    expected = expected_slices_by_process(result)
    processes = [p.name for p in check.processes()]
    if processes != list(expected):
        problems.append(f"processes {processes} != the merged ranks {list(expected)}")
    found = check.slice_count_by_process()
    problems += [f"{name}: {found.get(name, 0)} slices in the file, the merge wrote {count}"
                 for name, count in expected.items() if found.get(name, 0) != count]
    if trace_processor is not None:
        problems += check_with_trace_processor(result.output, trace_processor, expected_slices=expected).problems
    return problems


def expected_slices_by_process(result: MergeResult) -> dict[str, int]:
    """Process name -> slices written (recorded events plus overlay slices), in rank order."""
    return {s.process_name: s.slice_count + s.overlay_slice_count for s in result.per_rank if s.files}
