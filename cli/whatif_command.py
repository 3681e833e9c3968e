"""`fleetscope whatif PATH`: the job without its stragglers, by simulation (analysis/whatif), for an op-level
timeline in the OSDI'25 straggler artifact's schema, or a data-parallel or pipeline-parallel job's Kineto traces
(a run directory or a folder of traces)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ..traces.jsontext import strict_dumps
from ..traces.outputs import guard_output
from .exit_codes import EXIT_OK
from .terminal_text import escape_controls


def register_whatif(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("whatif", help="how fast the job would run without its stragglers (simulated): the "
                                           "slowdown S, by op type, worker and stage, and M_W / M_S")
    parser.add_argument("path", help="a run directory or folder of Kineto traces (data- or pipeline-parallel jobs), or an op-level "
                                     "timeline: the straggler artifact's table (.parquet with pyarrow, .csv[.gz]) or "
                                     "its Chrome JSON timeline (.json[.gz])")
    parser.add_argument("--top", type=int, default=5, help="how many op types and workers to list (default: 5)")
    parser.add_argument("--ideal", choices=("mean", "median"), default="mean",
                        help="a computation op type's ideal time: the mean over all its ops (default, the paper's) "
                             "or the median")
    parser.add_argument("--json", dest="json_out", help="write every figure as JSON here")
    parser.add_argument("--ideal-timeline", dest="ideal_out",
                        help="write the simulated ideal here as the artifact's Chrome JSON (.json or .json.gz), to "
                             "open in Perfetto beside the recorded timeline")
    parser.set_defaults(handler=handle_whatif)


def handle_whatif(args: argparse.Namespace) -> int:
    from ..analysis.whatif.metrics import WhatIfConfig, ideal_timeline, what_if
    from ..analysis.whatif.pipeline_model import model_timeline
    from ..traces.atomic import write_bytes_atomically
    from ..traces.op_timeline import chrome_timeline_bytes, read_op_timeline

    json_out = guard_output(args.json_out, analyzed=Path(args.path)) if args.json_out else None
    ideal_out = guard_output(args.ideal_out, analyzed=Path(args.path)) if args.ideal_out else None
    if Path(args.path).is_dir():
        if ideal_out:
            raise ValueError("--ideal-timeline: written for op-level timelines only, not yet for traces")
        return _what_if_of_traces(args.path, json_out, top=max(args.top, 1))
    modeled = model_timeline(read_op_timeline(args.path))
    config = WhatIfConfig(computation_statistic=args.ideal)
    result = what_if(modeled, config)
    print(escape_controls(render_what_if(result, top=max(args.top, 1))), end="")
    if json_out:
        write_bytes_atomically((strict_dumps(dataclasses.asdict(result), indent=2) + "\n").encode(), json_out)
    if ideal_out:
        timeline = ideal_timeline(modeled, config)
        write_bytes_atomically(chrome_timeline_bytes(timeline, compress=ideal_out.name.endswith(".gz")), ideal_out)
    return EXIT_OK


def _what_if_of_traces(path: str, json_out: Path | None, *, top: int) -> int:
    from ..analysis.whatif.trace_model import model_traces, read_rank_results
    from ..analysis.whatif.trace_whatif import trace_what_if
    from ..traces.atomic import write_bytes_atomically

    results, notes = read_rank_results(path)
    result = trace_what_if(model_traces(results, source=path))
    print(escape_controls(render_trace_what_if(result, notes, top=top)), end="")
    if json_out:
        figures = {**dataclasses.asdict(result), "slowest_rank": result.slowest.rank}
        write_bytes_atomically((strict_dumps(figures, indent=2) + "\n").encode(), json_out)
    return EXIT_OK


def render_trace_what_if(result, notes: list[str], *, top: int) -> str:
    """A trace what-if as text: step times, S, S_w by rank and the slowest rank's what-if."""
    slowest = result.slowest
    lines = [
        f"what-if by simulation: {result.source}",
        f"  {len(result.steps)} steps, {result.ranks} "
        + (f"pipeline stages, one a rank ({result.pipeline_steps} steps with sends and receives)"
           if result.pipeline_steps else "data-parallel ranks"),
        f"  step time    measured {result.measured_step_ms:.1f} ms, replayed {result.replayed_step_ms:.1f} ms, "
        f"ideal {result.ideal_step_ms:.1f} ms (every rank's compute at the ranks' lower median"
        + (", a stage's in total" if result.pipeline_steps else "") + ")",
        f"  S            {result.slowdown:.3f}  (replayed / ideal)",
        "  S_w by rank      " + ", ".join(f"rank {r.rank} {r.slowdown:.3f}" for r in result.by_rank[:top]),
        f"  slowest rank {slowest.rank}: its compute {slowest.compute_ms:.1f} ms a step, its peers' "
        f"{slowest.peers_compute_ms:.1f} ms; were it theirs, a step would take {slowest.what_if_step_ms:.1f} ms "
        f"(replayed as recorded: {result.replayed_step_ms:.1f} ms)",
    ]
    lines += [f"  skipped      {why}" for why in result.skipped[:top]]
    lines += [f"  note         {note}" for note in notes[:top]]
    return "\n".join(lines) + "\n"


def render_what_if(result, *, top: int) -> str:
    """The result as text: step times, S, the largest S_t and S_w, S by stage, M_W and M_S."""
    workers = len(result.slowdown_by_worker)
    explained = result.replayed_step_s / result.measured_step_s
    lines = [
        f"what-if by simulation: {result.source}",
        f"  {result.steps} steps, {result.stages} pipeline stages x {result.dp_ranks} DP ranks = {workers} workers",
        f"  step time    measured {result.measured_step_s:.3f} s, replayed {result.replayed_step_s:.3f} s "
        f"({explained:.1%} of it from the modeled ops), ideal {result.ideal_step_s:.3f} s",
        f"  S            {result.slowdown:.3f}  (replayed / ideal: without stragglers a step would take "
        f"{1 - 1 / result.slowdown:.0%} less)",
        "  S_t by op type   " + ", ".join(f"{name} {value:.3f}"
                                          for name, value in list(result.slowdown_by_op_type.items())[:top]),
        "  S_w by worker    " + ", ".join(f"rank {w.rank} (DP {w.dp_rank}, stage {w.stage}) {w.slowdown:.3f}"
                                          for w in result.slowdown_by_worker[:top]),
        "  S by stage       " + ", ".join(f"stage {stage} {value:.3f}"
                                          for stage, value in sorted(result.slowdown_by_stage.items())),
        f"  M_W          {result.worker_share_explained:.1%} of the slowdown is gone when the slowest "
        f"{len(result.workers_explaining)} worker(s) (rank {', '.join(map(str, result.workers_explaining))}) "
        "take ideal times",
        f"  M_S          {result.stage_share_explained:.1%} is gone when the last stage ({result.stages - 1}) does",
    ]
    return "\n".join(lines) + "\n"


REGISTRY = [register_whatif]
