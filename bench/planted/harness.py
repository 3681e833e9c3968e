"""What the held-out program sets (bench/planted/heldout2.py, heldout3.py) share: the device and sizes, timing with
the profiler off, recording a trace, and running a set into OUT/NAME/{trace, planted.json}.

Each set defines `PROGRAMS` ({build function: planted causes}) and `WITH_STACK`, then calls `run_set(__doc__,
PROGRAMS, WITH_STACK)`. Programs read the device with `dev()` and sizes with `pick(gpu, cpu)`, so `--device cpu`
(smoke mode: the same code paths, small sizes) switches every program at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

BF16 = torch.bfloat16
_DEVICE = ["cuda"]
"""The device every program builds on: "cuda", or "cpu" in smoke mode (run_set's --device)."""


def dev() -> str:
    return _DEVICE[0]


def use_device(device: str) -> None:
    """Build every program on `device` ("cuda", or "cpu" for the smoke mode)."""
    _DEVICE[0] = device


def on_gpu() -> bool:
    return dev() == "cuda"


def pick(gpu: int, cpu: int) -> int:
    """A size: `gpu` on CUDA, the small `cpu` in smoke mode."""
    return gpu if on_gpu() else cpu


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def autocast(enabled: bool = True) -> torch.autocast:
    return torch.autocast(dev(), dtype=BF16, enabled=enabled)


def mel_filterbank(rate: int, n_fft: int, mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Triangular filters equally spaced on the (HTK) mel scale: [mels, n_fft // 2 + 1]."""
    to_mel, to_hz = (lambda f: 2595 * np.log10(1 + f / 700)), (lambda m: 700 * (10 ** (m / 2595) - 1))
    edges = to_hz(np.linspace(to_mel(fmin), to_mel(fmax), mels + 2))[:, None]
    bins = np.linspace(0, rate / 2, n_fft // 2 + 1)[None]
    rising = (bins - edges[:-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[2:] - bins) / (edges[2:] - edges[1:-1])
    return np.maximum(0, np.minimum(rising, falling)).astype(np.float32)


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def fused_adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def timed(step, n: int = 7) -> float:
    """The median of `n` steps (after two warm-up steps), each between two synchronizes, profiler off."""
    for _ in range(2):
        step()
    times = []
    for _ in range(n):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def record(step, directory: Path, with_stack: bool = False) -> None:
    extra = {}
    if with_stack:
        extra["experimental_config"] = torch.profiler._ExperimentalConfig(record_python_gc_info=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu() else [])
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2),
                 on_trace_ready=tensorboard_trace_handler(str(directory), worker_name="rank0", use_gzip=True),
                 record_shapes=True, with_stack=with_stack, **extra) as prof:
        for _ in range(4):
            step()
            prof.step()
    sync()


def restore_defaults() -> None:
    """The process-wide settings as the next program expects them (a program may change them while it is built)."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_program(build: Callable, causes: list[str], directory: Path, with_stack: bool) -> None:
    torch.manual_seed(0)
    record(build(False), directory, with_stack=with_stack)
    step_ms = timed(build(False))
    fixed_ms = timed(build(True)) if causes else step_ms
    planted = {causes[0]: round(step_ms - fixed_ms, 3)} if causes else {}
    (directory / "planted.json").write_text(json.dumps(
        {"program": build.__name__, "causes": causes, "planted_ms_per_step": planted, "step_ms": round(step_ms, 3),
         "fixed_step_ms": round(fixed_ms, 3), "healthy": not causes, "device":
         torch.cuda.get_device_name() if on_gpu() else "cpu", "description": " ".join(build.__doc__.split()),
         "torch": torch.__version__}, indent=1) + "\n")
    print(f"{build.__name__}: step {step_ms:.2f} ms, fixed {fixed_ms:.2f} ms", flush=True)


def run_all(out: Path, programs: dict[Callable, list[str]], with_stack: set[str], names: list[str] | None,
            run: Callable = run_program, between: Callable[[], None] = lambda: None) -> int:
    """Each named program (default: all) through `run` into OUT/NAME; `between` runs after each, before the
    process-wide settings are restored."""
    started = time.monotonic()
    by_name = {build.__name__: (build, causes) for build, causes in programs.items()}
    for name in names or by_name:
        build, causes = by_name[name]
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        try:
            run(build, causes, directory, name in with_stack)
        except Exception as error:  # one program's failure is reported, the rest still run
            (directory / "error.txt").write_text(traceback.format_exc())
            print(f"{name}: {error!r}", flush=True)
        between()
        restore_defaults()
    print(f"done in {time.monotonic() - started:.1f} s", flush=True)
    return 0


def run_set(doc: str, programs: dict[Callable, list[str]], with_stack: set[str]) -> None:
    """The command line of a program set: OUT [NAME ...] [--device cuda|cpu]."""
    args = _set_arguments(doc, programs)
    sys.exit(run_all(args.out, programs, with_stack, args.names))


def _set_arguments(doc: str, programs: dict[Callable, list[str]]) -> argparse.Namespace:
    """OUT [NAME ...] [--device cuda|cpu], the names checked against the set's programs and the device chosen."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="*", metavar="NAME", help="programs to run (default: all)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_intermixed_args()
    known = {build.__name__ for build in programs}
    if unknown := [name for name in args.names if name not in known]:
        parser.error(f"unknown programs: {', '.join(unknown)}")
    use_device(args.device)
    return args


# ------------------------------------------------------------------------- programs with one or more problems

class PerSamples:
    """A small-batch step that stands for `steps` of itself: its time is reported for the samples of the fixed
    batch (tiny_batch), while the trace records single steps."""

    def __init__(self, step: Callable[[], object], steps: int) -> None:
        self.step, self.steps = step, steps

    def __call__(self) -> object:
        return self.step()


def timed_per_samples(step: Callable[[], object]) -> float:
    """timed(step) times the steps it stands for (PerSamples), else timed(step)."""
    return timed(step) * getattr(step, "steps", 1)


def run_program_fixes(build: Callable, causes: list[str], directory: Path, with_stack: bool) -> None:
    """run_program for builds that take the frozenset of causes to fix. Each cause's planted cost is the step as
    written less the step with that cause alone fixed; fixed_step_ms has every cause fixed; causes are written
    largest cost first."""
    torch.manual_seed(0)
    record(build(frozenset()), directory, with_stack=with_stack)
    step_ms = timed_per_samples(build(frozenset()))
    fixed_ms = timed_per_samples(build(frozenset(causes))) if causes else step_ms
    alone = {cause: fixed_ms if len(causes) == 1 else timed_per_samples(build(frozenset({cause})))
             for cause in causes}
    planted = {cause: round(step_ms - ms, 3) for cause, ms in alone.items()}
    causes = sorted(causes, key=lambda cause: -planted[cause])
    (directory / "planted.json").write_text(json.dumps(
        {"program": build.__name__, "causes": causes, "planted_ms_per_step": planted, "step_ms": round(step_ms, 3),
         "fixed_step_ms": round(fixed_ms, 3), "healthy": not causes, "device":
         torch.cuda.get_device_name() if on_gpu() else "cpu", "description": " ".join(build.__doc__.split()),
         "torch": torch.__version__}, indent=1) + "\n")
    costs = ", ".join(f"{cause} {ms:.2f} ms" for cause, ms in planted.items())
    print(f"{build.__name__}: step {step_ms:.2f} ms, fixed {fixed_ms:.2f} ms{'; ' + costs if costs else ''}",
          flush=True)


def reset_compiled() -> None:
    """Forget what torch.compile compiled (a program's graphs and recompile counts stay its own)."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def run_set_fixes(doc: str, programs: dict[Callable, list[str]], with_stack: set[str]) -> None:
    """run_set for programs whose `build(fixes)` takes the frozenset of causes to fix (run_program_fixes)."""
    args = _set_arguments(doc, programs)
    sys.exit(run_all(args.out, programs, with_stack, args.names, run=run_program_fixes, between=reset_compiled))


def release_cached_memory() -> None:
    """torch.cuda.empty_cache(), where there is a CUDA allocator to empty."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_synchronize() -> None:
    """torch.cuda.synchronize(), where there is a GPU to wait for."""
    if on_gpu():
        torch.cuda.synchronize()


def heads_of(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, W] -> [B, H, S, W / H]."""
    b, s, w = x.shape
    return x.view(b, s, heads, w // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)
