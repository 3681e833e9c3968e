"""What the always-on whole-run parts cost the trainer on a real device: the per-step timeline record
(traces/timeline.py) and the change detectors behind the relative anomaly triggers (traces/change_points.py).

    python bench/timeline_gpu_overhead.py --out OUT_DIR [--compile none|reduce-overhead] [--steps 300]
                                          [--block 10] [--preset small --batch 4 --seq 128 --skip 20]

One `fleetscope launch` with the timeline on and triggers step_time>1000x,data_time>1000x (a detector per trigger
fed every step, never firing, so no window is taken), no profiler window. A probe loaded into the trainer
(bench/timeline_probe/sitecustomize.py, through PYTHONPATH) turns both parts off in alternate blocks of --block
steps (ABAB inside one process: between processes the same settings differ by up to +-20% at host-bound shapes on
the H200's host, which hides anything under a few percent), times each of their calls, and notes when the loop
reaches each step's record. Two results:
  * throughput: the loop's period (from one step's record to the next: everything a step costs, including the
    work between steps where these parts run; the per-step metrics' step_time_ms leaves that out) in the on
    blocks over the off blocks: median difference, with a 95% bootstrap interval resampling blocks;
  * direct: the host time the parts took per step (on blocks), as a share of the median period: the bound on
    what they can add, since they are host-only and add no device sync.
Target (issue: the whole run): <= 0.2% of step time. Writes OUT_DIR/timeline-overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SETTINGS = ["observability.step_timeline=true", "profiler.trigger=step_time>1000x,data_time>1000x"]
TARGET_PCT = 0.2
PROBE_DIR = Path(__file__).parent / "timeline_probe"
RESAMPLES = 2000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block", type=int, default=10, help="steps per block; blocks alternate on, off")
    parser.add_argument("--skip", type=int, default=20, help="steps left out at the start (compilation, warm-up)")
    parser.add_argument("--compile", default="none", help="performance.compile")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    probes = launch(out / f"run-{args.compile}", out / f"probe-{args.compile}", args)
    summary = {"preset": args.preset, "batch": args.batch, "seq": args.seq, "steps": args.steps, "block": args.block,
               "skip": args.skip, "compile": args.compile, "ranks": [summarize(p, args.skip) for p in probes]}
    (out / "timeline-overhead.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary), flush=True)
    return 0


def launch(run_dir: Path, probe_dir: Path, args: argparse.Namespace) -> list[dict]:
    probe_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "fleetscope.cli.main", "launch", "--no-post", "--nproc-per-node", "1",
               "--device", args.device, "--preset", args.preset, "--batch-size", str(args.batch),
               "--seq-len", str(args.seq), "--steps", str(args.steps), "--profile", "off", "--run-dir", str(run_dir),
               *[f"--set={s}" for s in [*SETTINGS, f"performance.compile={args.compile}",
                                        "observability.clock_round_trips=0", *args.overrides]]]
    environment = dict(os.environ, FS_TIMELINE_PROBE_OUT=str(probe_dir), FS_TIMELINE_PROBE_BLOCK=str(args.block),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(PROBE_DIR), os.environ.get("PYTHONPATH")])))
    started = time.monotonic()
    completed = subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               check=False)
    if completed.returncode:
        raise SystemExit(f"{run_dir}: launch failed ({completed.returncode}):\n{completed.stdout[-3000:]}")
    print(f"{run_dir.name} in {time.monotonic() - started:.0f} s", flush=True)
    probes = [json.loads(path.read_text()) for path in sorted(probe_dir.glob("probe-rank*.json"))]
    probes = [p for p in probes if len(p["arm"]) >= args.steps // 2]  # the trainer's, not a helper process's
    if not probes:
        raise SystemExit(f"{probe_dir}: the probe wrote nothing (was bench/timeline_probe on PYTHONPATH?)")
    return probes


def summarize(probe: dict, skip: int) -> dict:
    arm = {int(step): value for step, value in probe["arm"].items()}
    entered = {int(step): ns for step, ns in probe["entered_ns"].items()}
    host_ns = {int(step): ns for step, ns in probe["host_ns"].items()}
    # step t's period (record t-1 -> record t) holds the parts' work for step t-1: it belongs to t-1's arm
    periods: dict[str, list[tuple[int, float]]] = {"on": [], "off": []}
    for step in sorted(entered):
        if step - 1 in entered and step - 1 >= skip and step - 1 in arm:
            periods[arm[step - 1]].append(((step - 1) // probe["block"], (entered[step] - entered[step - 1]) / 1e6))
    on_ms, off_ms = [ms for _, ms in periods["on"]], [ms for _, ms in periods["off"]]
    low, high = _bootstrap(periods["on"], periods["off"])
    host_us = [host_ns[s] / 1e3 for s in sorted(host_ns) if s >= skip]
    median_period = statistics.median(on_ms + off_ms)
    return {"periods_on": len(on_ms), "periods_off": len(off_ms),
            "median_period_on_ms": round(statistics.median(on_ms), 4),
            "median_period_off_ms": round(statistics.median(off_ms), 4),
            "throughput_pct": round(100.0 * (statistics.median(on_ms) / statistics.median(off_ms) - 1.0), 3),
            "throughput_low_pct": low, "throughput_high_pct": high,
            "host_us_median": round(statistics.median(host_us), 2), "host_us_mean": round(statistics.mean(host_us), 2),
            "host_us_p99": round(float(np.quantile(host_us, 0.99)), 2),
            "host_share_pct": round(100.0 * statistics.mean(host_us) / 1e3 / median_period, 4)}


def _bootstrap(on: list[tuple[int, float]], off: list[tuple[int, float]]) -> tuple[float, float]:
    """95% interval of the on/off median ratio (percent), resampling whole blocks within each arm."""
    rng = np.random.default_rng(0)
    on_blocks, off_blocks = _blocks(on), _blocks(off)
    ratios = np.empty(RESAMPLES)
    for index in range(RESAMPLES):
        on_pick = np.concatenate([on_blocks[i] for i in rng.integers(0, len(on_blocks), len(on_blocks))])
        off_pick = np.concatenate([off_blocks[i] for i in rng.integers(0, len(off_blocks), len(off_blocks))])
        ratios[index] = np.median(on_pick) / np.median(off_pick)
    low, high = np.quantile(100.0 * (ratios - 1.0), [0.025, 0.975])
    return round(float(low), 3), round(float(high), 3)


def _blocks(periods: list[tuple[int, float]]) -> list[np.ndarray]:
    grouped: dict[int, list[float]] = {}
    for block, ms in periods:
        grouped.setdefault(block, []).append(ms)
    return [np.asarray(values) for values in grouped.values()]


def table(summary: dict) -> str:
    lines = [f"preset {summary['preset']}, batch {summary['batch']} x {summary['seq']}, {summary['steps']} steps "
             f"(first {summary['skip']} left out), compile {summary['compile']}, blocks of {summary['block']} steps "
             "alternating on/off in one process",
             "| rank | median period on / off ms | throughput cost, 95% interval | parts' host time per step "
             "(median, mean, p99 us) | host share of the period | target |",
             "|---|---|---|---|---|---|"]
    for rank, r in enumerate(summary["ranks"]):
        lines.append(f"| {rank} | {r['median_period_on_ms']} / {r['median_period_off_ms']} | "
                     f"{r['throughput_pct']:+.3f}% [{r['throughput_low_pct']:+.3f}, {r['throughput_high_pct']:+.3f}] | "
                     f"{r['host_us_median']}, {r['host_us_mean']}, {r['host_us_p99']} | {r['host_share_pct']:.4f}% | "
                     f"<= {TARGET_PCT}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
