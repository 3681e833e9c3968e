"""What scheduled profiling costs the trainer: step time with profiling off, outside the profiler's
windows, and inside them (active steps), measured by the real trainer in one run.

    python bench/profiler_overhead.py --out OUT_DIR [--preset small] [--set performance.compile=...]

Two runs of `fleetscope launch` on one device with the same settings: profiling off, and a
schedule of three windows. The step times come from the runs' own metrics (CUDA-event timed);
the first --skip steps (compilation, warm-up) are left out of every median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SCHEDULE = "skip_first=20,wait=10,warmup=2,active=3,repeat=3"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--skip", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out).absolute()
    runs = {label: launch(out / f"overhead-{label}", args, profile) for label, profile in
            (("off", "off"), ("scheduled", SCHEDULE))}
    summary = summarize(runs["off"], runs["scheduled"], args.skip)
    (out / "profiler-overhead.json").write_text(json.dumps(summary, indent=2))
    print(table(summary))
    return 0


def launch(run_dir: Path, args: argparse.Namespace, profile: str) -> list[dict]:
    command = [sys.executable, "-m", "fleetscope.cli.main", "launch", "--no-post", "--nproc-per-node", "1",
               "--device", args.device, "--preset", args.preset, "--batch-size", str(args.batch),
               "--seq-len", str(args.seq), "--steps", str(args.steps), "--profile", profile,
               "--run-dir", str(run_dir), *[f"--set={o}" for o in args.overrides]]
    subprocess.run(command, check=True)
    return [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]


def summarize(off: list[dict], scheduled: list[dict], skip: int) -> dict:
    def median(rows: list[dict]) -> float:
        return round(statistics.median(r["step_time_ms"] for r in rows), 3)

    baseline = median([r for r in off if r["step"] >= skip])
    outside = median([r for r in scheduled if r["step"] >= skip and not r["profiled"]])
    inside = median([r for r in scheduled if r["step"] >= skip and r["profiled"]])
    return {
        "schedule": SCHEDULE,
        "off_ms": baseline,
        "outside_windows_ms": outside,
        "inside_windows_ms": inside,
        "outside_overhead_pct": round(100 * (outside / baseline - 1), 2),
        "inside_overhead_pct": round(100 * (inside / baseline - 1), 2),
    }


def table(summary: dict) -> str:
    return "\n".join([
        "| profiling | median step ms | vs off |",
        "|---|---:|---:|",
        f"| off | {summary['off_ms']:.2f} | 1.000 |",
        f"| scheduled, outside windows | {summary['outside_windows_ms']:.2f} | "
        f"{summary['outside_windows_ms'] / summary['off_ms']:.3f} |",
        f"| scheduled, inside windows (warmup + active) | {summary['inside_windows_ms']:.2f} | "
        f"{summary['inside_windows_ms'] / summary['off_ms']:.3f} |",
    ])


if __name__ == "__main__":
    sys.exit(main())
