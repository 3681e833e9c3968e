"""Wall time and peak memory of the default `fleetscope postprocess` (gather + analyze + merge).

Builds a run directory of N synthetic ranks from one real GPU trace (analysis/synthetic.py: every rank
a copy with its own rank, host and clock), then runs `fleetscope postprocess RUN` as a subprocess,
with no special flags and a private, empty parsed-trace cache (a cold run, what a user gets the first
time), and reports the wall time of each stage and the peak memory of the whole process tree.

    python bench/postprocess_scale.py --ranks 8 64            # synthetic sets
    python bench/postprocess_scale.py --run-dir runs/demo     # an existing run (e.g. the demo's)
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
import time
from pathlib import Path

from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set
from fleetscope.traces.layout import RunLayout, trace_file_name, window_name

DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / "tests/fixtures/gpu/h200-small-hf-eager-2steps.json.gz"
_STAGE_RE = re.compile(r"^(gather|analyze|merge) took (\d+(?:\.\d+)?) s$", re.MULTILINE)


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
    command = ["/usr/bin/time", "-f", "maxrss_kb=%M", sys.executable, "-m", "fleetscope.cli.main",
               "postprocess", str(run_dir), "--timings"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    stages = {name: float(seconds) for name, seconds in _STAGE_RE.findall(done.stdout + done.stderr)}
    rss = re.search(r"maxrss_kb=(\d+)", done.stderr)
    return {"exit": done.returncode, "wall_s": round(wall, 2), "stages_s": stages,
            "max_rss_mb": round(int(rss.group(1)) / 1024, 1) if rss else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--run-dir", type=Path, action="append", default=[], help="an existing run directory")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="fleetscope-bench-") as scratch:
        targets = [(f"{n} synthetic ranks", make_run(args.source, Path(scratch) / f"set{n}", n)) for n in args.ranks]
        targets += [(str(path), path) for path in args.run_dir]
        for label, run_dir in targets:
            cache = Path(scratch) / f"cache-{len(results)}"
            measured = run_postprocess(run_dir, cache)
            results.append({"input": label, **measured})
            print(f"{label}: {json.dumps(measured)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
