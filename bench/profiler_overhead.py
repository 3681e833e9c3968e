"""What profiling and the always-on capture parts cost the trainer, measured by the real trainer on one device.

    python bench/profiler_overhead.py --out OUT_DIR [--compile none|default|reduce-overhead] [--repeats 3]
                                      [--preset small --batch 4 --seq 128 --steps 90]

Four arms of `fleetscope launch`, run one after the other in ABAB order (round r runs the arms forward when r is
even, backward when odd), --repeats rounds:
  capture_off  no profiling, the capture parts off (bench/capture_overhead.py's OFF settings)
  never        no profiling, the capture parts on (capture_overhead.py's ON: on-demand polling, Flight Recorder,
               hang watchdog, triggers evaluated every step)
  profiled     capture on, --schedule windows, CUPTI left subscribed after them (profiler.cupti_teardown=false)
  teardown     capture on, --schedule windows, the default: TEARDOWN_CUPTI=1 on every rank (traces/cupti.py)
Step times come from the runs' own metrics (CUDA-event timed). Compared, as the difference of pooled medians
with a bootstrap interval that resamples runs then steps (analysis/per_rank/profiling_cost.py):
  * after the last window: steps >= the last window's end, each profiled arm vs never;
  * inside the windows: the profiled steps of each profiled arm vs the same steps of never;
  * the capture parts: never vs capture_off, all steps from --skip;
  * per run, after-window steps over the steps before the first window (the issue's own ratio).
Targets: after-window within 1% of never (interval includes 0 or lies within +-1%); inside <= 5% compiled.
Writes OUT_DIR/profiler-overhead.json after every round (a run stopped early keeps what it measured) and prints
a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fleetscope.analysis.per_rank.profiling_cost import median_difference
from fleetscope.traces import cupti
from fleetscope.traces.formats import read_metric_records
from fleetscope.traces.layout import RunLayout

sys.path.insert(0, str(Path(__file__).parent))
from capture_overhead import OFF as CAPTURE_OFF, ON as CAPTURE_ON  # noqa: E402

SCHEDULE = "skip_first=10,wait=5,warmup=2,active=3,repeat=3"
"""Three windows, steps 15-19, 25-29, 35-39 (warmup + active); steps 3-14 come before, 40 on after."""
ARMS: dict[str, tuple[str, list[str]]] = {
    "capture_off": ("off", CAPTURE_OFF),
    "never": ("off", CAPTURE_ON),
    "profiled": (SCHEDULE, [*CAPTURE_ON, "profiler.cupti_teardown=false"]),
    "teardown": (SCHEDULE, CAPTURE_ON),
}
PROFILED_ARMS = ("profiled", "teardown")
AFTER_TARGET_PCT, INSIDE_TARGET_PCT = 1.0, 5.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--skip", type=int, default=3, help="steps left out at the start (compilation, warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every arm once")
    parser.add_argument("--compile", default="none", help="performance.compile")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        order = list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            runs[arm].append(launch(out / f"{arm}-{repeat}", args, arm))
        summary = summarize(runs, args)
        (out / "profiler-overhead.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(table(summary), flush=True)
    return 0


def launch(run_dir: Path, args: argparse.Namespace, arm: str) -> list[dict]:
    profile, settings = ARMS[arm]
    command = [sys.executable, "-m", "fleetscope.cli.main", "launch", "--no-post", "--nproc-per-node", "1",
               "--device", args.device, "--preset", args.preset, "--batch-size", str(args.batch),
               "--seq-len", str(args.seq), "--steps", str(args.steps), "--profile", profile,
               "--run-dir", str(run_dir),
               *[f"--set={s}" for s in [*settings, f"performance.compile={args.compile}",
                                        "observability.clock_round_trips=0", *args.overrides]]]
    environment = {k: v for k, v in os.environ.items() if k not in (cupti.TEARDOWN_VAR, cupti.DEFAULT_MARK_VAR)}
    started = time.monotonic()
    completed = subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if completed.returncode:
        raise SystemExit(f"{run_dir}: launch failed ({completed.returncode}):\n{completed.stdout[-3000:]}")
    print(f"{arm}: {run_dir.name} in {time.monotonic() - started:.0f} s", flush=True)
    rows = []
    for path in RunLayout.at(run_dir).step_metrics_files():
        rows += read_metric_records(path).records
    return sorted(rows, key=lambda r: r["step"])


def summarize(runs: dict[str, list[list[dict]]], args: argparse.Namespace) -> dict:
    steady = {arm: [[r for r in rows if r["step"] >= args.skip] for rows in arm_runs] for arm, arm_runs in runs.items()}
    summary: dict = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                     "compile": args.compile, "schedule": SCHEDULE, "skip": args.skip,
                     "rounds": len(runs["never"]), "arms": {}}
    for arm in PROFILED_ARMS:
        if not steady[arm] or not steady["never"]:
            continue
        summary["arms"][arm] = arm_summary(steady[arm], steady["never"])
    if steady["capture_off"] and steady["never"]:
        summary["capture_on_vs_off"] = _as_dict(median_difference(_times(steady["never"]), _times(steady["capture_off"])))
    summary["median_ms"] = {arm: _median_ms(rows) for arm, rows in steady.items() if rows}
    reference = steady["profiled"][0] if steady["profiled"] else []
    summary["never_after_over_before"] = [after_over_before(rows, *window_span(reference)) for rows in steady["never"]]
    return summary


def arm_summary(arm_runs: list[list[dict]], never_runs: list[list[dict]]) -> dict:
    start = window_span(arm_runs[0])[1]
    profiled_steps = {r["step"] for r in arm_runs[0] if r.get("profiled")}
    after = [[r for r in rows if r["step"] >= start] for rows in arm_runs]
    never_after = [[r for r in rows if r["step"] >= start] for rows in never_runs]
    inside = [[r for r in rows if r.get("profiled")] for rows in arm_runs]
    never_inside = [[r for r in rows if r["step"] in profiled_steps] for rows in never_runs]
    return {"after_from_step": start,
            "after_vs_never": _as_dict(median_difference(_times(after), _times(never_after))),
            "inside_vs_never": _as_dict(median_difference(_times(inside), _times(never_inside))),
            "after_over_before": [after_over_before(rows, *window_span(rows)) for rows in arm_runs]}


def window_span(rows: list[dict]) -> tuple[int | None, int | None]:
    """The first profiled step and the first step after the last window (None, None: no window)."""
    profiled = [r["step"] for r in rows if r.get("profiled")]
    return (min(profiled), max(profiled) + 1) if profiled else (None, None)


def after_over_before(rows: list[dict], first: int | None, start: int | None) -> float | None:
    """Median of the steps from `start` over the median of the steps before `first` (the first profiled step;
    for an unprofiled run, the profiled arms')."""
    if first is None or start is None:
        return None
    before = [r["step_time_ms"] for r in rows if r["step"] < first]
    after = [r["step_time_ms"] for r in rows if r["step"] >= start]
    if not before or not after:
        return None
    return round(_median(after) / _median(before), 4)


def _times(runs: list[list[dict]]) -> list[list[float]]:
    return [[r["step_time_ms"] for r in rows] for rows in runs]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _median_ms(runs: list[list[dict]]) -> list[float]:
    return [round(_median([r["step_time_ms"] for r in rows]), 3) for rows in runs]


def _as_dict(difference) -> dict | None:
    return None if difference is None else {"median_pct": difference.median_pct, "low_pct": difference.low_pct,
                                            "high_pct": difference.high_pct}


def _interval(difference: dict | None) -> str:
    if difference is None:
        return "n/a"
    return f"{difference['median_pct']:+.2f}% [{difference['low_pct']:+.2f}, {difference['high_pct']:+.2f}]"


def verdict(difference: dict | None, target: float) -> str:
    if difference is None:
        return "n/a"
    inside = difference["low_pct"] <= 0 <= difference["high_pct"] or (
        -target <= difference["low_pct"] and difference["high_pct"] <= target)
    return "met" if inside else "NOT met"


def table(summary: dict) -> str:
    lines = [f"preset {summary['preset']}, batch {summary['batch']} x {summary['seq']}, {summary['steps']} steps, "
             f"compile {summary['compile']}, schedule {summary['schedule']}, {summary['rounds']} ABAB round(s)",
             "| arm | after last window vs never (median %, 95% interval) | target 1% | inside windows vs never | "
             "after / before per run |", "|---|---|---|---|---|"]
    for arm, result in summary["arms"].items():
        lines.append(f"| {arm} | {_interval(result['after_vs_never'])} | {verdict(result['after_vs_never'], AFTER_TARGET_PCT)} | "
                     f"{_interval(result['inside_vs_never'])} | {', '.join(map(str, result['after_over_before']))} |")
    lines.append(f"| never | | | | {', '.join(map(str, summary['never_after_over_before']))} |")
    lines.append(f"capture parts on vs off (all steps from {summary['skip']}): {_interval(summary.get('capture_on_vs_off'))}")
    lines.append("median step ms per run: " + "; ".join(f"{arm} {values}" for arm, values in summary["median_ms"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
