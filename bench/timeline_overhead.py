"""What the always-on whole-run recording costs a step, measured directly (no GPU needed).

    python bench/timeline_overhead.py [--steps 200000] [--repeats 5]

Per step, every rank appends one timeline record (traces/timeline.py TimelineWriter: a buffered 32-byte
write, flushed every FLUSH_EVERY steps) and the anomaly trigger feeds one value to the online change detector
(traces/change_points.py ChangeDetector). Both run on the host between steps and add no device sync, so their
cost is their own host time. This benchmark times, in the same run, over --steps steps each, --repeats times:
  baseline   the loop that builds the same arguments and calls a no-op function (the floor of any recording)
  timeline   TimelineWriter.append (to a file in a temp dir, as on local disk)
  detector   ChangeDetector.observe on lognormal 5% noise
and prints the median cost per step of each above the baseline, in microseconds and as a share of the step
times measured on the H200 (bench/results/h200: small preset eager 4 x 128 ~65 ms, the same under CUDA graphs
~16 ms, batch 8 x 2048 ~130 ms). Target (whole-run issue): <= 0.2% of step time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from fleetscope.traces.change_points import ChangeDetector
from fleetscope.traces.timeline import TimelineWriter

H200_STEP_MS = {"eager 4x128": 65.0, "CUDA graphs 4x128": 16.0, "eager 8x2048": 130.0}
TARGET_PCT = 0.2


def _noop(**_: object) -> None:
    return None


def time_appends(append, steps: int, values: np.ndarray) -> float:
    start_us = time.time_ns() / 1000
    began = time.perf_counter()
    for step in range(steps):
        append(step=step, start_us=start_us, step_ms=float(values[step]), data_ms=0.5, profiled=False,
               first=step == 0)
    return (time.perf_counter() - began) / steps * 1e6


def time_detector(steps: int, values: np.ndarray) -> float:
    detector = ChangeDetector()
    observe = detector.observe
    began = time.perf_counter()
    for step in range(steps):
        observe(float(values[step]))
    return (time.perf_counter() - began) / steps * 1e6


def time_noop_loop(steps: int, values: np.ndarray) -> float:
    noop = _noop
    began = time.perf_counter()
    for step in range(steps):
        noop(value=float(values[step]))
    return (time.perf_counter() - began) / steps * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    values = np.random.default_rng(0).lognormal(np.log(65.0), 0.05, args.steps)
    arms: dict[str, list[float]] = {"baseline": [], "timeline": [], "detector": [], "detector baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            arms["baseline"].append(time_appends(_noop, args.steps, values))
            writer = TimelineWriter(Path(tmp) / f"rank{repeat}.timeline", repeat)
            arms["timeline"].append(time_appends(writer.append, args.steps, values))
            writer.close()
            arms["detector baseline"].append(time_noop_loop(args.steps, values))
            arms["detector"].append(time_detector(args.steps, values))
    medians = {name: statistics.median(samples) for name, samples in arms.items()}
    timeline_us = medians["timeline"] - medians["baseline"]
    detector_us = medians["detector"] - medians["detector baseline"]
    total_us = timeline_us + detector_us
    print(f"{args.steps} steps x {args.repeats} repeats; median host time per step (us):")
    for name, median in medians.items():
        print(f"  {name:<18} {median:8.3f}")
    print(f"  timeline append above its baseline: {timeline_us:.3f} us; detector above its baseline: "
          f"{detector_us:.3f} us; together {total_us:.3f} us a step")
    for label, step_ms in H200_STEP_MS.items():
        share = total_us / (step_ms * 1000) * 100
        print(f"  share of a {step_ms:g} ms step ({label}, H200): {share:.4f}% (target <= {TARGET_PCT}%: "
              f"{'met' if share <= TARGET_PCT else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
