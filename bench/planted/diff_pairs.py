"""Pairs for `fleetscope diff`: corpus programs (bench/planted/corpus.py) recorded as written and with their
problem fixed, each with the planted cost the program timed (profiler off):

    python bench/planted/diff_pairs.py OUT NAME [NAME ...]   # on a GPU
    python bench/planted/diff_pairs.py OUT NAME --device cpu # smoke mode

OUT/NAME/as_written/ and OUT/NAME/fixed/ get a trace each (ProfilerStep#2-3, as corpus.py records them), OUT/NAME/
planted.json the step times with and without the problem. `fleetscope diff OUT/NAME/as_written OUT/NAME/fixed`
should name the planted change first, with its size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from corpus import PROGRAMS, Dev, Fixes, measure  # noqa: E402  (the corpus's own programs and harness)


def record_pair(name: str, device: torch.device, out: Path) -> dict:
    spec = PROGRAMS[name]
    (out / name).mkdir(parents=True, exist_ok=True)
    written_ms = measure(spec, Dev(device, out / name / "tmp"), Fixes(), trace_dir=out / name / "as_written")
    fixed_ms = measure(spec, Dev(device, out / name / "tmp"), Fixes(spec.causes), trace_dir=out / name / "fixed")
    shutil.rmtree(out / name / "tmp", ignore_errors=True)
    record = {"program": name, "causes": list(spec.causes), "step_ms": round(written_ms, 3),
              "fixed_step_ms": round(fixed_ms, 3), "planted_ms_per_step": round(written_ms - fixed_ms, 3),
              "description": spec.description, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    (out / name / "planted.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_intermixed_args(argv)
    if unknown := [name for name in args.names if name not in PROGRAMS]:
        parser.error(f"unknown programs: {', '.join(unknown)}")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    for name in args.names:
        record = record_pair(name, device, args.out)
        print(f"{name}: {record['step_ms']:.2f} ms as written, {record['fixed_step_ms']:.2f} ms fixed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
