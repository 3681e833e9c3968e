"""How much the profiler adds per recorded host event, against the same trace's median launch call: the
constant behind advise's estimate of the dispatch idle a trace-only step would have unprofiled
(analysis/advise/model.py PROFILER_EVENT_PER_LAUNCH_CALL).

    python bench/profiler_cost_per_launch.py tests/fixtures/gpu/corpus tests/fixtures/gpu/heldout4 ...

Every program of the given planted sets (bench/planted: each folder holds one rank's trace and planted.json with
the step measured unprofiled) whose profiled step leaves the GPU idle at least HOST_BOUND_IDLE of the time and
whose planted causes only the profiler lengthens (dispatch: launch-bound loops, per-parameter optimizers, syncs;
not a collection, a loader, a compile or a save, whose time varies from step to step on its own). For each:
(profiled step - unprofiled step) / the ops and runtime calls the step recorded (steps.py recorded_op_starts:
Python frames under with_stack cost a fraction of an op, bench/profiler_cost_results.md) is the profiler's cost per event; divided by
the median launch call the trace records, the ratio. A host's speed sets both: its launch calls as the profiler
records them (CUPTI's callbacks included) and its per-event recording cost. The constant is the median ratio.

Then, for every program, the unprofiled step that constant predicts (profiled step - events x ratio x median
launch call) against the baseline a trace alone gives without it (the profiled step), as the error of each.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from fleetscope.analysis.per_rank.events import Kind, extract_events
from fleetscope.analysis.per_rank.names import is_launch_call
from fleetscope.analysis.per_rank.steps import find_steps, recorded_op_starts

HOST_BOUND_IDLE = 0.5
PROFILER_ONLY_CAUSES = {"launch_bound", "optimizer_impl", "host_syncs"}


def measure(folder: Path) -> dict | None:
    planted = json.loads((folder / "planted.json").read_text())
    traces = sorted(folder.glob("*.json.gz"))
    if not traces or not planted.get("step_ms"):
        return None
    events = extract_events(json.load(gzip.open(traces[0])))
    steps, _ = find_steps(events)
    launches = events.of_kind(Kind.CUDA_RUNTIME) & events.names_matching(is_launch_call)
    busy = [s.gpu_busy_ms for s in steps if s.gpu_busy_ms is not None]
    if not steps or not launches.any() or len(busy) != len(steps):
        return None
    profiled = statistics.fmean(s.step_time_ms for s in steps)
    starts = recorded_op_starts(events)
    host_events = statistics.fmean(int(np.searchsorted(starts, s.start_us + 1000.0 * s.host_ms)
                                       - np.searchsorted(starts, s.start_us)) for s in steps)
    return {"program": folder.name, "causes": set(planted.get("causes", [])), "steady_ms": planted["step_ms"],
            "profiled_ms": profiled, "idle": 1.0 - statistics.fmean(busy) / profiled, "events": host_events,
            "launch_us": float(np.median(events.dur_us[launches]))}


def main(sets: list[str]) -> None:
    rows = [row for s in sets for folder in sorted(Path(s).iterdir()) if (folder / "planted.json").is_file()
            for row in [measure(folder)] if row is not None]
    chosen = [r for r in rows if r["idle"] >= HOST_BOUND_IDLE and r["causes"] and r["causes"] <= PROFILER_ONLY_CAUSES]
    print(f"{'program':40s} {'launch us':>9s} {'events':>7s} {'profiled':>9s} {'steady':>8s} {'us/event':>8s} {'ratio':>6s}")
    ratios = []
    for r in chosen:
        per_event_us = 1000.0 * (r["profiled_ms"] - r["steady_ms"]) / r["events"]
        ratios.append(per_event_us / r["launch_us"])
        print(f"{r['program'][:40]:40s} {r['launch_us']:9.2f} {r['events']:7.0f} {r['profiled_ms']:9.1f} "
              f"{r['steady_ms']:8.1f} {per_event_us:8.2f} {ratios[-1]:6.2f}")
    if not ratios:
        print("no host-bound program whose only cost under profiling is the profiler")
        return
    ratio = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"ratio (profiler's cost per event / median launch call) over {len(ratios)} programs: median {ratio:.2f}, "
          f"quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    print("\nunprofiled step predicted on host-bound programs (all planted causes), error against the measured one:")
    errors, baseline = [], []
    # a tiny-batch program's planted step is the larger batch's (bench/planted), not this step unprofiled
    for r in (r for r in rows if r["idle"] >= HOST_BOUND_IDLE and "tiny_batch" not in r["causes"]):
        predicted = r["profiled_ms"] - r["events"] * ratio * r["launch_us"] / 1000.0
        errors.append(abs(predicted / r["steady_ms"] - 1.0))
        baseline.append(abs(r["profiled_ms"] / r["steady_ms"] - 1.0))
        print(f"  {r['program'][:40]:40s} measured {r['steady_ms']:8.1f}  profiled {r['profiled_ms']:8.1f} "
              f"({100 * (r['profiled_ms'] / r['steady_ms'] - 1):+5.0f}%)  predicted {predicted:8.1f} "
              f"({100 * (predicted / r['steady_ms'] - 1):+5.0f}%)")
    print(f"median error: predicted {100 * statistics.median(errors):.0f}%, the profiled step as it is "
          f"{100 * statistics.median(baseline):.0f}% ({statistics.median(baseline) / max(statistics.median(errors), 1e-9):.1f}x)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
