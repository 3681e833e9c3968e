"""A held-out check of the advisor: programs of other shapes than bench/planted/corpus.py's, written after its
rules were (the last four after the gc_pauses and activation_checkpointing rules), with the same output format (OUT/NAME/trace + planted.json), scored the same way:

    python bench/planted/heldout.py OUT          # on a GPU
    python bench/planted/confusion.py OUT
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

DEV = "cuda"


def timed(step, n: int = 7) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def record(step, directory: Path, with_stack: bool = False) -> None:
    extra = {"experimental_config": torch.profiler._ExperimentalConfig(record_python_gc_info=True)} if with_stack else {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=1, warmup=1, active=2),
                 on_trace_ready=tensorboard_trace_handler(str(directory), worker_name="rank0", use_gzip=True),
                 record_shapes=True, with_stack=with_stack, **extra) as prof:
        for _ in range(4):
            step()
            prof.step()
    torch.cuda.synchronize()


def blocks(width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width)) for _ in range(depth)])


def fp32_transformer_mlp(fixed: bool):
    """fp32 weights and activations, TF32 off: every GEMM on the SIMT cores. Fix: bf16 autocast."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = blocks(2048, 4).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(4096, 2048, device=DEV)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=fixed):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sgd_loop_over_many_params(fixed: bool):
    """SGD with momentum, foreach=False, over 600 small parameter tensors. Fix: foreach=True."""
    params = [nn.Parameter(torch.randn(256, 64, device=DEV)) for _ in range(600)]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=fixed)
    x = torch.randn(64, 256, device=DEV)

    def step():
        loss = sum((x @ p).square().mean() for p in params[:8])
        loss.backward()
        for p in params[8:]:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        opt.step()
    return step


def empty_cache_in_transformer(fixed: bool):
    """torch.cuda.empty_cache() after every step: the next step's blocks come back from cudaMalloc. Fix: drop it."""
    model = blocks(1024, 6).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(2048, 1024, device=DEV)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not fixed:
            torch.cuda.empty_cache()
    return step


def router_nonzero_per_block(fixed: bool):
    """A top-1 router per block that gathers each expert's tokens with torch.nonzero (4 experts, 6 blocks): a
    device-to-host count read per expert. Fix: a dense masked computation (torch.where)."""
    width, experts = 512, 4
    gates = nn.ModuleList(nn.Linear(width, experts) for _ in range(6)).to(DEV)
    ffn = nn.ModuleList(nn.ModuleList(nn.Linear(width, width) for _ in range(experts)) for _ in range(6)).to(DEV)
    opt = torch.optim.AdamW(list(gates.parameters()) + list(ffn.parameters()), fused=True)
    x = torch.randn(4096, width, device=DEV)

    def step():
        h = x
        for gate, expert_ffn in zip(gates, ffn):
            choice = gate(h).argmax(-1)
            out = torch.zeros_like(h)
            for e, layer in enumerate(expert_ffn):
                if fixed:
                    out = out + torch.where((choice == e).unsqueeze(-1), layer(h), 0.0)
                else:
                    rows = torch.nonzero(choice == e).squeeze(-1)
                    out = out.index_add(0, rows, layer(h[rows]))
            h = h + out
        h.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def python_loss_weights(fixed: bool):
    """Per-sample loss weights computed in a Python loop over 30,000 floats each step, then copied in. Fix: the
    same weights computed on the device."""
    model = blocks(1024, 2).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(30000, 1024, device=DEV)
    ages = [float(i % 97) for i in range(30000)]
    ages_dev = torch.tensor(ages, device=DEV)

    def step():
        if fixed:
            w = 1.0 / (1.0 + 0.01 * ages_dev) ** 0.5
        else:
            w = torch.tensor([1.0 / (1.0 + 0.01 * a) ** 0.5 for a in ages], device=DEV)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (model(x).float().pow(2).mean(-1) * w).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def save_optimizer_state_each_step(fixed: bool, scratch: Path = Path("/tmp/heldout-scratch")):
    """torch.save of the model and optimizer state every step. Fix: save every 100 steps (not in these)."""
    scratch.mkdir(parents=True, exist_ok=True)
    model = blocks(1024, 4).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(1024, 1024, device=DEV)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not fixed:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, scratch / "ckpt.pt")
    return step


def healthy_big_bf16_transformer(fixed: bool):
    """bf16 autocast, SDPA, fused AdamW, a batch big enough to keep the GPU busy: nothing planted."""
    width, heads, seq, batch = 1024, 16, 1024, 16
    qkv = nn.Linear(width, 3 * width).to(DEV)
    proj = blocks(width, 2).to(DEV)
    opt = torch.optim.AdamW(list(qkv.parameters()) + list(proj.parameters()), fused=True)
    x = torch.randn(batch, seq, width, device=DEV)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q, k, v = qkv(x).view(batch, seq, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, width)
            loss = proj(a).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def gc_in_logging_callback(fixed: bool):
    """A metrics callback that calls gc.collect() after every step "to keep memory flat", in a process holding a
    200k-entry caption cache; conv net, bf16. Profiled with stacks (as one looking for Python time would).
    Fix: no collect in the callback (gc.freeze() after the cache is built)."""
    cache = {i: {"caption": f"image {i}", "tokens": [i % 97, i % 89]} for i in range(200_000)}
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(128, 3, 64, 64, device=DEV)
    if fixed:
        gc.freeze()

    def on_step_end(loss: torch.Tensor) -> None:
        if not fixed:
            gc.collect()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        on_step_end(loss)
        return len(cache)
    return step


def reentrant_checkpoint_convnet(fixed: bool):
    """checkpoint_sequential (reentrant) over 8 conv blocks of a net that fits easily: the backward runs every
    segment's forward again. Fix: no checkpointing."""
    from torch.utils.checkpoint import checkpoint_sequential
    layers = [nn.Sequential(nn.Conv2d(128, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
              for _ in range(8)]
    model = nn.Sequential(*layers).to(DEV, memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(64, 128, 56, 56, device=DEV).contiguous(memory_format=torch.channels_last).requires_grad_()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x) if fixed else checkpoint_sequential(model, 4, x, use_reentrant=True)
            loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


class LlamaBlock(nn.Module):
    """RMSNorm, bias-free q/k/v/o and SwiGLU projections, SDPA: the matrix products are plain `aten::mm`."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.gate_up, self.down = nn.Linear(width, 8 * width, bias=False), nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def llama_stack(fixed: bool, checkpointed: bool):
    from torch.utils.checkpoint import checkpoint
    blocks_ = nn.ModuleList(LlamaBlock(1024, 16) for _ in range(6)).to(DEV, torch.bfloat16)
    opt = torch.optim.AdamW(blocks_.parameters(), fused=True)
    x = torch.randn(4, 2048, 1024, device=DEV, dtype=torch.bfloat16)

    def step():
        h = x
        for block in blocks_:
            h = checkpoint(block, h, use_reentrant=False) if checkpointed and not fixed else block(h)
        h.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def checkpointed_llama_blocks(fixed: bool):
    """Llama-style blocks (bias-free linears, RMSNorm, SwiGLU, SDPA) each under torch.utils.checkpoint, bf16;
    memory is plentiful. Fix: no checkpointing."""
    return llama_stack(fixed, checkpointed=True)


def healthy_llama_blocks_bf16(fixed: bool):
    """The same Llama-style blocks without checkpointing: nothing planted."""
    return llama_stack(fixed, checkpointed=False)


PROGRAMS = {
    "fp32_transformer_mlp": ["precision"],
    "sgd_loop_over_many_params": ["optimizer_impl"],
    "empty_cache_in_transformer": ["allocator_churn"],
    "router_nonzero_per_block": ["host_syncs"],
    "python_loss_weights": ["host_work"],
    "save_optimizer_state_each_step": ["checkpoint_in_step"],
    "healthy_big_bf16_transformer": [],
    "gc_in_logging_callback": ["gc_pauses"],
    "reentrant_checkpoint_convnet": ["activation_checkpointing"],
    "checkpointed_llama_blocks": ["activation_checkpointing"],
    "healthy_llama_blocks_bf16": [],
}
WITH_STACK = {"gc_in_logging_callback"}
"""Programs profiled with Python stacks (and garbage collections)."""


def main(out: Path) -> int:
    for name, causes in PROGRAMS.items():
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        try:
            torch.manual_seed(0)
            build = globals()[name]
            record(build(False), directory, with_stack=name in WITH_STACK)
            step_ms = timed(build(False))
            fixed_ms = timed(build(True)) if causes else step_ms
            torch.backends.cuda.matmul.allow_tf32 = False
            planted = {causes[0]: step_ms - fixed_ms} if causes else {}
            (directory / "planted.json").write_text(json.dumps(
                {"program": name, "causes": causes, "planted_ms_per_step": planted, "step_ms": step_ms,
                 "fixed_step_ms": fixed_ms, "healthy": not causes, "device": torch.cuda.get_device_name()}))
            print(f"{name}: step {step_ms:.2f} ms, fixed {fixed_ms:.2f} ms", flush=True)
        except Exception as error:  # one program's failure is reported, the rest still run
            (directory / "error.txt").write_text(repr(error))
            print(f"{name}: {error!r}", flush=True)
        gc.unfreeze()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
