"""Wall time and peak memory of the default `fleetscope postprocess` (gather + analyze + merge).

Builds a run directory of N synthetic ranks from one real GPU trace (analysis/synthetic.py: every rank
a copy with its own rank, host and clock), then runs `fleetscope postprocess RUN` as a subprocess,
with no special flags and a private, empty parsed-trace cache (a cold run, what a user gets the first
time), and reports the wall time of each stage and the peak memory of the whole process tree (largest sum
of RSS over the process and all its descendants, sampled every 0.1 s with psutil).

In the same run, on the same traces, stock HTA: `TraceAnalysis(trace_dir=...)` (HTA's own JSON loader,
its own multiprocessing) + temporal breakdown + idle-time breakdown + comm/comp overlap + kernel
breakdown, all ranks; the ratios of its wall time to the whole `postprocess` and to its analyze stage
(which includes HTA's views) are printed.

    python bench/postprocess_scale.py --ranks 8 64            # synthetic sets
    python bench/postprocess_scale.py --run-dir runs/demo     # an existing run (e.g. the demo's)
    python bench/postprocess_scale.py --ranks 256 --no-stock-hta
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set
from fleetscope.traces.layout import RunLayout, trace_file_name, window_name

DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / "tests/fixtures/gpu/h200-small-hf-eager-2steps.json.gz"
_STAGE_RE = re.compile(r"^(gather|analyze|merge) took (\d+(?:\.\d+)?) s$", re.MULTILINE)
SAMPLE_SECONDS = 0.1
STOCK_HTA = textwrap.dedent("""
    import logging, sys, warnings
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis
    analysis = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
    ranks = sorted(analysis.t.traces)
    analysis.get_temporal_breakdown(visualize=False)
    analysis.get_idle_time_breakdown(ranks=ranks, visualize=False, show_idle_interval_stats=True)
    analysis.get_comm_comp_overlap(visualize=False)
    analysis.get_gpu_kernel_breakdown(visualize=False)
""")


def make_run(source: Path, root: Path, ranks: int) -> Path:
    """A run directory of `ranks` synthetic ranks in one window (no job.json: a bare trace tree)."""
    layout = RunLayout.at(root)
    window = layout.traces_dir / window_name(0)
    staging = root / "staging"
    paths = make_trace_set(source, staging, TraceSetSpec(ranks=ranks))
    window.mkdir(parents=True, exist_ok=True)
    for rank, path in enumerate(paths):
        path.rename(window / trace_file_name(rank=rank, host=f"node{rank // 8}"))
    shutil.rmtree(staging)
    return root


def run_postprocess(run_dir: Path, cache_dir: Path) -> dict:
    env = {**os.environ, "FLEETSCOPE_CACHE_DIR": str(cache_dir)}
    command = [sys.executable, "-m", "fleetscope.cli.main", "postprocess", str(run_dir), "--timings"]
    exit_code, wall, peak_mb, output = run_watched(command, env)
    stages = {name: float(seconds) for name, seconds in _STAGE_RE.findall(output)}
    return {"exit": exit_code, "wall_s": round(wall, 2), "stages_s": stages, "peak_tree_rss_mb": peak_mb}


def run_stock_hta(trace_dir: Path) -> dict:
    exit_code, wall, peak_mb, output = run_watched([sys.executable, "-c", STOCK_HTA, str(trace_dir)], dict(os.environ))
    return {"exit": exit_code, "wall_s": round(wall, 2), "peak_tree_rss_mb": peak_mb,
            **({"error": output.strip().splitlines()[-1][:200]} if exit_code and output.strip() else {})}


def run_watched(command: list[str], env: dict) -> tuple[int, float, float, str]:
    """(exit code, wall seconds, peak RSS of the process tree in MB, stdout+stderr)."""
    with tempfile.TemporaryFile("w+") as sink:
        started = time.perf_counter()
        process = psutil.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        peak = 0
        while process.poll() is None:
            peak = max(peak, _tree_rss(process))
            time.sleep(SAMPLE_SECONDS)
        wall = time.perf_counter() - started
        sink.seek(0)
        return process.returncode, wall, round(peak / 2**20, 1), sink.read()


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for member in members:
        try:
            total += member.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--run-dir", type=Path, action="append", default=[], help="an existing run directory")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--no-stock-hta", action="store_true", help="skip the stock HTA run")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="fleetscope-bench-") as scratch:
        targets = [(f"{n} synthetic ranks", make_run(args.source, Path(scratch) / f"set{n}", n)) for n in args.ranks]
        targets += [(str(path), path) for path in args.run_dir]
        for label, run_dir in targets:
            cache = Path(scratch) / f"cache-{len(results)}"
            measured = run_postprocess(run_dir, cache)
            if not args.no_stock_hta:
                stock = run_stock_hta(RunLayout.at(run_dir).traces_dir / window_name(0))
                measured["stock_hta"] = stock
                if stock["exit"] == 0 and measured["wall_s"] > 0:
                    measured["stock_hta_over_postprocess"] = round(stock["wall_s"] / measured["wall_s"], 1)
                if stock["exit"] == 0 and measured["stages_s"].get("analyze"):
                    measured["stock_hta_over_analyze"] = round(stock["wall_s"] / measured["stages_s"]["analyze"], 1)
            results.append({"input": label, **measured})
            print(f"{label}: {json.dumps(measured)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
