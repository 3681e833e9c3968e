"""`analyze(path)`: traces in, Report out (and JSON / HTML files where asked).

Per-rank work (read, parse, compute) runs in a process pool when there are enough traces; each worker
returns a compact RankResult, so memory does not grow with the size of the traces held at once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable

from fleetscope.traces.outputs import guard_output
from fleetscope.traces.safe_read import InputRefused, read_metadata
from fleetscope.analysis.cross_rank.capture import capture_section
from fleetscope.analysis.cross_rank.placement import place_traces
from fleetscope.analysis.cross_rank.moe import moe_records_noted
from fleetscope.analysis.cross_rank.records import trainer_evidence
from fleetscope.analysis.cross_rank.whole_run import whole_run_section
from fleetscope.analysis.cross_rank.hta_views import start_hta_workers
from fleetscope.analysis.inputs.records import RunRecords, read_step_metrics_only
from fleetscope.traces.layout import RunLayout
from fleetscope.analysis.inputs.resolve import AnalysisInput, resolve_input
from fleetscope.analysis.inputs.sources import TraceFailure, TraceSource
from fleetscope.analysis.per_rank.cache import ResultCache, open_cache
from fleetscope.analysis.per_rank.parse import Progress, parse_traces
from fleetscope.analysis.per_rank.rank import RankResult, other_tool_trace_reason
from fleetscope.analysis.options import AnalyzeOptions, with_overrides
from fleetscope.analysis.invariants import audit, auditing, check_report
from fleetscope.analysis.report.build import (
    HTA_RANKS_ALL,
    HTA_RANKS_AUTO,
    build_report,
    hta_runner,
    no_hta,
)
from fleetscope.analysis.gate import steady_metrics
from fleetscope.analysis.quantities import (PROFILED_UNREPRESENTATIVE_PCT, metrics_basis, metrics_step_time_ms,
                                           profiled_excess_pct)
from fleetscope.analysis.report.model import Problem, Report
from fleetscope.analysis.cross_rank.outcome import OUTCOME_PROBLEM_LABEL, JobOutcome, job_outcome
from fleetscope.traces.own_traces import recorded_uncollected_hint
from fleetscope.traces.writer import write_bytes_atomically


def analyze(path: str | Path, options: AnalyzeOptions = AnalyzeOptions(), *, json_out: str | Path | None = None,
            html_out: str | Path | None = None, write_default_outputs: bool = True,
            progress: Progress | None = None, hta_progress: Progress | None = None,
            on_parsed: Callable[[list[RankResult | TraceFailure]], None] | None = None,
            advisor: Callable[[RunRecords, Report], list] | None = None, records: RunRecords | None = None,
            **option_overrides) -> Report:
    """Analyze a run directory, a directory of Kineto traces, or one trace file.

    Writes the JSON report to `json_out` and the HTML report to `html_out` when given. For a run directory,
    `write_default_outputs` also writes whichever of them was not given to report/report.json and
    report/report.html; nothing is ever written into a foreign trace directory unless asked.
    Raises FileNotFoundError / ValueError when `path` holds no traces at all; unusable traces are
    reported in `Report.problems` (and make `Report.complete` false), never raised.
    `options` (analysis/options.py) says what is computed and how: HTA's views, the parsed-trace cache, the
    links' peak bandwidth, which kernels communicate; keyword arguments named as its fields (use_hta=False, ...)
    override it, the older spelling of the same options. HTA's views run from fleetscope's own parse of each
    trace (no HTA JSON loader); per-trace results, and HTA's views of each HTA rank, are kept in the parsed-trace
    cache (per_rank/cache.py, per_rank/hta_cache.py).
    `progress(done, total)` as traces are parsed, `hta_progress(done, total)` as HTA ranks finish.
    `on_parsed(outcomes)` gets the per-trace outcomes of the parse (RankResult.from_cache tells a cache hit),
    e.g. for the reduce step of a fanned-out parse to record that it parsed nothing.
    `advisor(records, report)` returns the findings shown next to the verdict (Report.advice; the CLI passes
    analysis/advise/'s top_findings, which this module cannot import: advise reads reports this writes).
    `records`: the run directory's records (inputs/records.py) when the caller has read them (postprocess hands
    the merge the same); read once here otherwise.
    """
    options = with_overrides(options, option_overrides)  # validated: an invalid pattern fails before any work
    inputs = resolve_input(path, records=records)
    run = inputs.records
    json_out, html_out = _guarded_outputs(inputs, json_out, html_out, write_default_outputs)
    cache, cache_off = open_cache(options.cache_dir) if options.use_cache else (None, None)
    hta_ranks = options.hta_rank_choice
    views_in_parse = (options.use_hta and cache is not None
                      and _hta_on_every_rank(inputs.sources, hta_ranks, options.hta_max_ranks))
    if options.use_hta and (options.hta_oracle or not views_in_parse):
        start_hta_workers()  # HTA's stage will need its workers: their server imports while the parse runs
    outcomes = parse_traces(inputs.sources, workers=options.workers, progress=progress, cache=cache,
                            comm_kernel_pattern=options.comm_kernel_pattern, hta_views=views_in_parse)
    if on_parsed is not None:
        on_parsed(outcomes)
    outcomes = [_profiler_trace_or_failure(outcome) for outcome in outcomes]
    placement = place_traces(inputs, outcomes)
    moe_records, moe_notes = moe_records_noted(inputs.layout, run.moe if run is not None else {},
                                               _record_ranks(placement.results, inputs.world_size))
    report = build_report(
        source_path=str(inputs.root),
        source_kind=inputs.kind,
        results=placement.results,
        failures=inputs.failures + placement.failures,
        missing=placement.missing,
        missing_total=placement.missing_total,
        world_size=inputs.world_size,
        notes=inputs.notes + placement.notes + _cache_notes(cache, cache_off, outcomes) + moe_notes,
        hta=hta_runner(options.hta_max_ranks, hta_ranks, hta_progress, _cache_directory(cache),
                       oracle=options.hta_oracle) if options.use_hta else no_hta,
        measured_offsets=inputs.measured_offsets,
        min_lateness_us=options.min_lateness_us,
        link_peak_gbps=options.link_peak_gbps,
        trainer=trainer_evidence(run, placement.results, inputs.world_size),
        moe_records=moe_records,
    )
    report.capture = capture_section(run, inputs.world_size)
    report.whole_run = whole_run_section(run)
    _with_run_step_time(report, run)
    _with_outcome(report, job_outcome(run, report.capture.hang if report.capture else None))
    report.notes += _uncollected_note(run)
    if advisor is not None:
        root = inputs.layout.root if inputs.layout is not None else Path(path)
        report.advice = list(advisor(run if run is not None else read_step_metrics_only(RunLayout.at(root)), report))
    if auditing():
        audit("report", json_out or path, check_report(report))
    _write_outputs(report, json_out, html_out)
    return report


def _profiler_trace_or_failure(outcome):
    """A parsed file with no torch.profiler event (a Chrome trace of another tool) is a problem of the analysis,
    named as such (per_rank/rank.py other_tool_trace_reason; the merge still draws it)."""
    reason = other_tool_trace_reason(outcome) if isinstance(outcome, RankResult) else None
    if reason is None:
        return outcome
    return TraceFailure(label=outcome.label, window=outcome.window, rank=outcome.rank, reason=reason)


def _with_run_step_time(report: Report, run: RunRecords | None) -> None:
    """The run's steady step time beside the profiled one; a verdict built on profiled steps much slower than
    the run's says so in its first sentence (quantities.PROFILED_UNREPRESENTATIVE_PCT)."""
    steady = steady_metrics(run) if run is not None else {}   # the step metrics read once (inputs/records.py)
    run_ms = metrics_step_time_ms(steady)
    if run_ms is None:
        return
    report.run_step_time_ms, report.run_step_time_basis = run_ms, metrics_basis(steady)
    profiled = report.step_time.median_ms if report.step_time is not None else None
    excess = profiled_excess_pct(profiled, run_ms)
    if excess is not None and excess >= PROFILED_UNREPRESENTATIVE_PCT:
        report.verdict = (f"The profiled steps ({profiled:.2f} ms) are {excess:.0f}% slower than the run's steady "
                          f"steps ({run_ms:.2f} ms, step metrics): what follows is of the profiled steps. "
                          + report.verdict)


def _uncollected_note(run: RunRecords | None) -> list[str]:
    """The Kineto traces a user's program wrote outside the run, as its launch recorded them (own_traces.py)."""
    if run is None or run.job_problem:
        return []
    hint = recorded_uncollected_hint(run.job)
    return [hint] if hint else []


def _with_outcome(report: Report, outcome: JobOutcome | None) -> None:
    """A job that did not complete: its outcome leads the verdict and the problems, and the report is not
    complete; what the traces show is said to be of the steps before the failure."""
    report.outcome = outcome
    if outcome is None or outcome.completed:
        return
    report.complete = False
    report.problems.insert(0, Problem(label=OUTCOME_PROBLEM_LABEL, reason=outcome.sentence))
    report.verdict = f"{outcome.sentence} What follows is of the profiled steps before it: {report.verdict}"


def _hta_on_every_rank(sources: list[TraceSource], hta_ranks: str | list[int], max_ranks: int) -> bool:
    """Whether HTA's stage will take every GPU rank, known before the parse: all asked for, or, automatic,
    no window with more traces than it picks from (windows not yet known count as one). Then each rank's
    parse computes its HTA views from its own decode (parse_traces `hta_views`)."""
    if hta_ranks == HTA_RANKS_ALL:
        return True
    if hta_ranks != HTA_RANKS_AUTO:
        return False
    per_window = Counter(source.window for source in sources)
    return not per_window or max(per_window.values()) <= max_ranks


def _cache_directory(cache: ResultCache | None) -> Path | None:
    """Where HTA's per-rank views are kept: beside the parsed traces, under the same checks."""
    return None if cache is None else cache.directory


def _record_ranks(results: list[RankResult], world_size: int | None) -> list[int]:
    """The ranks whose records to read: every rank of the job when its size is known."""
    return list(range(world_size)) if world_size else [r.rank for r in results]


def _guarded_outputs(inputs: AnalysisInput, json_out, html_out,
                     write_defaults: bool) -> tuple[Path | None, Path | None]:
    """The report paths to write, each checked by the output guard before any work (an output over an
    input, or over a file fleetscope did not write, raises OutputRefused)."""
    if write_defaults and inputs.layout is not None:
        json_out = json_out or inputs.layout.report_json
        html_out = html_out or inputs.layout.report_html
    read = [s.path for s in inputs.sources]
    if inputs.layout is not None:
        layout = inputs.layout
        read += [layout.manifest_file, layout.job_file]
    return tuple(None if out is None else guard_output(out, analyzed=inputs.root, inputs=read)
                 for out in (json_out, html_out))


def _cache_notes(cache: ResultCache | None, cache_off: str | None, outcomes: list) -> list[str]:
    """Traces an earlier analysis parsed (a cache hit from gather's own pass in this postprocess is the one
    parse of that file, nothing to note)."""
    hits = sum(1 for outcome in outcomes if isinstance(outcome, RankResult) and outcome.from_cache
               and not outcome.parsed_while_gathering)
    if cache_off:
        return [cache_off]
    if cache is None or not hits:
        return []
    return [f"{hits} of {len(outcomes)} trace(s) read from the parsed-trace cache {cache.directory} "
            "(identical bytes, same fleetscope; --no-cache parses them again)"]


def _write_outputs(report: Report, json_out: Path | None, html_out: Path | None) -> None:
    if json_out is not None:
        write_report_json(report, Path(json_out))
    if html_out is not None:
        from fleetscope.analysis.render.html import render_html

        write_bytes_atomically(render_html(report).encode(), Path(html_out))


def write_report_json(report: Report, path: Path) -> Path:
    text = json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n"
    write_bytes_atomically(text.encode(), path)
    return path


def load_report_json(path: str | Path, *, within: Path | None = None) -> Report:
    """Read a report JSON written by `analyze` (any path; a run's own report only from inside the run
    when `within` is its directory); ValueError naming the file for anything else."""
    try:
        data = json.loads(read_metadata(Path(path), within=within))
        if not isinstance(data, dict):
            raise ValueError(f"top level is {type(data).__name__}, expected an object")
        if "schema_version" not in data:
            raise _NotAReport("not a fleetscope report (no schema_version): give a run directory, a report.json "
                              "that `fleetscope analyze` wrote, a directory of traces or a trace file")
        return Report.from_json(data)
    except _NotAReport as error:
        raise ValueError(f"{path}: cannot read report: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: cannot read report: not JSON (line {error.lineno} column {error.colno})") from None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
        reason = error.reason if isinstance(error, InputRefused) else f"{type(error).__name__}: {error}"
        raise ValueError(f"{path}: cannot read report: {str(reason)[:300]}") from error


class _NotAReport(ValueError):
    """JSON that is no report at all (the message says what to give instead)."""
