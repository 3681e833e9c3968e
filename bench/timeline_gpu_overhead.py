"""What the always-on whole-run parts cost the trainer on a real device: the per-step timeline record
(traces/timeline.py) and the change detector behind the relative anomaly triggers (traces/change_points.py).

    python bench/timeline_gpu_overhead.py --out OUT_DIR [--compile none|reduce-overhead] [--repeats 6]
                                          [--preset small --batch 4 --seq 128 --steps 150 --skip 10]

Two arms of `fleetscope launch`, one process each, run one after the other in ABAB order (round r runs
off, on when r is even; on, off when odd), --repeats rounds, no profiler window in either:
  off  observability.step_timeline=false, no trigger: neither part runs
  on   the timeline on (the default) and triggers step_time>1000x,data_time>1000x: a detector per trigger is fed
       every step but never fires (so no window is taken). This also counts the trigger votes that predate
       the detector: an upper bound of what the whole run adds.
Step times come from the runs' own metrics (CUDA-event timed), the first --skip steps left out. Two statistics:
  * pooled: difference of the pooled medians, with a bootstrap interval resampling runs then steps
    (analysis/per_rank/profiling_cost.median_difference);
  * paired: per round, the on run's median step over the off run's of the same round (neighbours in time see
    the same device state); their median and range.
Target (issue: the whole run): <= 0.2% of step time. Writes OUT_DIR/timeline-overhead.json after every round (a run
stopped early keeps what it measured) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fleetscope.analysis.per_rank.profiling_cost import median_difference
from fleetscope.traces.formats import read_metric_records
from fleetscope.traces.layout import RunLayout

ARMS: dict[str, list[str]] = {
    "off": ["observability.step_timeline=false", "profiler.trigger="],
    "on": ["observability.step_timeline=true", "profiler.trigger=step_time>1000x,data_time>1000x"],
}
TARGET_PCT = 0.2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=10, help="steps left out at the start (compilation, warm-up)")
    parser.add_argument("--repeats", type=int, default=6, help="rounds; each runs both arms once")
    parser.add_argument("--compile", default="none", help="performance.compile")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        for arm in (list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))):
            runs[arm].append(step_times(launch(out / f"{arm}-{repeat}", args, arm), args.skip))
        summary = summarize(runs, args)
        (out / "timeline-overhead.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(table(summary), flush=True)
    return 0


def launch(run_dir: Path, args: argparse.Namespace, arm: str) -> list[dict]:
    command = [sys.executable, "-m", "fleetscope.cli.main", "launch", "--no-post", "--nproc-per-node", "1",
               "--device", args.device, "--preset", args.preset, "--batch-size", str(args.batch),
               "--seq-len", str(args.seq), "--steps", str(args.steps), "--profile", "off", "--run-dir", str(run_dir),
               *[f"--set={s}" for s in [*ARMS[arm], f"performance.compile={args.compile}",
                                        "observability.clock_round_trips=0", *args.overrides]]]
    started = time.monotonic()
    completed = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if completed.returncode:
        raise SystemExit(f"{run_dir}: launch failed ({completed.returncode}):\n{completed.stdout[-3000:]}")
    layout = RunLayout.at(run_dir)
    timelines = layout.timeline_ranks()
    if (arm == "on") != bool(timelines):
        raise SystemExit(f"{run_dir}: arm {arm} but timeline files for ranks {timelines}")
    print(f"{arm}: {run_dir.name} in {time.monotonic() - started:.0f} s", flush=True)
    rows = []
    for path in layout.step_metrics_files():
        rows += read_metric_records(path).records
    return rows


def step_times(rows: list[dict], skip: int) -> list[float]:
    return [float(r["step_time_ms"]) for r in sorted(rows, key=lambda r: r["step"]) if r["step"] >= skip]


def summarize(runs: dict[str, list[list[float]]], args: argparse.Namespace) -> dict:
    pooled = median_difference(runs["on"], runs["off"])
    paired = [100.0 * (statistics.median(on) / statistics.median(off) - 1.0)
              for on, off in zip(runs["on"], runs["off"])]
    return {"preset": args.preset, "batch": args.batch, "seq": args.seq, "steps": args.steps, "skip": args.skip,
            "compile": args.compile, "rounds": len(paired),
            "median_ms": {arm: [round(statistics.median(r), 3) for r in arm_runs] for arm, arm_runs in runs.items()},
            "pooled_pct": None if pooled is None else {"median": pooled.median_pct, "low": pooled.low_pct,
                                                       "high": pooled.high_pct},
            "paired_pct": [round(p, 3) for p in paired],
            "paired_median_pct": round(statistics.median(paired), 3) if paired else None}


def table(summary: dict) -> str:
    pooled = summary["pooled_pct"]
    pooled_text = "n/a" if pooled is None else f"{pooled['median']:+.3f}% [{pooled['low']:+.3f}, {pooled['high']:+.3f}]"
    paired = summary["paired_pct"]
    return "\n".join([
        f"preset {summary['preset']}, batch {summary['batch']} x {summary['seq']}, {summary['steps']} steps "
        f"(first {summary['skip']} left out), compile {summary['compile']}, {summary['rounds']} ABAB round(s)",
        "| statistic | on vs off | target |", "|---|---|---|",
        f"| pooled medians, 95% bootstrap interval | {pooled_text} | <= {TARGET_PCT}% |",
        f"| paired rounds: median [min, max] | {summary['paired_median_pct']:+.3f}% "
        f"[{min(paired):+.3f}, {max(paired):+.3f}] | <= {TARGET_PCT}% |",
        "median step ms per run: " + "; ".join(f"{arm} {values}" for arm, values in summary["median_ms"].items()),
    ])


if __name__ == "__main__":
    sys.exit(main())
