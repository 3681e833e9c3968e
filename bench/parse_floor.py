"""How close fleetscope's per-rank parse is to the floor of reading a trace: inflating it and a typed decode of the
same bytes into the fields every event has (no analysis, nothing kept but the decoded list).

    python bench/parse_floor.py [TRACE ...] [--repeat 5]

For each trace (default: the large and the small H200 fixtures), in this process, each stage --repeat times, the
median wall time, with Python's cyclic collector paused as analyze's workers pause it, of:
  inflate        traces/kineto.decompress (ISA-L when installed, else zlib): what every reader pays
  typed decode   msgspec into a struct of ph, cat, name, ts, dur, pid, tid and the args' External id and
                 correlation, everything else skipped: the least a decode that links launches to kernels reads
  floor          inflate + typed decode
  parse          fleetscope's per-rank pass as `analyze` runs it in a worker: analysis/per_rank/rank.analyze_bytes
                 (inflate, the selective decode, the columnar table, steps, timeline, collectives, idle gaps)
  decode+table   the part of parse up to the columnar table (rank.decode_identified: gather's shared decode)
The issue's target: parse within 2x of the floor. Prints one row per trace and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Union

import msgspec

from fleetscope.analysis.inputs.sources import TraceSource
from fleetscope.analysis.per_rank.parse import cyclic_gc_paused
from fleetscope.analysis.per_rank.rank import analyze_bytes, decode_identified
from fleetscope.traces.kineto import decompress, read_raw

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = (ROOT / "tests/fixtures/gpu/large/h200-medium-eager-stack-3steps.json.gz",
                  ROOT / "tests/fixtures/gpu/h200-small-hf-eager-2steps.json.gz")


class _Args(msgspec.Struct, gc=False):
    external_id: Any = msgspec.field(default=None, name="External id")
    correlation: Any = None


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: Union[float, None] = None
    dur: Union[float, None] = None
    pid: Union[int, str, None] = None
    tid: Union[int, str, None] = None
    args: Union[_Args, None] = None


class _Document(msgspec.Struct, gc=False):
    traceEvents: list[_Event] = []  # noqa: N815 - Kineto's key


_DECODER = msgspec.json.Decoder(_Document)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", type=Path, default=list(DEFAULT_TRACES))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| trace | JSON MB | events | inflate s | typed decode s | floor s | decode+table s | parse s | "
          "parse / floor (target <= 2x) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.traces:
        print(row(path, args.repeat), flush=True)
    return 0


def row(path: Path, repeat: int) -> str:
    raw = read_raw(path)
    text = decompress(raw, path)
    events = len(_DECODER.decode(text).traceEvents)
    source = TraceSource(path=path, label=path.name, window=0)
    inflate = _median_s(lambda: decompress(raw, path), repeat)
    decode = _median_s(lambda: _DECODER.decode(text), repeat)
    table = _median_s(lambda: decode_identified(path, raw), repeat)
    parse = _median_s(lambda: analyze_bytes(source, raw), repeat)
    floor = inflate + decode
    return (f"| {path.name} | {len(text) / 1e6:.1f} | {events:,} | {inflate:.3f} | {decode:.3f} | {floor:.3f} | "
            f"{table:.3f} | {parse:.3f} | {parse / floor:.2f}x |")


def _median_s(work, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        with cyclic_gc_paused():  # as every stage runs in the product (parse.analyze_trace)
            started = time.perf_counter()
            result = work()
            times.append(time.perf_counter() - started)
        del result
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
