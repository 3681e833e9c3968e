"""What torch.profiler adds to the host per event it records, in isolated loops: no constant that carries from
host to host (its results), which is why advise estimates that cost from a trace's own launch calls
(bench/profiler_cost_per_launch.py).

    python bench/profiler_cost.py OUT_DIR [--device cuda|cpu]

Host-bound loops of known work, each timed unprofiled (median of synchronized steps) and profiled as the corpus
programs are (CPU and CUDA activities, record_shapes; then again with with_stack and the collector's events),
and the events each profiled step recorded counted from its trace (cpu_op, cuda_runtime, python_function):
  ops_cuda      2,000 small CUDA ops a step (launch-bound: every op is a cpu_op and a launch)
  ops_cpu       2,000 small CPU tensor ops a step (cpu_ops, no launch)
  python_calls  20,000 Python calls a step and 200 CUDA ops (Python frames under with_stack)
  mixed         a small MLP's forward, backward and optimizer step at batch 8 (autograd, dispatch)
Per loop and arm: the excess of the profiled step over the unprofiled one, and per recorded event. Then a
least-squares fit of the excess on the counts (per cpu_op, per runtime call, per Python event) over every loop
and arm, printed with each loop's residual: the fit is the constant, the residuals its error.
Writes OUT_DIR/profiler-cost.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(step, device: str, n: int = 9) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(n):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def profiled(step, device: str, directory: Path, with_stack: bool) -> tuple[float, dict[str, float]]:
    """Median profiled step (ms, synchronized at both ends as the unprofiled one) and events per step."""
    directory.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    extra = {"experimental_config": torch.profiler._ExperimentalConfig(record_python_gc_info=True)} if with_stack else {}
    times = []
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=tensorboard_trace_handler(str(directory), worker_name="cal", use_gzip=True),
                 record_shapes=True, with_stack=with_stack, **extra) as prof:
        for index in range(5):
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            if index >= 2:
                times.append(1000 * (time.perf_counter() - start))
            prof.step()
    return statistics.median(times), counts_per_step(next(directory.glob("*.pt.trace.json.gz")))


def counts_per_step(path: Path) -> dict[str, float]:
    events = [e for e in json.loads(gzip.open(path).read())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name")).startswith("ProfilerStep#")]
    totals = {"cpu_op": 0, "cuda_runtime": 0, "python_function": 0}
    for step in steps:
        begin, end = step["ts"], step["ts"] + step["dur"]
        for e in events:
            if begin <= e["ts"] < end:
                category = "cuda_runtime" if e.get("cat") == "cuda_driver" else e.get("cat")
                if category in totals:
                    totals[category] += 1
    return {k: v / max(len(steps), 1) for k, v in totals.items()}


def ops_cuda(device: str):
    x = torch.zeros(64, device=device)

    def step():
        for _ in range(500):
            x.add_(1.0)
            x.mul_(0.5)
            torch.relu_(x)
            x.sub_(0.1)
    return step


def ops_cpu(device: str):
    """The same ops on a CPU tensor: recorded ops that launch nothing."""
    return ops_cuda("cpu")


def python_calls(device: str):
    x = torch.zeros(64, device=device)

    def leaf(value: float) -> float:
        return value * 0.5 + 1.0

    def middle(value: float) -> float:
        return leaf(value) - leaf(value * 0.25)

    def step():
        total = 0.0
        for i in range(200):
            for j in range(33):
                total += middle(float(j))
            x.add_(1.0)
        return total
    return step


def mixed(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU())
                                  for _ in range(24)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(8, 256, device=device)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


LOOPS = {"ops_cuda": ops_cuda, "ops_cpu": ops_cpu, "python_calls": python_calls, "mixed": mixed}
COLUMNS = ("cpu_op", "cuda_runtime", "python_function")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = []
    for name, build in LOOPS.items():
        step = build(args.device)
        base = timed(step, args.device)
        for with_stack in (False, True):
            arm = f"{name}{'+stack' if with_stack else ''}"
            ms, counts = profiled(step, args.device, args.out / arm, with_stack)
            excess_us = 1000 * (ms - base)
            events = sum(counts.values())
            rows.append({"loop": arm, "unprofiled_ms": base, "profiled_ms": ms, "excess_us": excess_us, **counts})
            print(f"{arm:20s} unprofiled {base:8.3f} ms  profiled {ms:8.3f} ms  +{excess_us / 1000:7.3f} ms  "
                  + "  ".join(f"{k} {counts[k]:7.0f}" for k in COLUMNS)
                  + f"  {excess_us / max(events, 1):5.2f} us/event", flush=True)
    matrix = np.array([[row[k] for k in COLUMNS] for row in rows])
    excess = np.array([row["excess_us"] for row in rows])
    fit, *_ = np.linalg.lstsq(matrix, excess, rcond=None)
    print("fit (us per recorded event): " + ", ".join(f"{k} {v:.2f}" for k, v in zip(COLUMNS, fit)))
    for row, predicted in zip(rows, matrix @ fit):
        print(f"  {row['loop']:20s} excess {row['excess_us'] / 1000:8.3f} ms  fit {predicted / 1000:8.3f} ms  "
              f"error {100 * (predicted - row['excess_us']) / max(abs(row['excess_us']), 1):+6.1f}%")
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "rows": rows, "fit_us_per_event": dict(zip(COLUMNS, fit.tolist()))}
    (args.out / "profiler-cost.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
