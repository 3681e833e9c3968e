"""Bench-only probe for bench/timeline_gpu_overhead.py --design blocks, loaded into every trainer process through
PYTHONPATH (FS_TIMELINE_PROBE_OUT set). It times each call of the whole-run parts (TimelineWriter.append, each
ChangeDetector.observe) and turns both off in alternate blocks of FS_TIMELINE_PROBE_BLOCK steps, so that one process
runs both arms many times (run-to-run variance, +-20% between processes at host-bound shapes, drops out). At exit
it writes, per rank, each step's arm, the host nanoseconds the parts took, and when the trainer reached the step's
record (the loop's period between two of these is what a user's throughput sees: the per-step metrics' step time
leaves out the work between steps, where these parts run)."""

import atexit
import json
import os
import time

_OUT = os.environ.get("FS_TIMELINE_PROBE_OUT")
_BLOCK = int(os.environ.get("FS_TIMELINE_PROBE_BLOCK", "10"))


def _install() -> None:
    from fleetscope.traces import change_points, timeline

    state = {"step": -1, "on": True, "arm": {}, "host_ns": {}, "entered_ns": {}}
    append, observe = timeline.TimelineWriter.append, change_points.ChangeDetector.observe

    def timed_append(self, *args, **kwargs):
        step = int(kwargs.get("step", args[0] if args else -1))
        state["entered_ns"][step] = time.perf_counter_ns()  # one a loop iteration, in both arms: the step's period
        state["step"], state["on"] = step, (step // _BLOCK) % 2 == 0
        state["arm"][step] = "on" if state["on"] else "off"
        if not state["on"]:
            return None
        started = time.perf_counter_ns()
        result = append(self, *args, **kwargs)
        state["host_ns"][step] = state["host_ns"].get(step, 0) + time.perf_counter_ns() - started
        return result

    def timed_observe(self, value):
        if not state["on"]:
            return None
        started = time.perf_counter_ns()
        result = observe(self, value)
        step = state["step"]
        state["host_ns"][step] = state["host_ns"].get(step, 0) + time.perf_counter_ns() - started
        return result

    timeline.TimelineWriter.append, change_points.ChangeDetector.observe = timed_append, timed_observe

    def write() -> None:
        if state["arm"]:
            rank = os.environ.get("RANK", "0")
            path = os.path.join(_OUT, f"probe-rank{rank}-{os.getpid()}.json")
            with open(path, "w") as handle:
                json.dump({"block": _BLOCK, "arm": state["arm"], "host_ns": state["host_ns"],
                           "entered_ns": state["entered_ns"]}, handle)

    atexit.register(write)


if _OUT:
    try:
        _install()
    except ImportError:  # a process without fleetscope (torchrun's own agent): nothing to time
        pass
