"""Per-rank parse routes, end to end, on several trace shapes: today's decode path against columnar readers.

    python bench/parse_routes.py [--repeat 5] [--shape NAME ...] [--libs DIR]

Every route runs here, in one process, on each shape in turn, each stage --repeat times in alternating rounds,
with Python's cyclic collector paused as analyze's workers pause it; the medians are printed, and each route's
ratio against today's path measured in the same rounds. Stages:

  inflate      traces/kineto.decompress (ISA-L)                                     every route
  fused look   rank._refuse_fused (traces/fused.may_be_fused: the scan analyze makes of every trace's
               bytes for several ranks fused into one file)                         today
  decode       today: events.decode_selectively (msgspec typed structs);
               polars: pl.read_json with a schema of the fields the table reads, the events exploded and unnested;
               duckdb: read_json of the same schema, unnested in SQL, fetched as Arrow
  table        today: events.build_table (the whole TraceEvents);
               columnar routes: the table's core columns (name, kind, start, dur, thread, device, correlation,
               the cpu_op filter of GPU traces, sorted by start) built from the columns in polars; checked
               against today's table row by row (`core equal`)
  hta frame    today: hta_native.unfiltered_frame(parsed_columns(events)) (GPU traces); columnar: not built
  analysis     today: rank.analyze_decoded from the table (steps, timeline, collectives, idle gaps, ...); the
               columnar routes would share it from an equal table
  merge        today: merge/window_decode.decode_window + column_plan.group_columns (the merge's slice table,
               from its own decode of the inflated bytes); columnar: not built

`cold parse` = inflate + fused look + decode + table + analysis: what `analyze` pays per rank without a cache
hit, as the first rank a worker parses (the name rules' memos of names.py are emptied before each round);
events/s per core = the trace's events (every phase) over it. The columnar readers are not dependencies: install
them apart (`pip install --target DIR polars pyarrow duckdb`) and name DIR with --libs (they are left out when
missing). Shapes default to real traces among the fixtures (see SHAPES).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fleetscope.analysis.inputs.sources import TraceSource
from fleetscope.analysis.merge.column_plan import group_columns
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.window import WindowClock
from fleetscope.analysis.merge.window_decode import decode_window
from fleetscope.analysis.per_rank.events import (_GPU_CATEGORY_NAMES, _GPU_TRACK_CODES, _KIND_CODE, NO_ID,
                                                 TraceEvents, _thread_key, build_table, decode_selectively)
from fleetscope.analysis.per_rank.hta_native import parsed_columns, unfiltered_frame
from fleetscope.analysis.per_rank import names
from fleetscope.analysis.per_rank.names import is_kept_host_op
from fleetscope.analysis.per_rank.parse import cyclic_gc_paused
from fleetscope.analysis.per_rank.rank import DecodedTrace, _refuse_fused, analyze_decoded, base_time_ns_of
from fleetscope.traces.kineto import decompress, read_raw

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests/fixtures"
SHAPES = {
    "gpu-heavy": FIXTURES / "gpu/h200-small-accumulation/traces/window000/rank0.vm.pt.trace.json.gz",
    "with-stack": FIXTURES / "gpu/large/h200-medium-eager-stack-3steps.json.gz",
    "cpu-op-heavy": FIXTURES / "public/hta/ns_resolution/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "flow-heavy": FIXTURES / "public/kineto/resnet50_2021/worker0.1623143089861.pt.trace.json.gz",
    "cpu-only": FIXTURES / "public/hta/distributed_info_unavailable/distributed_info_not_found.json.gz",
}
"""gpu-heavy: fleetscope's H200 gradient-accumulation rank (98k events, 9.5k kernels); with-stack: the large H200
fixture (150k events, 39k python_function frames); cpu-op-heavy: HTA's V100 DDP trace (69k events, 24k cpu_op,
15k runtime calls, 21k ac2g flow events); flow-heavy: Kineto's 2021 ResNet-50 (18k async flow events, 13k
instants); cpu-only: HTA's host-ops-only trace (no device activity)."""
STAGES = ("inflate", "fused look", "decode", "table", "hta frame", "analysis", "merge")
COLD = ("inflate", "fused look", "decode", "table", "analysis")


# --- today's path ---------------------------------------------------------------------------------------------

def today(raw: bytes, path: Path) -> tuple[dict[str, float], TraceEvents]:
    _forget_names()
    times, clock = {}, _Clock()
    data = decompress(raw, path)
    times["inflate"] = clock.lap()
    _refuse_fused(path, data)
    times["fused look"] = clock.lap()
    metadata, events = decode_selectively(data)
    times["decode"] = clock.lap()
    table = build_table(events)
    times["table"] = clock.lap()
    if table.has_gpu_activity:
        unfiltered_frame(parsed_columns(events))
    times["hta frame"] = clock.lap()
    analyze_decoded(TraceSource(path=path, label=path.name, window=0), DecodedTrace(metadata, table, [], None))
    times["analysis"] = clock.lap()
    window = decode_window(data)
    group_columns(window, WindowClock(base_ns=base_time_ns_of(metadata)), MergeOptions())
    times["merge"] = clock.lap()
    return times, table


def _forget_names() -> None:
    """Empty the name rules' memos (names.py), so that each round measures a worker's first rank."""
    for rule in (names.kernel_category, names.is_known_comm_kernel):
        getattr(rule, "cache_clear", lambda: None)()  # a checkout from before the memos has none


# --- columnar routes --------------------------------------------------------------------------------------------

def _event_schema(pl: Any) -> Any:
    args = pl.Struct({"correlation": pl.Int64, "stream": pl.Int64, "device": pl.Int64})
    return pl.Struct({"ph": pl.String, "cat": pl.String, "name": pl.String, "ts": pl.Float64, "dur": pl.Float64,
                      "pid": pl.String, "tid": pl.String, "args": args})


def polars_route(raw: bytes, path: Path) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    import polars as pl

    times, clock = {}, _Clock()
    data = decompress(raw, path)
    times["inflate"] = clock.lap()
    document = pl.read_json(io.BytesIO(data), schema={"traceEvents": pl.List(_event_schema(pl))})
    events = document.select(pl.col("traceEvents").explode()).unnest("traceEvents").unnest("args")
    times["decode"] = clock.lap()
    table = core_table(events)
    times["table"] = clock.lap()
    return times, table


def duckdb_route(raw: bytes, path: Path) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    import duckdb
    import polars as pl

    times, clock = {}, _Clock()
    data = decompress(raw, path)
    with tempfile.NamedTemporaryFile(suffix=".json") as file:  # DuckDB's reader takes a path
        file.write(data)
        file.flush()
        times["inflate"] = clock.lap()
        columns = ("{traceEvents: 'STRUCT(ph VARCHAR, cat VARCHAR, name VARCHAR, ts DOUBLE, dur DOUBLE, pid VARCHAR, "
                   "tid VARCHAR, args STRUCT(correlation BIGINT, stream BIGINT, device BIGINT))[]'}")
        query = (f"SELECT e.ph, e.cat, e.name, e.ts, e.dur, e.pid, e.tid, e.args.correlation AS correlation, "
                 f"e.args.stream AS stream, e.args.device AS device FROM (SELECT unnest(traceEvents) AS e FROM "
                 f"read_json('{file.name}', columns={columns}, maximum_object_size={len(data) + 1}))")
        with duckdb.connect() as connection:
            events = pl.from_arrow(connection.sql(query).to_arrow_table())
    times["decode"] = clock.lap()
    table = core_table(events)
    times["table"] = clock.lap()
    return times, table


def core_table(events: Any) -> dict[str, np.ndarray]:
    """build_table's core columns from decoded columns, in polars: complete events, the cpu_op filter of GPU
    traces (names.is_kept_host_op per distinct name), a missing dur as 0, kinds by category, GPU rows on their
    stream and device, sorted by start (stable)."""
    import polars as pl

    complete = events.filter(pl.col("ph") == "X").with_columns(pl.col("dur").fill_null(0.0))
    if complete["cat"].is_in(list(_GPU_CATEGORY_NAMES)).any():
        op_names = complete.filter(pl.col("cat") == "cpu_op")["name"].unique().to_list()
        kept = [name for name in op_names if name is not None and is_kept_host_op(name)]
        complete = complete.filter((pl.col("cat") != "cpu_op") | pl.col("name").is_in(kept))
    complete = complete.filter(pl.col("ts").is_not_null() & (pl.col("dur") >= 0)).with_columns(
        pid=pl.col("pid").cast(pl.Int64, strict=False), tid=_thread_keys(complete["tid"]))
    kind = pl.col("cat").replace_strict(_KIND_CODE, default=0, return_dtype=pl.Int8)
    on_gpu = pl.col("kind").is_in(list(_GPU_TRACK_CODES))
    table = complete.with_columns(kind=kind).with_columns(
        thread=pl.when(on_gpu).then(pl.col("stream").fill_null(pl.col("tid")).fill_null(NO_ID)).otherwise(pl.col("tid")),
        device=pl.when(on_gpu).then(pl.col("device").fill_null(pl.col("pid")).fill_null(0)).otherwise(NO_ID),
        correlation=pl.col("correlation").fill_null(NO_ID),
    ).sort("ts", maintain_order=True)
    names = table["name"].unique(maintain_order=True)
    return {"names": names.to_list(), "name_id": table["name"].cast(pl.Enum(names)).to_physical().to_numpy(),
            "kind": table["kind"].to_numpy(), "start_us": table["ts"].to_numpy(), "dur_us": table["dur"].to_numpy(),
            "thread": table["thread"].to_numpy(), "device": table["device"].to_numpy(),
            "correlation": table["correlation"].to_numpy()}


def _thread_keys(tids: Any) -> Any:
    """events._thread_key of each tid (decoded as text): the int, else a key per distinct string."""
    import polars as pl

    as_int = tids.cast(pl.Int64, strict=False)
    named = tids.filter(as_int.is_null() & tids.is_not_null()).unique().to_list()
    if not named:
        return as_int
    keys = {name: _thread_key(name) for name in named}
    return pl.select(pl.when(as_int.is_null()).then(tids.replace_strict(keys, default=None, return_dtype=pl.Int64))
                     .otherwise(as_int)).to_series()


def core_differences(columns: dict[str, np.ndarray], table: TraceEvents) -> list[str]:
    """The core columns where a columnar route's table differs from today's (names compared as strings)."""
    if len(columns["start_us"]) != len(table):
        return [f"rows {len(columns['start_us'])} vs {len(table)}"]
    differ = []
    ours = np.asarray(table.names, dtype=object)[table.name_id]
    theirs = np.asarray(columns["names"], dtype=object)[columns["name_id"]]
    if not np.array_equal(ours, theirs):
        differ.append("name")
    for name in ("kind", "start_us", "dur_us", "thread", "device", "correlation"):
        if not np.array_equal(np.asarray(columns[name], dtype=np.float64), getattr(table, name).astype(np.float64)):
            differ.append(name)
    return differ


ROUTES: dict[str, Callable] = {"today": today, "polars": polars_route, "duckdb": duckdb_route}


# --- measuring ---------------------------------------------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


def measure(path: Path, routes: list[str], repeat: int) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    raw = read_raw(path)
    samples: dict[str, dict[str, list[float]]] = {route: {} for route in routes}
    equal: dict[str, str] = {}
    reference = None
    for _ in range(repeat):
        for route in routes:  # alternating rounds: load on the machine falls on every route alike
            with cyclic_gc_paused():
                times, table = ROUTES[route](raw, path)
            for stage, seconds in times.items():
                samples[route].setdefault(stage, []).append(seconds)
            if route == "today":
                reference = table
            elif route not in equal and reference is not None:
                differ = core_differences(table, reference)
                equal[route] = "yes" if not differ else "no: " + ", ".join(differ)
    return samples, equal


def event_count(path: Path) -> int:
    metadata, events = decode_selectively(decompress(read_raw(path), path))
    return len(events)


def print_shape(shape: str, path: Path, routes: list[str], repeat: int) -> None:
    samples, equal = measure(path, routes, repeat)
    events = event_count(path)
    medians = {route: {stage: statistics.median(values) for stage, values in stages.items()}
               for route, stages in samples.items()}
    base = medians["today"]
    base_cold = sum(base[stage] for stage in COLD)
    print(f"\n### {shape}: {path.relative_to(ROOT)} ({events:,} events)\n")
    print("| route | " + " | ".join(f"{stage} s" for stage in STAGES) + " | to table s | time / today | core equal |")
    print("|---|" + "---:|" * (len(STAGES) + 2) + "---|")
    base_table = sum(base[stage] for stage in ("inflate", "decode", "table"))
    for route in routes:
        stage_times = medians[route]
        cells = [f"{stage_times[stage]:.3f}" if stage in stage_times
                 else "-" if route == "today" or stage == "fused look" else "not built" for stage in STAGES]
        to_table = sum(stage_times[stage] for stage in ("inflate", "decode", "table"))
        print(f"| {route} | " + " | ".join(cells) + f" | {to_table:.3f} | {to_table / base_table:.2f}x | "
              f"{equal.get(route, 'reference')} |")
    print(f"\ncold parse (inflate + fused look + decode + table + analysis), today: {base_cold:.3f} s = "
          f"{events / base_cold / 1e6:.2f} M events/s per core; with the HTA frame "
          f"{base_cold + base['hta frame']:.3f} s; the merge's own decode and slice table "
          + (f"{base['merge']:.3f} s" if "merge" in base else "refused (the per-event planner takes it)"))


def available_routes() -> list[str]:
    routes = ["today"]
    for route, module in (("polars", "polars"), ("duckdb", "duckdb")):
        try:
            __import__(module)
            if route == "duckdb":
                __import__("polars")
            routes.append(route)
        except ImportError:
            print(f"({route}: {module} is not installed; left out)")
    return routes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    parser.add_argument("--libs", type=Path, default=None, help="a folder holding polars, pyarrow and duckdb")
    args = parser.parse_args()
    if args.libs is not None:
        sys.path.insert(0, str(args.libs))
    routes = available_routes()
    for shape in args.shape or list(SHAPES):
        print_shape(shape, SHAPES[shape], routes, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
