"""A fourth held-out check of the advisor: fourteen programs of other architectures than bench/planted/corpus.py's,
heldout.py's, heldout2.py's and heldout3.py's (a Mixtral-style MoE transformer, SimCLR, a Mamba-style selective scan,
TransE, RealNVP, a convolutional seq2seq, DETR, PPO, fast neural style transfer, a WaveNet vocoder, a Swin
transformer, Graphormer, a point-voxel CNN and a compiled FastSpeech), nine with one planted problem, three with
two at once and two healthy, written without reading the advisor's rules, with the same output format
(OUT/NAME/trace + planted.json), scored the same way:

    python bench/planted/heldout4.py OUT                  # on a GPU
    python bench/planted/heldout4.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout4.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT

Each program's `build(fixes)` returns one training step; each problem sits behind `if CAUSE not in fixes` (or a
choice made from `fixes`) and its fix is what a user would change. A cause's planted cost is the step as written
less the step with that cause alone fixed; fixed_step_ms has every cause fixed (medians of 7 steps, each between
two synchronizes, profiler off). The tiny-batch program reports its times for the samples of the fixed batch (the
small step times the steps it takes to see them); its trace records single small steps. The programs whose
problem is on the host read their loss with `.item()` at the end of the step, as a loop that logs every step
does, so their traces serialise as their timing. Without a GPU the CUDA-only parts (graph capture, pinned memory,
torch.cuda.empty_cache) are skipped, so in smoke mode a fix may time the same as its problem.
"""

from __future__ import annotations

import gc
import math
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from harness import (BF16, PerSamples, autocast, dev, fused_adamw, on_gpu, pick, pinned, release_cached_memory,
                     run_set_fixes)

Fixes = frozenset[str]
Step = Callable[[], object]


# ------------------------------------------------------------------------------------------------ host_syncs

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, -1)
    return torch.cat([-second, first], -1)


def rotary_tables(length: int, head_dim: int, base: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [length, head_dim]."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq)
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class SparseMoE(nn.Module):
    """A Mixtral-style sparse mixture of SwiGLU experts: a linear router, the top 2 experts of each token, their
    outputs weighted by the renormalised router probabilities. Dispatched expert by expert as Hugging Face's
    Mixtral block does, or with a fixed capacity per expert (GShard) and batched matrix products."""

    def __init__(self, width: int, hidden: int, experts: int, per_expert: bool, capacity_factor: float = 2.0) -> None:
        super().__init__()
        self.experts, self.per_expert, self.capacity_factor = experts, per_expert, capacity_factor
        self.router = nn.Linear(width, experts, bias=False)
        self.w_gate = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(width))
        self.w_up = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(width))
        self.w_down = nn.Parameter(torch.randn(experts, hidden, width) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).float().softmax(-1).topk(2, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.per_expert:
            return self.expert_by_expert(x, weights, chosen)
        return self.fixed_capacity(x, weights, chosen)

    def expert_by_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """For each expert, torch.where over its routing mask (how many tokens it got is read on the host), the
        expert on those tokens, index_add_ back."""
        out = torch.zeros_like(x)
        routed = F.one_hot(chosen, self.experts).permute(2, 1, 0)
        for e in range(self.experts):
            choice, token = torch.where(routed[e])
            if token.numel() == 0:
                continue
            h = x[token]
            y = (F.silu(h @ self.w_gate[e]) * (h @ self.w_up[e])) @ self.w_down[e]
            out.index_add_(0, token, (y * weights[token, choice, None]).to(out.dtype))
        return out

    def fixed_capacity(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each (token, choice) copied into its expert's slot (capacity_factor x the even share; overflow dropped),
        three batched matrix products, the outputs gathered back: no host reads."""
        tokens, width = x.shape
        capacity = int(self.capacity_factor * 2 * tokens / self.experts)
        expert, weight = chosen.t().reshape(-1), weights.t().reshape(-1)
        one_hot = F.one_hot(expert, self.experts)
        position = (one_hot.cumsum(0) * one_hot).sum(1) - 1
        kept = position < capacity
        slot = torch.where(kept, expert * capacity + position, self.experts * capacity)
        slots = x.new_zeros(self.experts * capacity + 1, width).index_copy(0, slot, x.repeat(2, 1))
        h = slots[:-1].view(self.experts, capacity, width)
        y = torch.bmm(F.silu(torch.bmm(h, self.w_gate)) * torch.bmm(h, self.w_up), self.w_down).view(-1, width)
        y = F.pad(y, (0, 0, 0, 1)).index_select(0, slot) * (weight * kept)[:, None]
        return y.view(2, tokens, width).sum(0).to(x.dtype)


class MoEBlock(nn.Module):
    """A pre-norm decoder block: RMSNorm, causal rotary self-attention (SDPA), RMSNorm, sparse MoE."""

    def __init__(self, width: int, heads: int, hidden: int, experts: int, per_expert: bool) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.moe = SparseMoE(width, hidden, experts, per_expert)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, w))
        return x + self.moe(self.norm2(x).flatten(0, 1)).view(b, s, w)


class MoETransformer(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int, hidden: int, experts: int, length: int,
                 per_expert: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(MoEBlock(width, heads, hidden, experts, per_expert) for _ in range(depth))
        self.norm, self.head = nn.RMSNorm(width), nn.Linear(width, vocab, bias=False)
        cos, sin = rotary_tables(length, width // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos[:tokens.shape[1]], self.sin[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def moe_expert_loop_where(fixes: Fixes) -> Step:
    """A Mixtral-style decoder (4 blocks of width 512 with rotary attention and a top-2 of 8 SwiGLU experts of
    hidden 1024, 4 x 512 tokens, bf16 autocast) whose MoE layer is dispatched as in Hugging Face's Mixtral code: a
    loop over the experts with `torch.where(expert_mask[e])` to find each one's tokens, a device-to-host read per
    expert and layer (32 a forward), the host waiting for the GPU each time. Fix: dispatch with a fixed capacity
    per expert (2x the even share; position by cumsum, index_copy into [experts, capacity, width], batched
    matrix products, gather back), no host reads."""
    vocab, width, heads, depth = pick(16384, 512), pick(512, 64), pick(8, 4), pick(4, 2)
    hidden, experts, batch, length = pick(1024, 128), pick(8, 4), pick(4, 2), pick(512, 64)
    model = MoETransformer(vocab, width, heads, depth, hidden, experts, length,
                           per_expert="host_syncs" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    tokens = torch.randint(vocab, (batch, length + 1), device=dev())

    def step() -> None:
        with autocast():
            logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- host_work

GREY = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def crop_box(rng: np.random.Generator, size: int) -> tuple[int, int, int, int]:
    """A random-resized-crop box (top, left, height, width): 20-100% of the area, aspect ratio 3/4 to 4/3."""
    area = size * size * rng.uniform(0.2, 1.0)
    ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    height, width = min(size, round(math.sqrt(area / ratio))), min(size, round(math.sqrt(area * ratio)))
    return int(rng.integers(size - height + 1)), int(rng.integers(size - width + 1)), height, width


def augment_numpy(image: np.ndarray, rng: np.random.Generator, out: int) -> np.ndarray:
    """One SimCLR view of an HxWx3 uint8 image: random resized crop (nearest), flip, colour jitter, grey."""
    top, left, height, width = crop_box(rng, image.shape[0])
    ys, xs = top + np.arange(out) * height // out, left + np.arange(out) * width // out
    if rng.random() < 0.5:
        xs = xs[::-1]
    view = image[ys[:, None], xs[None, :]].astype(np.float32)
    if rng.random() < 0.8:
        view *= rng.uniform(0.6, 1.4)
        mean = view.mean()
        view = (view - mean) * rng.uniform(0.6, 1.4) + mean
        grey = (view @ GREY)[..., None]
        view = grey + (view - grey) * rng.uniform(0.6, 1.4)
    if rng.random() < 0.2:
        view = np.repeat((view @ GREY)[..., None], 3, -1)
    return np.clip(view, 0, 255).astype(np.uint8)


def views_numpy(images: np.ndarray, rng: np.random.Generator, batch: int, out: int) -> torch.Tensor:
    """Two views of `batch` random images, made image by image on the host, as a [2 batch, 3, out, out] batch."""
    chosen = rng.integers(len(images), size=batch)
    views = [augment_numpy(images[i], rng, out) for _ in range(2) for i in chosen]
    return torch.from_numpy(np.stack(views)).to(dev()).permute(0, 3, 1, 2).float()


def uniform(n: int, low: float, high: float, *shape: int) -> torch.Tensor:
    return torch.empty(n, *shape, device=dev()).uniform_(low, high)


def crop_and_flip_on_device(x: torch.Tensor, out: int) -> torch.Tensor:
    """Random resized crops (20-100% of the area, aspect 3/4 to 4/3) and flips of a [N, 3, H, W] batch as one
    affine grid_sample."""
    n = x.shape[0]
    area, ratio = uniform(n, 0.2, 1.0), uniform(n, math.log(3 / 4), math.log(4 / 3)).exp()
    width, height = (area * ratio).sqrt().clamp(max=1), (area / ratio).sqrt().clamp(max=1)
    flip = torch.where(torch.rand(n, device=dev()) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3, device=dev())
    theta[:, 0, 0], theta[:, 1, 1] = width * flip, height
    theta[:, 0, 2], theta[:, 1, 2] = (1 - width) * uniform(n, -1, 1), (1 - height) * uniform(n, -1, 1)
    grid = F.affine_grid(theta, [n, 3, out, out], align_corners=False)
    return F.grid_sample(x, grid, mode="nearest", align_corners=False)


def jitter_on_device(x: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast and saturation jitter (p=0.8) and grey (p=0.2) with per-sample factors."""
    n = x.shape[0]
    jittered = torch.rand(n, 1, 1, 1, device=dev()) < 0.8
    brightness, contrast, saturation = (torch.where(jittered, uniform(n, 0.6, 1.4, 1, 1, 1), 1.0) for _ in range(3))
    weights = torch.from_numpy(GREY).to(dev()).view(1, 3, 1, 1)
    x = x * brightness
    mean = x.mean((1, 2, 3), keepdim=True)
    x = (x - mean) * contrast + mean
    grey = (x * weights).sum(1, keepdim=True)
    x = grey + (x - grey) * saturation
    to_grey = torch.rand(n, 1, 1, 1, device=dev()) < 0.2
    return torch.where(to_grey, (x * weights).sum(1, keepdim=True).expand_as(x), x).clamp(0, 255)


def views_on_device(images: torch.Tensor, batch: int, out: int) -> torch.Tensor:
    """The same two views made for the whole batch at once on the device, from images kept there."""
    chosen = torch.randint(len(images), (batch,), device=dev()).repeat(2)
    return jitter_on_device(crop_and_flip_on_device(images[chosen].permute(0, 3, 1, 2).float(), out))


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def resnet18_trunk(widths: tuple[int, ...]) -> nn.Sequential:
    """ResNet-18 with SimCLR's small-image stem (a 3x3 stride-1 convolution, no max pool), pooled features."""
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                               nn.ReLU(inplace=True)]
    cin = widths[0]
    for i, width in enumerate(widths):
        layers += [ResidualBlock(cin, width, 1 if i == 0 else 2), ResidualBlock(width, width, 1)]
        cin = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())


def nt_xent(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss: each view's positive is the other view of its image, the other 2N-2 views negatives."""
    z = F.normalize(z.float(), dim=-1)
    n = z.shape[0] // 2
    similarity = (z @ z.T / temperature).masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device),
                                                     float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(similarity, targets)


def simclr_numpy_augmentation(fixes: Fixes) -> Step:
    """SimCLR pretraining of a ResNet-18 (small-image stem, projection MLP to 128, NT-Xent at temperature 0.5,
    128 images a step, two 64x64 views each, channels_last, bf16 autocast) on 96x96 images held as a uint8 numpy
    array, whose two views are made in the training loop image by image with numpy (crop indices, flip,
    brightness, contrast, saturation, grey) before the batch is copied in. Fix: upload the images once and
    augment the whole batch on the GPU (one affine grid_sample for crop and flip, per-sample jitter factors)."""
    count, size, out, batch = pick(4096, 64), pick(96, 48), pick(64, 32), pick(128, 4)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (count, size, size, 3), dtype=np.uint8)
    images_dev = torch.from_numpy(images).to(dev())
    widths = (64, 128, 256, 512) if on_gpu() else (8, 8, 16, 16)
    encoder = resnet18_trunk(widths)
    model = nn.Sequential(encoder, nn.Linear(widths[-1], 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                          nn.Linear(2048, 128)).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev()).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev()).view(1, 3, 1, 1) * 255
    losses = []

    def step() -> None:
        if "host_work" in fixes:
            views = views_on_device(images_dev, batch, out)
        else:
            views = views_numpy(images, rng, batch, out)
        x = ((views - mean) / std).contiguous(memory_format=torch.channels_last)
        with autocast():
            z = model(x)
        loss = nt_xent(z, 0.5)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

class SelectiveScanBlock(nn.Module):
    """A Mamba block in plain PyTorch: input projection to x and a gate z, a causal depthwise convolution, an
    input-dependent step size dt and matrices B and C, the selective scan h_t = exp(dt_t A) h_(t-1) + dt_t B_t x_t,
    y_t = C_t h_t + D x_t, run as a loop over time steps, and a gated output projection."""

    def __init__(self, width: int, state: int = 16, expand: int = 2, kernel: int = 4) -> None:
        super().__init__()
        inner, self.rank = expand * width, math.ceil(width / 16)
        self.state = state
        self.norm = nn.RMSNorm(width)
        self.in_proj = nn.Linear(width, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.x_proj = nn.Linear(inner, self.rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(self.rank, inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1).float()).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, width, bias=False)

    def scan(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        decay = torch.exp(dt.unsqueeze(-1) * -torch.exp(self.A_log.float()))
        drive = (dt * x).unsqueeze(-1) * B.unsqueeze(2)
        h = x.new_zeros(x.shape[0], x.shape[2], self.state)
        outputs = []
        for t in range(x.shape[1]):
            h = decay[:, t] * h + drive[:, t]
            outputs.append(torch.bmm(h, C[:, t].unsqueeze(-1)).squeeze(-1))
        return torch.stack(outputs, 1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        length = u.shape[1]
        x, z = self.in_proj(self.norm(u)).chunk(2, -1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :length].transpose(1, 2))
        dt, B, C = self.x_proj(x).split([self.rank, self.state, self.state], -1)
        dt = F.softplus(self.dt_proj(dt).float())
        y = self.scan(x.float(), dt, B.float(), C.float()) + x.float() * self.D
        return u + self.out_proj((y * F.silu(z.float())).to(u.dtype))


class ByteMamba(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.Sequential(*[SelectiveScanBlock(width) for _ in range(depth)])
        self.norm, self.head = nn.RMSNorm(width), nn.Linear(width, 256, bias=False)

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(data))))


def graphed_training_step(loss_fn: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> Step:
    """The whole training step (forward, backward, optimizer) captured once in a CUDA graph and replayed, as in
    PyTorch's whole-network capture recipe: three warm-up steps on a side stream, then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss_fn().backward()
        opt.step()
    return graph.replay


def mamba_python_scan(fixes: Fixes) -> Step:
    """A byte-level Mamba language model (2 selective-scan blocks of width 256, state 16, bf16 weights, the scan
    in fp32) on 16 sequences of 32 bytes, its scan a Python loop over the time steps: three small kernels a time
    step and layer forward, more backward, about a thousand launches of a few microseconds each. Fix: capture the
    whole training step in a CUDA graph (torch.cuda.graph, AdamW(fused=True, capturable=True)) and replay it."""
    width, depth, batch, length = pick(256, 32), 2, 16, pick(32, 16)
    model = ByteMamba(width, depth).to(dev(), BF16)
    graphed = "launch_bound" in fixes and on_gpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu(), capturable=graphed)
    data = torch.randint(256, (batch, length + 1), device=dev())

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(data[:, :-1]).flatten(0, 1).float(), data[:, 1:].flatten())

    if graphed:
        return graphed_training_step(loss_fn, opt)

    def step() -> None:
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------ tiny_batch

class TransE(nn.Module):
    """TransE (Bordes et al.): a triple (h, r, t) scores the L1 distance between h + r and t."""

    def __init__(self, entities: int, relations: int, dim: int) -> None:
        super().__init__()
        bound = 6 / math.sqrt(dim)
        self.entity, self.relation = nn.Embedding(entities, dim), nn.Embedding(relations, dim)
        nn.init.uniform_(self.entity.weight, -bound, bound)
        nn.init.uniform_(self.relation.weight, -bound, bound)
        with torch.no_grad():
            self.relation.weight.copy_(F.normalize(self.relation.weight, dim=-1))

    def forward(self, heads: torch.Tensor, relations: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        return (self.entity(heads) + self.relation(relations) - self.entity(tails)).abs().sum(-1)


def transe_minibatch_64(fixes: Fixes) -> Step:
    """TransE on a knowledge graph of 40k entities, 1.3k relations and 500k triples (dimension 200, margin 1,
    AdamW) with the paper's per-step routine (renormalise the entity vectors, draw triples, corrupt the head or
    the tail of each, margin ranking loss) at 64 triples a step, where the GPU would take 2048: every kernel is
    tiny. step_ms is the time for 2048 triples (32 steps of 64). Fix: 2048 triples a step (one step for the same
    triples)."""
    entities, relations, dim, margin = pick(40_000, 2_000), pick(1_345, 50), pick(200, 32), 1.0
    full = pick(2048, 256)
    batch = full if "tiny_batch" in fixes else pick(64, 16)
    triples = torch.stack([torch.randint(entities, (pick(500_000, 10_000),)),
                           torch.randint(relations, (pick(500_000, 10_000),)),
                           torch.randint(entities, (pick(500_000, 10_000),))], 1).to(dev())
    model = TransE(entities, relations, dim).to(dev())
    opt = fused_adamw(model.parameters())

    def step() -> None:
        with torch.no_grad():
            model.entity.weight.copy_(F.normalize(model.entity.weight, dim=-1))
        h, r, t = triples[torch.randint(len(triples), (batch,), device=dev())].unbind(1)
        corrupt_head = torch.rand(batch, device=dev()) < 0.5
        random_entity = torch.randint(entities, (batch,), device=dev())
        negative_h = torch.where(corrupt_head, random_entity, h)
        negative_t = torch.where(corrupt_head, t, random_entity)
        loss = F.relu(margin + model(h, r, t) - model(negative_h, r, negative_t)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return PerSamples(step, full // batch)


# ------------------------------------------------------------------------------------------------- precision

def squeeze2x2(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


class ActNorm(nn.Module):
    """Glow's per-channel affine normalisation; returns the output and its log-determinant per image."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.log_scale, self.bias = nn.Parameter(torch.zeros(1, channels, 1, 1)), nn.Parameter(
            torch.zeros(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.log_scale.exp() + self.bias, self.log_scale.sum() * x.shape[2] * x.shape[3]


class AffineCoupling(nn.Module):
    """RealNVP's affine coupling: half the channels, through a conv net, scale and shift the other half; the
    channels are then reversed so the next coupling transforms the other half."""

    def __init__(self, channels: int, hidden: int, amp: bool) -> None:
        super().__init__()
        self.amp = amp
        self.net = nn.Sequential(nn.Conv2d(channels // 2, hidden, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(hidden, hidden, 1), nn.ReLU(), nn.Conv2d(hidden, channels, 3, padding=1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fixed, changed = x.chunk(2, 1)
        with autocast(enabled=self.amp):
            log_scale, shift = self.net(fixed).float().chunk(2, 1)
        log_scale = torch.tanh(log_scale)
        changed = changed * log_scale.exp() + shift
        return torch.cat([fixed, changed], 1).flip(1), log_scale.flatten(1).sum(1)


class RealNVP(nn.Module):
    """A two-scale RealNVP/Glow-style flow: squeeze, `steps` (actnorm, coupling) pairs, factor out half the
    channels as Gaussian latents, squeeze, `steps` more pairs. Returns the negative log-likelihood in bits/dim."""

    def __init__(self, hidden: int, steps: int, amp: bool) -> None:
        super().__init__()
        self.scale1 = nn.ModuleList(m for _ in range(steps) for m in (ActNorm(12), AffineCoupling(12, hidden, amp)))
        self.scale2 = nn.ModuleList(m for _ in range(steps) for m in (ActNorm(24), AffineCoupling(24, hidden, amp)))

    @staticmethod
    def gaussian_log_prob(z: torch.Tensor) -> torch.Tensor:
        return (-0.5 * (z.square() + math.log(2 * math.pi))).flatten(1).sum(1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        dims = images[0].numel()
        x = squeeze2x2(images - 0.5)
        log_det = torch.zeros(images.shape[0], device=images.device)
        for layer in self.scale1:
            x, ld = layer(x)
            log_det = log_det + ld
        x, factored = x.chunk(2, 1)
        x = squeeze2x2(x)
        for layer in self.scale2:
            x, ld = layer(x)
            log_det = log_det + ld
        log_likelihood = self.gaussian_log_prob(factored) + self.gaussian_log_prob(x) + log_det
        return (-(log_likelihood / dims) + math.log(256)).mean() / math.log(2)


def realnvp_fp32(fixes: Fixes) -> Step:
    """A RealNVP-style flow (two scales of 8 affine couplings whose conv nets are 512 wide, 64x64 images,
    batch 32) trained in fp32 with TF32 turned off for cuDNN ('TF32 moved bits/dim in the third decimal'), no
    autocast: every coupling net's convolution in full fp32, off the tensor cores. Fix: bf16 autocast around the
    coupling nets only (their outputs, the scale and shift, the log-determinants and the Gaussian
    log-likelihood stay fp32)."""
    torch.backends.cudnn.allow_tf32 = False
    size, hidden, steps, batch = pick(64, 16), pick(512, 32), pick(8, 2), pick(32, 4)
    model = RealNVP(hidden, steps, amp="precision" in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    images = (torch.randint(0, 256, (batch, 3, size, size), device=dev()).float()
              + torch.rand(batch, 3, size, size, device=dev())) / 256

    def step() -> None:
        model(images).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ---------------------------------------------------------------------------------------- checkpoint_in_step

class GLUConv(nn.Module):
    """ConvS2S's convolution: a 1-D convolution to twice the width, a GLU, a scaled residual; causal (left padding
    only) in the decoder."""

    def __init__(self, width: int, kernel: int, causal: bool) -> None:
        super().__init__()
        self.padding = (kernel - 1, 0) if causal else ((kernel - 1) // 2, (kernel - 1) // 2)
        self.conv = nn.Conv1d(width, 2 * width, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.conv(F.pad(x.transpose(1, 2), self.padding)), 1).transpose(1, 2)
        return (x + h) * math.sqrt(0.5)


class ConvS2S(nn.Module):
    """A convolutional sequence-to-sequence model (Gehring et al.): a convolutional encoder whose keys are its
    outputs and values its outputs plus the source embeddings, and a causal convolutional decoder that attends to
    them (dot-product, SDPA) after every layer; trained with teacher forcing."""

    def __init__(self, vocab: int, embed: int, width: int, depth: int, kernel: int, length: int) -> None:
        super().__init__()
        self.source, self.target = nn.Embedding(vocab, embed), nn.Embedding(vocab, embed)
        self.source_position, self.target_position = nn.Embedding(length, embed), nn.Embedding(length, embed)
        self.encoder_in, self.encoder_out = nn.Linear(embed, width), nn.Linear(width, embed)
        self.encoder = nn.ModuleList(GLUConv(width, kernel, causal=False) for _ in range(depth))
        self.decoder_in, self.decoder_out = nn.Linear(embed, width), nn.Linear(width, embed)
        self.decoder = nn.ModuleList(GLUConv(width, kernel, causal=True) for _ in range(depth))
        self.query = nn.ModuleList(nn.Linear(width, embed) for _ in range(depth))
        self.context = nn.ModuleList(nn.Linear(embed, width) for _ in range(depth))
        self.classify = nn.Linear(embed, vocab)

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.source(source) + self.source_position.weight[:source.shape[1]]
        h = self.encoder_in(e)
        for layer in self.encoder:
            h = layer(h)
        keys = self.encoder_out(h)
        return keys, (keys + e) * math.sqrt(0.5)

    def forward(self, source: torch.Tensor, target: torch.Tensor, source_mask: torch.Tensor) -> torch.Tensor:
        keys, values = self.encode(source)
        keys, values = keys.unsqueeze(1), values.unsqueeze(1)
        g = self.target(target) + self.target_position.weight[:target.shape[1]]
        h = self.decoder_in(g)
        for conv, query, context in zip(self.decoder, self.query, self.context):
            h = conv(h)
            q = ((query(h) + g) * math.sqrt(0.5)).unsqueeze(1)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=source_mask).squeeze(1)
            h = (h + context(attended)) * math.sqrt(0.5)
        return self.classify(self.decoder_out(h))


def convs2s_save_every_step(fixes: Fixes) -> Step:
    """A ConvS2S translation model (6+6 GLU conv layers of width 384, embeddings of 256, an 8k vocabulary,
    256 sentence pairs of up to 64 tokens, bf16 autocast) on preemptible machines, so it writes
    torch.save(model.state_dict()) to a checkpoint file in /dev/shm (copied off the machine in the background)
    after every step: 20M parameters (78 MB of fp32) copied to the host and written each step. Fix: checkpoint
    every 1000 steps (none in the timed steps)."""
    vocab, embed, width, depth = pick(8000, 256), pick(256, 32), pick(384, 32), pick(6, 2)
    batch, length = pick(256, 4), pick(64, 16)
    model = ConvS2S(vocab, embed, width, depth, 3, length).to(dev())
    opt = fused_adamw(model.parameters())
    source = torch.randint(vocab, (batch, length), device=dev())
    target = torch.randint(vocab, (batch, length + 1), device=dev())
    lengths = torch.randint(length // 2, length + 1, (batch,), device=dev())
    source_mask = (torch.arange(length, device=dev()) < lengths[:, None]).view(batch, 1, 1, length)
    shm = Path("/dev/shm")
    folder = tempfile.TemporaryDirectory(prefix="convs2s-", dir=shm if shm.is_dir() else None)
    every = 1000 if "checkpoint_in_step" in fixes else 1
    state = {"step": 0, "losses": []}

    def step() -> None:
        with autocast():
            logits = model(source, target[:, :-1], source_mask)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        state["losses"].append(loss.item())
        if state["step"] % every == 0:
            torch.save(model.state_dict(), Path(folder.name) / "latest.pt")
    return step


# ------------------------------------------------------------------------------------------- eager_attention

class DetrEncoderLayer(nn.Module):
    """DETR's post-norm encoder layer: the positional encoding added to queries and keys, not values."""

    def __init__(self, width: int, heads: int, hidden: int, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.attention = nn.MultiheadAttention(width, heads, dropout=0.1, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, width))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + attend(self.attention, x + pos, x + pos, x, self.need_weights))
        return self.norm2(x + self.ffn(x))


class DetrDecoderLayer(nn.Module):
    """DETR's decoder layer: self-attention among the object queries, cross-attention to the encoded image."""

    def __init__(self, width: int, heads: int, hidden: int, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.self_attention = nn.MultiheadAttention(width, heads, dropout=0.1, batch_first=True)
        self.cross_attention = nn.MultiheadAttention(width, heads, dropout=0.1, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, width))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(3))

    def forward(self, t: torch.Tensor, query_pos: torch.Tensor, memory: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        t = self.norms[0](t + attend(self.self_attention, t + query_pos, t + query_pos, t, self.need_weights))
        t = self.norms[1](t + attend(self.cross_attention, t + query_pos, memory + pos, memory, self.need_weights))
        return self.norms[2](t + self.ffn(t))


def attend(attention: nn.MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           need_weights: bool) -> torch.Tensor:
    """nn.MultiheadAttention as DETR's code calls it (need_weights left at its default, True: the head-averaged
    weights are computed and returned) or with need_weights=False."""
    if need_weights:
        return attention(q, k, v)[0]
    return attention(q, k, v, need_weights=False)[0]


def sine_positions(height: int, width: int, channels: int) -> torch.Tensor:
    """DETR's 2-D sine positional encoding, [height * width, channels]."""
    quarter = channels // 4
    freqs = 10_000 ** (-torch.arange(quarter).float() / quarter)
    ys, xs = torch.meshgrid(torch.arange(height).float(), torch.arange(width).float(), indexing="ij")
    parts = [f(grid.flatten()[:, None] * freqs) for grid in (ys, xs) for f in (torch.sin, torch.cos)]
    return torch.cat(parts, 1)


class Detr(nn.Module):
    """A DETR detector: a ResNet trunk to stride 16, a 6-layer transformer encoder over the feature map, a 6-layer
    decoder of learned object queries, class and box heads."""

    def __init__(self, image: int, width: int, heads: int, depth: int, queries: int, classes: int,
                 trunk_widths: tuple[int, ...], need_weights: bool) -> None:
        super().__init__()
        stem = trunk_widths[0]
        layers: list[nn.Module] = [nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = stem
        for i, w in enumerate(trunk_widths):
            layers += [ResidualBlock(cin, w, 1 if i == 0 else 2), ResidualBlock(w, w, 1)]
            cin = w
        self.trunk = nn.Sequential(*layers)
        self.project = nn.Conv2d(cin, width, 1)
        side = image // 4 // 2 ** (len(trunk_widths) - 1)
        self.register_buffer("pos", sine_positions(side, side, width), persistent=False)
        self.encoder = nn.ModuleList(DetrEncoderLayer(width, heads, 8 * width, need_weights) for _ in range(depth))
        self.decoder = nn.ModuleList(DetrDecoderLayer(width, heads, 8 * width, need_weights) for _ in range(depth))
        self.queries = nn.Parameter(torch.randn(queries, width))
        self.classify = nn.Linear(width, classes + 1)
        self.box = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 4))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self.project(self.trunk(images)).flatten(2).transpose(1, 2)
        for layer in self.encoder:
            memory = layer(memory, self.pos)
        query_pos = self.queries.expand(images.shape[0], -1, -1)
        t = torch.zeros_like(query_pos)
        for layer in self.decoder:
            t = layer(t, query_pos, memory, self.pos)
        return self.classify(t), self.box(t).sigmoid()


@torch.no_grad()
def greedy_matching(cost: torch.Tensor) -> torch.Tensor:
    """For each target in turn, the cheapest query not yet taken ([batch, queries, targets] -> [batch, targets]):
    a greedy stand-in for the Hungarian matching, on the device."""
    taken = torch.zeros(cost.shape[:2], dtype=torch.bool, device=cost.device)
    chosen = []
    for g in range(cost.shape[2]):
        query = cost[:, :, g].masked_fill(taken, float("inf")).argmin(1)
        taken.scatter_(1, query[:, None], True)
        chosen.append(query)
    return torch.stack(chosen, 1)


def set_prediction_loss(logits: torch.Tensor, boxes: torch.Tensor, classes: torch.Tensor,
                        target_boxes: torch.Tensor) -> torch.Tensor:
    """DETR's loss after matching: cross-entropy over every query (unmatched ones to 'no object', weighted 0.1)
    and an L1 box loss on the matched ones."""
    probs = logits.float().softmax(-1)
    cost = -probs.gather(2, classes[:, None, :].expand(-1, probs.shape[1], -1)) \
        + 5 * torch.cdist(boxes.float(), target_boxes, p=1)
    matched = greedy_matching(cost)
    no_object = logits.shape[-1] - 1
    labels = torch.full(logits.shape[:2], no_object, device=logits.device).scatter(1, matched, classes)
    weight = torch.ones(logits.shape[-1], device=logits.device)
    weight[no_object] = 0.1
    class_loss = F.cross_entropy(logits.float().transpose(1, 2), labels, weight=weight)
    matched_boxes = boxes.float().gather(1, matched[..., None].expand(-1, -1, 4))
    return class_loss + 5 * F.l1_loss(matched_boxes, target_boxes)


def detr_attention_weights(fixes: Fixes) -> Step:
    """DETR (a ResNet trunk to stride 16 on 16 images of 512x512, so 1024 image tokens; 6+6 transformer layers of
    width 256, 8 heads, 100 queries, bf16 autocast) whose layers call nn.MultiheadAttention as DETR's code does,
    without need_weights, so it defaults to True: every attention computes softmax(QK^T)V with the [16, 8, 1024,
    1024] probabilities materialised (and averaged over heads for the unused second output), forward and
    backward. Fix: need_weights=False (then MultiheadAttention calls F.scaled_dot_product_attention)."""
    image, batch, width = pick(512, 64), pick(16, 2), pick(256, 32)
    trunk = (64, 128, 256) if on_gpu() else (8, 16, 16)
    queries, classes, targets = pick(100, 10), 91, pick(16, 4)
    model = Detr(image, width, pick(8, 2), pick(6, 1), queries, classes, trunk,
                 need_weights="eager_attention" not in fixes).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    images = torch.randn(batch, 3, image, image, device=dev()).contiguous(memory_format=torch.channels_last)
    target_classes = torch.randint(classes, (batch, targets), device=dev())
    target_boxes = torch.rand(batch, targets, 4, device=dev()) * 0.5 + 0.25

    def step() -> None:
        with autocast():
            logits, boxes = model(images)
        set_prediction_loss(logits, boxes, target_classes, target_boxes).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------------------------- pageable_copy

class ImpalaStage(nn.Module):
    """IMPALA's CNN stage: a convolution, a 3x3 stride-2 max pool, two residual blocks."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(),
                                                  nn.Conv2d(cout, cout, 3, padding=1)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.conv(x), 3, 2, 1)
        for block in self.blocks:
            x = x + block(x)
        return x


class ActorCritic(nn.Module):
    def __init__(self, frames: int, widths: tuple[int, ...], size: int, actions: int) -> None:
        super().__init__()
        stages, cin = [], frames
        for width in widths:
            stages.append(ImpalaStage(cin, width))
            cin, size = width, (size + 1) // 2
        self.trunk = nn.Sequential(*stages, nn.ReLU(), nn.Flatten(), nn.Linear(cin * size * size, 256), nn.ReLU())
        self.policy, self.value = nn.Linear(256, actions), nn.Linear(256, 1)

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(frames)
        return self.policy(h), self.value(h).squeeze(-1)


def ppo_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor, old_log_probs: torch.Tensor,
             advantages: torch.Tensor, returns: torch.Tensor, clip: float = 0.1) -> torch.Tensor:
    """PPO's clipped surrogate, value loss and entropy bonus, advantages normalised over the minibatch."""
    log_probs = logits.float().log_softmax(-1)
    new_log_probs = log_probs.gather(1, actions[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    ratio = (new_log_probs - old_log_probs).exp()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
    return -surrogate + 0.5 * F.mse_loss(values.float(), returns) - 0.01 * entropy


def ppo_numpy_rollout(fixes: Fixes) -> Step:
    """One PPO minibatch update (IMPALA CNN of widths 32-64-64, 4 stacked 84x84 frames, 18 actions, 1024
    transitions a minibatch, bf16 autocast, gradient clipping) from a rollout buffer of 4096 transitions kept in
    numpy arrays (frames scaled to [0, 1] as float32 when collected), shuffled once per epoch: each minibatch is a
    slice copied with torch.from_numpy(...).to('cuda'), 116 MB of frames a step from pageable memory, the host
    waiting on it. Fix: allocate the rollout buffer in pinned memory (torch.empty(..., pin_memory=True)) and copy
    with non_blocking=True."""
    transitions, minibatch, size = pick(4096, 64), pick(1024, 16), pick(84, 36)
    widths, actions = (32, 64, 64) if on_gpu() else (8, 16, 16), 18
    rng = np.random.default_rng(0)
    buffer = {"frames": rng.random((transitions, 4, size, size), dtype=np.float32),
              "actions": rng.integers(actions, size=transitions),
              "log_probs": np.log(rng.uniform(0.01, 1, transitions)).astype(np.float32),
              "advantages": rng.standard_normal(transitions, dtype=np.float32),
              "returns": rng.standard_normal(transitions, dtype=np.float32)}
    pin = "pageable_copy" in fixes
    if pin:
        buffer = {name: pinned(torch.from_numpy(array)) for name, array in buffer.items()}
    model = ActorCritic(4, widths, size, actions).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    minibatches = iter(range(1 << 30))

    def fetch(name: str, start: int) -> torch.Tensor:
        part = buffer[name][start:start + minibatch]
        return part.to(dev(), non_blocking=True) if pin else torch.from_numpy(part).to(dev())

    def step() -> None:
        start = next(minibatches) % (transitions // minibatch) * minibatch
        frames, taken, old, advantages, returns = (fetch(name, start) for name in buffer)
        x = frames.contiguous(memory_format=torch.channels_last)
        with autocast():
            logits, values = model(x)
        loss = ppo_loss(logits, values, taken, old, advantages, returns)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------- allocator_churn

class ConvLayer(nn.Module):
    """Reflection-padded convolution, InstanceNorm, ReLU (the style network's unit); `upsample` first doubles
    the resolution (nearest) instead of a transposed convolution."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, upsample: bool = False,
                 relu: bool = True) -> None:
        super().__init__()
        self.upsample, self.relu = upsample, relu
        self.pad = nn.ReflectionPad2d(kernel // 2)
        self.conv = nn.Conv2d(cin, cout, kernel, stride)
        self.norm = nn.InstanceNorm2d(cout, affine=True) if relu else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upsample:
            x = F.interpolate(x, scale_factor=2, mode="nearest")
        x = self.norm(self.conv(self.pad(x)))
        return F.relu(x) if self.relu else x


class StyleResidual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(ConvLayer(channels, channels, 3), ConvLayer(channels, channels, 3, relu=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def style_network(widths: tuple[int, int, int]) -> nn.Sequential:
    """Johnson et al.'s image transformation network: down, five residual blocks, up."""
    a, b, c = widths
    return nn.Sequential(ConvLayer(3, a, 9), ConvLayer(a, b, 3, 2), ConvLayer(b, c, 3, 2),
                         *[StyleResidual(c) for _ in range(5)], ConvLayer(c, b, 3, upsample=True),
                         ConvLayer(b, a, 3, upsample=True), ConvLayer(a, 3, 9, relu=False))


class LossNetwork(nn.Module):
    """VGG-16's convolutions up to relu4_3 (frozen; random weights stand in for the ImageNet ones), returning
    relu1_2, relu2_2, relu3_3 and relu4_3."""

    def __init__(self, widths: tuple[int, int, int, int]) -> None:
        super().__init__()
        stages, cin = [], 3
        for width, convs in zip(widths, (2, 2, 3, 3)):
            layers: list[nn.Module] = [nn.MaxPool2d(2)] if stages else []
            for _ in range(convs):
                layers += [nn.Conv2d(cin, width, 3, padding=1), nn.ReLU(inplace=True)]
                cin = width
            stages.append(nn.Sequential(*layers))
        self.stages = nn.ModuleList(stages)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


def gram(features: torch.Tensor) -> torch.Tensor:
    b, c, h, w = features.shape
    f = features.float().reshape(b, c, h * w)
    return f @ f.transpose(1, 2) / (c * h * w)


def style_transfer_empty_cache(fixes: Fixes) -> Step:
    """Fast neural style transfer (Johnson et al.: the transformation network, 16 content images of 256x256, a
    frozen VGG-16 loss network to relu4_3 with style Gram matrices and relu2_2 content loss, channels_last, bf16
    autocast) that computes the content targets under no_grad and then calls torch.cuda.empty_cache() 'so the
    loss network's activations do not pile up': the allocator hands its cached blocks back to the driver each
    step and takes them again with cudaMalloc for the stylised forward and the backward. Fix: drop the
    empty_cache() call."""
    size, batch = pick(256, 32), pick(16, 2)
    transformer = style_network((32, 64, 128) if on_gpu() else (8, 8, 16))
    transformer = transformer.to(dev(), memory_format=torch.channels_last)
    vgg = LossNetwork((64, 128, 256, 512) if on_gpu() else (8, 8, 16, 16)).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(transformer.parameters())
    content = torch.rand(batch, 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        with autocast():
            style_features = vgg(torch.rand(1, 3, size, size, device=dev()))
        style_grams = [gram(f) for f in style_features]

    def step() -> None:
        with torch.no_grad(), autocast():
            content_target = vgg(content)[1]
        if "allocator_churn" not in fixes:
            release_cached_memory()
        with autocast():
            stylised = transformer(content)
            features = vgg(stylised)
        content_loss = F.mse_loss(features[1].float(), content_target.float())
        style_loss = sum(F.mse_loss(gram(f), g.expand(batch, -1, -1)) for f, g in zip(features, style_grams))
        tv = (stylised[..., 1:, :] - stylised[..., :-1, :]).abs().mean() + \
            (stylised[..., 1:] - stylised[..., :-1]).abs().mean()
        (content_loss + 1e5 * style_loss + 1e-2 * tv.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ----------------------------------------------------------------------------- gc_pauses + allocator_churn

class WaveNetLayer(nn.Module):
    """A WaveNet residual layer: a dilated causal convolution (kernel 2) plus the local conditioning, a gated
    tanh x sigmoid activation, 1x1 convolutions to the residual and the skip path."""

    def __init__(self, residual: int, gate: int, skip: int, conditioning: int, dilation: int) -> None:
        super().__init__()
        self.dilation = dilation
        self.dilated = nn.Conv1d(residual, 2 * gate, 2, dilation=dilation)
        self.condition = nn.Conv1d(conditioning, 2 * gate, 1)
        self.residual, self.skip = nn.Conv1d(gate, residual, 1), nn.Conv1d(gate, skip, 1)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        filt, gate = (self.dilated(F.pad(x, (self.dilation, 0))) + self.condition(c)).chunk(2, 1)
        h = torch.tanh(filt) * torch.sigmoid(gate)
        return (x + self.residual(h)) * math.sqrt(0.5), self.skip(h)


class WaveNetVocoder(nn.Module):
    """A WaveNet vocoder: mu-law sample embeddings, mel frames upsampled to the sample rate by a transposed
    convolution, stacks of dilated layers (dilations 1 to 512), a skip-sum head to 256 mu-law classes."""

    def __init__(self, residual: int, gate: int, skip: int, mels: int, hop: int, stacks: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, residual)
        self.upsample = nn.ConvTranspose1d(mels, mels, 2 * hop, stride=hop, padding=hop // 2)
        self.layers = nn.ModuleList(WaveNetLayer(residual, gate, skip, mels, 2 ** i)
                                    for _ in range(stacks) for i in range(layers))
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(skip, skip, 1), nn.ReLU(), nn.Conv1d(skip, 256, 1))

    def forward(self, samples: torch.Tensor, mel: torch.Tensor) -> torch.Tensor:
        x = self.embed(samples).transpose(1, 2)
        c = self.upsample(mel)[..., :samples.shape[1]]
        skips = 0
        for layer in self.layers:
            x, s = layer(x, c)
            skips = skips + s
        return self.head(skips)


def wavenet_collect_and_empty_cache(fixes: Fixes) -> Step:
    """A WaveNet vocoder (2 stacks of 10 dilated layers, 128 residual / 256 gate / 128 skip channels, 16 clips of
    8192 samples conditioned on 80-bin mel frames, bf16 autocast) whose loop ends every step with
    `del logits, loss; gc.collect(); torch.cuda.empty_cache()` 'to keep memory flat'. Profiled with stacks. Two
    fixes, each its own cause: drop gc.collect() (nothing here makes reference cycles) and drop
    torch.cuda.empty_cache() (the next step reallocates every block it handed back)."""
    batch, length, mels, hop = pick(16, 2), pick(8192, 512), 80, 256
    residual, gate, skip, layers = pick(128, 16), pick(256, 32), pick(128, 16), pick(10, 4)
    model = WaveNetVocoder(residual, gate, skip, mels, hop, 2, layers).to(dev())
    opt = fused_adamw(model.parameters())
    audio = torch.randint(256, (batch, length + 1), device=dev())
    mel = torch.randn(batch, mels, length // hop, device=dev())
    losses = []

    def step() -> None:
        with autocast():
            logits = model(audio[:, :-1], mel)
        loss = F.cross_entropy(logits.float(), audio[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del logits, loss
        if "gc_pauses" not in fixes:
            gc.collect()
        if "allocator_churn" not in fixes:
            release_cached_memory()
    return step


# ----------------------------------------------------------------------------- eager_attention + optimizer_impl

def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """[B, H, W, C] -> [B * windows, window * window, C]."""
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c).transpose(2, 3)
    return x.reshape(-1, window * window, c)


def window_merge(windows: torch.Tensor, window: int, h: int, w: int) -> torch.Tensor:
    c = windows.shape[-1]
    x = windows.view(-1, h // window, w // window, window, window, c).transpose(2, 3)
    return x.reshape(-1, h, w, c)


def relative_position_index(window: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
    return relative[..., 0] * (2 * window - 1) + relative[..., 1]


def shifted_window_mask(h: int, w: int, window: int, shift: int) -> torch.Tensor:
    """Swin's mask for shifted windows: -100 between tokens that came from different regions, [windows, N, N]."""
    regions = torch.zeros(1, h, w, 1)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for label, (rows, cols) in enumerate((r, c) for r in cuts for c in cuts):
        regions[:, rows, cols, :] = label
    labels = window_partition(regions, window).squeeze(-1)
    return (labels[:, None, :] != labels[:, :, None]).float() * -100.0


def windows_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Swin's window attention as its reference code writes it: scaled scores, + bias (relative positions and the
    shift mask, [windows, heads, N, N]), softmax, times V. q, k, v: [B * windows, heads, N, d]."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    scores = scores.view(-1, bias.shape[0], *scores.shape[1:]) + bias
    return scores.view(-1, *scores.shape[2:]).softmax(-1) @ v


def windows_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The same attention through F.scaled_dot_product_attention, the bias as its additive mask (windows folded
    into the head dimension so one mask broadcasts over the batch)."""
    windows, heads, n, d = bias.shape[0], *q.shape[1:]
    q, k, v = (t.reshape(-1, windows * heads, n, d) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.reshape(1, windows * heads, n, n).to(q.dtype))
    return out.reshape(-1, heads, n, d)


class SwinBlock(nn.Module):
    """A Swin transformer block: (shifted) window attention with a relative position bias, then an MLP."""

    def __init__(self, width: int, heads: int, resolution: int, window: int, shift: int, attend) -> None:
        super().__init__()
        self.heads, self.resolution, self.window, self.shift, self.attend = heads, resolution, window, shift, attend
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.bias_table = nn.Parameter(0.02 * torch.randn((2 * window - 1) ** 2, heads))
        self.register_buffer("bias_index", relative_position_index(window), persistent=False)
        mask = shifted_window_mask(resolution, resolution, window, shift) if shift else torch.zeros(1, 1, 1)
        self.register_buffer("shift_mask", mask[:, None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        r, window = self.resolution, self.window
        h = self.norm1(x).view(b, r, r, c)
        if self.shift:
            h = torch.roll(h, (-self.shift, -self.shift), (1, 2))
        windows = window_partition(h, window)
        q, k, v = self.qkv(windows).view(windows.shape[0], -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias_table[self.bias_index].permute(2, 0, 1).unsqueeze(0) + self.shift_mask
        attended = self.attend(q, k, v, bias).transpose(1, 2).reshape(windows.shape[0], -1, c)
        h = window_merge(self.proj(attended), window, r, r)
        if self.shift:
            h = torch.roll(h, (self.shift, self.shift), (1, 2))
        x = x + h.reshape(b, n, c)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, width: int, resolution: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.norm, self.reduce = nn.LayerNorm(4 * width), nn.Linear(4 * width, 2 * width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, c = x.shape
        r = self.resolution
        x = x.view(b, r // 2, 2, r // 2, 2, c).permute(0, 1, 3, 4, 2, 5).reshape(b, (r // 2) ** 2, 4 * c)
        return self.reduce(self.norm(x))


class Swin(nn.Module):
    """A Swin transformer classifier: 4x4 patches, four stages of (shifted) window blocks with patch merging
    between them; a stage whose map is no larger than the window attends over the whole map, unshifted."""

    def __init__(self, image: int, width: int, depths: tuple[int, ...], heads: tuple[int, ...], window: int,
                 classes: int, attend) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, 4, 4)
        self.patch_norm = nn.LayerNorm(width)
        layers: list[nn.Module] = []
        resolution = image // 4
        for stage, (depth, stage_heads) in enumerate(zip(depths, heads)):
            if stage:
                layers.append(PatchMerging(width, resolution))
                width, resolution = 2 * width, resolution // 2
            w = min(window, resolution)
            layers += [SwinBlock(width, stage_heads, resolution, w, w // 2 if i % 2 and resolution > w else 0,
                                 attend) for i in range(depth)]
        self.layers = nn.Sequential(*layers)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_norm(self.patches(images).flatten(2).transpose(1, 2))
        return self.head(self.norm(self.layers(x)).mean(1))


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The usual AdamW parameter groups: no weight decay for biases, norms and the position-bias tables."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "bias_table" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def swin_windows_foreach_off(fixes: Fixes) -> Step:
    """A Swin-T classifier (depths 2-2-6-2, widths 96-768, 32 images of 256x256, SwinV2's 16x16 windows, bf16
    autocast) written after the reference code, with two problems. Its window attention is written out,
    softmax(QK^T * scale + bias)V, materialising [32 x 16 windows, 3 heads, 256, 256] scores in the first stage
    (fix: F.scaled_dot_product_attention with the relative-position bias and shift mask as attn_mask). And its
    AdamW is built with foreach=False ('foreach ran out of memory once'), so the update loops over the 173
    parameter tensors one at a time (fix: AdamW(fused=True))."""
    image, window, batch = pick(256, 64), pick(16, 4), pick(32, 2)
    attend = windows_sdpa if "eager_attention" in fixes else windows_by_hand
    model = Swin(image, pick(96, 24), pick((2, 2, 6, 2), (2, 2, 2, 2)), (3, 6, 12, 24), window, 1000, attend)
    model = model.to(dev())
    per_tensor = "optimizer_impl" not in fixes
    opt = torch.optim.AdamW(decay_groups(model, 0.05), lr=1e-3, foreach=False if per_tensor else None,
                            fused=None if per_tensor else on_gpu())
    images = torch.randn(batch, 3, image, image, device=dev())
    labels = torch.randint(1000, (batch,), device=dev())

    def step() -> None:
        with autocast():
            logits = model(images)
        F.cross_entropy(logits.float(), labels, label_smoothing=0.1).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ---------------------------------------------------------------------------- data_loader + act. checkpointing

def random_molecules(count: int, max_atoms: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Molecule-like graphs: (atom types, bond list), a random tree of 9 to `max_atoms` atoms plus a ring bond
    for every six atoms."""
    rng = np.random.default_rng(seed)
    molecules = []
    for _ in range(count):
        n = int(rng.integers(9, max_atoms + 1))
        tree = [(int(rng.integers(i)), i) for i in range(1, n)]
        rings = [tuple(int(a) for a in rng.choice(n, 2, replace=False)) for _ in range(n // 6)]
        molecules.append((rng.integers(1, 28, n), np.array(tree + rings, dtype=np.int64)))
    return molecules


def shortest_paths(n: int, bonds: np.ndarray, unreachable: int) -> np.ndarray:
    """All-pairs shortest path lengths (Floyd-Warshall), capped at `unreachable`."""
    distance = np.full((n, n), unreachable, dtype=np.int64)
    distance[bonds[:, 0], bonds[:, 1]] = distance[bonds[:, 1], bonds[:, 0]] = 1
    np.fill_diagonal(distance, 0)
    for k in range(n):
        np.minimum(distance, distance[:, k, None] + distance[None, k, :], out=distance)
    return np.minimum(distance, unreachable)


class MoleculeGraphs(torch.utils.data.Dataset):
    """One molecule per sample with Graphormer's inputs: atom types, degrees and shortest-path distances."""

    def __init__(self, molecules: list, max_distance: int) -> None:
        self.molecules, self.max_distance = molecules, max_distance
        self.targets = np.random.default_rng(1).standard_normal(len(molecules)).astype(np.float32)

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.float32]:
        atoms, bonds = self.molecules[index % len(self.molecules)]
        distance = shortest_paths(len(atoms), bonds, self.max_distance + 1)
        degree = np.bincount(bonds.flatten(), minlength=len(atoms))
        return atoms, degree, distance, self.targets[index % len(self.molecules)]


def pad_molecules(samples: list, max_atoms: int) -> tuple[torch.Tensor, ...]:
    """Collate: every graph padded to `max_atoms` (padding atoms are type 0, distance index 0)."""
    b = len(samples)
    atoms, degree = np.zeros((b, max_atoms), dtype=np.int64), np.zeros((b, max_atoms), dtype=np.int64)
    distance = np.zeros((b, max_atoms, max_atoms), dtype=np.int64)
    for i, (a, d, sp, _) in enumerate(samples):
        n = len(a)
        atoms[i, :n], degree[i, :n], distance[i, :n, :n] = a, np.minimum(d, 15), sp + 1
    targets = np.array([s[3] for s in samples], dtype=np.float32)
    return tuple(torch.from_numpy(t) for t in (atoms, degree, distance, targets))


class GraphormerLayer(nn.Module):
    """A pre-norm transformer layer whose attention takes the graph's spatial bias as its additive mask (SDPA)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, n, w))
        return x + self.mlp(self.norm2(x))


class Graphormer(nn.Module):
    """Graphormer (Ying et al.): atom and degree (centrality) embeddings, a virtual graph token, a learned
    attention bias per shortest-path distance and head, pre-norm layers, the graph token read out."""

    def __init__(self, width: int, heads: int, depth: int, max_distance: int, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.atoms, self.degrees = nn.Embedding(28, width, padding_idx=0), nn.Embedding(16, width)
        self.graph_token = nn.Parameter(0.02 * torch.randn(1, 1, width))
        self.spatial = nn.Embedding(max_distance + 3, heads)
        self.virtual_distance = nn.Parameter(torch.zeros(heads))
        self.layers = nn.ModuleList(GraphormerLayer(width, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 1)

    def attention_bias(self, atoms: torch.Tensor, distance: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        bias = F.pad(self.spatial(distance).permute(0, 3, 1, 2), (1, 0, 1, 0))
        border = torch.ones(bias.shape[-2:], device=bias.device)
        border[1:, 1:] = 0
        bias = bias + border * self.virtual_distance[:, None, None]
        keys = torch.cat([torch.ones_like(atoms[:, :1], dtype=torch.bool), atoms != 0], 1)[:, None, None, :]
        return bias.masked_fill(~keys, float("-inf")).to(dtype)

    def forward(self, atoms: torch.Tensor, degree: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        x = self.atoms(atoms) + self.degrees(degree)
        x = torch.cat([self.graph_token.expand(x.shape[0], -1, -1).to(x.dtype), x], 1)
        bias = self.attention_bias(atoms, distance, torch.get_autocast_dtype(x.device.type)
                                   if torch.is_autocast_enabled(x.device.type) else x.dtype)
        for layer in self.layers:
            x = checkpoint(layer, x, bias, use_reentrant=False) if self.checkpointed else layer(x, bias)
        return self.head(self.norm(x[:, 0])).squeeze(-1)


def graphormer_checkpointed_loader(fixes: Fixes) -> Step:
    """Graphormer regressing a molecular property (12 layers of width 768, 32 heads, 256 molecules of up to 31
    atoms a step, bf16 autocast), with two problems. Each layer runs under torch.utils.checkpoint (copied from a
    config for large graphs), so its forward runs again in the backward, though these activations fit easily
    (fix: no checkpointing). And its DataLoader has num_workers=0: each molecule's shortest-path matrix
    (Floyd-Warshall in numpy) and the padding collate run in the training process every step (fix:
    num_workers=8, persistent_workers=True)."""
    width, heads, depth, batch = pick(768, 32), pick(32, 4), pick(12, 2), pick(256, 4)
    max_atoms, max_distance = 31, 20
    dataset = MoleculeGraphs(random_molecules(pick(10_000, 200), max_atoms), max_distance)
    workers = {"num_workers": 8, "persistent_workers": True} if "data_loader" in fixes else {"num_workers": 0}
    batches = iter(torch.utils.data.DataLoader(dataset, batch_size=batch,
                                               collate_fn=partial(pad_molecules, max_atoms=max_atoms), **workers))
    model = Graphormer(width, heads, depth, max_distance, checkpointed="activation_checkpointing" not in fixes)
    model = model.to(dev())
    opt = fused_adamw(model.parameters())
    losses = []

    def step() -> None:
        atoms, degree, distance, targets = (t.to(dev()) for t in next(batches))
        with autocast():
            predicted = model(atoms, degree, distance)
        loss = F.l1_loss(predicted.float(), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# --------------------------------------------------------------------------------------------------- healthy

class PointVoxelConv(nn.Module):
    """PVConv (Liu et al.): point features averaged into a voxel grid, two 3-D convolutions there, the result
    sampled back to the points trilinearly, plus a per-point linear branch."""

    def __init__(self, cin: int, cout: int, resolution: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.voxel = nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm3d(cout),
                                   nn.LeakyReLU(0.1, inplace=True), nn.Conv3d(cout, cout, 3, padding=1, bias=False),
                                   nn.BatchNorm3d(cout), nn.LeakyReLU(0.1, inplace=True))
        self.point = nn.Sequential(nn.Linear(cin, cout), nn.LayerNorm(cout), nn.LeakyReLU(0.1))

    def voxelise(self, features: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        b, p, c = features.shape
        r = self.resolution
        cell = (coords * r).long().clamp_(0, r - 1)
        flat = ((torch.arange(b, device=coords.device)[:, None] * r + cell[..., 0]) * r + cell[..., 1]) * r \
            + cell[..., 2]
        sums = features.new_zeros(b * r ** 3, c, dtype=torch.float32).index_add_(
            0, flat.flatten(), features.flatten(0, 1).float())
        counts = torch.zeros(b * r ** 3, device=coords.device).index_add_(
            0, flat.flatten(), torch.ones(b * p, device=coords.device)).clamp_(min=1)
        grid = (sums / counts[:, None]).view(b, r, r, r, c).permute(0, 4, 1, 2, 3)
        return grid.to(features.dtype) if torch.is_autocast_enabled(coords.device.type) else grid

    def forward(self, features: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        grid = self.voxel(self.voxelise(features, coords))
        where = (coords * 2 - 1).flip(-1)[:, :, None, None, :]
        sampled = F.grid_sample(grid.float(), where, align_corners=False).squeeze(-1).squeeze(-1).transpose(1, 2)
        return sampled.to(features.dtype) + self.point(features)


class PointVoxelSegmenter(nn.Module):
    def __init__(self, widths: tuple[int, ...], resolutions: tuple[int, ...], parts: int) -> None:
        super().__init__()
        cins = (6, *widths[:-1])
        self.blocks = nn.ModuleList(PointVoxelConv(a, b, r) for a, b, r in zip(cins, widths, resolutions))
        self.classify = nn.Sequential(nn.Linear(sum(widths), 256), nn.LeakyReLU(0.1), nn.Linear(256, parts))

    def forward(self, features: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        outputs = []
        for block in self.blocks:
            features = block(features, coords)
            outputs.append(features)
        return self.classify(torch.cat(outputs, -1))


def healthy_point_voxel_bf16(fixes: Fixes) -> Step:
    """A point-voxel CNN part segmenter (three PVConv blocks of 64-128-256 channels at voxel resolutions 32-16-16,
    16 clouds of 16k points with normals, 50 parts), voxelisation and devoxelisation on the device,
    channels_last_3d, cudnn.benchmark, bf16 autocast, fused AdamW: nothing planted."""
    torch.backends.cudnn.benchmark = True
    batch, points = pick(16, 2), pick(16384, 512)
    widths, resolutions = ((64, 128, 256), (32, 16, 16)) if on_gpu() else ((8, 16, 16), (8, 4, 4))
    model = PointVoxelSegmenter(widths, resolutions, 50).to(dev(), memory_format=torch.channels_last_3d)
    opt = fused_adamw(model.parameters())
    coords = torch.rand(batch, points, 3, device=dev())
    features = torch.cat([coords, F.normalize(torch.randn(batch, points, 3, device=dev()), dim=-1)], -1)
    labels = torch.randint(50, (batch, points), device=dev())

    def step() -> None:
        with autocast():
            logits = model(features, coords)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sinusoids(length: int, width: int) -> torch.Tensor:
    position = torch.arange(length).float()[:, None]
    freqs = torch.exp(-math.log(10_000) * torch.arange(0, width, 2).float() / width)
    return torch.cat([torch.sin(position * freqs), torch.cos(position * freqs)], -1)


class FFTBlock(nn.Module):
    """FastSpeech's feed-forward Transformer block: self-attention (SDPA, key padding mask) and a two-layer
    1-D convolution (kernels 9 and 1), post-norm."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.conv1, self.conv2 = nn.Conv1d(width, hidden, 9, padding=4), nn.Conv1d(hidden, width, 1)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        x = self.norm1(x + self.proj(attended.transpose(1, 2).reshape(b, t, w)))
        h = self.conv2(F.relu(self.conv1(x.transpose(1, 2)))).transpose(1, 2)
        return self.norm2(x + h) * keys.squeeze(1).squeeze(1)[..., None]


class VariancePredictor(nn.Module):
    """FastSpeech 2's duration / pitch / energy predictor: two convolutions with LayerNorm, a linear output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(width, width, 3, padding=1), nn.Conv1d(width, width, 3, padding=1)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(F.relu(self.conv1(x.transpose(1, 2))).transpose(1, 2))
        x = self.norm2(F.relu(self.conv2(x.transpose(1, 2))).transpose(1, 2))
        return self.out(x).squeeze(-1)


class FastSpeech2(nn.Module):
    """FastSpeech 2: phoneme encoder, variance adaptor (duration, pitch and energy predictors, pitch and energy
    embeddings of the ground truth), a length regulator that expands phonemes to frames by their durations, mel
    decoder. Every FFT block is compiled (torch.compile per block)."""

    def __init__(self, phonemes: int, width: int, heads: int, hidden: int, depth: int, mels: int,
                 frames: int) -> None:
        super().__init__()
        self.frames = frames
        self.embed = nn.Embedding(phonemes, width, padding_idx=0)
        self.register_buffer("positions", sinusoids(frames, width), persistent=False)
        self.encoder = nn.ModuleList(FFTBlock(width, heads, hidden) for _ in range(depth))
        self.decoder = nn.ModuleList(FFTBlock(width, heads, hidden) for _ in range(depth))
        for block in (*self.encoder, *self.decoder):
            block.compile(dynamic=False)
        self.duration, self.pitch, self.energy = (VariancePredictor(width) for _ in range(3))
        self.pitch_embed, self.energy_embed = nn.Embedding(256, width), nn.Embedding(256, width)
        self.register_buffer("bins", torch.linspace(-3, 3, 255), persistent=False)
        self.mel = nn.Linear(width, mels)

    def regulate(self, x: torch.Tensor, durations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each phoneme repeated for its duration (frames beyond the utterance masked), without host reads."""
        ends = durations.cumsum(1)
        frames = torch.arange(self.frames, device=x.device).expand(x.shape[0], -1).contiguous()
        source = torch.searchsorted(ends, frames, right=True)
        valid = source < x.shape[1]
        x = x.gather(1, source.clamp(max=x.shape[1] - 1)[..., None].expand(-1, -1, x.shape[-1]))
        return x * valid[..., None], valid

    def forward(self, text: torch.Tensor, durations: torch.Tensor, pitch: torch.Tensor,
                energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        keys = (text != 0)[:, None, None, :]
        x = self.embed(text) + self.positions[:text.shape[1]]
        for block in self.encoder:
            x = block(x, keys)
        predicted = self.duration(x), self.pitch(x), self.energy(x)
        x = x + self.pitch_embed(torch.bucketize(pitch, self.bins)) + self.energy_embed(
            torch.bucketize(energy, self.bins))
        x, valid = self.regulate(x, durations)
        x = x + self.positions
        for block in self.decoder:
            x = block(x, valid[:, None, None, :])
        return self.mel(x), valid, predicted


def healthy_fastspeech_compiled(fixes: Fixes) -> Step:
    """FastSpeech 2 (4+4 FFT blocks of width 384, 2 heads, conv filter 1536, 32 utterances of 160 phonemes
    expanded to 1024 mel frames) with each FFT block compiled (regional torch.compile, static shapes: the encoder
    and decoder shapes compile during warm-up), bf16 autocast, fused AdamW: nothing planted."""
    batch, phonemes, frames = pick(32, 2), pick(160, 16), pick(1024, 64)
    width, hidden, depth = pick(384, 32), pick(1536, 64), pick(4, 1)
    model = FastSpeech2(80, width, 2, hidden, depth, 80, frames).to(dev())
    opt = fused_adamw(model.parameters())
    lengths = torch.randint(phonemes * 3 // 4, phonemes + 1, (batch,), device=dev())
    text = torch.randint(1, 80, (batch, phonemes), device=dev()) * (torch.arange(phonemes, device=dev())
                                                                     < lengths[:, None])
    durations = torch.randint(1, 2 * frames // phonemes, (batch, phonemes), device=dev()) * (text != 0)
    pitch, energy = torch.randn(batch, phonemes, device=dev()), torch.randn(batch, phonemes, device=dev())
    mel = torch.randn(batch, frames, 80, device=dev())

    def step() -> None:
        with autocast():
            predicted_mel, valid, (log_duration, predicted_pitch, predicted_energy) = model(text, durations, pitch,
                                                                                             energy)
        keep = (text != 0).float()
        mel_loss = ((predicted_mel.float() - mel).abs().mean(-1) * valid).sum() / valid.sum()
        variance = ((log_duration.float() - torch.log1p(durations.float())).square()
                    + (predicted_pitch.float() - pitch).square() + (predicted_energy.float() - energy).square())
        ((mel_loss + (variance * keep).sum() / keep.sum())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


PROGRAMS = {
    "moe_expert_loop_where": ["host_syncs"],
    "simclr_numpy_augmentation": ["host_work"],
    "mamba_python_scan": ["launch_bound"],
    "transe_minibatch_64": ["tiny_batch"],
    "realnvp_fp32": ["precision"],
    "convs2s_save_every_step": ["checkpoint_in_step"],
    "detr_attention_weights": ["eager_attention"],
    "ppo_numpy_rollout": ["pageable_copy"],
    "style_transfer_empty_cache": ["allocator_churn"],
    "wavenet_collect_and_empty_cache": ["gc_pauses", "allocator_churn"],
    "swin_windows_foreach_off": ["eager_attention", "optimizer_impl"],
    "graphormer_checkpointed_loader": ["data_loader", "activation_checkpointing"],
    "healthy_point_voxel_bf16": [],
    "healthy_fastspeech_compiled": [],
}
WITH_STACK = {"wavenet_collect_and_empty_cache"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set_fixes(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
