"""The sub-commands of `fleetscope`; each registers its parser and handles its arguments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..launcher.jobrecord import now_iso, spec_record, write_job_record
from ..launcher.local import LocalPlan, LocalResult, plan_local, run_local
from ..launcher.spec import JobSpec
from ..trainer.config import ConfigError
from ..traces.layout import RunLayout
from .jobargs import add_job_arguments, job_spec_from_args
from .pipeline import PostprocessResult, describe_manifest, postprocess

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL = 0, 1, 2, 3


# --- launch / demo --------------------------------------------------------------------------


def register_launch(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("launch", help="start a training job (local torchrun or Slurm)")
    add_job_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the exact command; run nothing")
    parser.add_argument("--resume", action="store_true", help="allow an existing run directory (resume)")
    parser.add_argument("--no-post", action="store_true", help="skip gather/analyze/merge after the job")
    parser.add_argument("--wait", action="store_true",
                        help="Slurm: wait for the job and its post-processing, then print the outcome")
    parser.set_defaults(handler=handle_launch)


def handle_launch(args: argparse.Namespace) -> int:
    spec = job_spec_from_args(args)
    if spec.scheduler == "torchx_local":
        return launch_with_torchx_local(spec, args)
    if spec.scheduler != "local":
        from .slurm_commands import launch_on_slurm

        return launch_on_slurm(spec, args)
    plan = plan_local(spec)
    if args.dry_run:
        print(plan.render())
        return EXIT_OK
    layout = RunLayout.at(spec.train.run_dir)
    refuse_existing_run(layout, resume=args.resume)
    result = run_job_locally(spec, plan, layout)
    post = None if args.no_post else postprocess(layout.root)
    print_outcome(layout, result, post)
    return launch_exit_code(result, post)


def launch_with_torchx_local(spec: JobSpec, args: argparse.Namespace) -> int:
    """The TorchX AppDef of the Slurm path, run by TorchX's local_cwd scheduler on this node."""
    from torchx.specs import AppState

    from ..launcher.torchx_backend import plan_torchx_local, run_torchx_local

    plan = plan_torchx_local(spec)
    if args.dry_run:
        print(plan.render())
        return EXIT_OK
    layout = RunLayout.at(spec.train.run_dir)
    refuse_existing_run(layout, resume=args.resume)
    layout.root.mkdir(parents=True, exist_ok=True)
    write_job_record(layout, **spec_record(spec), plan={"kind": "torchx_local", "command": plan.render()},
                     status="running", started_at=now_iso())
    status = run_torchx_local(plan)
    succeeded = status is not None and status.state == AppState.SUCCEEDED
    write_job_record(layout, status="succeeded" if succeeded else "failed", finished_at=now_iso(),
                     torchx_state=str(status.state if status else None))
    post = None if args.no_post else postprocess(layout.root)
    if not succeeded:
        print(f"fleetscope: the job FAILED (TorchX state {status.state if status else 'unknown'}); logs under "
              f"{layout.logs_dir}", file=sys.stderr)
    if post is not None:
        print_outputs(post)
    if not succeeded:
        return EXIT_FAILED
    return EXIT_OK if post is None or post.complete else EXIT_PARTIAL


def refuse_existing_run(layout: RunLayout, *, resume: bool) -> None:
    """Nothing of an earlier run is reused or overwritten unless the user asks to resume it."""
    if layout.job_file.exists() and not resume:
        raise ConfigError(
            f"run_dir: {layout.root} already holds a run; pass --resume to continue it or choose another --run-dir"
        )


def run_job_locally(spec: JobSpec, plan: LocalPlan, layout: RunLayout) -> LocalResult:
    layout.root.mkdir(parents=True, exist_ok=True)
    write_job_record(layout, **spec_record(spec), plan=plan.to_json(), status="running", started_at=now_iso())
    print(f"fleetscope: running {spec.world_size} rank(s) into {layout.root}", flush=True)
    result = run_local(plan)
    failures = [vars(f) for f in result.failures]
    write_job_record(layout, status="succeeded" if result.ok else "failed", returncode=result.returncode,
                     failures=failures, finished_at=now_iso())
    return result


def print_outcome(layout: RunLayout, result: LocalResult, post: PostprocessResult | None) -> None:
    if not result.ok:
        print(f"\nfleetscope: the job FAILED (torchrun exit code {result.returncode})", file=sys.stderr)
        for order, failure in enumerate(result.failures):
            first = " [failed first]" if order == 0 and len(result.failures) > 1 else ""
            print(f"  rank {failure.rank}{first}: {failure.message}", file=sys.stderr)
            if failure.log_path:
                print(f"    log: {failure.log_path}", file=sys.stderr)
        if not result.failures:
            print(f"  no rank left an error file; see the logs under {layout.logs_dir}", file=sys.stderr)
        print("  traces written before the failure are kept and were gathered.", file=sys.stderr)
    if post is not None:
        print_outputs(post)


def print_outputs(post: PostprocessResult) -> None:
    print("\noutputs:")
    for name, path in post.outputs.items():
        if Path(path).exists():
            print(f"  {name:<13} {path}")
    if "merged_trace" in post.outputs and Path(post.outputs["merged_trace"]).exists():
        print("\nopen the merged trace: https://ui.perfetto.dev -> 'Open trace file' -> "
              f"{post.outputs['merged_trace']}")


def launch_exit_code(result: LocalResult, post: PostprocessResult | None) -> int:
    if not result.ok:
        return EXIT_FAILED
    if post is not None and not post.complete:
        return EXIT_PARTIAL
    return EXIT_OK


def register_demo(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="2-rank CPU run of the tiny MoE, profiled, analyzed, merged")
    parser.add_argument("--runs-root", default="runs")
    parser.add_argument("--model", default="qwen3_moe")
    parser.add_argument("--parallel", default="fsdp")
    parser.add_argument("--steps", type=int, default=10)
    parser.set_defaults(handler=handle_demo)


def handle_demo(args: argparse.Namespace) -> int:
    launch_args = build_launch_parser().parse_args([
        "--runs-root", args.runs_root, "--model", args.model, "--preset", "tiny", "--parallel", args.parallel,
        "--steps", str(args.steps), "--nproc-per-node", "2", "--device", "cpu",
        "--profile", "wait=1,warmup=1,active=2,repeat=2",
    ])
    return handle_launch(launch_args)


def build_launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetscope launch")
    sub = parser.add_subparsers()
    register_launch(sub)
    return sub.choices["launch"]


# --- train / gather / postprocess -------------------------------------------------------------


def register_train(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="one rank of a run (what torchrun/srun start on every GPU)",
                            add_help=False)
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=lambda args: _run_trainer(args.trainer_args))


def _run_trainer(argv: list[str]) -> int:
    from ..trainer.__main__ import main as trainer_main

    return trainer_main(argv)


def register_gather(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("gather", help="verify a run's traces and write manifest.json")
    parser.add_argument("run_dir")
    parser.set_defaults(handler=handle_gather)


def handle_gather(args: argparse.Namespace) -> int:
    from ..traces.gather import gather

    manifest = gather(args.run_dir)
    print(describe_manifest(manifest))
    print(f"manifest: {RunLayout.at(args.run_dir).manifest_file}")
    return EXIT_OK if manifest.complete else EXIT_PARTIAL


def register_postprocess(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("postprocess", help="gather + analyze + merge a finished run directory")
    parser.add_argument("run_dir")
    parser.add_argument("--timings", action="store_true", help="print each stage's wall time (stderr)")
    parser.set_defaults(handler=handle_postprocess)


def handle_postprocess(args: argparse.Namespace) -> int:
    post = postprocess(args.run_dir)
    print_outputs(post)
    if args.timings:
        for stage, seconds in post.seconds.items():
            print(f"{stage} took {seconds:.2f} s", file=sys.stderr)
    if post.errors:
        return EXIT_FAILED
    return EXIT_OK if post.complete else EXIT_PARTIAL


# --- analyze / merge / compare -----------------------------------------------------------------


def register_analyze(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("analyze", help="report on a run directory or any directory of Kineto traces")
    parser.add_argument("path", help="run directory, or a directory of *.json / *.json.gz traces")
    parser.add_argument("--json", dest="json_out", default=None, help="write the report JSON here")
    parser.add_argument("--html", dest="html_out", default=None, help="write the HTML report here")
    parser.add_argument("--no-hta", action="store_true", help="skip Holistic Trace Analysis (GPU traces)")
    parser.add_argument("--hta-ranks", default="auto", metavar="auto|all|LIST",
                        help="ranks HTA's views cover: auto (slowest, waited for, fastest, median, one per host; "
                             "at most 16 per window), all, or a list like 0,3,7")
    parser.add_argument("--no-cache", action="store_true",
                        help="parse every trace again instead of reusing results of identical trace files")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="parsed-trace cache (default: $FLEETSCOPE_CACHE_DIR, else ~/.cache/fleetscope/analysis)")
    parser.set_defaults(handler=handle_analyze)


def handle_analyze(args: argparse.Namespace) -> int:
    from ..analysis import analyze
    from ..analysis.render.terminal import render_terminal
    from ..analysis.report.build import parse_hta_ranks

    layout = RunLayout.at(args.path)
    json_out, html_out = args.json_out, args.html_out
    if layout.is_run_dir():
        json_out = json_out or layout.report_json
        html_out = html_out or layout.report_html
    report = analyze(layout.root, json_out=json_out, html_out=html_out, use_hta=not args.no_hta,
                     hta_ranks=parse_hta_ranks(args.hta_ranks), progress=progress_printer("analyze"),
                     hta_progress=progress_printer("HTA"), use_cache=not args.no_cache, cache_dir=args.cache_dir)
    print(render_terminal(report))
    for label, path in (("json", json_out), ("html", html_out)):
        if path:
            print(f"{label}: {path}")
    return EXIT_OK if report.complete else EXIT_PARTIAL


def register_merge(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("merge", help="one Perfetto trace of all ranks")
    parser.add_argument("path", help="run directory, or a directory of *.json / *.json.gz traces")
    parser.add_argument("-o", "--output", default=None,
                        help="output .perfetto-trace (default: <run>/report/merged.perfetto-trace)")
    parser.add_argument("--ranks", type=_int_set, default=None, metavar="0,3,8", help="only these ranks")
    parser.add_argument("--steps", type=_int_set, default=None, metavar="4,5", help="only these training steps")
    parser.add_argument("--window", type=_time_window, default=None, metavar="START:END",
                        help="only this time window, seconds after the first event")
    parser.add_argument("--no-python", action="store_true", help="drop python_function events")
    parser.add_argument("--no-flows", action="store_true", help="no launch->kernel or cross-rank arrows")
    parser.add_argument("--no-overlays", action="store_true", help="no 'fleetscope analysis' tracks")
    parser.add_argument("--args", action="store_true", help="keep each event's args (larger output)")
    parser.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                        help="also write merged Chrome JSON (default: <run>/report/merged.trace.json.gz)")
    parser.add_argument("--workers", type=int, default=1, help="ranks merged at once")
    parser.add_argument("--verify", action="store_true", help="read the output back and check it")
    parser.add_argument("--trace-processor", default=None, metavar="PATH",
                        help="also check it with this trace_processor_shell binary (SQL)")
    parser.set_defaults(handler=handle_merge)


def _int_set(text: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _time_window(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        return float(start), float(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None


def handle_merge(args: argparse.Namespace) -> int:
    from ..analysis.merge.run import merge
    from ..analysis.merge.options import MergeOptions
    from ..analysis.merge.verify import verify_merge

    layout = RunLayout.at(args.path)
    if args.output is None and not layout.is_run_dir():
        raise ValueError("-o OUT.perfetto-trace is required for a directory that is not a run directory")
    output = Path(args.output) if args.output else layout.merged_trace
    chrome_json = None if args.json is None else Path(args.json or layout.merged_json)
    options = MergeOptions(ranks=args.ranks, steps=args.steps, time_window_s=args.window,
                           drop_python_functions=args.no_python, flows=not args.no_flows,
                           collective_flows=not args.no_flows, overlays=not args.no_overlays,
                           event_args=args.args, chrome_json=chrome_json, workers=args.workers)
    result = merge(layout.root, output, options=options, progress=_merge_progress())
    print(f"merged {len(result.ranks)} rank(s) into {output} ({output.stat().st_size / 1e6:.1f} MB)")
    for problem in result.problems:
        print(f"  problem: {problem}", file=sys.stderr)
    failures = verify_merge(result, trace_processor=args.trace_processor) if (
        args.verify or args.trace_processor) else []
    for failure in failures:
        print(f"  verification failed: {failure}", file=sys.stderr)
    print(f"open it at https://ui.perfetto.dev -> 'Open trace file' -> {output}")
    if failures:
        return EXIT_FAILED
    return EXIT_OK if not result.problems else EXIT_PARTIAL


def _slurm_registry() -> list:
    from .slurm_commands import REGISTRY as SLURM_REGISTRY

    return SLURM_REGISTRY


def register_compare(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("compare", help="regression check: exit 1 when NEW is slower than BASE")
    parser.add_argument("base", help="run directory or report.json")
    parser.add_argument("new", help="run directory or report.json")
    parser.add_argument("--threshold", type=float, default=5.0,
                        help="percent drop in throughput / rise in step time that fails (default 5)")
    parser.set_defaults(handler=handle_compare)


def handle_compare(args: argparse.Namespace) -> int:
    from ..analysis import compare
    from ..analysis.render.terminal import render_comparison

    comparison = compare(args.base, args.new, threshold_pct=args.threshold)
    print(render_comparison(comparison))
    return comparison.exit_code


def _merge_progress():
    from .progress import counting, progress_callback

    return counting(progress_callback("merge", "ranks"))


def progress_printer(label: str):
    """Progress on stderr: a bar on a terminal, a status line every 10 s otherwise (cli/progress.py)."""
    from .progress import progress_callback

    return progress_callback(label)


REGISTRY = [
    register_launch, register_train, register_gather, register_analyze, register_merge, register_postprocess,
    register_demo, register_compare, *_slurm_registry(),
]
