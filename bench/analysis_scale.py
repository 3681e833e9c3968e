"""Scale benchmark: `fleetscope analyze` against stock HTA on N-rank trace sets, in the same run.

    python bench/analysis_scale.py                       # N = 8, 64, 256, 1024; HTA at 8 and 64
    python bench/analysis_scale.py --ranks 8 64 --hta-ranks 8 64 --out results.json
    python bench/analysis_scale.py --ranks 8 --hta-ranks 8 --repeat 3   # rounds alternate; medians

Each set is made from one real GPU trace (default: the H200 fixture of a stock transformers MoE step,
~3,150 kernels per step) by fleetscope.analysis.synthetic: every rank gets the trace's events under its
own rank and host, and one all-reduce per step is added (the source is a single-GPU recording).

Both tools run in a fresh subprocess each (imports included in the time):
  - ours: the default `analyze(dir)` with its default process pool (one worker per core), writing the
    report JSON: steps, busy/idle/comm/overlap per rank, stragglers, clock alignment, and HTA's views
    (temporal, idle time, overlap, kernels, launch statistics, stragglers) computed natively, without
    HTA (per_rank/hta_native*.py), on the ranks the report picks (`--hta-ranks auto`: at most 16); with an
    empty parsed-trace cache of the benchmark's own (so it parses every trace, and stores the results);
  - ours-warm: the same command again, now finding every trace's result and every rank's HTA views in
    that cache (what a second `analyze`, a `compare` or a `postprocess` of the same run costs);
  - HTA: stock HTA (bench/stock_hta.py: HTA's own JSON loader and multiprocessing, and the six views
    the default report holds, on all ranks).
Peak memory is the largest sum of PSS over the subprocess and all its descendants, sampled every 0.1 s
(PSS counts pages shared between forked workers once, so neither tool is charged twice for them); CPU
time is that tree's user + system time, sampled alike (the ratio to trust on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import stock_hta
from bytecode import compile_fleetscope
from fleetscope.cli.run_commands import int_at_least

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO / "tests" / "fixtures" / "gpu" / "h200-small-hf-eager-2steps.json.gz"
SAMPLE_SECONDS = 0.1

OURS = textwrap.dedent("""
    import sys
    from fleetscope.analysis import analyze
    report = analyze(sys.argv[1], json_out=sys.argv[2])
    assert len(report.ranks) == int(sys.argv[3]), (len(report.ranks), report.problems[:3])
    hta = report.windows[0].hta
    assert {"temporal_breakdown", "idle_time_breakdown", "comm_comp_overlap"} <= set(hta.tables), hta
""")



@dataclass(frozen=True)
class Measurement:
    tool: str
    ranks: int
    wall_s: float
    peak_pss_mb: float
    ok: bool
    error: str = ""
    cpu_s: float = 0.0
    """CPU time (user + system) of the process tree, sampled with the memory: on a shared machine the
    ratio of CPU seconds says what the ratio of wall seconds cannot."""


def ours_command(trace_dir: Path, report: Path, ranks: int) -> list[str]:
    return [sys.executable, "-c", OURS, str(trace_dir), str(report), str(ranks)]


def stock_hta_command(trace_dir: Path, report: Path, ranks: int) -> list[str]:
    return [sys.executable, stock_hta.SCRIPT, str(trace_dir), str(ranks)]


def run_measured(tool: str, command_of, trace_dir: Path, ranks: int, timeout_s: float,
                 cache_dir: Path | None = None) -> Measurement:
    """`command_of(trace_dir, report_path, ranks)` run and watched."""
    env = dict(os.environ, **({"FLEETSCOPE_CACHE_DIR": str(cache_dir)} if cache_dir else {}))
    with tempfile.TemporaryDirectory() as scratch:
        command = command_of(trace_dir, Path(scratch) / "report.json", ranks)
        start = time.perf_counter()
        process = psutil.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        peak, cpu = _watch(process, start + timeout_s)
        wall = time.perf_counter() - start
        stderr = process.stderr.read() if process.stderr else ""
    ok = process.returncode == 0
    error = "" if ok else (stderr.strip().splitlines() or [f"exit {process.returncode}"])[-1][:200]
    return Measurement(tool, ranks, wall, peak / 2**20, ok, error, cpu)


def _watch(process: psutil.Popen, deadline: float) -> tuple[int, float]:
    """(peak PSS in bytes, CPU seconds) of the process tree until it exits; killed at the deadline. Each
    member's CPU is its last sample (a member's last 0.1 s can be missed), the top process's its own at exit."""
    peak = 0
    cpu: dict[int, float] = {}
    while process.poll() is None:
        if time.perf_counter() > deadline:
            for child in process.children(recursive=True):
                child.kill()
            process.kill()
            break
        peak = max(peak, _tree_pss(process))
        _sample_cpu(process, cpu)
        time.sleep(SAMPLE_SECONDS)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    process.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the top process and every descendant it reaped, at exit; sampled members it did not reap on top
    reaped = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return peak, max(reaped, sum(cpu.values()))


def _sample_cpu(process: psutil.Process, cpu: dict[int, float]) -> None:
    try:
        members = [process] + process.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for member in members:
        try:
            times = member.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        cpu[member.pid] = max(cpu.get(member.pid, 0.0), times.user + times.system)


def _tree_pss(process: psutil.Process) -> int:
    total = 0
    try:
        members = [process] + process.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for member in members:
        try:
            total += member.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def measure_round(args, directory: Path, workdir: Path, ranks: int) -> list[Measurement]:
    """One round on one set: ours cold, ours warm (each with an empty cache first), then stock HTA."""
    measured = []
    if ranks in args.ranks:
        cache_dir = workdir / f"cache{ranks}"
        shutil.rmtree(cache_dir, ignore_errors=True)
        for tool in ("ours", "ours-warm"):
            measured.append(run_measured(tool, ours_command, directory, ranks, args.timeout, cache_dir))
            _print_run(measured[-1])
        shutil.rmtree(cache_dir, ignore_errors=True)
    if ranks in args.hta_ranks:
        measured.append(run_measured("hta", stock_hta_command, directory, ranks, args.timeout))
        _print_run(measured[-1])
    return measured


def _print_run(m: Measurement) -> None:
    print(f"  {m.tool:9} {m.wall_s:.1f} s (CPU {m.cpu_s:.1f} s) {m.peak_pss_mb:.0f} MB {m.error}", flush=True)


def median_measurement(runs: list[Measurement]) -> Measurement:
    """One tool's runs as one row: median wall and CPU, the largest peak; failed if any run failed."""
    return Measurement(runs[0].tool, runs[0].ranks, statistics.median(m.wall_s for m in runs),
                       max(m.peak_pss_mb for m in runs), all(m.ok for m in runs),
                       next((m.error for m in runs if not m.ok), ""), statistics.median(m.cpu_s for m in runs))


def make_set(source: Path, directory: Path, ranks: int) -> float:
    from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set

    start = time.perf_counter()
    make_trace_set(source, directory, TraceSetSpec(ranks=ranks, ranks_per_host=8, compress_level=6))
    return time.perf_counter() - start


TOOL_ORDER = ("ours", "ours-warm", "hta")


def print_table(results: list[Measurement]) -> None:
    print(f"{'ranks':>6} {'tool':>9} {'wall s':>9} {'s/rank':>8} {'CPU s':>8} {'peak MB':>9}  vs HTA / vs a cold run")
    by_tool = {(m.tool, m.ranks): m for m in results if m.ok}
    for m in sorted(results, key=lambda m: (m.ranks, TOOL_ORDER.index(m.tool))):
        versus = ""
        baseline = by_tool.get(("hta" if m.tool == "ours" else "ours", m.ranks)) if m.tool != "hta" else None
        if baseline is not None:
            versus = (f"{baseline.wall_s / m.wall_s:.1f}x faster ({baseline.cpu_s / max(m.cpu_s, 1e-9):.1f}x less CPU), "
                      f"{m.peak_pss_mb / baseline.peak_pss_mb:.2f}x the memory of "
                      f"{'HTA' if baseline.tool == 'hta' else 'a cold run'}")
        status = "" if m.ok else f"  FAILED: {m.error}"
        print(f"{m.ranks:>6} {m.tool:>9} {m.wall_s:>9.1f} {m.wall_s / m.ranks:>8.3f} {m.cpu_s:>8.1f} "
              f"{m.peak_pss_mb:>9.0f}  {versus}{status}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="one real rank trace (.json[.gz])")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--hta-ranks", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--workdir", type=Path, default=None, help="where trace sets go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per tool run")
    parser.add_argument("--out", type=Path, default=None, help="also write the measurements as JSON")
    parser.add_argument("--repeat", type=int_at_least(1), default=1,
                        help="rounds per set (ours cold, ours warm, HTA, alternating); the table holds medians")
    args = parser.parse_args()
    compile_fleetscope()  # as an install does (bench/bytecode.py)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleetscope-bench-"))
    print(f"source {args.source} ({args.source.stat().st_size / 1e6:.1f} MB), {os.cpu_count()} cores, sets in {workdir}, "
          f"load average {os.getloadavg()[0]:.2f}")
    results = []
    for ranks in sorted(set(args.ranks) | set(args.hta_ranks)):
        directory = workdir / f"ranks{ranks}"
        made_s = make_set(args.source, directory, ranks)
        size_mb = sum(p.stat().st_size for p in directory.iterdir()) / 1e6
        print(f"{ranks} ranks: {size_mb:.0f} MB of gzip traces, made in {made_s:.1f} s", flush=True)
        rounds = [measure_round(args, directory, workdir, ranks) for _ in range(args.repeat)]
        results += [median_measurement(list(runs)) for runs in zip(*rounds)]
        if args.repeat > 1:
            ratios = [by_tool["hta"].wall_s / by_tool["ours"].wall_s for by_tool in
                      ({m.tool: m for m in round_} for round_ in rounds) if {"hta", "ours"} <= set(by_tool)]
            if ratios:
                print(f"  stock HTA / ours, each round: {', '.join(f'{r:.1f}x' for r in ratios)}; "
                      f"median {statistics.median(ratios):.1f}x", flush=True)
        shutil.rmtree(directory)
    print_table(results)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps([asdict(m) for m in results], indent=1) + "\n")
    return 0 if all(m.ok for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
