"""Wall time and peak memory of the default `fleetscope postprocess` (gather + analyze + merge).

Builds a run directory of N synthetic ranks from one real GPU trace (analysis/synthetic.py: every rank
a copy with its own rank, host and clock), then runs `fleetscope postprocess RUN` as a subprocess,
with no special flags and a private, empty parsed-trace cache (a cold run, what a user gets the first
time), and reports the wall time of each stage and the peak memory of the whole process tree (largest sum
of RSS over the process and all its descendants, sampled every 0.2 s with psutil; PSS every 1 s).

In the same run, on the same traces, stock HTA (bench/stock_hta.py: HTA's own JSON loader and
multiprocessing, and the six views the default report holds, on all ranks); the ratios of its wall time
to the whole `postprocess`, to gather + analyze (what stock HTA's work corresponds to: reading every trace
and HTA's views; it writes no merged trace) and to the analyze stage are printed. Memory: the peak sums of RSS and of PSS over the process tree
(RSS counts a page shared by forked workers in each of them; PSS shares it out, so its sum is what the
tree holds).

Stock HTA runs only on sets of at most --stock-hta-max-ranks ranks (default 64: at 256 ranks it alone
takes over ten minutes on a 2-core machine); beyond that its ratio is printed as not measured, never
extrapolated. The machine's load average is recorded before and after each run (a shared machine slows
every number; both tools alike only on average).

    python bench/postprocess_scale.py                         # 8, 64, 256 and 1,024 synthetic ranks
    python bench/postprocess_scale.py --ranks 8 64 --markdown
    python bench/postprocess_scale.py --run-dir runs/demo     # an existing run (e.g. the demo's)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import stock_hta
from bytecode import compile_fleetscope
from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set
from fleetscope.traces.layout import RunLayout, trace_file_name, window_name

DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / "tests/fixtures/gpu/h200-small-hf-eager-2steps.json.gz"
_STAGE_RE = re.compile(r"^(gather|analyze|merge) took (\d+(?:\.\d+)?) s \(CPU (\d+(?:\.\d+)?) s\)$", re.MULTILINE)
SAMPLE_SECONDS = 0.2
PSS_EVERY = 5


def make_run(source: Path, root: Path, ranks: int) -> Path:
    """A run directory of `ranks` synthetic ranks in one window (no job.json: a bare trace tree)."""
    layout = RunLayout.at(root)
    window = layout.traces_dir / window_name(0)
    staging = root / "staging"
    paths = make_trace_set(source, staging, TraceSetSpec(ranks=ranks))
    window.mkdir(parents=True, exist_ok=True)
    for rank, path in enumerate(paths):
        path.rename(window / trace_file_name(rank=rank, host=f"node{rank // 8}"))
    shutil.rmtree(staging)
    return root


def run_postprocess(run_dir: Path, cache_dir: Path) -> dict:
    env = {**os.environ, "FLEETSCOPE_CACHE_DIR": str(cache_dir)}
    command = [sys.executable, "-m", "fleetscope.cli.main", "postprocess", str(run_dir), "--timings"]
    load_before = _load_average()
    exit_code, wall, peak_mb, output = run_watched(command, env)
    found = _STAGE_RE.findall(output)
    stages = {name: float(seconds) for name, seconds, _ in found}
    stages_cpu = {name: float(cpu) for name, _, cpu in found}
    return {"exit": exit_code, "wall_s": round(wall, 2), "cpu_s": _LAST_CPU["cpu_s"], "stages_s": stages,
            "stages_cpu_s": stages_cpu, "peak_tree_rss_mb": peak_mb, "peak_tree_pss_mb": _LAST_CPU["peak_pss_mb"],
            "peak_rss_at_s": _LAST_CPU["peak_rss_at_s"], "load_average": [load_before, _load_average()]}


def _load_average() -> float:
    """The 1-minute load average (of a machine with os.cpu_count() cores)."""
    return round(os.getloadavg()[0], 1)


def run_stock_hta(trace_dir: Path) -> dict:
    load_before = _load_average()
    exit_code, wall, peak_mb, output = run_watched([sys.executable, stock_hta.SCRIPT, str(trace_dir)], dict(os.environ))
    return {"exit": exit_code, "wall_s": round(wall, 2), "cpu_s": _LAST_CPU["cpu_s"], "peak_tree_rss_mb": peak_mb,
            "peak_tree_pss_mb": _LAST_CPU["peak_pss_mb"], "load_average": [load_before, _load_average()],
            **({"error": output.strip().splitlines()[-1][:200]} if exit_code and output.strip() else {})}


def with_stock_hta(measured: dict, trace_dir: Path, ranks: int | None, max_ranks: int) -> dict:
    """`measured` plus stock HTA's run and the ratios, or the reason it was not run."""
    if max_ranks < 0:
        return {**measured, "stock_hta": "not measured (--no-stock-hta)"}
    if ranks is not None and ranks > max_ranks:
        return {**measured, "stock_hta": f"not measured (more than {max_ranks} ranks)"}
    stock = run_stock_hta(trace_dir)
    measured = {**measured, "stock_hta": stock}
    if stock["exit"] == 0 and measured["wall_s"] > 0:
        measured["stock_hta_over_postprocess"] = round(stock["wall_s"] / measured["wall_s"], 1)
    before_merge = sum(measured["stages_s"].get(stage, 0.0) for stage in ("gather", "analyze"))
    if stock["exit"] == 0 and before_merge > 0:
        measured["stock_hta_over_gather_analyze"] = round(stock["wall_s"] / before_merge, 1)
    if stock["exit"] == 0 and measured["cpu_s"] > 0:
        measured["stock_hta_cpu_over_postprocess_cpu"] = round(stock["cpu_s"] / measured["cpu_s"], 1)
    if stock["exit"] == 0 and measured["stages_s"].get("analyze"):
        measured["stock_hta_over_analyze"] = round(stock["wall_s"] / measured["stages_s"]["analyze"], 1)
    return measured


def markdown_row(label: str, measured: dict) -> str:
    """One row of the results table (README order: stages, memory, stock HTA, ratios)."""
    stages = measured["stages_s"]
    stock = measured.get("stock_hta")
    measured_stock = isinstance(stock, dict) and stock.get("exit") == 0

    def ratio(key: str) -> str:
        return f"{measured[key]}x" if key in measured else "not measured"

    cells = [label, measured["wall_s"], measured["cpu_s"], *(stages.get(s, "-") for s in ("gather", "analyze", "merge")),
             measured["peak_tree_rss_mb"], measured["peak_tree_pss_mb"],
             stock["wall_s"] if measured_stock else "not run", stock["cpu_s"] if measured_stock else "-",
             stock["peak_tree_rss_mb"] if measured_stock else "-", stock["peak_tree_pss_mb"] if measured_stock else "-",
             ratio("stock_hta_over_analyze"), ratio("stock_hta_over_gather_analyze"), ratio("stock_hta_over_postprocess"),
             ratio("stock_hta_cpu_over_postprocess_cpu"), " / ".join(str(v) for v in measured["load_average"])]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def run_watched(command: list[str], env: dict) -> tuple[int, float, float, str]:
    """(exit code, wall seconds, peak RSS of the process tree in MB, stdout+stderr); the peak PSS of the
    tree and the CPU seconds go to _LAST_CPU."""
    with tempfile.TemporaryFile("w+") as sink, _cpu_seconds_into(_LAST_CPU):
        started = time.perf_counter()
        process = psutil.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        peak_rss = peak_pss = 0
        peak_at = 0.0
        unwaited_cpu: dict[int, float] = {}
        samples = 0
        while process.poll() is None:
            # PSS walks every page table: read it every PSS_EVERY-th sample only, RSS is cheap
            rss, pss = _tree_memory(process, unwaited_cpu, with_pss=samples % PSS_EVERY == 0)
            if rss > peak_rss:
                peak_rss, peak_at = rss, time.perf_counter() - started
            peak_pss, samples = max(peak_pss, pss), samples + 1
            time.sleep(SAMPLE_SECONDS)
        wall = time.perf_counter() - started
        sink.seek(0)
        _LAST_CPU["unwaited_cpu_s"] = sum(unwaited_cpu.values())
        _LAST_CPU["peak_pss_mb"] = round(peak_pss / 2**20, 1)
        _LAST_CPU["peak_rss_at_s"] = round(peak_at, 1)
        return process.returncode, wall, round(peak_rss / 2**20, 1), sink.read()


_LAST_CPU: dict[str, float] = {}


@contextlib.contextmanager
def _cpu_seconds_into(sink: dict[str, float]):
    """CPU seconds (user + system) of the children waited for inside the block, of their waited-for
    descendants (the worker pools), and of the forkserver processes nobody waits for (HTA's and the
    merge's workers: sampled, so up to SAMPLE_SECONDS of each one's last CPU time is missed): far less
    sensitive to a loaded machine than wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    yield
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    waited = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    sink["cpu_s"] = round(waited + sink.pop("unwaited_cpu_s", 0.0), 1)


_FORKSERVER_PIDS: dict[int, bool] = {}


def _is_forkserver(member: psutil.Process) -> bool:
    """A forkserver or one of its workers (its command line says so; read once per process)."""
    known = _FORKSERVER_PIDS.get(member.pid)
    if known is None:
        known = _FORKSERVER_PIDS[member.pid] = "forkserver" in " ".join(member.cmdline())
    return known


def _tree_memory(process: psutil.Process, unwaited_cpu: dict[int, float], *, with_pss: bool) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) over the process and its descendants. RSS counts pages shared by forked
    workers once in each of them; PSS splits each shared page among its sharers, so its sum is what the
    tree really holds. Also notes the CPU time of forkserver processes (`unwaited_cpu`, by pid)."""
    rss = pss = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for member in members:
        try:
            if with_pss:
                memory = member.memory_full_info()
                rss, pss = rss + memory.rss, pss + getattr(memory, "pss", memory.rss)
            else:
                rss += member.memory_info().rss
            if member is not process and _is_forkserver(member):
                times = member.cpu_times()
                unwaited_cpu[member.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return rss, pss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 256, 1024])
    parser.add_argument("--run-dir", type=Path, action="append", default=[], help="an existing run directory")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--no-stock-hta", action="store_true", help="skip the stock HTA run")
    parser.add_argument("--stock-hta-max-ranks", type=int, default=64,
                        help="run stock HTA only on sets of at most this many ranks (default 64)")
    parser.add_argument("--markdown", action="store_true", help="also print the results as a table")
    args = parser.parse_args()
    compile_fleetscope()  # as an install does (bench/bytecode.py)
    max_ranks = -1 if args.no_stock_hta else args.stock_hta_max_ranks
    results = []
    print(f"{os.cpu_count()} cores; load average {_load_average()} at the start", flush=True)
    with tempfile.TemporaryDirectory(prefix="fleetscope-bench-") as scratch:
        targets = [(f"{n} synthetic ranks", n, None) for n in args.ranks]
        targets += [(str(path), None, path) for path in args.run_dir]
        for label, ranks, run_dir in targets:
            if run_dir is None:  # made just before it is measured, removed after: 1,024 ranks are 1.9 GB
                run_dir = make_run(args.source, Path(scratch) / f"set{ranks}", ranks)
            cache = Path(scratch) / f"cache-{len(results)}"
            measured = run_postprocess(run_dir, cache)
            measured = with_stock_hta(measured, RunLayout.at(run_dir).traces_dir / window_name(0),
                                      ranks, max_ranks)
            results.append({"input": label, **measured})
            print(f"{label}: {json.dumps(measured)}", flush=True)
            if ranks is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
    if args.markdown:
        print("| input | postprocess wall s | postprocess CPU s | gather s | analyze s (incl. HTA's views) | merge s | "
              "peak tree RSS MB | peak tree PSS MB | stock HTA wall s | stock HTA CPU s | stock HTA peak RSS MB | "
              "stock HTA peak PSS MB | HTA / analyze | HTA / (gather + analyze) | HTA / postprocess | "
              "HTA CPU / postprocess CPU | load average before / after |")
        print("|---" * 17 + "|")
        for result in results:
            print(markdown_row(result["input"], result))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
