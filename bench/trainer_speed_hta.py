"""HTA's view of the traces `bench/trainer_speed.py --trace` records: per variant, HTA's temporal
breakdown (idle / compute / non-compute share of the step) and its top kernels.

    python bench/trainer_speed_hta.py TRACE_DIR [--json OUT.json]

Runs where HTA is installed (not needed on the GPU machine: bring the traces back and run it here).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

_NAME = re.compile(r"^trace-(?P<preset>[a-z]+)-b(?P<batch>\d+)-(?P<variant>[a-z_]+)\.json\.gz$")


def hta_breakdown(trace: Path, top: int) -> dict:
    from hta.trace_analysis import TraceAnalysis

    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "rank0.json.gz").symlink_to(trace.absolute())
        analysis = TraceAnalysis(trace_dir=directory)
        temporal = analysis.get_temporal_breakdown(visualize=False).iloc[0]
        kernels = analysis.get_gpu_kernel_breakdown(visualize=False, num_kernels=top)[1]
    named = kernels[kernels["name"] != "others"]  # HTA's bucket of everything below its top list
    by_kernel = named.groupby("name")["sum (us)"].sum().sort_values(ascending=False).head(top)
    return {
        "idle_pct": round(float(temporal["idle_time_pctg"]), 1),
        "compute_pct": round(float(temporal["compute_time_pctg"]), 1),
        "non_compute_pct": round(float(temporal["non_compute_time_pctg"]), 1),
        "top_kernels_ms": {name[:70]: round(us / 1e3, 2) for name, us in by_kernel.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir")
    parser.add_argument("--json", default=None)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    results = {}
    for trace in sorted(Path(args.trace_dir).glob("trace-*.json.gz")):
        match = _NAME.match(trace.name)
        if match:
            results[f"{match['preset']} b{match['batch']} {match['variant']}"] = hta_breakdown(trace, args.top)
    lines = ["| run | GPU idle % | compute % | non-compute % | largest named kernel (HTA sum over the traced steps, ms) |",
             "|---|---:|---:|---:|---|"]
    for run, row in results.items():
        kernel, ms = next(iter(row["top_kernels_ms"].items()), ("-", 0.0))
        lines.append(f"| {run} | {row['idle_pct']} | {row['compute_pct']} | {row['non_compute_pct']} | "
                     f"{kernel} ({ms}) |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
