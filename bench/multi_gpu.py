"""Multi-GPU runs on one node, in one script: parallel modes, weak scaling, DDP bucket size, an injected
straggler. Two phases, so the GPU machine needs nothing but torch and transformers:

    python bench/multi_gpu.py run --out RUNS [--nproc 8] [--preset small]      # on the GPU node
    python bench/multi_gpu.py summarize RUNS [--json OUT.json]                  # anywhere: analysis + table

`run` launches every job with `fleetscope launch --no-post` (NCCL, NVLink multicast off); `summarize`
gathers, analyzes and merges each run directory and prints one table:
  - modes: DDP, FSDP2, TP (tp = N) and 2-D FSDP x TP (tp = 2, N >= 4), profiled: tokens/s per GPU, MFU,
    busy / idle / communication / overlap per the report;
  - weak scaling: FSDP2 on 1 and N GPUs at the same per-GPU batch -> efficiency;
  - DDP bucket_cap_mb 25 vs 50: communication-computation overlap (fleetscope's and HTA's);
  - straggler: DDP with the last rank sleeping --straggle-ms before every step -> who and how much
    the report finds;
  - expert parallelism: FSDP2 and DDP with ep = N (every GPU holds 1/N of the experts), FSDP2 with ep = 2 x
    edp = N/2 (N >= 4), FSDP2 x TP with tp = 2 x ep = 2 (N a multiple of 4), and ep = N with the hot-expert fault (expert 3 draws most tokens): tokens/s and the
    MoE records' load imbalance (hottest expert's tokens / mean) and all-to-all volume per step.
  - parallel breadth (plan_breadth_jobs): gradient accumulation (FSDP2, 4 micro-batches), HSDP (2 replicas
    x N/2 shards, N >= 4), pipeline parallel 2 stages x FSDP2 over N/2 (GPipe, 1F1B, interleaved 1F1B) and
    1F1B with stage 1 slowed by --straggle-ms per micro-batch -> the report's pipeline bubble and slowest stage.
With --device cpu (gloo) the same script runs on a laptop, which is how it is tested.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Job:
    name: str
    nproc: int
    args: list[str] = field(default_factory=list)


def plan_jobs(nproc: int, straggle_ms: float) -> list[Job]:
    """Every job of the run phase (pure)."""
    jobs = [Job("mode-ddp", nproc, ["--parallel", "ddp"]), Job("mode-fsdp", nproc, ["--parallel", "fsdp"]),
            Job("mode-tp", nproc, ["--parallel", "tp", "--tp", str(nproc)])]
    if nproc >= 4:
        jobs.append(Job("mode-fsdp_tp", nproc, ["--parallel", "fsdp_tp", "--tp", "2"]))
    jobs += [
        Job("scaling-fsdp-1", 1, ["--parallel", "fsdp"]),
        Job("bucket-25", nproc, ["--parallel", "ddp", "--set", "parallel.bucket_cap_mb=25"]),
        Job("bucket-50", nproc, ["--parallel", "ddp", "--set", "parallel.bucket_cap_mb=50"]),
        Job("straggler", nproc, ["--parallel", "ddp", "--set", f"faults.straggle_rank={nproc - 1}",
                                 "--set", f"faults.straggle_ms={straggle_ms}"]),
    ]
    return jobs + expert_parallel_jobs(nproc)


def expert_parallel_jobs(nproc: int, hot_expert: int = 3) -> list[Job]:
    """The expert-parallel runs (pure); none on one GPU. The small preset's 16 experts split over 2, 4, 8."""
    if nproc < 2:
        return []
    jobs = [Job(f"ep{nproc}-fsdp", nproc, ["--parallel", "fsdp", "--set", f"parallel.ep={nproc}"]),
            Job(f"ep{nproc}-ddp", nproc, ["--parallel", "ddp", "--set", f"parallel.ep={nproc}"])]
    if nproc >= 4:
        jobs.append(Job(f"ep2-fsdp-edp{nproc // 2}", nproc, ["--parallel", "fsdp", "--set", "parallel.ep=2"]))
    if nproc % 4 == 0:  # TP inside pairs of GPUs, the routed experts split over ep = 2 TP groups (edp = N/4)
        jobs.append(Job("ep2-tp2-fsdp", nproc, ["--parallel", "fsdp_tp", "--tp", "2", "--set", "parallel.ep=2"]))
    jobs.append(Job(f"ep{nproc}-hot-expert", nproc, ["--parallel", "fsdp", "--set", f"parallel.ep={nproc}",
                                                     "--set", f"faults.hot_expert={hot_expert}"]))
    return jobs


def plan_breadth_jobs(nproc: int, straggle_ms: float) -> list[Job]:
    """Accumulation, HSDP and pipeline jobs (pure); pipelines need 2 GPUs, HSDP 4."""
    fsdp = ["--parallel", "fsdp"]
    jobs = [Job("accumulation-fsdp", nproc, [*fsdp, "--set", "optim.accumulation_steps=4"])]
    if nproc >= 4 and nproc % 2 == 0:
        jobs.append(Job("hsdp", nproc, [*fsdp, "--set", "parallel.dp_replicate=2"]))
    if nproc >= 2 and nproc % 2 == 0:
        pipeline = [*fsdp, "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=4"]
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
            jobs.append(Job(f"pp-{schedule}", nproc, [*pipeline, "--set", f"parallel.pp_schedule={schedule}"]))
        jobs.append(Job("pp-slow-stage", nproc, [*pipeline, "--set", "parallel.pp_schedule=1f1b",
                                                 "--set", "faults.slow_stage=1", "--set", f"faults.slow_stage_ms={straggle_ms}"]))
    return jobs


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).absolute()
    failed = []
    for job in plan_jobs(args.nproc, args.straggle_ms) + plan_breadth_jobs(args.nproc, args.straggle_ms):
        command = [sys.executable, "-m", "fleetscope.cli.main", "launch", "--no-post", "--device", args.device,
                   "--nproc-per-node", str(job.nproc), "--preset", args.preset, "--steps", str(args.steps),
                   "--batch-size", str(args.batch), "--seq-len", str(args.seq), "--profile", args.profile,
                   "--run-dir", str(out / job.name), *job.args, *[f"--set={o}" for o in args.overrides]]
        print("+", " ".join(command), flush=True)
        if subprocess.run(command).returncode != 0:
            failed.append(job.name)
    print(f"failed: {', '.join(failed)}" if failed else "all jobs finished")
    return 1 if failed else 0


# --- summarize ---------------------------------------------------------------------------------


def steady_metrics(run_dir: Path, skip: int) -> dict:
    """Medians over every rank's unprofiled steps from `skip` on."""
    from fleetscope.traces.layout import RunLayout

    rows = [json.loads(line) for path in RunLayout.at(run_dir).step_metrics_files()
            for line in path.read_text().splitlines()]
    steady = [r for r in rows if r["step"] >= skip and not r["profiled"]] or rows
    mfu = [r["mfu_pct"] for r in steady if r.get("mfu_pct") is not None]
    return {"tokens_per_s_per_gpu": statistics.median(r["tokens_per_s"] for r in steady),
            "step_ms": statistics.median(r["step_time_ms"] for r in steady),
            "mfu_pct": statistics.median(mfu) if mfu else None}


def report_summary(run_dir: Path) -> dict:
    from fleetscope.analysis import analyze
    from fleetscope.analysis.merge.run import merge
    from fleetscope.traces.gather import gather

    gather(run_dir)
    report = analyze(run_dir)
    merge(run_dir)
    data = report.to_json()
    ranks = data["ranks"]

    def mean(key: str) -> float | None:
        values = [r[key] for r in ranks if r.get(key) is not None]
        return round(statistics.mean(values), 2) if values else None

    return {"busy_pct": mean("busy_pct"), "idle_pct": mean("idle_pct"), "comm_pct": mean("comm_pct"),
            "overlap_pct": mean("overlap_pct"), "verdict": data.get("verdict"),
            "hta_overlap_pct": _hta_overlap(data), "pipeline": _pipeline(data)}


def _pipeline(report: dict) -> dict | None:
    """Bubble per rank, the schedule's own bubble and the slowest stage of the first pipeline window."""
    window = next((w["pipeline"] for w in report.get("windows", []) if w.get("pipeline")), None)
    if window is None:
        return None
    return {"bubble_pct": {r["rank"]: round(r["bubble_pct"], 1) for r in window["ranks"]},
            "theoretical_bubble_pct": window["theoretical_bubble_pct"], "slowest_rank": window["slowest_rank"]}


def _hta_overlap(report: dict) -> float | None:
    """Mean of HTA's comm/comp overlap over ranks and windows, when HTA ran."""
    values = []
    for window in report.get("windows", []):
        rows = ((window.get("hta") or {}).get("tables") or {}).get("comm_comp_overlap") or []
        values += [row.get("comp_comm_overlap_pctg") for row in rows if row.get("comp_comm_overlap_pctg") is not None]
    return round(statistics.mean(values), 2) if values else None


def summarize(args: argparse.Namespace) -> int:
    runs = Path(args.runs)
    rows = {}
    for run_dir in sorted(p for p in runs.iterdir() if (p / "job.json").is_file()):
        rows[run_dir.name] = {**steady_metrics(run_dir, args.skip), **report_summary(run_dir),
                              **moe_summary(run_dir, args.skip)}
    scaling = scaling_efficiency(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "weak_scaling_efficiency": scaling}, indent=2))
    print(table(rows, scaling))
    return 0


def moe_summary(run_dir: Path, skip: int) -> dict:
    """From metrics/rank<R>.moe.jsonl, steps from `skip` on: the hottest expert's share of the load against an
    even split (max / mean of tokens per expert, summed over ranks, medians over steps and layers), and the
    median all-to-all bytes one rank sends per step (all MoE layers, forward dispatch only)."""
    from fleetscope.traces.formats import read_moe_records
    from fleetscope.traces.layout import RunLayout

    layout = RunLayout.at(run_dir)
    records = [r for path in sorted(layout.metrics_dir.glob("rank*.moe.jsonl")) for r in read_moe_records(path)
               if r.step >= skip]
    if not records:
        return {"expert_imbalance": None, "a2a_mb_per_step": None}
    load: dict[tuple[int, int], list[int]] = {}
    sent: dict[tuple[int, int], int] = {}
    for r in records:
        total = load.setdefault((r.step, r.layer), [0] * len(r.tokens_per_expert))
        load[(r.step, r.layer)] = [a + b for a, b in zip(total, r.tokens_per_expert)]
        off_rank = sum(b for peer, b in enumerate(r.send_bytes) if peer != r.ep_rank) if r.ep > 1 else 0
        sent[(r.rank, r.step)] = sent.get((r.rank, r.step), 0) + off_rank
    imbalance = [max(c) / (sum(c) / len(c)) for c in load.values() if sum(c)]
    return {"expert_imbalance": round(statistics.median(imbalance), 2) if imbalance else None,
            "a2a_mb_per_step": round(statistics.median(sent.values()) / 2**20, 2)}


def scaling_efficiency(rows: dict) -> float | None:
    one, many = rows.get("scaling-fsdp-1"), rows.get("mode-fsdp")
    if not one or not many:
        return None
    return round(many["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"], 3)


def table(rows: dict, scaling: float | None) -> str:
    lines = ["| run | tokens/s per GPU | step ms | MFU % | busy % | idle % | comm % | overlap % | HTA overlap % "
             "| expert max/mean | all-to-all MB/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        cells = [f"{row['tokens_per_s_per_gpu']:,.0f}", f"{row['step_ms']:.1f}", _fmt(row["mfu_pct"]),
                 *(_fmt(row[k]) for k in ("busy_pct", "idle_pct", "comm_pct", "overlap_pct", "hta_overlap_pct")),
                 _fmt(row.get("expert_imbalance")), _fmt(row.get("a2a_mb_per_step"))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"\nweak scaling efficiency (FSDP2, N GPUs vs 1): {_fmt(scaling)}")
    if "straggler" in rows:
        lines.append(f"straggler run verdict: {rows['straggler']['verdict']}")
    for name, row in rows.items():
        if row.get("pipeline"):
            lines.append(f"{name}: pipeline {row['pipeline']}")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="phase", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("--out", required=True)
    run_parser.add_argument("--nproc", type=int, default=8)
    run_parser.add_argument("--device", default="cuda")
    run_parser.add_argument("--preset", default="small")
    run_parser.add_argument("--steps", type=int, default=30)
    run_parser.add_argument("--batch", type=int, default=8)
    run_parser.add_argument("--seq", type=int, default=2048)
    run_parser.add_argument("--profile", default="skip_first=15,wait=5,warmup=2,active=3,repeat=1")
    run_parser.add_argument("--straggle-ms", type=float, default=20.0)
    run_parser.add_argument("--set", dest="overrides", action="append", default=[])
    summary_parser = sub.add_parser("summarize")
    summary_parser.add_argument("runs")
    summary_parser.add_argument("--skip", type=int, default=10)
    summary_parser.add_argument("--json", default=None)
    args = parser.parse_args()
    return run(args) if args.phase == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
