"""`fleetscope history` over many runs: the gate's bootstrap drawn as arrays against the per-resample Python loop
it replaced, measured in the same process on the same runs.

    python bench/history_scale.py [--runs 100] [--steps 200] [--ranks 2]

Writes RUNS synthetic run directories (job.json with one job's spec and environment, metrics/rank<R>.jsonl with
STEPS steps a rank: step times around 100 ms with noise, every 10th run 8% slower), then times `history(root)`
(the default path: the gate of each run against the runs before it) with the array bootstrap and with the loop
(gate._bootstrap_interval swapped for LOOP_BOOTSTRAP below), checks that both flag the same regressions and
that their intervals agree within the bootstrap's own noise, and prints both times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fleetscope.analysis import gate as gate_module
from fleetscope.analysis.history import history


def loop_bootstrap(base_runs, new_runs, draws):
    """The gate's bootstrap as it was: one Python iteration, two concatenations and two medians a resample
    (seeded as the gate is; `draws`, the gate's own resamples, is not used)."""
    rng = np.random.default_rng(gate_module.DEFAULT_SEED)

    def resample(runs):
        chosen = rng.integers(0, len(runs), size=len(runs))
        return np.concatenate([rng.choice(runs[i], size=runs[i].size, replace=True) for i in chosen])

    changes = np.empty(gate_module.BOOTSTRAP_RESAMPLES)
    for index in range(gate_module.BOOTSTRAP_RESAMPLES):
        base = np.median(resample(base_runs))
        changes[index] = 100.0 * (np.median(resample(new_runs)) - base) / abs(base) if base else 0.0
    low, high = np.percentile(changes, gate_module.INTERVAL_PERCENTILES)
    return float(low), float(high)


def write_runs(root: Path, runs: int, steps: int, ranks: int) -> None:
    rng = np.random.default_rng(0)
    spec = {"scheduler": "local", "nodes": 1, "nproc_per_node": ranks,
            "train": {"model": {"family": "qwen3_moe"}, "steps": steps, "seed": 0}}
    environment = {"torch": "2.13.0", "python": "3.11", "gpu_model": None}
    for index in range(runs):
        run = root / f"run{index:03d}"
        (run / "metrics").mkdir(parents=True)
        slow = 1.08 if index % 10 == 9 else 1.0
        (run / "job.json").write_text(json.dumps({"spec": spec, "environment": environment, "status": "succeeded",
                                                  "started_at": f"2026-12-{1 + index // 24:02d}T{index % 24:02d}:00:00+00:00"}))
        for rank in range(ranks):
            times = 100.0 * slow * (1 + 0.03 * rng.standard_normal(steps))
            lines = [{"step": s, "rank": rank, "loss": 1.0, "step_time_ms": float(t), "data_ms": 1.0, "forward_ms": 30.0,
                      "backward_ms": 50.0, "optimizer_ms": 10.0, "tokens_per_s": 4096 / (t / 1000), "profiled": False}
                     for s, t in enumerate(times)]
            (run / "metrics" / f"rank{rank}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def timed_history(root: Path) -> tuple[float, list]:
    start = time.perf_counter()
    result = history(root)
    return time.perf_counter() - start, result.runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        write_runs(root, args.runs, args.steps, args.ranks)
        arrays_s, arrays = timed_history(root)
        vectorized = gate_module._bootstrap_interval
        gate_module._bootstrap_interval = loop_bootstrap
        try:
            loop_s, looped = timed_history(root)
        finally:
            gate_module._bootstrap_interval = vectorized
    same = [a.regressions for a in arrays] == [b.regressions for b in looped]
    flagged = sum(bool(a.regressions) for a in arrays)
    print(f"history of {args.runs} runs ({args.ranks} ranks x {args.steps} steps each), "
          f"{gate_module.BOOTSTRAP_RESAMPLES} resamples per gate:")
    print(f"  loop bootstrap (before):   {loop_s:7.2f} s")
    print(f"  array bootstrap (default): {arrays_s:7.2f} s   ({loop_s / arrays_s:.1f}x faster)")
    print(f"  runs flagged as regressions: {flagged} (the same runs with both: {same})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
