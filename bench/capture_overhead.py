"""What the always-on capture parts cost the trainer: request polling, anomaly triggers (their votes ride on
the per-step stop-flag all-reduce; rank_step_time adds one slot per rank every `trigger_every` steps), the
Flight Recorder in every rank and the hang watchdog thread. No window is recorded in either arm.

    python bench/capture_overhead.py --out OUT_DIR [--device cpu] [--nproc 2] [--steps 100] [--repeats 3]
                                     [--sequential]

Each repeat runs the two arms of `fleetscope launch` with the same settings AT THE SAME TIME (--concurrent,
the default: on a shared machine whose load changes by 2x from minute to minute, only arms that run side by
side see the same load), or one after the other in ABBA order (--sequential: a machine of one's own, e.g. a
GPU). Step times come from the runs' own metrics, the first --skip steps left out; the ratio is taken per
repeat, and the median of those ratios is the result.
  off: profiler.on_demand=false, no trigger, observability.flight_recorder_entries=0, hang_timeout_s=0
  on:  the defaults (on_demand, FR 2000 entries, hang watchdog) + triggers step_time, data_time and
       rank_step_time (trigger_every=10), all at 1000x: evaluated every step like any threshold, but no
       window is taken (on a shared CPU, scheduling noise alone passes 3x now and then)
Writes OUT_DIR/capture-overhead.json and prints a table: median step ms, throughput (steps/s from the
mean step time), the ratio on/off, and the agreement's own time (stop_agreement_ms, median).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fleetscope.traces.formats import read_metric_records
from fleetscope.traces.layout import RunLayout

PROFILE = "off"
OFF = ["profiler.on_demand=false", "profiler.trigger=", "observability.flight_recorder_entries=0",
       "observability.hang_timeout_s=0"]
ON = ["profiler.on_demand=true", "profiler.trigger=step_time>1000x,data_time>1000x,rank_step_time>1000x",
      "profiler.trigger_every=10", "observability.flight_recorder_entries=2000", "observability.hang_timeout_s=600"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (one of each arm)")
    parser.add_argument("--sequential", action="store_true", help="run the arms one after the other (ABBA)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out).absolute()
    pairs = []
    for repeat in range(args.repeats):
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        started = {label: start(out / f"capture-{label}-{repeat}", args, OFF if label == "off" else ON)
                   for label in order} if not args.sequential else None
        runs = {}
        for label in order:
            job = started[label] if started else start(out / f"capture-{label}-{repeat}", args,
                                                       OFF if label == "off" else ON)
            runs[label] = [r for r in finish(job) if r["step"] >= args.skip]
        pairs.append(runs)
    summary = summarize(pairs, args)
    summary["host_cost_us_per_step"] = host_costs(out)
    (out / "capture-overhead.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))
    return 0


def start(run_dir: Path, args: argparse.Namespace, settings: list[str]):
    command = [sys.executable, "-m", "fleetscope.cli.main", "launch", "--no-post", "--nproc-per-node", str(args.nproc),
               "--device", args.device, "--preset", args.preset, "--batch-size", str(args.batch),
               "--seq-len", str(args.seq), "--steps", str(args.steps), "--profile", PROFILE, "--run-dir", str(run_dir),
               *[f"--set={s}" for s in settings + ["observability.clock_round_trips=0", *args.overrides]]]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_name(run_dir.name + ".log")
    with open(log, "w") as handle:  # a file, not a pipe: two arms at once must never block on a full pipe
        return run_dir, log, subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)


def finish(job) -> list[dict]:
    run_dir, log, process = job
    if process.wait():
        raise SystemExit(f"{run_dir}: launch failed ({process.returncode}):\n{log.read_text()[-3000:]}")
    rows = []
    for path in RunLayout.at(run_dir).step_metrics_files():  # not the .moe.jsonl / .compile.json records
        rows += read_metric_records(path).records
    if any((run_dir / "captures").glob("*.json")):
        raise SystemExit(f"{run_dir}: a window was triggered; the comparison needs runs without windows")
    return rows


def summarize(pairs: list[dict[str, list[dict]]], args: argparse.Namespace) -> dict:
    def stats(rows: list[dict]) -> dict:
        times = [r["step_time_ms"] for r in rows]
        agreement = [r["stop_agreement_ms"] for r in rows if r.get("stop_agreement_ms") is not None]
        return {"rank_steps": len(times), "median_ms": round(statistics.median(times), 3),
                "steps_per_s": round(1e3 / statistics.fmean(times), 3),
                "agreement_median_ms": round(statistics.median(agreement), 4) if agreement else None}

    repeats = [{"off": stats(p["off"]), "on": stats(p["on"])} for p in pairs]
    for repeat in repeats:
        repeat["median_ratio"] = round(repeat["on"]["median_ms"] / repeat["off"]["median_ms"], 4)
        repeat["throughput_ratio"] = round(repeat["on"]["steps_per_s"] / repeat["off"]["steps_per_s"], 4)
    ratio = statistics.median(r["median_ratio"] for r in repeats)
    return {"device": args.device, "nproc": args.nproc, "preset": args.preset, "batch": args.batch, "seq": args.seq,
            "steps": args.steps, "skip": args.skip, "mode": "sequential" if args.sequential else "concurrent",
            "repeats": repeats, "median_ratio_on_off": round(ratio, 4),
            "throughput_ratio_on_off": round(statistics.median(r["throughput_ratio"] for r in repeats), 4),
            "overhead_pct": round(100 * (ratio - 1), 2)}


def host_costs(out: Path, steps: int = 20000) -> dict:
    """Host time per step of the capture controller's own work, in this process (no collective): the request
    poll (a stat of requests/ every step: the worst case, polling every step), the triggers' observe and the
    agreed-values check, for 8 ranks with all three triggers. Microseconds per step."""
    from fleetscope.traces.layout import RunLayout
    from fleetscope.trainer.capture import CaptureController
    from fleetscope.trainer.config import TrainConfig, apply_overrides
    from fleetscope.trainer.metrics import StepMetrics

    run = out / "host-costs"
    (run / "requests").mkdir(parents=True, exist_ok=True)
    config = apply_overrides(TrainConfig(run_dir=str(run), steps=steps + 10), [
        "profiler.request_poll_steps=1", "profiler.trigger=step_time>1000x,data_time>1000x,rank_step_time>1000x"])
    controller = CaptureController(config=config, layout=RunLayout.at(run), rank=0, world_size=8, planned=[],
                                   open_window=lambda window: None)
    metrics = StepMetrics(step=0, rank=0, loss=1.0, step_time_ms=10.0, data_ms=1.0, forward_ms=3.0,
                          backward_ms=5.0, optimizer_ms=1.0, tokens_per_s=1.0)
    started = time.perf_counter()
    for step in range(steps):
        values = controller.votes(step)
        controller.observe(dataclasses.replace(metrics, step=step))
        controller.agreed(step, values)
    return {"votes_observe_agreed": round((time.perf_counter() - started) / steps * 1e6, 2)}


def table(summary: dict) -> str:
    lines = [f"{summary['nproc']} rank(s), {summary['device']}, preset {summary['preset']}, {summary['mode']} arms",
             "| repeat | off median ms | on median ms | on/off | throughput on/off | agreement ms off / on |",
             "|---:|---:|---:|---:|---:|---:|"]
    for number, r in enumerate(summary["repeats"]):
        lines.append(f"| {number} | {r['off']['median_ms']:.2f} | {r['on']['median_ms']:.2f} | {r['median_ratio']:.4f} | "
                     f"{r['throughput_ratio']:.4f} | {r['off']['agreement_median_ms']} / {r['on']['agreement_median_ms']} |")
    lines.append(f"median of the repeats: on/off {summary['median_ratio_on_off']:.4f} step time, throughput "
                 f"{summary['throughput_ratio_on_off']:.4f} ({summary['overhead_pct']:+.2f}% step time)")
    lines.append(f"capture controller host work: {summary['host_cost_us_per_step']['votes_observe_agreed']} us/step "
                 "(request poll every step, 3 triggers, 8 ranks)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
