"""Stock HTA, the baseline of the scale benchmarks: HTA's own loader and the views fleetscope's default
report holds, called the way an HTA user calls them.

`TraceAnalysis(trace_dir=DIR, include_last_profiler_step=True)` (HTA's JSON loader and its own
multiprocessing), then on every rank: temporal breakdown, idle-time breakdown with idle-interval stats,
comm/comp overlap, kernel breakdown, CUDA kernel launch statistics (fleetscope's cutoffs), and the
potential-stragglers view. A view HTA fails on (e.g. its straggler view on traces of identical ranks:
"attempt to get argmax of an empty sequence") is printed and the next one runs, as fleetscope's report
does with the same failure; its time until it fails counts.

    python bench/stock_hta.py TRACE_DIR [EXPECTED_RANKS]
"""

from __future__ import annotations

import logging
import sys
import warnings

from fleetscope.analysis.per_rank.hta_rank import LAUNCH_DELAY_CUTOFF_US, LAUNCH_RUNTIME_CUTOFF_US

SCRIPT = __file__


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=argv[0], include_last_profiler_step=True)
    ranks = sorted(analysis.t.traces)
    if len(argv) > 1 and len(ranks) != int(argv[1]):
        print(f"HTA loaded {len(ranks)} ranks, expected {argv[1]}", file=sys.stderr)
        return 1
    views = {
        "temporal_breakdown": lambda: analysis.get_temporal_breakdown(visualize=False),
        "idle_time_breakdown": lambda: analysis.get_idle_time_breakdown(
            ranks=ranks, visualize=False, show_idle_interval_stats=True),
        "comm_comp_overlap": lambda: analysis.get_comm_comp_overlap(visualize=False),
        "kernel_breakdown": lambda: analysis.get_gpu_kernel_breakdown(visualize=False),
        "cuda_launch_stats": lambda: analysis.get_cuda_kernel_launch_stats(
            ranks=ranks, runtime_cutoff=LAUNCH_RUNTIME_CUTOFF_US, launch_delay_cutoff=LAUNCH_DELAY_CUTOFF_US,
            visualize=False),
        "potential_stragglers": lambda: analysis.get_potential_stragglers(num_candidates=1),
    }
    for name, view in views.items():
        try:
            view()
        except Exception as error:  # noqa: BLE001 - HTA raises anything; the next view still runs
            print(f"HTA's {name} failed: {type(error).__name__}: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
