"""How the whole-run analysis scales: 1,024 ranks x 100,000 steps of timelines (traces/timeline.py).

    python bench/whole_run_scale.py [--ranks 1024] [--steps 100000] [--work DIR] [--keep]

Writes a synthetic run into a temporary directory (or `--work`): every rank's `metrics/rank<R>.timeline`
(header and TIMELINE_DTYPE records written directly; lognormal step-time noise of 5%, a profiled window of
3 steps every 10,000, a clock offset per rank) with rank 37 planted 18% slower from step 34,000 to the end.
Then, each in its own process, cold in the same page cache:
  floor      np.fromfile of every rank's file (every record read once, nothing computed): the I/O floor
  analysis   analysis/cross_rank/whole_run.whole_run_section on the run directory
Reported: wall seconds, peak RSS of the process, the ratio analysis / floor, whether the planted rank was
found (its start step and size), and the load average (the analysis runs on up to WORKERS threads: other
work on the cores slows it). The data is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SLOW_RANK, SLOW_FROM, SLOW_FACTOR = 37, 34_000, 1.18


def write_run(root: Path, ranks: int, steps: int) -> None:
    from fleetscope.traces.clock import ClockOffset, write_clock_offset
    from fleetscope.traces.layout import RunLayout
    from fleetscope.traces.timeline import FLAG_FIRST, FLAG_PROFILED, HEADER, MAGIC, TIMELINE_DTYPE

    layout = RunLayout.at(root)
    layout.metrics_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    step = np.arange(steps)
    profiled = (step % 10_000 >= 5_000) & (step % 10_000 < 5_003)
    common = 100.0 * np.exp(rng.normal(0, 0.02, steps))  # what every rank shares (data, collectives)
    begins = 1.7e15 + np.concatenate([[0.0], np.cumsum(common[:-1] * 1.1e3)])
    for rank in range(ranks):
        offset = 0.0 if rank == 0 else float(rng.normal(0, 300))
        if rank:
            write_clock_offset(ClockOffset(rank=rank, offset_us=offset, uncertainty_us=5.0, best_round_trip_us=10.0,
                                           round_trips=16, host=f"node{rank // 8}", measured_at_ns=0),
                               layout.clock_file(rank))
        records = np.zeros(steps, dtype=TIMELINE_DTYPE)
        step_ms = common * np.exp(rng.normal(0, 0.05, steps))
        if rank == SLOW_RANK:
            step_ms[SLOW_FROM:] *= SLOW_FACTOR
        records["step"], records["step_ms"] = step, step_ms
        records["start_us"] = begins + offset
        records["data_ms"] = step_ms * 0.05
        records["first_collective_ms"] = step_ms * 0.7
        records["exposed_comm_ms"] = np.nan
        records["flags"] = np.where(profiled, FLAG_PROFILED, 0) | np.where(step == 0, FLAG_FIRST, 0)
        with open(layout.timeline_file(rank), "wb") as handle:
            handle.write(HEADER.pack(MAGIC, TIMELINE_DTYPE.itemsize, rank))
            records.tofile(handle)


def floor(root: Path) -> dict:
    from fleetscope.traces.timeline import HEADER, TIMELINE_DTYPE

    started, count = time.perf_counter(), 0
    for path in sorted((root / "metrics").glob("*.timeline")):
        count += np.fromfile(path, dtype=TIMELINE_DTYPE, offset=HEADER.size).size
    return {"wall_s": time.perf_counter() - started, "records": count}


def analysis(root: Path) -> dict:
    from fleetscope.analysis.cross_rank.whole_run import whole_run_section
    from fleetscope.traces.layout import RunLayout

    started = time.perf_counter()
    section = whole_run_section(RunLayout.at(root))
    wall = time.perf_counter() - started
    found = [s for s in section.slow_ranks if s.rank == SLOW_RANK]
    return {"wall_s": wall, "slow_ranks": len(section.slow_ranks), "changes": section.changes_total,
            "found_from_step": found[0].from_step if found else None,
            "found_excess_pct": found[0].excess_pct if found else None,
            "found_to_the_end": found[0].to_the_end if found else None}


def _child(kind: str, root: Path) -> dict:
    """One measurement in a fresh process: its result and peak RSS (MiB)."""
    code = (f"import json, resource, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import whole_run_scale as b; from pathlib import Path; r = b.{kind}(Path({str(root)!r})); "
            "r['peak_rss_mib'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024; print(json.dumps(r))")
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    root = args.work or Path(tempfile.mkdtemp(prefix="whole-run-bench-"))
    try:
        started = time.perf_counter()
        write_run(root, args.ranks, args.steps)
        print(f"wrote {args.ranks} ranks x {args.steps:,} steps in {time.perf_counter() - started:.1f} s under {root}")
        _child("floor", root)  # the first read fills the page cache; both measurements below find it warm
        base, result = _child("floor", root), _child("analysis", root)
        print(f"{'':10} {'wall s':>8} {'peak RSS MiB':>13}")
        print(f"{'floor':10} {base['wall_s']:8.2f} {base['peak_rss_mib']:13.0f}   np.fromfile of every record")
        print(f"{'analysis':10} {result['wall_s']:8.2f} {result['peak_rss_mib']:13.0f}   whole_run_section")
        print(f"ratio analysis / floor: {result['wall_s'] / base['wall_s']:.1f}x")
        print("load average (1, 5, 15 min) after the analysis: " + ", ".join(f"{v:.1f}" for v in os.getloadavg()))
        print(f"planted rank {SLOW_RANK} +{100 * (SLOW_FACTOR - 1):.0f}% from step {SLOW_FROM:,}: found from step "
              f"{result['found_from_step']}, {result['found_excess_pct']}% (to the end: {result['found_to_the_end']}); "
              f"slow-rank findings {result['slow_ranks']}, change points {result['changes']}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
