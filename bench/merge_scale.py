"""How the merged Perfetto trace scales with the number of ranks.

    python bench/merge_scale.py --focus [--ranks 64,256,1024] [--all-up-to 256] [--out bench.json]
    python bench/merge_scale.py --one-rank TRACE [--repeat 3] [--baseline-rev REV] [--out bench.json]
    python bench/merge_scale.py [--source TRACE] [--ranks 8,64,256] [--steps 4] [--json-ranks 8,64]
                                [--work DIR] [--out bench.json]

`--focus`: the DEFAULT `fleetscope merge` (what a user gets: the focus set in full within the size
budget, and a summary track of every rank) against `--ranks all` in the same run, on N-rank sets made by
analysis/synthetic.py from the H200 fixture (as bench/postprocess_scale.py makes them: 8 ranks per
host). Each merge is `python -m fleetscope.cli.main merge SET -o OUT [--ranks all]` in its own process with
a private, empty parsed-trace cache (both cold). Reported per N and mode: output bytes (every file),
ranks drawn in full, wall time, peak RSS of the whole process tree (sum over the process and its
descendants, sampled every 0.1 s), and the trace processor's load time and peak RSS on the output; then
the ratios default / all. `--ranks all` runs only for N <= `--all-up-to` (its merge time grows with N).
`--one-rank TRACE`: one rank drawn in full (the trace copied alone into a scratch directory), merged with
the columnar decoder (the default) and with the generic reader (the path of files the columnar decoder
refuses: merge/event_window.py turns its events into the same columns), alternately `--repeat` times each, every merge in its own process after one warm-up merge that fills a private parsed-trace
cache (so each measured merge is what a merge after `analyze` costs: read, plan, write). Reported per
encoder: the median wall and CPU s of `merge()`, peak RSS, slices, us per slice, the median wall s of
writing the planned packets (the part the encoder replaces; the rest is reading and planning), and the ratios.
`--baseline-rev REV` adds fleetscope as of git revision REV (its packages extracted from git into the scratch
directory and imported in place of this checkout's), merging the same rank as often, in the same run: issue 30
asked for the merge 5x faster than on the day it was filed (`aa83b8f^`, the commit before the columnar encoder).
Without `--focus` or `--one-rank`, every rank in full (`--ranks all`) as below:

From one real GPU trace (default: the H200 fixture, a stock transformers eager step with ~3,150
kernels) it builds N-rank sets: the trace's steps are tiled to `--steps` steps, and each rank is the
same events under its own `distributedInfo` and host, 13.7 us later than the rank before
(`baseTimeNanoseconds` moves, the events do not). Every file is gzip, written as three gzip members
(header, events, footer) so the big one is compressed once.

Each merge runs in its own process (default options: flows, overlays). Reported per N:
  input JSON     uncompressed JSON bytes of all ranks
  wall s, CPU s  time of `merge()`: wall clock, and CPU time of the merging process and its workers
                 (the same as wall on an idle machine without workers; lower when other work shares
                 the cores)
  CPU s/GB       CPU seconds per GB of input JSON
  peak RSS       maximum resident set of the merging process, or of its largest worker with --workers
                 (goal: flat in N)
  output         the Perfetto trace; vs JSON: its size over the same events as merged Chrome JSON
                 (`MergeOptions.chrome_json`, measured in a second run for the N in --json-ranks;
                 goal <= 0.3)
  UI budget      whether the output fits the Perfetto UI's ~2 GB tab (the UI needs 2-4x the file)
  engine s, RSS  Perfetto's trace processor (`trace_processor_shell`, the engine behind the UI) loading
                 the output and counting its slices: wall time, and peak resident set from
                 `/usr/bin/time -f %M` (os.wait4 where that is missing); `--trace-processor PATH`, default
                 the one `analysis/merge/perfetto/sql.py` finds; skipped ("-") without one
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from fleetscope.cli.run_commands import int_at_least

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO / "tests" / "fixtures" / "gpu" / "h200-small-hf-eager-2steps.json.gz"
RANK_SHIFT_NS = 13_700
UI_BUDGET_BYTES = 2 << 30
UI_MEMORY_FACTOR = 4
"""The UI needs 2-4x the file in its tab; the worst case decides whether a trace fits."""
STEP_PREFIX = "ProfilerStep#"
_ID_ARGS = ("correlation", "External id")


@dataclass(frozen=True, kw_only=True)
class ScaleRow:
    ranks: int
    steps: int
    input_json_bytes: int
    input_stored_bytes: int
    merge_s: float
    """Wall time."""
    cpu_s: float
    """CPU time of the merging process (what wall time would be on an idle machine)."""
    cpu_s_per_gb: float
    peak_rss_mb: float
    output_bytes: int
    chrome_json_bytes: int | None
    fits_ui: bool
    engine_load_s: float | None = None
    """Wall time of the trace processor loading the output and answering one COUNT(*) query."""
    engine_peak_rss_mb: float | None = None
    engine_slices: int | None = None

    @property
    def vs_json(self) -> float | None:
        return self.output_bytes / self.chrome_json_bytes if self.chrome_json_bytes else None


# --- building rank sets (pure but for the final write) -----------------------------------------

def tile_steps(document: dict, steps: int) -> list[dict]:
    """The events of `document` repeated until they hold `steps` profiler steps (each copy later by
    the window's span, step numbers, correlation and flow ids moved on so they stay unique)."""
    events = [e for e in document["traceEvents"] if isinstance(e, dict)]
    source_steps = sorted({int(e["name"][len(STEP_PREFIX):]) for e in events
                           if e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_PREFIX)})
    if not source_steps:
        raise ValueError("the source trace has no ProfilerStep#N events to tile")
    timed = [e for e in events if e.get("ph") != "M" and isinstance(e.get("ts"), (int, float))]
    span_us = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 1000.0
    id_stride = 1 + max((e.get("args", {}).get(k, 0) for e in timed for k in _ID_ARGS
                         if isinstance(e.get("args", {}).get(k, 0), int)), default=0)
    copies = -(-steps // len(source_steps))
    tiled = [e for e in events if e.get("ph") == "M"]
    for copy in range(copies):
        tiled += [_shifted(e, copy, span_us, id_stride, len(source_steps)) for e in timed]
    return _keep_steps(tiled, steps)


def _shifted(event: dict, copy: int, span_us: float, id_stride: int, step_count: int) -> dict:
    if copy == 0:
        return event
    moved = {**event, "ts": round(event["ts"] + copy * span_us, 3)}
    name = moved.get("name")
    if isinstance(name, str) and name.startswith(STEP_PREFIX):
        moved["name"] = f"{STEP_PREFIX}{int(name[len(STEP_PREFIX):]) + copy * step_count}"
    if "id" in moved and isinstance(moved["id"], int):
        moved["id"] += copy * id_stride
    args = moved.get("args")
    if isinstance(args, dict) and any(isinstance(args.get(k), int) for k in _ID_ARGS):
        moved["args"] = {**args, **{k: args[k] + copy * id_stride for k in _ID_ARGS if isinstance(args.get(k), int)}}
    return moved


def _keep_steps(events: list[dict], steps: int) -> list[dict]:
    """Drop what starts at or after the start of step number `steps` + 1 (tiling may overshoot)."""
    starts = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith(STEP_PREFIX))
    if len(starts) <= steps:
        return events
    return [e for e in events if e.get("ph") == "M" or e["ts"] < starts[steps]]


def write_rank_set(document: dict, events: list[dict], ranks: int, directory: Path) -> tuple[int, int]:
    """Write `ranks` gzip traces; returns (uncompressed JSON bytes, stored bytes) of the set."""
    directory.mkdir(parents=True, exist_ok=True)
    body = orjson.dumps(events)[1:-1]
    body_member = gzip.compress(body, compresslevel=1, mtime=0)
    footer = b"]}"
    json_bytes = stored = 0
    for rank in range(ranks):
        header = _header(document, rank, ranks)
        data = gzip.compress(header, mtime=0) + body_member + gzip.compress(footer, mtime=0)
        (directory / f"rank{rank}.node{rank // 8}.pt.trace.json.gz").write_bytes(data)
        json_bytes += len(header) + len(body) + len(footer)
        stored += len(data)
    return json_bytes, stored


def _header(document: dict, rank: int, ranks: int) -> bytes:
    meta = {k: v for k, v in document.items() if k != "traceEvents"}
    meta["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": ranks}
    meta["host_name"] = f"node{rank // 8}"
    meta["baseTimeNanoseconds"] = int(document.get("baseTimeNanoseconds", 0)) + rank * RANK_SHIFT_NS
    return orjson.dumps(meta)[:-1] + b',"traceEvents":['


# --- measuring ----------------------------------------------------------------------------------

def measure_in_child(traces: Path, out: Path, chrome_json: Path | None, workers: int, *,
                     encoder: str = "columnar-plan", env: dict | None = None) -> dict:
    command = [sys.executable, __file__, "--one-merge", str(traces), str(out), "--workers", str(workers),
               "--encoder", encoder]
    if chrome_json is not None:
        command += ["--chrome-json", str(chrome_json)]
    completed = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"merge of {traces} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def one_merge(traces: Path, out: Path, chrome_json: Path | None, workers: int, encoder: str = "columnar-plan") -> dict:
    from fleetscope.analysis.merge import run
    from fleetscope.analysis.merge.options import MergeOptions

    if encoder == "generic-decode":  # the generic reader's path into the one planner (event_window.py)
        run.decode_window = lambda data: None
    emit_s = _time_packet_writing(run) if encoder != BASELINE else [float("nan")]
    started, cpu_started = time.perf_counter(), _cpu_s()
    result = run.merge(traces, out, options=MergeOptions(chrome_json=chrome_json, workers=workers))
    elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu_started
    return {
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "peak_rss_mb": _peak_rss_mb(),
        "output_bytes": result.output_bytes,
        "chrome_json_bytes": result.chrome_json_uncompressed_bytes,
        "ranks": len(result.ranks),
        "slices": result.slice_count,
        "emit_s": emit_s[0],
        "problems": [p.reason for p in result.problems][:5],
        "merge_module": run.__file__,
    }


def _time_packet_writing(run: Any) -> list[float]:
    """Wall seconds spent writing the planned packets of every window (the part the encoder does),
    summed into the returned one-item list as the merge runs."""
    total = [0.0]
    emit = run._RankEmitter.emit

    def timed(self, *args):
        started = time.perf_counter()
        emit(self, *args)
        total[0] += time.perf_counter() - started

    run._RankEmitter.emit = timed
    return total


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished worker processes."""
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _peak_rss_mb() -> float:
    """This process's peak resident set, or with worker processes the largest of them and this one."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


ENGINE_SQL = "SELECT COUNT(*) AS slices FROM slice;"


def measure_engine(trace: Path, binary: Path) -> dict:
    """Load `trace` in the trace processor at `binary`: wall seconds, peak RSS (MB), slices it holds."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as query:
        query.write(ENGINE_SQL)
        query.flush()
        command = [str(binary), "-q", query.name, str(trace)]
        timer = shutil.which("time", path="/usr/bin")
        started = time.perf_counter()
        if timer:
            completed = subprocess.run([timer, "-f", "%M", *command], capture_output=True, text=True, check=False)
            elapsed, returncode, stdout = time.perf_counter() - started, completed.returncode, completed.stdout
            peak_kb = int(completed.stderr.strip().splitlines()[-1])
        else:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            stdout = process.stdout.read()
            _, status, usage = os.wait4(process.pid, 0)
            elapsed, returncode, peak_kb = time.perf_counter() - started, os.waitstatus_to_exitcode(status), usage.ru_maxrss
    if returncode != 0:
        raise RuntimeError(f"{binary} failed on {trace} (exit {returncode})")
    slices = int(stdout.strip().splitlines()[-1])
    return {"elapsed_s": elapsed, "peak_rss_mb": peak_kb / 1024, "slices": slices}


def run_scale(source: Path, rank_counts: list[int], steps: int, json_ranks: set[int], work: Path,
              workers: int = 1, engine: Path | None = None) -> list[ScaleRow]:
    document = json.loads(gzip.decompress(source.read_bytes()) if source.name.endswith(".gz") else source.read_bytes())
    events = tile_steps(document, steps)
    rows = []
    for ranks in rank_counts:
        directory = work / f"ranks{ranks}"
        json_bytes, stored = write_rank_set(document, events, ranks, directory / "traces")
        merged = measure_in_child(directory / "traces", directory / "merged.perfetto-trace", None, workers)
        if merged["ranks"] != ranks:
            raise RuntimeError(f"{ranks}-rank set merged {merged['ranks']} ranks: {merged['problems']}")
        chrome = None
        if ranks in json_ranks:
            chrome = measure_in_child(directory / "traces", directory / "with-json.perfetto-trace",
                                      directory / "merged.trace.json", workers)["chrome_json_bytes"]
            (directory / "merged.trace.json").unlink(missing_ok=True)
        loaded = measure_engine(directory / "merged.perfetto-trace", engine) if engine else {}
        rows.append(ScaleRow(
            ranks=ranks, steps=steps, input_json_bytes=json_bytes, input_stored_bytes=stored,
            merge_s=merged["elapsed_s"], cpu_s=merged["cpu_s"], cpu_s_per_gb=merged["cpu_s"] / (json_bytes / 1e9),
            peak_rss_mb=merged["peak_rss_mb"], output_bytes=merged["output_bytes"], chrome_json_bytes=chrome,
            fits_ui=merged["output_bytes"] * UI_MEMORY_FACTOR <= UI_BUDGET_BYTES,
            engine_load_s=loaded.get("elapsed_s"), engine_peak_rss_mb=loaded.get("peak_rss_mb"),
            engine_slices=loaded.get("slices"),
        ))
        print(format_row(rows[-1]), flush=True)
        for path in (directory / "traces").iterdir():
            path.unlink()
        (directory / "merged.perfetto-trace").unlink(missing_ok=True)
    return rows


# --- reporting ----------------------------------------------------------------------------------

HEADER = (f"{'ranks':>5} {'steps':>5} {'input JSON':>11} {'stored':>9} {'wall s':>8} {'CPU s':>7} {'CPU s/GB':>8} "
          f"{'peak RSS':>9} {'output':>9} {'merged JSON':>12} {'vs JSON':>7} {'UI fit':>6} {'engine s':>8} "
          f"{'engine RSS':>10}")


def format_row(row: ScaleRow) -> str:
    chrome = _size(row.chrome_json_bytes) if row.chrome_json_bytes else "-"
    ratio = f"{row.vs_json:.3f}" if row.vs_json is not None else "-"
    return (f"{row.ranks:>5} {row.steps:>5} {_size(row.input_json_bytes):>11} {_size(row.input_stored_bytes):>9} "
            f"{row.merge_s:>8.1f} {row.cpu_s:>7.1f} {row.cpu_s_per_gb:>8.1f} {row.peak_rss_mb:>7.0f}MB {_size(row.output_bytes):>9} "
            f"{chrome:>12} {ratio:>7} {'yes' if row.fits_ui else 'no':>6} "
            f"{_or_dash(row.engine_load_s, '.1f'):>8} {_or_dash(row.engine_peak_rss_mb, '.0f', 'MB'):>10}")


def _or_dash(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return f"{count}B"


# --- one rank drawn in full: the columnar decoder against the generic reader, into the one planner ----------

ENCODERS = ("generic-decode", "columnar-plan")
"""generic-decode: the window read by the generic reader and turned into columns (event_window.py);
columnar-plan: the window decoded on columns (window_decode.py), the default. Both are planned by
column_plan.py and written by the columnar encoder: the bytes must be the same."""


def run_one_rank(trace: Path, repeat: int, work: Path, baseline_rev: str | None = None) -> dict[str, list[dict]]:
    """Merges of `trace` as one rank in full, the encoders (and the baseline revision, when given) alternating
    round by round, so that a machine slowing down or speeding up weighs on every variant alike; the raw
    measurements per variant."""
    traces = work / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trace, traces / ("rank0.pt.trace.json" + (".gz" if trace.name.endswith(".gz") else "")))
    env = {**os.environ, "FLEETSCOPE_CACHE_DIR": str(work / "cache")}
    measure_in_child(traces, work / "warm-up.perfetto-trace", None, 1, env=env)
    baseline = _baseline_variant(baseline_rev, traces, work) if baseline_rev else None
    runs: dict[str, list[dict]] = {encoder: [] for encoder in ENCODERS}
    if baseline is not None:
        runs[baseline.label] = []
    for _ in range(repeat):
        for encoder in ENCODERS:
            runs[encoder].append(measure_in_child(traces, work / f"{encoder}.perfetto-trace", None, 1,
                                                  encoder=encoder, env=env))
        if baseline is not None:
            runs[baseline.label].append(baseline.measure())
    reference = (work / "per-event.perfetto-trace").read_bytes()
    if any((work / f"{encoder}.perfetto-trace").read_bytes() != reference for encoder in ENCODERS):
        raise RuntimeError("the columnar decoder and the generic reader gave different traces")
    return runs


BASELINE = "baseline"


@dataclass(frozen=True)
class _BaselineVariant:
    """fleetscope as it was at a git revision, merging the same traces: "faster than today" measured against
    the code of that day, in the same run (its output differs: the merge drew more since)."""

    label: str
    revision: str
    traces: Path
    work: Path
    env: dict

    def measure(self) -> dict:
        """One merge in its own process, checked to have run the extracted revision's code."""
        measured = measure_in_child(self.traces, self.work / "baseline.perfetto-trace", None, 1, encoder=BASELINE,
                                    env=self.env)
        if not Path(measured["merge_module"]).resolve().is_relative_to((self.work / "baseline").resolve()):
            raise RuntimeError(f"the baseline merge did not run the code of {self.revision}: "
                               f"{measured['merge_module']}")
        return measured


def _baseline_variant(rev: str, traces: Path, work: Path) -> _BaselineVariant:
    """The revision's sources extracted beside this checkout and imported first, after a warm-up merge that
    fills its own parsed-trace cache."""
    package = _extract_revision(rev, work / "baseline")
    env = {**os.environ, "PYTHONPATH": str(package), "FLEETSCOPE_CACHE_DIR": str(work / "baseline-cache")}
    measure_in_child(traces, work / "baseline-warm-up.perfetto-trace", None, 1, encoder=BASELINE, env=env)
    return _BaselineVariant(label=f"{BASELINE} {rev}", revision=rev, traces=traces, work=work, env=env)


def _extract_revision(rev: str, into: Path) -> Path:
    """fleetscope's packages at `rev` as an importable `fleetscope` package directory (its subpackages
    linked to the extracted folders, as pyproject.toml's package-dir maps them); returns its parent."""
    if not re.fullmatch(r"[0-9A-Za-z_.^~/-]{1,80}", rev):
        raise ValueError(f"not a git revision: {rev!r}")
    source, package = into / "src", into / "pkg"
    source.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "--", *FLEETSCOPE_FOLDERS],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    (package / "fleetscope").mkdir(parents=True, exist_ok=True)
    for folder in FLEETSCOPE_FOLDERS:
        link = package / "fleetscope" / folder
        if not link.exists():
            link.symlink_to(source / folder, target_is_directory=True)
    return package


FLEETSCOPE_FOLDERS = ("cli", "launcher", "trainer", "traces", "analysis")
"""The folders pyproject.toml maps to fleetscope.<folder>."""


def one_rank_rows(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for encoder, measured in runs.items():
        wall = sorted(m["elapsed_s"] for m in measured)[len(measured) // 2]
        cpu = sorted(m["cpu_s"] for m in measured)[len(measured) // 2]
        slices = measured[0]["slices"]
        emit = sorted(m["emit_s"] for m in measured)[len(measured) // 2]
        rows.append({"encoder": encoder, "wall_s": wall, "cpu_s": cpu, "emit_s": emit,
                     "walls_s": [m["elapsed_s"] for m in measured],
                     "peak_rss_mb": max(m["peak_rss_mb"] for m in measured), "slices": slices,
                     "us_per_slice": wall / slices * 1e6, "output_bytes": measured[0]["output_bytes"]})
    return rows


def format_one_rank(rows: list[dict]) -> list[str]:
    lines = [f"{'encoder':>15} {'slices':>8} {'wall s':>7} {'CPU s':>6} {'us/slice':>8} {'writing s':>9} "
             f"{'us/slice':>8} {'peak RSS':>9} {'output':>8}"]
    lines += [f"{r['encoder']:>15} {r['slices']:>8} {r['wall_s']:>7.3f} {r['cpu_s']:>6.3f} {r['us_per_slice']:>8.2f} "
              f"{r['emit_s']:>9.3f} {r['emit_s'] / r['slices'] * 1e6:>8.2f} {r['peak_rss_mb']:>7.0f}MB "
              f"{_size(r['output_bytes']):>8}" for r in rows]
    by = {r["encoder"]: r for r in rows}
    for before in ("generic-decode", *(e for e in by if e.startswith(BASELINE))):
        lines.append(f"{before} / columnar-plan: wall {by[before]['wall_s'] / by['columnar-plan']['wall_s']:.2f}x, "
                     f"CPU {by[before]['cpu_s'] / by['columnar-plan']['cpu_s']:.2f}x")
    return lines


# --- default (focus set) against --ranks all --------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class FocusRow:
    ranks: int
    mode: str
    """"default" or "all"."""
    output_bytes: int
    ranks_in_full: int
    wall_s: float
    peak_tree_rss_mb: float
    engine_load_s: float | None
    engine_peak_rss_mb: float | None
    exit_code: int


def run_focus_scale(source: Path, rank_counts: list[int], all_up_to: int, work: Path,
                    engine: Path | None) -> list[FocusRow]:
    from postprocess_scale import make_run

    rows = []
    for ranks in rank_counts:
        run_dir = make_run(source, work / f"set{ranks}", ranks)
        modes = ["default"] + (["all"] if ranks <= all_up_to else [])
        for mode in modes:
            rows.append(_focus_row(run_dir, ranks, mode, work, engine))
            print(format_focus_row(rows[-1]), flush=True)
        shutil.rmtree(run_dir)
    return rows


def _focus_row(run_dir: Path, ranks: int, mode: str, work: Path, engine: Path | None) -> FocusRow:
    from postprocess_scale import run_watched

    out = work / f"{mode}{ranks}" / "merged.perfetto-trace"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "fleetscope.cli.main", "merge", str(run_dir), "-o", str(out)]
    command += ["--ranks", "all"] if mode == "all" else []
    env = {**os.environ, "FLEETSCOPE_CACHE_DIR": str(work / f"cache-{mode}{ranks}")}
    exit_code, wall, peak_mb, output = run_watched(command, env)
    files = sorted(out.parent.glob("*.perfetto-trace"))
    loaded = measure_engine(out, engine) if engine and out.is_file() else {}
    row = FocusRow(ranks=ranks, mode=mode, output_bytes=sum(f.stat().st_size for f in files),
                   ranks_in_full=_ranks_in_full(output), wall_s=round(wall, 1), peak_tree_rss_mb=peak_mb,
                   engine_load_s=loaded.get("elapsed_s"), engine_peak_rss_mb=loaded.get("peak_rss_mb"),
                   exit_code=exit_code)
    if exit_code != 0:
        print(output[-2000:], file=sys.stderr)
    shutil.rmtree(out.parent)
    shutil.rmtree(work / f"cache-{mode}{ranks}", ignore_errors=True)
    return row


def _ranks_in_full(output: str) -> int:
    for line in output.splitlines():
        if line.startswith("merged ") and " rank(s) in full" in line:
            return int(line.split()[1])
    return -1


FOCUS_HEADER = (f"{'ranks':>5} {'mode':>8} {'in full':>7} {'output':>9} {'wall s':>7} {'tree RSS':>9} "
                f"{'engine s':>8} {'engine RSS':>10} {'exit':>4}")


def format_focus_row(row: FocusRow) -> str:
    return (f"{row.ranks:>5} {row.mode:>8} {row.ranks_in_full:>7} {_size(row.output_bytes):>9} {row.wall_s:>7.1f} "
            f"{row.peak_tree_rss_mb:>7.0f}MB {_or_dash(row.engine_load_s, '.1f'):>8} "
            f"{_or_dash(row.engine_peak_rss_mb, '.0f', 'MB'):>10} {row.exit_code:>4}")


def focus_ratios(rows: list[FocusRow]) -> list[str]:
    """Default over all, per N where both ran."""
    lines = []
    by_key = {(r.ranks, r.mode): r for r in rows}
    for ranks in sorted({r.ranks for r in rows}):
        default, every = by_key.get((ranks, "default")), by_key.get((ranks, "all"))
        if default is None or every is None:
            continue
        engine = (f", engine RSS {default.engine_peak_rss_mb / every.engine_peak_rss_mb:.2f}x"
                  if default.engine_peak_rss_mb and every.engine_peak_rss_mb else "")
        lines.append(f"{ranks} ranks, default / --ranks all: size {default.output_bytes / every.output_bytes:.2f}x, "
                     f"wall {default.wall_s / every.wall_s:.2f}x{engine}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--focus", action="store_true", help="the default merge against --ranks all (docstring)")
    parser.add_argument("--all-up-to", type=int, default=256, help="--focus: run --ranks all up to this many ranks")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--ranks", default="8,64,256")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json-ranks", default="8,64", help="rank counts that also get a merged Chrome JSON")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--workers", type=int, default=1, help="MergeOptions.workers for every merge")
    parser.add_argument("--trace-processor", type=Path, default=None,
                        help="trace_processor_shell to load each output with (default: the project's lookup)")
    parser.add_argument("--no-engine", action="store_true", help="do not load the outputs in the trace processor")
    parser.add_argument("--one-rank", type=Path, default=None, metavar="TRACE",
                        help="one rank in full: the columnar encoder against the per-event writer (docstring)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3, help="--one-rank: merges per encoder")
    parser.add_argument("--one-merge", nargs=2, type=Path, metavar=("TRACES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--chrome-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--encoder", choices=(*ENCODERS, BASELINE), default="columnar-plan", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-rev", default=None, metavar="REV",
                        help="--one-rank: also merge with fleetscope as of git revision REV, in the same run")
    args = parser.parse_args()
    if args.one_merge:
        print(json.dumps(one_merge(*args.one_merge, args.chrome_json, args.workers, args.encoder)))
        return 0
    if args.one_rank:
        return _main_one_rank(args)
    rank_counts = [int(n) for n in args.ranks.split(",") if n]
    engine = None
    if not args.no_engine:
        from fleetscope.analysis.merge.perfetto.sql import find_trace_processor
        engine = find_trace_processor(args.trace_processor)
    if args.focus:
        return _main_focus(args, rank_counts, engine)
    json_ranks = {int(n) for n in args.json_ranks.split(",") if n}
    with tempfile.TemporaryDirectory(prefix="merge_scale_") as scratch:
        work = args.work or Path(scratch)
        print(f"trace processor: {engine or 'none found (engine columns skipped)'}", flush=True)
        print(f"source: {args.source} ({args.steps} steps per rank)\n{HEADER}", flush=True)
        rows = run_scale(args.source, rank_counts, args.steps, json_ranks, work, args.workers, engine)
    if args.out:
        args.out.write_text(json.dumps([asdict(r) | {"vs_json": r.vs_json} for r in rows], indent=2) + "\n")
    return 0


def _main_one_rank(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="merge_one_rank_") as scratch:
        rows = one_rank_rows(run_one_rank(args.one_rank, args.repeat, args.work or Path(scratch), args.baseline_rev))
    print(f"source: {args.one_rank}")
    for line in format_one_rank(rows):
        print(line)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _main_focus(args: argparse.Namespace, rank_counts: list[int], engine: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="merge_focus_") as scratch:
        work = args.work or Path(scratch)
        print(f"trace processor: {engine or 'none found (engine columns skipped)'}", flush=True)
        print(f"source: {args.source}\n{FOCUS_HEADER}", flush=True)
        rows = run_focus_scale(args.source, rank_counts, args.all_up_to, work, engine)
    for line in focus_ratios(rows):
        print(line)
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0 if all(r.exit_code == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
