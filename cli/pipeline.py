"""After a job: gather -> analyze -> merge, each step independent so one failure loses nothing else."""

from __future__ import annotations

import resource
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..analysis.quantities import step_ranges
from ..traces.gather import gather
from .progress import counting, progress_callback
from ..traces.layout import RunLayout
from ..traces.validate import missing_note
from .terminal_text import escape_controls


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


def postprocess(run_dir: str | Path, *, echo: bool = True, gather_traces: bool = True,
                cache_dir: Path | None = None, on_parsed=None, use_cache: bool = True, use_hta: bool = True,
                link_peak_gbps: float | None = None, merge_options=None, hta_oracle: bool = False) -> PostprocessResult:
    """Gather, analyze and merge a run directory; every step runs even if an earlier one failed.

    `gather_traces=False` keeps the manifest as it is (the reduce step of a fanned-out parse: the array
    tasks' cache entries are keyed by what that manifest says of each trace); `cache_dir` is the
    parsed-trace cache of both analyze and merge (default: default_cache_dir()); `on_parsed(outcomes)`
    gets analyze's per-trace outcomes (analysis.analyze). `use_cache`, `use_hta`, `hta_oracle` and
    `link_peak_gbps` go to analyze, `use_cache` and `merge_options` (analysis.merge.options.MergeOptions) to merge."""
    from ..analysis.inputs.records import read_run_records

    layout = RunLayout.at(run_dir)
    result = PostprocessResult(run_dir=layout.root)
    if gather_traces:
        _timed(result, "gather", lambda: _gather(layout, result, echo, cache_dir))
    records = read_run_records(layout)   # once, after gather wrote the manifest: analyze and merge share them
    if not gather_traces:
        _timed(result, "manifest", lambda: _read_manifest(records, result))
    analyze_options = {"use_cache": use_cache, "use_hta": use_hta, "hta_oracle": hta_oracle,
                       "link_peak_gbps": link_peak_gbps, "records": records}
    _timed(result, "analyze", lambda: _analyze(layout, result, echo, cache_dir, on_parsed, analyze_options))
    _timed(result, "merge", lambda: _merge(layout, result, echo, cache_dir,
                                           {"use_cache": use_cache, "options": merge_options, "records": records}))
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


def _gather(layout: RunLayout, result: PostprocessResult, echo: bool, cache_dir: Path | None) -> None:
    manifest = gather(layout.root, inspector=_parsing_inspector(cache_dir))
    result.manifest_complete = manifest.complete
    result.outputs["manifest"] = layout.manifest_file
    if echo:
        print(describe_manifest(manifest))


def _parsing_inspector(cache_dir: Path | None):
    """The per-rank parse in gather's pass over the traces (analysis.per_rank.parse.ParsingInspector),
    when the parsed-trace cache is usable; analyze then finds every trace parsed."""
    from ..analysis.per_rank.cache import open_cache
    from ..analysis.per_rank.parse import ParsingInspector

    cache, _ = open_cache(cache_dir)
    return ParsingInspector(cache.directory) if cache is not None else None


def _read_manifest(records, result: PostprocessResult) -> None:
    """The manifest as the run's records hold it (analysis/inputs/records.py); an unusable one fails this stage."""
    if records.manifest is None:
        raise ValueError(records.manifest_problem or f"{records.layout.manifest_file}: no manifest")
    result.manifest_complete = records.manifest.complete
    result.outputs["manifest"] = records.layout.manifest_file


def describe_manifest(manifest) -> str:
    lines = [f"gathered {len(manifest.traces)} trace(s) of world size {manifest.world_size} "
             f"in {len(manifest.windows)} window(s)"]
    lines += [f"  unreadable: {p.path}: {p.reason}" for p in manifest.problems]
    by_window: dict = {}
    for entry in manifest.missing:
        by_window.setdefault(entry.window, set()).add(entry.rank)
    total = manifest.missing_total or len(manifest.missing)
    for window, ranks in sorted(by_window.items(), key=lambda item: item[0] or 0):
        count = total if len(by_window) == 1 else len(ranks)
        of = f" of {manifest.world_size}" if manifest.world_size else ""
        where = "" if window is None else f" in window {window}"
        if count > len(ranks) and manifest.world_size:  # the list is capped: the whole set when it is every gap
            present = {t.rank for t in manifest.traces if t.window == window}
            every = [r for r in range(manifest.world_size) if r not in present]
            ranks = set(every) if len(every) == count else ranks
        lines.append(f"  missing{where}: {count}{of} ranks ({step_ranges(sorted(ranks))})")
    counted = missing_note(len(manifest.missing), manifest.missing_total)
    return "\n".join(lines + ([f"  missing: {counted}"] if counted else []))


def _analyze(layout: RunLayout, result: PostprocessResult, echo: bool, cache_dir: Path | None,
             on_parsed, options: dict) -> None:
    from ..analysis import analyze
    from ..analysis.advise import top_findings
    from ..analysis.render.terminal import render_terminal

    report = analyze(layout.root, json_out=layout.report_json, html_out=layout.report_html,
                     progress=progress_callback("analyze"), hta_progress=progress_callback("HTA", "ranks"),
                     cache_dir=cache_dir, on_parsed=on_parsed, advisor=top_findings, **options)
    result.report_complete = report.complete
    result.outputs["report_json"] = layout.report_json
    result.outputs["report_html"] = layout.report_html
    if echo:
        print(escape_controls(render_terminal(report)))   # names from traces are untrusted text


def _merge(layout: RunLayout, result: PostprocessResult, echo: bool, cache_dir: Path | None, options: dict) -> None:
    from ..analysis.merge.run import merge

    merged = merge(layout.root, layout.merged_trace, progress=counting(progress_callback("merge", "ranks")),
                   cache_dir=cache_dir, **options)
    if not merged.ranks:
        if echo:
            from .merge_messages import describe_merge

            print("\n".join(describe_merge(merged)))
        return
    result.outputs["merged_trace"] = layout.merged_trace
    if layout.report_json.is_file():
        _link_report_to_trace(layout, merged)
    if echo:
        from .merge_messages import describe_merge

        print("\n".join(describe_merge(merged)))


def _link_report_to_trace(layout: RunLayout, merged) -> None:
    """Render report.html again, its 'Open in Perfetto' buttons now scrolled to each finding's steps."""
    from ..analysis import load_report_json, render_html
    from ..traces.writer import write_bytes_atomically

    html = render_html(load_report_json(layout.report_json, within=layout.root), trace_ranges=merged.step_ranges_ns())
    write_bytes_atomically(html.encode(), layout.report_html)
