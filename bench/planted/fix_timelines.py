"""What a planted problem's fix changes in the step, as the trace shows it: each named program of a set whose
builds take the frozenset of causes to fix (heldout4.py) recorded as written and with each cause alone fixed,
then timed, profiler off, in alternating rounds (as written, each fix, again), so that a drift of the host's
speed between timings shows as the spread of each round's difference and not as a cost.

    python bench/planted/fix_timelines.py SET OUT NAME [NAME ...] [--rounds N] [--device cuda|cpu]

OUT/NAME/as_written and OUT/NAME/fixed_CAUSE hold one trace each (two profiled steps, shapes recorded);
OUT/NAME/timings.json the steps' medians per round and per variant. Read the traces with `fleetscope analyze`
or `fleetscope advise`: the fixed trace is the ground truth of where the saving came from (GPU time, host
dispatch, idle)."""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (a script beside its harness)


def variants(causes: list[str]) -> dict[str, frozenset[str]]:
    """The variants to record and time: as written, and each cause alone fixed."""
    return {"as_written": frozenset(), **{f"fixed_{cause}": frozenset({cause}) for cause in causes}}


def run_program(build, causes: list[str], directory: Path, rounds: int, with_stack: bool) -> dict:
    steps = {}
    for name, fixes in variants(causes).items():
        torch.manual_seed(0)
        steps[name] = build(fixes)
        harness.record(steps[name], directory / name, with_stack=with_stack)
    timings: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            timings[name].append(round(harness.timed_per_samples(step), 3))
    summary = {"program": build.__name__, "causes": causes, "rounds": rounds, "step_ms_by_round": timings,
               "median_ms": {name: round(statistics.median(ms), 3) for name, ms in timings.items()},
               "device": torch.cuda.get_device_name() if harness.on_gpu() else "cpu", "torch": torch.__version__}
    written = timings["as_written"]
    summary["saved_ms_by_round"] = {name: [round(a - b, 3) for a, b in zip(written, ms)]
                                    for name, ms in timings.items() if name != "as_written"}
    (directory / "timings.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("program", "median_ms", "saved_ms_by_round")}), flush=True)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("set", help="a program set whose builds take a frozenset of fixes (heldout4)")
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+", metavar="NAME")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    module = importlib.import_module(args.set)
    unknown = [name for name in args.names if name not in module.PROGRAMS]
    if unknown:
        parser.error(f"unknown programs of {args.set}: {', '.join(unknown)}")
    harness.use_device(args.device)
    for name in args.names:
        directory = args.out / name
        directory.mkdir(parents=True, exist_ok=True)
        run_program(getattr(module, name), module.PROGRAMS[name], directory, args.rounds,
                    name in module.WITH_STACK)
        harness.reset_compiled()
        harness.restore_defaults()
    return 0


if __name__ == "__main__":
    sys.exit(main())
