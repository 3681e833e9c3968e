"""After a job: gather -> analyze -> merge -> the HTML report, each stage independent so one failure loses
nothing else.

The HTML report is rendered once, last: its 'Open in Perfetto' buttons scroll the merged trace to each finding's
steps, which are known only after the merge. What each stage shows on a terminal is the caller's (StageEcho):
the command line prints it, a library caller may ignore it.
"""

from __future__ import annotations

import resource
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fleetscope.analysis.options import AnalyzeOptions, with_overrides
from fleetscope.traces.layout import RunLayout

Progress = Callable[[int, int], None]
"""progress(done, total); total 0 when it is not known beforehand."""


@dataclass(frozen=True, kw_only=True)
class StageEcho:
    """What the caller is shown as each stage ends; every field may stay None (nothing shown)."""

    manifest: Callable[[object], None] | None = None
    """Gets the manifest gather wrote (traces/manifest.py Manifest)."""
    report: Callable[[object], None] | None = None
    """Gets the analysis' Report."""
    merged: Callable[[object], None] | None = None
    """Gets the merge's result (analysis/merge/run.py), also when it drew no rank."""
    progress: Callable[[str, str], Progress] | None = None
    """progress(label, unit): a progress callback for a stage (analyze: traces, HTA: ranks, merge: ranks)."""
    merge_progress: Callable[[Progress], Callable[[object], None]] | None = None
    """Turns a progress callback into the merge's per-rank callback (it is called once per rank merged)."""


@dataclass(kw_only=True)
class PostprocessResult:
    run_dir: Path
    manifest_complete: bool = False
    report_complete: bool = False
    outputs: dict[str, Path] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    """Per stage: CPU time of this process and of the worker processes it waited for (user + system)."""

    @property
    def complete(self) -> bool:
        return not self.errors and self.manifest_complete and self.report_complete


@dataclass
class _Stages:
    """What one stage leaves for a later one."""

    report: object | None = None
    html_path: Path | None = None
    trace_ranges: object | None = None


def postprocess(run_dir: str | Path, options: AnalyzeOptions = AnalyzeOptions(), *, echo: StageEcho = StageEcho(),
                gather_traces: bool = True, on_parsed=None, merge_options=None,
                **option_overrides) -> PostprocessResult:
    """Gather, analyze and merge a run directory, then write its HTML report; every stage runs even if an
    earlier one failed.

    `options` are the analysis' (analysis/options.py; keyword arguments named as its fields override them);
    its `cache_dir` and `use_cache` are the merge's too, and gather parses into that cache while it reads each
    trace. `gather_traces=False` keeps the manifest as it is (the reduce step of a fanned-out parse: the array
    tasks' cache entries are keyed by what that manifest says of each trace); `on_parsed(outcomes)` gets
    analyze's per-trace outcomes (analysis.analyze); `merge_options` (analysis.merge.options.MergeOptions)
    go to the merge."""
    from fleetscope.analysis.inputs.records import read_run_records

    options = with_overrides(options, option_overrides)
    layout = RunLayout.at(run_dir)
    result = PostprocessResult(run_dir=layout.root)
    stages = _Stages()
    if gather_traces:
        _timed(result, "gather", lambda: _gather(layout, result, echo, options))
    records = read_run_records(layout)   # once, after gather wrote the manifest: analyze and merge share them
    if not gather_traces:
        _timed(result, "manifest", lambda: _read_manifest(records, result))
    _timed(result, "analyze", lambda: _analyze(layout, result, stages, echo, options, on_parsed, records))
    _timed(result, "merge", lambda: _merge(layout, result, stages, echo, options, merge_options, records))
    if stages.report is not None:
        _timed(result, "html", lambda: _write_html(stages))
    return result


def _cpu_seconds() -> float:
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _timed(result: PostprocessResult, name: str, step) -> None:
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    try:
        step()
    except Exception as error:  # noqa: BLE001 - one failed stage must not stop the others
        result.errors.append(f"{name}: {type(error).__name__}: {error}")
        print(f"fleetscope: {name} failed: {error}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
    result.seconds[name] = time.perf_counter() - started
    result.cpu_seconds[name] = _cpu_seconds() - cpu_started


def _progress(echo: StageEcho, label: str, unit: str = "traces") -> Progress | None:
    return echo.progress(label, unit) if echo.progress is not None else None


def _gather(layout: RunLayout, result: PostprocessResult, echo: StageEcho, options: AnalyzeOptions) -> None:
    from fleetscope.traces.gather import gather

    manifest = gather(layout.root, inspector=_parsing_inspector(options.cache_dir))
    result.manifest_complete = manifest.complete
    result.outputs["manifest"] = layout.manifest_file
    if echo.manifest is not None:
        echo.manifest(manifest)


def _parsing_inspector(cache_dir: Path | None):
    """The per-rank parse in gather's pass over the traces (analysis.per_rank.parse.ParsingInspector),
    when the parsed-trace cache is usable; analyze then finds every trace parsed."""
    from fleetscope.analysis.per_rank.cache import open_cache
    from fleetscope.analysis.per_rank.parse import ParsingInspector

    cache, _ = open_cache(cache_dir)
    return ParsingInspector(cache.directory) if cache is not None else None


def _read_manifest(records, result: PostprocessResult) -> None:
    """The manifest as the run's records hold it (analysis/inputs/records.py); an unusable one fails this stage."""
    if records.manifest is None:
        raise ValueError(records.manifest_problem or f"{records.layout.manifest_file}: no manifest")
    result.manifest_complete = records.manifest.complete
    result.outputs["manifest"] = records.layout.manifest_file


def _analyze(layout: RunLayout, result: PostprocessResult, stages: _Stages, echo: StageEcho,
             options: AnalyzeOptions, on_parsed, records) -> None:
    """The report JSON now; the HTML once the merge is done (_write_html), its path checked here, before the
    work, as analyze checks the paths it writes."""
    from fleetscope.analysis.advise import top_findings
    from fleetscope.analysis.analyze import analyze
    from fleetscope.traces.outputs import guard_output

    html_path = guard_output(layout.report_html, analyzed=layout.root)
    report = analyze(layout.root, options, json_out=layout.report_json, write_default_outputs=False,
                     progress=_progress(echo, "analyze"), hta_progress=_progress(echo, "HTA", "ranks"),
                     on_parsed=on_parsed, advisor=top_findings, records=records)
    stages.report, stages.html_path = report, html_path
    result.report_complete = report.complete
    result.outputs["report_json"] = layout.report_json
    result.outputs["report_html"] = layout.report_html
    if echo.report is not None:
        echo.report(report)


def _merge(layout: RunLayout, result: PostprocessResult, stages: _Stages, echo: StageEcho,
           options: AnalyzeOptions, merge_options, records) -> None:
    from fleetscope.analysis.merge.run import merge

    progress = _progress(echo, "merge", "ranks")
    per_rank = echo.merge_progress(progress) if progress is not None and echo.merge_progress is not None else None
    # the Report the analysis just made, as it is (the merge reads report.json back only where there is none)
    merged = merge(layout.root, layout.merged_trace, progress=per_rank, cache_dir=options.cache_dir,
                   use_cache=options.use_cache, options=merge_options, records=records, report=stages.report)
    if merged.ranks:
        result.outputs["merged_trace"] = layout.merged_trace
        if layout.report_json.is_file():   # the report the merge drew its findings from
            stages.trace_ranges = merged.step_ranges_ns()
    if echo.merged is not None:
        echo.merged(merged)


def _write_html(stages: _Stages) -> None:
    """report.html, its 'Open in Perfetto' buttons scrolled to each finding's steps when the merge drew them."""
    from fleetscope.analysis.render.html import render_html
    from fleetscope.traces.writer import write_bytes_atomically

    html = render_html(stages.report, trace_ranges=stages.trace_ranges)
    write_bytes_atomically(html.encode(), stages.html_path)
