"""Trainer speed on one GPU: stock transformers eager vs fleetscope's trainer, in one run.

    python bench/trainer_speed.py --out OUT_DIR \
        --plan "small:8:hf_eager,fs_graphs;medium:8:hf_eager,fs_graphs;medium:16:fs_graphs"

A plan entry is PRESET:BATCH:VARIANTS (sequences of --seq tokens). Speed-ups are tokens/s over the
hf_eager variant of the same preset (batch sizes may differ: larger ones may not fit HF eager).

Every variant trains the same model (same seed, same weights) on the same synthetic batches and
runs in its own process. Per variant: median step time over the timed steps, tokens/s, model
TFLOP/s and MFU (formula in fleetscope/trainer/flops.py; peak: dense bf16 datasheet value), max
memory, the loss of every step (for the numerics check) and, with --trace, a profiler trace of
two steps for HTA. Prints a table last and writes bench.json + bench.md into OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Variant name -> trainer settings (`--set` assignments); hf_* variants bypass the trainer.
VARIANTS: dict[str, list[str]] = {
    "hf_eager": [],
    "hf_compile": [],
    "fs_eager": ["performance.fast_experts=true", "performance.fused_loss=true"],
    "fs_compile": ["performance.compile=default"],
    "fs_autotune": ["performance.compile=max-autotune-no-cudagraphs"],
    "fs_graphs": ["performance.compile=reduce-overhead"],
    "fs_plain": ["performance.fast_experts=false", "performance.fused_loss=false"],
}


@dataclass(frozen=True)
class Shape:
    preset: str
    batch: int
    seq: int
    family: str
    device: str


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--variants", default="hf_eager,hf_compile,fs_eager,fs_compile,fs_graphs")
    parser.add_argument("--plan", default=None, help="PRESET:BATCH:VARIANTS;... (overrides preset/batch/variants)")
    parser.add_argument("--steps", type=int, default=30, help="steps per variant (first --warmup untimed)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--trace", action="store_true", help="also record a 2-step profiler trace per variant")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per variant")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the script")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = Shape(args.preset, args.batch, args.seq, args.family, args.device)
    if args.one:
        result = run_variant(args.one, shape, args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    return drive(shape, args)


# --- driver -----------------------------------------------------------------------------------


def drive(shape: Shape, args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = args.plan or f"{shape.preset}:{shape.batch}:{args.variants}"
    results = []
    for entry in plan.split(";"):
        preset, batch, variants = entry.split(":")
        for variant in variants.split(","):
            result = run_in_subprocess(variant, args, preset=preset, batch=int(batch))
            result.update(preset=preset, batch=int(batch))
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "step_ms_all")}), flush=True)
    summary = summarize(results, shape)
    (out / "bench.json").write_text(json.dumps(summary, indent=2))
    table = markdown_table(summary)
    (out / "bench.md").write_text(table + "\n")
    print(table)
    return 0


def run_in_subprocess(variant: str, args: argparse.Namespace, *, preset: str, batch: int) -> dict:
    command = [sys.executable, __file__, *sys.argv[1:], "--one", variant, "--preset", preset, "--batch", str(batch)]
    started = time.time()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.timeout} s"}
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode != 0 or not lines:
        tail = (completed.stderr or completed.stdout)[-3000:]
        return {"variant": variant, "error": f"exit {completed.returncode}: {tail}"}
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = round(time.time() - started, 1)
    return result


def summarize(results: list[dict], shape: Shape) -> dict:
    for result in results:
        baseline = next((r for r in results if r.get("variant") == "hf_eager" and "error" not in r
                         and r["preset"] == result["preset"]), None)
        if baseline is None or "error" in result:
            continue
        result["speedup_vs_hf_eager"] = round(result["tokens_per_s"] / baseline["tokens_per_s"], 3)
        if baseline["batch"] == result["batch"]:
            result["max_loss_diff_vs_hf_eager"] = max_loss_diff(baseline["losses"], result["losses"])
    return {"shape": {"seq": shape.seq, "family": shape.family, "device": shape.device}, "results": results}


def max_loss_diff(reference: list[float], other: list[float]) -> float:
    return round(max(abs(a - b) for a, b in zip(reference, other)), 5)


def markdown_table(summary: dict) -> str:
    shape = summary["shape"]
    header = (f"{shape['family']}, sequences of {shape['seq']} tokens, one device\n\n"
              "| preset | batch | variant | step ms | tokens/s | TFLOP/s | MFU % | max mem GB | tokens/s vs HF eager "
              "| max abs loss diff |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for r in summary["results"]:
        if "error" in r:
            rows.append(f"| {r['preset']} | {r['batch']} | {r['variant']} | failed: "
                        f"{r['error'].strip().splitlines()[-1][:80]} |||||||")
            continue
        speedup = f"{r['speedup_vs_hf_eager']:.2f}x" if "speedup_vs_hf_eager" in r else "n/a"
        loss_diff = f"{r['max_loss_diff_vs_hf_eager']:.4f}" if "max_loss_diff_vs_hf_eager" in r else "n/a"
        rows.append(f"| {r['preset']} | {r['batch']} | {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} "
                    f"| {r['tflops']:.0f} | {r['mfu_pct']:.1f} | {r['max_mem_gb']:.1f} | {speedup} | {loss_diff} |")
    return "\n".join([header, *rows])


# --- one variant (in its own process) ---------------------------------------------------------


def run_variant(variant: str, shape: Shape, args: argparse.Namespace) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    if variant.startswith("hf_"):
        step_fn, flops, peak = hf_step_function(variant, shape)
    else:
        step_fn, flops, peak = fleetscope_step_function(variant, shape)
    sync = torch.cuda.synchronize if shape.device == "cuda" else (lambda: None)
    losses, times_ms = [], []
    for step in range(args.steps):
        sync()
        start = time.perf_counter()
        losses.append(step_fn())
        sync()
        times_ms.append((time.perf_counter() - start) * 1e3)
    step_ms = statistics.median(times_ms[args.warmup:])
    tokens = shape.batch * shape.seq
    tflops = flops.per_token(shape.seq) * tokens / (step_ms / 1e3) / 1e12
    result = {
        "variant": variant, "step_ms": round(step_ms, 2), "tokens_per_s": round(tokens / (step_ms / 1e3)),
        "tflops": round(tflops, 1), "mfu_pct": round(100 * tflops / peak, 2) if peak else 0.0, "peak_tflops": peak,
        "max_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if shape.device == "cuda" else 0.0,
        "losses": losses, "step_ms_all": [round(t, 2) for t in times_ms], "active_params": flops.active_params,
        "total_params": flops.total_params,
        "device": torch.cuda.get_device_name() if shape.device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
    }
    if args.trace:
        result["trace"] = record_trace(step_fn, Path(args.out) / f"trace-{shape.preset}-b{shape.batch}-{variant}.json.gz")
    return result


def batches(shape: Shape, vocab_size: int):
    import torch
    from fleetscope.trainer.data import SyntheticTokens

    dataset = SyntheticTokens(vocab_size=vocab_size, seq_len=shape.seq, seed=0, length=10**9)
    index = 0
    while True:
        yield torch.stack([dataset[index + i] for i in range(shape.batch)]).to(shape.device, non_blocking=True)
        index += shape.batch


def hf_step_function(variant: str, shape: Shape):
    """Stock transformers: AutoModelForCausalLM, bf16 autocast, fused AdamW, the model's own loss."""
    import torch
    import transformers
    from fleetscope.trainer.config import ModelConfig
    from fleetscope.trainer.flops import flop_model, peak_tflops
    from fleetscope.trainer.models import build_config

    config = build_config(ModelConfig(family=shape.family, preset=shape.preset))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(shape.device)
    flops = flop_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=shape.device == "cuda")
    forward = torch.compile(model) if variant == "hf_compile" else model
    data = batches(shape, config.vocab_size)

    def step() -> float:
        input_ids = next(data)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=shape.device == "cuda"):
            loss = forward(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, flops, peak_tflops(torch.device(shape.device))


def fleetscope_step_function(variant: str, shape: Shape):
    """fleetscope's trainer itself (build_state + train_step), one rank, no profiler."""
    import torch
    from fleetscope.trainer.config import TrainConfig, apply_overrides
    from fleetscope.trainer.flops import peak_tflops
    from fleetscope.trainer.loop import build_state, train_step
    from fleetscope.trainer.metrics import PhaseTimer
    from fleetscope.trainer.runtime import init_runtime

    _single_rank_environment()
    config = apply_overrides(TrainConfig(run_dir=tempfile.mkdtemp()), [
        f"model.family={shape.family}", f"model.preset={shape.preset}", f"data.batch_size={shape.batch}",
        f"data.seq_len={shape.seq}", f"performance.device={shape.device}", "profiler.enabled=false",
        *VARIANTS[variant],
    ])
    runtime = init_runtime(config)
    state = build_state(config, runtime)
    data = batches(shape, state.vocab_size)
    timer = PhaseTimer(use_cuda=runtime.use_cuda)

    def step() -> float:
        loss = train_step(state, data, config, runtime, timer)
        timer.finish()
        state.step += 1
        return loss.item()

    return step, state.flops, peak_tflops(runtime.device)


def _single_rank_environment() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def record_trace(step_fn, path: Path) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for step in range(2):
            with record_function(f"ProfilerStep#{step}"):
                step_fn()
    prof.export_chrome_trace(str(path))
    return path.name


if __name__ == "__main__":
    sys.exit(main())
