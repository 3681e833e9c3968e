"""Straggler causes against ground truth: every injected cause on every source, late rank and clock skew.

    python bench/cause_truth.py                  # prints the confusion table and precision / recall per cause
    python bench/cause_truth.py --out cases.json

Each case is a 4-rank set (2 hosts of 2 ranks) from one real GPU trace or a hand-built one, made by
fleetscope.analysis.synthetic with one rank late for a known reason (LATE_CAUSES), or none late ("none":
no finding is the right answer). The named cause is the classification of the rank causing the most
waiting (analysis/cross_rank/causes.py); a case with a late rank also needs that rank to be the one named.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from collections import Counter
from pathlib import Path

from fleetscope.analysis import analyze
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, CAUSE_SLOW_DEVICE, CAUSE_WORK
from fleetscope.analysis.synthetic import (
    LATE_EXTRA_WORK,
    LATE_HOST,
    LATE_SLOW_KERNELS,
    TraceSetSpec,
    make_trace_set,
)

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gpu"
EXPECTED = {LATE_HOST: CAUSE_HOST, LATE_EXTRA_WORK: CAUSE_WORK, LATE_SLOW_KERNELS: CAUSE_SLOW_DEVICE, "none": "none"}
AMOUNTS_US = (500.0, 2000.0)
SLOW_FACTORS = (1.03, 1.08)
OFFSETS = ({}, {1: 37_000.0})


def hand_built(directory: Path) -> Path:
    events, step_us = [], 10_000.0
    for step in range(3):
        s = 1_000_000.0 + step * step_us
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                       "ts": s, "dur": step_us})
        for name, start, dur in (("gemm", 100, 3000), ("norm", 3100, 1000), ("softmax", 4100, 500)):
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": s + start,
                           "dur": dur, "args": {"device": 0, "stream": 7}})
    path = directory / "hand_built.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"baseTimeNanoseconds": 1_790_000_000_000_000_000,
                                               "traceEvents": events}).encode()))
    return path


def cases(sources: dict[str, Path]):
    for source_name, source in sources.items():
        for offsets in OFFSETS:
            yield source_name, source, "none", None, 0.0, 1.0, offsets
            for late_rank in (1, 3):
                for amount in AMOUNTS_US:
                    yield source_name, source, LATE_HOST, late_rank, amount, 1.0, offsets
                    yield source_name, source, LATE_EXTRA_WORK, late_rank, amount, 1.0, offsets
                for factor in SLOW_FACTORS:
                    yield source_name, source, LATE_SLOW_KERNELS, late_rank, 0.0, factor, offsets


def named(report, late_rank: int | None) -> str:
    findings = [f for w in report.windows for f in w.causes.findings]
    if not findings:
        return "none"
    top = max(findings, key=lambda f: f.wait_share)
    if late_rank is not None and top.rank != late_rank:
        return f"wrong rank ({top.cause})"
    return top.cause


def run(out: Path | None) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        sources = {"fleetscope-fast fixture": FIXTURES / "h200-small-fleetscope-fast-2steps.json.gz",
                   "hf-eager fixture": FIXTURES / "h200-small-hf-eager-2steps.json.gz",
                   "hand-built": hand_built(root)}
        # the inserted all-reduce must outlast the largest delay and fit in the source's step
        allreduce_us = {"fleetscope-fast fixture": 20_000.0, "hf-eager fixture": 20_000.0, "hand-built": 5000.0}
        results = []
        for index, (source_name, source, cause, late_rank, amount, factor, offsets) in enumerate(cases(sources)):
            directory = root / f"case{index}"
            make_trace_set(source, directory, TraceSetSpec(
                ranks=4, ranks_per_host=2, late_rank=late_rank, late_us=amount,
                late_cause=cause if cause != "none" else LATE_HOST, slow_factor=factor,
                host_offsets_us=offsets, inserted_allreduce_us=allreduce_us[source_name]))
            report = analyze(directory, use_hta=False, cache_dir=root / "cache", write_default_outputs=False)
            results.append({"source": source_name, "injected": cause, "late_rank": late_rank, "late_us": amount,
                            "slow_factor": factor, "skewed": bool(offsets), "expected": EXPECTED[cause],
                            "named": named(report, late_rank)})
    print_table(results)
    if out is not None:
        out.write_text(json.dumps(results, indent=2) + "\n")


def print_table(results: list[dict]) -> None:
    pairs = Counter((r["expected"], r["named"]) for r in results)
    classes = sorted({r["expected"] for r in results})
    print(f"{len(results)} cases")
    print("expected -> named: count")
    for (expected, got), count in sorted(pairs.items()):
        print(f"  {expected:>16} -> {got}: {count}")
    print("cause              precision  recall")
    for cls in classes:
        tp = pairs[(cls, cls)]
        named_as = sum(c for (_, g), c in pairs.items() if g == cls)
        actual = sum(c for (e, _), c in pairs.items() if e == cls)
        precision = tp / named_as if named_as else float("nan")
        print(f"  {cls:>16}  {precision:9.2f}  {tp / actual:6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write every case as JSON here")
    run(parser.parse_args().out)
