"""`fleetscope history` over many runs: the gate's bootstrap as it is against the per-resample Python loop it
replaced and the first array version, measured in the same process on the same runs.

    python bench/history_scale.py [--runs 100] [--steps 200] [--ranks 2] [--varied] [--repeats 3]

Writes RUNS synthetic run directories (job.json with one job's spec and environment, metrics/rank<R>.jsonl with
STEPS steps a rank: step times around 100 ms with noise, every 10th run 8% slower; --varied: step counts and data
times that differ by run), then times `history(root)` (the default path: the gate of each run against the runs
before it) REPEATS times with the gate's bootstrap (its cache of resamples emptied before each), once with the
loop (gate._bootstrap_interval swapped for loop_bootstrap below) and once with the first array version
(first_arrays_bootstrap), checks that all three flag the same runs, and prints the times and the ratios.
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


def first_arrays_bootstrap(base_runs, new_runs, draws):
    """The gate's first array bootstrap (commit c333ea5): each metric draws its own int64 step indexes and
    partitions float values, at two kth for an even count; runs of different lengths as one padded matrix."""
    rng = np.random.default_rng(gate_module.DEFAULT_SEED)
    base, new = _first_medians(base_runs, rng), _first_medians(new_runs, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        changes = np.where(base != 0, 100.0 * (new - base) / np.abs(base), 0.0)
    low, high = np.percentile(changes, gate_module.INTERVAL_PERCENTILES)
    return float(low), float(high)


def _first_medians(runs, rng, count=gate_module.BOOTSTRAP_RESAMPLES):
    sizes = np.array([run.size for run in runs])
    flat = np.concatenate(runs).astype(np.float64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    chosen = rng.integers(0, sizes.size, size=(count, sizes.size))
    if np.all(sizes == sizes[0]):
        steps = rng.integers(0, sizes[0], size=(count, sizes.size, int(sizes[0])))
        drawn = flat[offsets[chosen][:, :, None] + steps].reshape(count, -1)
        middle = (drawn.shape[1] - 1) // 2
        kth = [middle, middle + 1] if drawn.shape[1] % 2 == 0 else [middle]
        return np.partition(drawn, kth, axis=1)[:, kth].mean(axis=1)
    drawn = sizes[chosen]
    totals = drawn.sum(axis=1)
    run_of_value = np.repeat(chosen.ravel(), drawn.ravel())
    values = flat[offsets[run_of_value] + (rng.random(run_of_value.size) * sizes[run_of_value]).astype(np.int64)]
    lower = (totals - 1) // 2
    column = int(lower.max())
    before = column - lower
    width = int((before + totals).max())
    matrix = np.full((totals.size, width), np.inf)
    matrix[np.arange(width)[None, :] < before[:, None]] = -np.inf
    rows = np.repeat(np.arange(totals.size), totals)
    starts = np.concatenate([[0], np.cumsum(totals)[:-1]])
    matrix[rows, before[rows] + np.arange(values.size) - starts[rows]] = values
    kth = [column, column + 1] if column + 1 < width else [column]
    parted = np.partition(matrix, kth, axis=1)
    upper = parted[:, column + 1] if column + 1 < width else parted[:, column]
    return np.where(totals % 2 == 1, parted[:, column], (parted[:, column] + upper) / 2.0)


def write_runs(root: Path, runs: int, steps: int, ranks: int, varied: bool = False) -> None:
    """`varied`: each run's step count drawn from STEPS +- 10% and its data time noisy (runs as they come: no two
    gates have runs of the same lengths, and no metric is constant)."""
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
        run_steps = int(rng.integers(steps * 9 // 10, steps * 11 // 10 + 1)) if varied else steps
        for rank in range(ranks):
            times = 100.0 * slow * (1 + 0.03 * rng.standard_normal(run_steps))
            data = 1.0 + 0.2 * rng.random(run_steps) if varied else np.ones(run_steps)
            lines = [{"step": s, "rank": rank, "loss": 1.0, "step_time_ms": float(t), "data_ms": float(d),
                      "forward_ms": 30.0, "backward_ms": 50.0, "optimizer_ms": 10.0, "tokens_per_s": 4096 / (t / 1000),
                      "profiled": False}
                     for s, (t, d) in enumerate(zip(times, data))]
            (run / "metrics" / f"rank{rank}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def timed_history(root: Path, bootstrap=None) -> tuple[float, list]:
    """history(root) with the gate's bootstrap, or with `bootstrap` in its place; its time and runs."""
    gate_module._drawn_chunk.cache_clear()      # every timing starts without resamples drawn
    current = gate_module._bootstrap_interval
    gate_module._bootstrap_interval = bootstrap or current
    try:
        start = time.perf_counter()
        result = history(root)
        return time.perf_counter() - start, result.runs
    finally:
        gate_module._bootstrap_interval = current


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--varied", action="store_true", help="step counts differ by run, data times vary")
    parser.add_argument("--repeats", type=int, default=3, help="timings of the default bootstrap")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        write_runs(root, args.runs, args.steps, args.ranks, args.varied)
        timed = [timed_history(root) for _ in range(args.repeats)]
        loop_s, looped = timed_history(root, loop_bootstrap)
        first_s, first = timed_history(root, first_arrays_bootstrap)
    times = sorted(seconds for seconds, _ in timed)
    median = times[len(times) // 2]
    flagged = [[a.regressions for a in runs] for runs in (timed[0][1], looped, first)]
    same = flagged[0] == flagged[1] == flagged[2]
    print(f"history of {args.runs} runs ({args.ranks} ranks x {args.steps} steps each"
          f"{' +-10%, data times varied' if args.varied else ''}), "
          f"{gate_module.BOOTSTRAP_RESAMPLES} resamples per gate:")
    print(f"  loop bootstrap (before):        {loop_s:7.2f} s   ({loop_s / median:.1f}x the default's time)")
    print(f"  first array bootstrap:          {first_s:7.2f} s   ({first_s / median:.1f}x the default's time)")
    print(f"  bootstrap (default), median of {len(times)}: {median:5.2f} s   "
          f"(runs: {', '.join(f'{t:.2f}' for t in times)} s)")
    print(f"  runs flagged as regressions: {sum(bool(r) for r in flagged[0])} "
          f"(the same runs with all three: {same})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
