"""A seventh held-out check of the advisor: eleven programs of other architectures than bench/planted/corpus.py's and
heldout.py's to heldout6.py's (an FT-Transformer on tabular data, PatchTST, N-BEATS, an EfficientNet-style
classifier, ColBERT, DLRM, a stacked hourglass pose estimator, a ViT with registers, a SalsaNext-style LiDAR
range-image segmenter, a top-k sparse autoencoder and EDSR), six with one planted problem, three with two at once
and two healthy, written without reading the advisor's rules, with the same output format (OUT/NAME/trace +
planted.json), scored the same way:

    python bench/planted/heldout7.py OUT                  # on a GPU
    python bench/planted/heldout7.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout7.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT
    python bench/planted/fix_timelines.py heldout7 OUT2 NAME [NAME ...]   # a program as written and fixed

The programs, one sentence each:

    ft_transformer_norm_items       an FT-Transformer on tabular rows whose dashboard reads every parameter's
                                    gradient and weight norms with `.item()`, one at a time, each step (host_syncs)
    patchtst_numpy_window_sampler   PatchTST forecasting whose windows are cut, scaled and normalised one by one in
                                    numpy in the step (host_work)
    nbeats_eager_block_stack        N-BEATS, 30 small MLP blocks run eagerly: thousands of microsecond kernels a step
                                    (launch_bound)
    efficientnet_inline_decode      an EfficientNet-style classifier whose DataLoader decompresses and augments each
                                    image in the training process (data_loader)
    colbert_gc_memory_monitor       ColBERT over a Python corpus of token lists, with a leak-hunting callback that
                                    runs gc.collect() after every step (gc_pauses)
    dlrm_checkpoint_every_step      DLRM that saves model and optimizer with torch.save after every step, for
                                    preemptible machines (checkpoint_in_step)
    hourglass_fp32_rmsprop_loop     a stacked hourglass pose estimator in full fp32 with cuDNN's TF32 turned off,
                                    trained with RMSprop(foreach=False) (precision, optimizer_impl)
    vit_registers_eager_checkpoint  a ViT-S/8 with registers whose attention is written out and every block
                                    checkpointed (eager_attention, activation_checkpointing)
    rangenet_pageable_empty_cache   a LiDAR range-image segmenter fed float64 scans from pageable memory that empties
                                    the CUDA cache after every step (pageable_copy, allocator_churn)
    healthy_topk_sae_bf16           a top-k sparse autoencoder on residual-stream activations, GEMM-bound in bf16
    healthy_edsr_channels_last      EDSR x2 super-resolution, convolution-bound in bf16 and channels_last

Each program's `build(fixes)` returns one training step; each problem sits behind `if CAUSE not in fixes` (or a
choice made from `fixes`) and its fix is what a user would change. A cause's planted cost is the step as written
less the step with that cause alone fixed; fixed_step_ms has every cause fixed (medians of 7 steps, each between
two synchronizes, profiler off). The programs whose problem is on the host read their loss with `.item()` at the
end of the step, as a loop that logs every step does, so their traces serialise as their timing. Without a GPU
the CUDA-only parts (graph capture, pinned memory, torch.cuda.empty_cache) are skipped, so in smoke mode a fix may
time the same as its problem.
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import random
import resource
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from harness import (BF16, autocast, dev, fused_adamw, heads_of, merge_heads, on_gpu, pick, pinned,
                     release_cached_memory, run_set_fixes)

Fixes = frozenset[str]
Step = Callable[[], object]


class TransformerBlock(nn.Module):
    """A pre-norm Transformer encoder block: multi-head self-attention under an optional key mask ([B, 1, 1, S],
    True where a key may be attended), a GELU MLP. `eager` writes the attention out (scores, fp32 softmax, the
    weighted sum, [B, H, S, S] materialised); otherwise F.scaled_dot_product_attention."""

    def __init__(self, width: int, heads: int, hidden: int, eager: bool = False) -> None:
        super().__init__()
        self.heads, self.eager = heads, eager
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        return scores.float().softmax(-1).to(v.dtype) @ v

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        x = x + self.proj(merge_heads(self.attend(q, k, v, keep)))
        return x + self.mlp(self.norm2(x))


# ------------------------------------------------------------------------------------------------ host_syncs

class FeatureTokenizer(nn.Module):
    """FT-Transformer's tokenizer: each numeric feature scales its own learned vector (plus its own bias), each
    categorical feature looks its value up in its own slice of one embedding (plus its own bias); a [CLS] token
    goes first."""

    def __init__(self, numeric: int, cardinalities: list[int], width: int) -> None:
        super().__init__()
        self.numeric_weight = nn.Parameter(torch.randn(numeric, width) * width ** -0.5)
        self.numeric_bias = nn.Parameter(torch.zeros(numeric, width))
        self.register_buffer("offsets", torch.tensor([0] + cardinalities[:-1]).cumsum(0), persistent=False)
        self.categorical = nn.Embedding(sum(cardinalities), width)
        self.categorical_bias = nn.Parameter(torch.zeros(len(cardinalities), width))
        self.cls = nn.Parameter(torch.randn(1, 1, width) * width ** -0.5)

    def forward(self, numeric: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        numeric_tokens = numeric[..., None] * self.numeric_weight + self.numeric_bias
        categorical_tokens = self.categorical(categorical + self.offsets) + self.categorical_bias
        return torch.cat([self.cls.expand(len(numeric), -1, -1), numeric_tokens, categorical_tokens], 1)


class ReGLUBlock(nn.Module):
    """An FT-Transformer block: pre-norm SDPA self-attention over the feature tokens, a ReGLU feed-forward layer."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ffn_in, self.ffn_out = nn.Linear(width, 2 * hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        dropout = 0.1 if self.training else 0.0
        x = x + self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)))
        gate, value = self.ffn_in(self.norm2(x)).chunk(2, -1)
        return x + self.ffn_out(F.relu(gate) * value)


class FTTransformer(nn.Module):
    def __init__(self, numeric: int, cardinalities: list[int], width: int, heads: int, depth: int,
                 classes: int) -> None:
        super().__init__()
        self.tokenizer = FeatureTokenizer(numeric, cardinalities, width)
        self.blocks = nn.Sequential(*(ReGLUBlock(width, heads, 4 * width // 3) for _ in range(depth)))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, numeric: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tokenizer(numeric, categorical))[:, 0])


def norms_item_by_item(model: nn.Module) -> dict[str, tuple[float, float]]:
    """Each parameter's gradient and weight norms for the dashboard, read one `.item()` at a time."""
    return {name: (p.grad.norm().item(), p.detach().norm().item()) for name, p in model.named_parameters()}


def norms_in_one_read(model: nn.Module) -> dict[str, tuple[float, float]]:
    """The same norms computed on the device and brought over together."""
    names, params = zip(*model.named_parameters())
    grads = torch.stack([p.grad.norm() for p in params])
    weights = torch.stack([p.detach().norm() for p in params])
    return dict(zip(names, map(tuple, torch.stack([grads, weights], 1).tolist())))


def ft_transformer_norm_items(fixes: Fixes) -> Step:
    """An FT-Transformer classifying tabular rows (64 numeric and 32 categorical features as 97 tokens of width
    192, 8 heads, 8 ReGLU blocks, 7 classes; 2048 rows a step; bf16 autocast, fused AdamW). For a training
    dashboard it logs every parameter's gradient norm and weight norm after the backward, each read with its own
    `.item()`: some 210 device-to-host reads a step, each waiting for a small norm kernel, the GPU idle between
    them. Fix: the norms computed on the device, stacked, and read in one `.tolist()`."""
    numeric_features, width, heads, depth, classes = 64, pick(192, 16), pick(8, 2), pick(8, 2), 7
    rows, batch = pick(200_000, 256), pick(2048, 8)
    rng = np.random.default_rng(0)
    cardinalities = rng.integers(3, pick(200, 12), size=32).tolist()
    model = FTTransformer(numeric_features, cardinalities, width, heads, depth, classes).to(dev())
    opt = fused_adamw(model.parameters())
    numeric = torch.randn(rows, numeric_features, device=dev())
    categorical = torch.stack([torch.randint(c, (rows,), device=dev()) for c in cardinalities], 1)
    labels = (numeric[:, :classes] + 0.5 * (categorical[:, :classes] % 2)).argmax(1)
    read_norms = norms_in_one_read if "host_syncs" in fixes else norms_item_by_item
    dashboard: list[dict[str, tuple[float, float]]] = []

    def step() -> float:
        picked = torch.randint(rows, (batch,), device=dev())
        with autocast():
            logits = model(numeric[picked], categorical[picked])
        loss = F.cross_entropy(logits.float(), labels[picked])
        loss.backward()
        dashboard.append(read_norms(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------- host_work

class PatchTST(nn.Module):
    """PatchTST, channel-independent: every channel of a (normalised) lookback window is cut into overlapping
    patches, embedded, encoded by a Transformer shared over channels, and flattened into a linear forecast head."""

    def __init__(self, lookback: int, horizon: int, patch: int, stride: int, width: int, heads: int,
                 depth: int) -> None:
        super().__init__()
        self.patch, self.stride = patch, stride
        patches = (lookback - patch) // stride + 1
        self.embed = nn.Linear(patch, width)
        self.position = nn.Parameter(0.02 * torch.randn(patches, width))
        self.blocks = nn.ModuleList(TransformerBlock(width, heads, 2 * width) for _ in range(depth))
        self.head = nn.Linear(patches * width, horizon)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        b, c, length = window.shape
        x = self.embed(window.reshape(b * c, length).unfold(-1, self.patch, self.stride)) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1)).view(b, c, -1)


def numpy_windows(series: np.ndarray, batch: int, lookback: int, horizon: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Training windows cut one by one: a random start, an amplitude-scaling augmentation per channel, then each
    channel z-normalised by its own lookback statistics (the forecast target with them too)."""
    channels, length = series.shape
    inputs, targets = [], []
    for _ in range(batch):
        start = int(rng.integers(length - lookback - horizon))
        window = series[:, start:start + lookback + horizon] * rng.uniform(0.9, 1.1, size=(channels, 1))
        past = window[:, :lookback]
        window = (window - past.mean(1, keepdims=True)) / (past.std(1, keepdims=True) + 1e-5)
        inputs.append(window[:, :lookback])
        targets.append(window[:, lookback:])
    return np.stack(inputs).astype(np.float32), np.stack(targets).astype(np.float32)


def device_windows(series: torch.Tensor, batch: int, lookback: int,
                   horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same windows gathered and normalised on the device, the whole batch at once."""
    channels, length = series.shape
    starts = torch.randint(length - lookback - horizon, (batch,), device=series.device)
    window = series[:, starts[:, None] + torch.arange(lookback + horizon, device=series.device)].transpose(0, 1)
    window = window * torch.empty(batch, channels, 1, device=series.device).uniform_(0.9, 1.1)
    past = window[..., :lookback]
    window = (window - past.mean(-1, keepdim=True)) / (past.std(-1, keepdim=True, correction=0) + 1e-5)
    return window[..., :lookback], window[..., lookback:]


def synthetic_weather(channels: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Multivariate float64 series like a weather station's: daily and yearly cycles, a random walk, noise."""
    t = np.arange(length)[None, :]
    daily = np.sin(2 * np.pi * t / 144 + rng.uniform(0, 2 * np.pi, (channels, 1)))
    yearly = np.sin(2 * np.pi * t / 52_560 + rng.uniform(0, 2 * np.pi, (channels, 1)))
    walk = np.cumsum(rng.standard_normal((channels, length)) * 0.05, 1)
    return rng.uniform(0.5, 3, (channels, 1)) * daily + 2 * yearly + walk + 0.1 * rng.standard_normal(walk.shape)


def patchtst_numpy_window_sampler(fixes: Fixes) -> Step:
    """PatchTST forecasting a 21-channel weather-like series (lookback 336, horizon 96, patches of 16 with stride
    8, width 128, 16 heads, 3 blocks; 256 windows a step, i.e. 5376 channel series of 41 patches; bf16 autocast,
    fused AdamW). The windows come from a sampler written in numpy inside the step: per window a random start, a
    slice, a per-channel amplitude scaling and a z-normalisation by the window's own statistics, 256 times in
    Python, then stacked and copied over while the GPU waits. Fix: the series kept on the GPU as a tensor and the
    whole batch gathered, scaled and normalised there in a few kernels."""
    channels, length = 21, pick(52_696, 3000)
    lookback, horizon, patch, stride = pick(336, 96), pick(96, 24), 16, 8
    width, heads, depth, batch = pick(128, 16), pick(16, 2), pick(3, 1), pick(256, 4)
    rng = np.random.default_rng(0)
    series = synthetic_weather(channels, length, rng)
    model = PatchTST(lookback, horizon, patch, stride, width, heads, depth).to(dev())
    opt = fused_adamw(model.parameters())
    on_device = torch.from_numpy(series).float().to(dev())

    def step() -> float:
        if "host_work" in fixes:
            inputs, targets = device_windows(on_device, batch, lookback, horizon)
        else:
            inputs, targets = (torch.from_numpy(a).to(dev()) for a in numpy_windows(series, batch, lookback,
                                                                                     horizon, rng))
        with autocast():
            forecast = model(inputs)
        loss = F.mse_loss(forecast.float(), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

class NBeatsBlock(nn.Module):
    """A generic N-BEATS block: a ReLU MLP on the residual window, then expansion coefficients for the backcast
    and the forecast, mapped through learned linear bases."""

    def __init__(self, lookback: int, horizon: int, width: int, layers: int, theta: int) -> None:
        super().__init__()
        sizes = [lookback] + [width] * layers
        self.mlp = nn.Sequential(*(m for i in range(layers) for m in (nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU())))
        self.theta_backcast = nn.Linear(width, theta, bias=False)
        self.theta_forecast = nn.Linear(width, theta, bias=False)
        self.backcast_basis, self.forecast_basis = nn.Linear(theta, lookback), nn.Linear(theta, horizon)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.mlp(x)
        return self.backcast_basis(self.theta_backcast(h)), self.forecast_basis(self.theta_forecast(h))


class NBeats(nn.Module):
    """N-BEATS' doubly residual stack: each block removes its backcast from the window and adds its forecast."""

    def __init__(self, lookback: int, horizon: int, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NBeatsBlock(lookback, horizon, width, 4, 32) for _ in range(blocks))

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        residual, forecast = window, 0.0
        for block in self.blocks:
            backcast, block_forecast = block(residual)
            residual = residual - backcast
            forecast = forecast + block_forecast
        return forecast


def capture_training_step(train: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer,
                          static_x: torch.Tensor, static_y: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The whole training step (forward, backward, optimizer) captured once as a CUDA graph over static inputs, as
    in PyTorch's whole-network capture recipe: warm-up iterations on a side stream, then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train(static_x, static_y)
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = train(static_x, static_y)
    return graph, static_loss


def nbeats_eager_block_stack(fixes: Fixes) -> Step:
    """N-BEATS (generic) forecasting hourly load series (lookback 336, horizon 48; 30 blocks of a 4-layer ReLU MLP
    of width 512 and linear bases; 1024 windows a step, each scaled by its own maximum; bf16 autocast, fused
    AdamW): every block is some 30 small kernels forward (8 matmuls, their bf16 casts, ReLUs) and more backward,
    each a few microseconds on the GPU, so the eager step is some 2000 launches from Python and the GPU mostly
    waits for them. Fix: the whole step
    captured once as a CUDA graph (capturable AdamW) and replayed, the new batch copied into its static inputs."""
    lookback, horizon, width, blocks, batch = pick(336, 24), pick(48, 8), pick(512, 16), pick(30, 3), pick(1024, 8)
    model = NBeats(lookback, horizon, width, blocks).to(dev())
    graphed = "launch_bound" in fixes and on_gpu()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=on_gpu(), capturable=graphed)
    t = torch.arange(pick(200_000, 2000), device=dev(), dtype=torch.float32)
    load = 10 + 3 * torch.sin(2 * math.pi * t / 24) + torch.sin(2 * math.pi * t / 168) + 0.3 * torch.randn_like(t)
    windows = load.unfold(0, lookback + horizon, 1)

    def sample() -> tuple[torch.Tensor, torch.Tensor]:
        picked = windows[torch.randint(len(windows), (batch,), device=dev())]
        scale = picked[:, :lookback].amax(1, keepdim=True)
        return picked[:, :lookback] / scale, picked[:, lookback:] / scale

    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # a graph capture cannot keep autocast's cast cache
        with torch.autocast(dev(), dtype=BF16, cache_enabled=not graphed):
            forecast = model(x)
        loss = F.l1_loss(forecast.float(), y)
        loss.backward()
        opt.step()
        return loss

    if graphed:
        static_x, static_y = sample()
        graph, static_loss = capture_training_step(train, opt, static_x, static_y)

        def replay() -> float:
            x, y = sample()
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            return static_loss.item()
        return replay

    def step() -> float:
        loss = train(*sample())
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ----------------------------------------------------------------------------------------------- data_loader

class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True)))).sigmoid()


class MBConv(nn.Module):
    """EfficientNet's inverted residual: a 1x1 expansion, a depthwise convolution, squeeze-and-excitation, a 1x1
    projection (BatchNorm and SiLU between), a residual where the shape allows."""

    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int) -> None:
        super().__init__()
        mid = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.SiLU(True)]
        layers += [nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False), nn.BatchNorm2d(mid),
                   nn.SiLU(True), SqueezeExcite(mid, max(1, cin // 4)), nn.Conv2d(mid, cout, 1, bias=False),
                   nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


def efficientnet_b0(classes: int, width_percent: int = 100) -> nn.Sequential:
    """EfficientNet-B0's layout (expansion, width, repeats, stride, kernel per stage), no stochastic depth; the
    widths scaled by `width_percent`."""
    stages = [(1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3), (6, 112, 3, 1, 5),
              (6, 192, 4, 2, 5), (6, 320, 1, 1, 3)]
    stem = 32 * width_percent // 100
    layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, 2, 1, bias=False), nn.BatchNorm2d(stem), nn.SiLU(True)]
    cin = stem
    for expand, cout, repeats, stride, kernel in stages:
        cout = cout * width_percent // 100
        for i in range(repeats):
            layers.append(MBConv(cin, cout, expand, kernel, stride if i == 0 else 1))
            cin = cout
    layers += [nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.SiLU(True), nn.AdaptiveAvgPool2d(1),
               nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


def smooth_image(side: int, rng: np.random.Generator) -> np.ndarray:
    """A uint8 HWC image with some structure (colour gradients, a few blobs, a little noise), so it compresses."""
    y, x = np.mgrid[0:side, 0:side] / side
    image = rng.uniform(0, 1, 3) * x[..., None] + rng.uniform(0, 1, 3) * y[..., None]
    for _ in range(4):
        cy, cx, radius = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        image += rng.uniform(-1, 1, 3) * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / radius ** 2)[..., None]
    image += 0.02 * rng.standard_normal(image.shape)
    return (np.clip(image / 2 + 0.25, 0, 1) * 255).astype(np.uint8)


def random_resized_crop(image: np.ndarray, out: int, scale: tuple[float, float] = (0.25, 1.0)) -> np.ndarray:
    """Inception-style crop (random area and aspect ratio), resized to out x out by nearest neighbour."""
    h, w, _ = image.shape
    area = h * w * random.uniform(*scale)
    aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
    crop_h, crop_w = min(h, round(math.sqrt(area / aspect))), min(w, round(math.sqrt(area * aspect)))
    top, left = random.randint(0, h - crop_h), random.randint(0, w - crop_w)
    rows = top + (np.arange(out) * crop_h // out)
    cols = left + (np.arange(out) * crop_w // out)
    return image[rows[:, None], cols[None, :]]


def color_jitter(image: np.ndarray, strength: float = 0.4) -> np.ndarray:
    """Brightness, contrast and saturation jitter on a float HWC image in [0, 1]."""
    image = image * random.uniform(1 - strength, 1 + strength)
    mean = image.mean()
    image = (image - mean) * random.uniform(1 - strength, 1 + strength) + mean
    gray = (image @ np.array([0.299, 0.587, 0.114], np.float32))[..., None]
    image = (image - gray) * random.uniform(1 - strength, 1 + strength) + gray
    return np.clip(image, 0, 1)


class CompressedImageShard(torch.utils.data.Dataset):
    """An in-memory shard of zlib-compressed uint8 images with labels (as a tar shard holds encoded images); each
    item is decoded and augmented on access: random resized crop, horizontal flip, colour jitter, normalisation."""

    MEAN = np.array([0.485, 0.456, 0.406], np.float32)
    STD = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, images: int, side: int, crop: int, classes: int) -> None:
        rng = np.random.default_rng(0)
        self.side, self.crop = side, crop
        self.encoded = [zlib.compress(smooth_image(side, rng).tobytes()) for _ in range(images)]
        self.labels = rng.integers(classes, size=images).tolist()

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = np.frombuffer(zlib.decompress(self.encoded[index]), np.uint8).reshape(self.side, self.side, 3)
        image = random_resized_crop(image, self.crop)
        if random.random() < 0.5:
            image = image[:, ::-1]
        image = (color_jitter(image.astype(np.float32) / 255) - self.MEAN) / self.STD
        return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))), self.labels[index]


def efficientnet_inline_decode(fixes: Fixes) -> Step:
    """An EfficientNet-B0-style classifier (MBConv stages with squeeze-and-excitation, 100 classes; 128 crops of
    128x128 a step from 176x176 images; channels_last, bf16 autocast, fused AdamW, label smoothing) fed by a
    DataLoader with num_workers=0: each sample is zlib-decompressed, randomly crop-resized, flipped, colour
    jittered and normalised in numpy inside the training process, 128 times a step, the GPU waiting. Fix:
    num_workers=6 with persistent_workers=True, so the batches are prepared while the GPU trains."""
    classes, side, crop, batch = 100, pick(176, 40), pick(128, 32), pick(128, 4)
    # (a quarter of the widths on the CPU, where depthwise convolutions run group by group)
    model = efficientnet_b0(classes, pick(100, 25)).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    dataset = CompressedImageShard(pick(256, 16), side, crop, classes)
    workers = pick(6, 2) if "data_loader" in fixes else 0
    sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=1 << 30)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers,
                                         persistent_workers=workers > 0, pin_memory=on_gpu(), drop_last=True)
    batches = iter(loader)

    def step() -> float:
        images, labels = next(batches)
        images = images.to(dev(), non_blocking=True).contiguous(memory_format=torch.channels_last)
        with autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels.to(dev(), non_blocking=True), label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------ gc_pauses

PAD, CLS, QUERY_MARK, DOC_MARK, MASK = 0, 1, 2, 3, 4


class ColBERT(nn.Module):
    """ColBERT: a BERT-style encoder shared by queries and passages (learned positions, pre-norm blocks, SDPA under
    the passage padding mask), every token projected to 128 dimensions and L2-normalised; a query's score for a
    passage is the sum over its tokens of the best-matching passage token's similarity (MaxSim)."""

    def __init__(self, vocabulary: int, width: int, heads: int, depth: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width, padding_idx=PAD)
        self.position = nn.Parameter(0.02 * torch.randn(length, width))
        self.blocks = nn.ModuleList(TransformerBlock(width, heads, 4 * width) for _ in range(depth))
        self.norm, self.project = nn.LayerNorm(width), nn.Linear(width, 128, bias=False)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        keep = (ids != PAD)[:, None, None, :]
        x = self.embed(ids) + self.position[:ids.shape[1]]
        for block in self.blocks:
            x = block(x, keep)
        return F.normalize(self.project(self.norm(x)), dim=-1)

    def forward(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        q, p = self.encode(queries), self.encode(passages)
        similarity = torch.einsum("asd,btd->abst", q, p)
        similarity = similarity.masked_fill((passages == PAD)[None, :, None, :], -1e4)
        return similarity.amax(-1).sum(-1)


def tokenised_corpus(texts: int, shortest: int, longest: int, vocabulary: int,
                     rng: np.random.Generator) -> list[list[int]]:
    """Texts as Python lists of word-piece ids, as a tokeniser's output is kept in memory."""
    lengths = rng.integers(shortest, longest, size=texts)
    flat = rng.integers(MASK + 1, vocabulary, size=int(lengths.sum())).tolist()
    ends = np.cumsum(lengths).tolist()
    return [flat[start:end] for start, end in zip([0] + ends[:-1], ends)]


def padded(rows: list[list[int]], length: int, marker: int, fill: int) -> torch.Tensor:
    """[CLS] marker tokens..., truncated to `length` and filled with `fill`."""
    rows = [[CLS, marker, *row[:length - 2]] for row in rows]
    return torch.tensor([row + [fill] * (length - len(row)) for row in rows])


class HostMemoryMonitor:
    """A step-end callback left from a host-memory leak hunt: a full garbage collection (so only live objects are
    counted), then the resident set size."""

    def __init__(self, collect: bool) -> None:
        self.collect = collect
        self.resident_mb: list[float] = []

    def on_step_end(self) -> None:
        if self.collect:
            gc.collect()
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        self.resident_mb.append(pages * resource.getpagesize() / 2 ** 20)


def colbert_gc_memory_monitor(fixes: Fixes) -> Step:
    """ColBERT trained on (query, positive, hard negative) triples (a BERT-base-sized encoder: 12 blocks of width
    768, 12 heads, a 30k word-piece vocabulary; 64 queries of 32 tokens, padded with [MASK], and 128 passages of up
    to 180 tokens a step, every query scored against every passage; bf16 autocast, fused AdamW) over a corpus held
    as Python lists of token ids (20k passages, 10k queries, 2.5M list entries). A HostMemoryMonitor callback from
    a leak hunt runs gc.collect() after every step before reading the resident set size: a full collection walks
    the corpus and the rest of the interpreter's heap each step, the GPU idle. Profiled with stacks. Fix: read the
    resident set size without collecting (the automatic collector runs as usual)."""
    vocabulary, width, heads, depth = pick(30_000, 500), pick(768, 32), pick(12, 2), pick(12, 1)
    queries_n, passage_len, query_len, triples_n = pick(64, 2), pick(180, 24), pick(32, 8), pick(50_000, 100)
    rng = np.random.default_rng(0)
    passages = tokenised_corpus(pick(20_000, 200), 60, 180, vocabulary, rng)
    queries = tokenised_corpus(pick(10_000, 100), 6, 20, vocabulary, rng)
    triples = list(zip(rng.integers(len(queries), size=triples_n).tolist(),
                       rng.integers(len(passages), size=triples_n).tolist(),
                       rng.integers(len(passages), size=triples_n).tolist()))
    model = ColBERT(vocabulary, width, heads, depth, max(query_len, passage_len)).to(dev())
    opt = fused_adamw(model.parameters())
    monitor = HostMemoryMonitor(collect="gc_pauses" not in fixes)
    # each query's positive sits at 2 * i among the batch's passages, its hard negative at 2 * i + 1
    positives = torch.arange(queries_n, device=dev()) * 2

    def step() -> float:
        batch = random.sample(triples, queries_n)
        query_ids = padded([queries[q] for q, _, _ in batch], query_len, QUERY_MARK, MASK).to(dev())
        passage_ids = padded([passages[p] for _, pos, neg in batch for p in (pos, neg)], passage_len, DOC_MARK,
                             PAD).to(dev())
        with autocast():
            scores = model(query_ids, passage_ids)
        loss = F.cross_entropy(scores.float(), positives)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        monitor.on_step_end()
        return value
    return step


# -------------------------------------------------------------------------------------- checkpoint_in_step

def relu_mlp(sizes: list[int], last_relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (cin, cout) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(cin, cout))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM: a bottom MLP on the dense features, one sum-pooled EmbeddingBag per categorical feature, the pairwise
    dot products of all those vectors (upper triangle), and a top MLP on them and the dense vector."""

    def __init__(self, dense: int, table_sizes: list[int], dim: int, bottom: list[int], top: list[int]) -> None:
        super().__init__()
        self.bottom = relu_mlp([dense, *bottom, dim])
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for rows in table_sizes)
        vectors = len(table_sizes) + 1
        self.register_buffer("upper", torch.triu_indices(vectors, vectors, 1), persistent=False)
        self.top = relu_mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, bags: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x] + [table(ids) for table, ids in zip(self.tables, bags)], 1)
        dots = vectors @ vectors.transpose(1, 2)
        return self.top(torch.cat([x, dots[:, self.upper[0], self.upper[1]]], 1)).squeeze(1)


def save_atomically(state: dict, path: Path) -> None:
    """torch.save to a temporary name, then rename, so a preempted save never leaves half a checkpoint."""
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def dlrm_checkpoint_every_step(fixes: Fixes) -> Step:
    """DLRM click-through training (13 dense features, 26 categorical ones in EmbeddingBags of 64 dimensions with
    100k rows in all, some multi-hot; a bottom MLP 512-256-64 and a top MLP 1024-1024-512-256; 8192 impressions
    a step; bf16 autocast, fused AdamW) on preemptible machines, so after every step it saves model and optimizer
    (some 8.8M parameters and their two Adam moments, ~105 MB) with torch.save to a temporary file renamed into
    place: the state copied to the host and written each step while the GPU waits. Fix: save every 1000 steps."""
    table_sizes = [pick(rows, max(4, rows // 500)) for rows in
                   (24_000, 18_000, 14_000, 10_000, 8_000, 6_000, 5_000, 4_000, 3_000, 2_500, 2_000, 1_500, 1_000,
                    800, 600, 500, 400, 300, 200, 150, 100, 80, 60, 40, 20, 4)]
    bag_sizes = [3 if i % 5 == 0 else 1 for i in range(len(table_sizes))]
    dim, batch, pool = pick(64, 8), pick(8192, 16), pick(65_536, 64)
    model = DLRM(13, table_sizes, dim, [pick(512, 16), pick(256, 16)],
                 [pick(1024, 16), pick(1024, 16), pick(512, 16), pick(256, 16)]).to(dev())
    opt = fused_adamw(model.parameters())
    dense = torch.randn(pool, 13, device=dev()).exp()
    # popularity-skewed ids: a few rows of every table take most of the traffic
    bags = [(torch.rand(pool, bag, device=dev()) ** 3 * rows).long() for rows, bag in zip(table_sizes, bag_sizes)]
    clicks = (torch.rand(pool, device=dev()) < 0.25).float()
    checkpoints = tempfile.TemporaryDirectory(prefix="dlrm_checkpoints_")
    save_every = 1000 if "checkpoint_in_step" in fixes else 1
    steps_done = itertools.count(1)

    def step() -> float:
        rows = torch.randint(pool, (batch,), device=dev())
        with autocast():
            logits = model(dense[rows].log1p(), [ids[rows] for ids in bags])
        loss = F.binary_cross_entropy_with_logits(logits.float(), clicks[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if next(steps_done) % save_every == 0:
            save_atomically({"model": model.state_dict(), "optimizer": opt.state_dict()},
                            Path(checkpoints.name) / "latest.pt")
        return loss.item()
    return step


# ---------------------------------------------------------------------------------- precision + optimizer_impl

class Bottleneck(nn.Module):
    """The hourglass network's pre-activation residual module: BN-ReLU-1x1 to half width, BN-ReLU-3x3, BN-ReLU-1x1
    back, plus the input (through a 1x1 convolution where the widths differ)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        mid = cout // 2
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(True), nn.Conv2d(cin, mid, 1),
                                  nn.BatchNorm2d(mid), nn.ReLU(True), nn.Conv2d(mid, mid, 3, padding=1),
                                  nn.BatchNorm2d(mid), nn.ReLU(True), nn.Conv2d(mid, cout, 1))
        self.skip = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.skip(x)


class Hourglass(nn.Module):
    """One hourglass: a residual branch at this resolution, and max-pooled down through a smaller hourglass (a
    residual module at the bottom) and nearest-upsampled back."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.here, self.down, self.up = Bottleneck(width, width), Bottleneck(width, width), Bottleneck(width, width)
        self.inner = Hourglass(depth - 1, width) if depth > 1 else Bottleneck(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = self.up(self.inner(self.down(F.max_pool2d(x, 2))))
        return self.here(x) + F.interpolate(low, scale_factor=2, mode="nearest")


class StackedHourglass(nn.Module):
    """Newell et al.'s stacked hourglass network: a stride-4 stem, then hourglasses each predicting joint heatmaps
    (intermediate supervision), their features and heatmaps merged back into the next stack's input."""

    def __init__(self, stacks: int, depth: int, width: int, joints: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU(True), Bottleneck(64, 128),
                                  nn.MaxPool2d(2), Bottleneck(128, 128), Bottleneck(128, width))
        self.hourglasses = nn.ModuleList(Hourglass(depth, width) for _ in range(stacks))
        self.features = nn.ModuleList(nn.Sequential(Bottleneck(width, width), nn.Conv2d(width, width, 1),
                                                    nn.BatchNorm2d(width), nn.ReLU(True)) for _ in range(stacks))
        self.heatmaps = nn.ModuleList(nn.Conv2d(width, joints, 1) for _ in range(stacks))
        self.merge_features = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(stacks - 1))
        self.merge_heatmaps = nn.ModuleList(nn.Conv2d(joints, width, 1) for _ in range(stacks - 1))

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        x, outputs = self.stem(images), []
        for i, hourglass in enumerate(self.hourglasses):
            features = self.features[i](hourglass(x))
            outputs.append(self.heatmaps[i](features))
            if i < len(self.merge_features):
                x = x + self.merge_features[i](features) + self.merge_heatmaps[i](outputs[-1])
        return outputs


def joint_heatmaps(joints: torch.Tensor, side: int, sigma: float = 1.5) -> torch.Tensor:
    """Gaussian target heatmaps [N, J, side, side] around joint positions [N, J, 2] (in heatmap pixels)."""
    grid = torch.arange(side, device=joints.device, dtype=torch.float32)
    dy = (grid[:, None] - joints[..., 0, None, None]) ** 2
    dx = (grid[None, :] - joints[..., 1, None, None]) ** 2
    return torch.exp(-(dy + dx) / (2 * sigma ** 2))


def hourglass_fp32_rmsprop_loop(fixes: Fixes) -> Step:
    """A two-stack hourglass network for human pose (width 256, hourglasses of depth 4, 16 joints; 32 crops of
    256x256 a step, heatmaps of 64x64 with intermediate supervision, MSE; channels_last) trained as in the paper's
    reference code: in full fp32 with torch.backends.cudnn.allow_tf32 = False so the heatmaps match the reference
    numbers (the larger cost: every convolution in true fp32; fix: bf16 autocast), and with RMSprop(lr 2.5e-4),
    here foreach=False, left from a memory experiment: some 400 parameter tensors, each its own handful of kernels
    launched from Python after the loss is read for the progress bar, the GPU waiting for them (fix: the default
    foreach RMSprop)."""
    stacks, depth, width, joints = 2, pick(4, 2), pick(256, 16), pick(16, 4)
    batch, side = pick(32, 2), pick(256, 32)
    torch.backends.cudnn.benchmark = True
    full_fp32 = "precision" not in fixes
    # the reference numbers were produced in full fp32: cuDNN off TF32 and no autocast to match them
    torch.backends.cudnn.allow_tf32 = not full_fp32
    model = StackedHourglass(stacks, depth, width, joints).to(dev(), memory_format=torch.channels_last)
    opt = torch.optim.RMSprop(model.parameters(), lr=2.5e-4, foreach="optimizer_impl" in fixes)
    pool = pick(256, 4)
    images = torch.randn(pool, 3, side, side, device=dev()).contiguous(memory_format=torch.channels_last)
    targets = joint_heatmaps(torch.rand(pool, joints, 2, device=dev()) * (side // 4), side // 4)

    def step() -> float:
        picked = torch.randint(pool, (batch,), device=dev())
        with autocast(enabled=not full_fp32):
            outputs = model(images[picked])
        target = targets[picked]
        loss = sum(F.mse_loss(heatmaps.float(), target) for heatmaps in outputs)
        loss.backward()
        value = loss.item()  # the progress bar's running loss, read before the update as the reference loop does
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value
    return step


# ---------------------------------------------------------------------- eager_attention + activation_checkpointing

class RegisterViT(nn.Module):
    """A ViT with registers (Darcet et al.): patch tokens and a class token with learned positions, plus a few
    learned register tokens without positions that every block attends to, discarded at the output."""

    def __init__(self, image: int, patch: int, width: int, heads: int, depth: int, registers: int, classes: int,
                 eager: bool, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.patch = nn.Conv2d(3, width, patch, patch)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, width))
        self.registers = nn.Parameter(0.02 * torch.randn(1, registers, width))
        self.position = nn.Parameter(0.02 * torch.randn(1, 1 + (image // patch) ** 2, width))
        self.blocks = nn.ModuleList(TransformerBlock(width, heads, 4 * width, eager) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.position
        x = torch.cat([x[:, :1], self.registers.expand(len(x), -1, -1), x[:, 1:]], 1)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x[:, 0]))


def vit_registers_eager_checkpoint(fixes: Fixes) -> Step:
    """A ViT-S/8 with 4 registers classifying 224x224 images (12 blocks of width 384, 6 heads, 789 tokens; 64
    images a step, 1000 classes, label smoothing; bf16 autocast, fused AdamW). Its attention is written out to
    look at the registers' attention maps: q @ k^T scaled, a softmax in fp32, then @ v, materialising a
    [64, 6, 789, 789] score tensor per block in two precisions (the larger cost; fix:
    F.scaled_dot_product_attention);
    and since that ran out of memory on a smaller card every block is wrapped in torch.utils.checkpoint, though
    on this GPU the activations fit several times over, so each block's forward runs twice (fix: call the blocks
    directly)."""
    image, patch, width, heads, depth = pick(224, 32), 8, pick(384, 32), pick(6, 2), pick(12, 2)
    batch, classes, pool = pick(64, 2), 1000, pick(256, 4)
    model = RegisterViT(image, patch, width, heads, depth, 4, classes, eager="eager_attention" not in fixes,
                        checkpointed="activation_checkpointing" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    images = torch.randn(pool, 3, image, image, device=dev())
    labels = torch.randint(classes, (pool,), device=dev())

    def step() -> None:
        picked = torch.randint(pool, (batch,), device=dev())
        with autocast():
            logits = model(images[picked])
        F.cross_entropy(logits.float(), labels[picked], label_smoothing=0.1).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ----------------------------------------------------------------------------- pageable_copy + allocator_churn

def conv_bn(cin: int, cout: int, kernel: int = 3, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, padding=dilation * (kernel // 2), dilation=dilation,
                                   bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1, True))


class DilatedResidual(nn.Module):
    """SalsaNext's residual block: 3x3 convolutions with dilations 1, 2, 2 in a chain, their outputs concatenated
    and fused by a 1x1 convolution, plus a 1x1 shortcut."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.shortcut = nn.Conv2d(cin, cout, 1)
        self.a, self.b, self.c = conv_bn(cin, cout), conv_bn(cout, cout, dilation=2), conv_bn(cout, cout, dilation=2)
        self.fuse = conv_bn(3 * cout, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        b = self.b(a)
        c = self.c(b)
        return self.shortcut(x) + self.fuse(torch.cat([a, b, c], 1))


class RangeImageSegmenter(nn.Module):
    """A SalsaNext-style encoder-decoder over spherical range images: dilated residual blocks average-pooled down
    four times, pixel-shuffle upsampling with skip connections back up, a 1x1 head per class."""

    def __init__(self, channels: int, widths: list[int], classes: int) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(DilatedResidual(cin, cout) for cin, cout in zip([channels] + widths[:-1],
                                                                                      widths))
        self.decoder = nn.ModuleList(nn.Sequential(conv_bn(widths[i + 1] // 4 + widths[i], widths[i]),
                                                   conv_bn(widths[i], widths[i]))
                                     for i in reversed(range(len(widths) - 1)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, scan: torch.Tensor) -> torch.Tensor:
        skips, x = [], scan
        for i, block in enumerate(self.encoder):
            x = block(x if i == 0 else F.avg_pool2d(x, 2))
            skips.append(x)
        for stage, skip in zip(self.decoder, reversed(skips[:-1])):
            x = stage(torch.cat([F.pixel_shuffle(x, 2), skip], 1))
        return self.head(x)


def rangenet_pageable_empty_cache(fixes: Fixes) -> Step:
    """A SalsaNext-style LiDAR semantic segmenter on 64x2048 range images (x, y, z, range, remission; widths
    32-256 over five levels; 20 classes with 'unlabelled' ignored, class-weighted cross-entropy; 16 scans a step
    as two accumulated micro-batches of 8; channels_last, bf16 autocast, fused AdamW). The loader hands over each
    micro-batch as float64 numpy scans (the projection was done in numpy's default precision) and int64 labels in
    ordinary host memory, copied with `.to('cuda')`: ~100 MB a step through the pageable staging path, the host
    blocked on it (fix: the loader pins its batches and the step copies with non_blocking=True). And after each
    micro-batch's backward it calls torch.cuda.empty_cache() 'to keep the peak flat', so the release waits for the
    device and every activation block of the next pass is cudaMalloc'ed again (fix: drop the call)."""
    channels, classes, micro_batch, micro_batches = 5, 20, pick(8, 2), 2
    height, width_px = pick(64, 16), pick(2048, 64)
    widths = [pick(32, 8), pick(64, 8), pick(128, 16), pick(256, 16), pick(256, 16)]
    torch.backends.cudnn.benchmark = True
    model = RangeImageSegmenter(channels, widths, classes).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    pin = "pageable_copy" in fixes
    rng = np.random.default_rng(0)
    loaded = []
    for _ in range(2 * micro_batches):
        scans = torch.from_numpy(rng.standard_normal((micro_batch, channels, height, width_px)))
        labels = torch.from_numpy(rng.integers(classes, size=(micro_batch, height, width_px)))
        loaded.append((pinned(scans), pinned(labels)) if pin else (scans, labels))
    batches = itertools.cycle(loaded)
    frequency = torch.tensor(rng.dirichlet(np.ones(classes)), dtype=torch.float32)
    class_weights = (1 / (frequency + 1e-3)).to(dev())
    class_weights[0] = 0.0

    def step() -> float:
        total = torch.zeros((), device=dev())
        for _ in range(micro_batches):
            scans, labels = next(batches)
            scans, labels = scans.to(dev(), non_blocking=pin), labels.to(dev(), non_blocking=pin)
            with autocast():
                logits = model(scans.float().contiguous(memory_format=torch.channels_last))
            loss = F.cross_entropy(logits.float(), labels, weight=class_weights) / micro_batches
            loss.backward()
            total += loss.detach()
            del logits, loss
            if "allocator_churn" not in fixes:
                release_cached_memory()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()
    return step


# --------------------------------------------------------------------------------------------------- healthy

class TopKSparseAutoencoder(nn.Module):
    """A top-k sparse autoencoder (Gao et al.): a pre-bias subtracted, a linear encoder, only the k largest latents
    kept (ReLU'd), a linear decoder with unit-norm columns, the pre-bias added back."""

    def __init__(self, width: int, latents: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.pre_bias = nn.Parameter(torch.zeros(width))
        self.encoder = nn.Linear(width, latents)
        self.decoder = nn.Linear(latents, width, bias=False)
        with torch.no_grad():
            self.decoder.weight.copy_(self.encoder.weight.t())
            self.normalise_decoder()

    @torch.no_grad()
    def normalise_decoder(self) -> None:
        self.decoder.weight.div_(self.decoder.weight.norm(dim=0, keepdim=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.encoder(x - self.pre_bias)
        top = pre.topk(self.k, -1)
        codes = torch.zeros_like(pre).scatter_(-1, top.indices, F.relu(top.values))
        return self.decoder(codes) + self.pre_bias


def synthetic_activations(rows: int, width: int, features: int, active: int) -> torch.Tensor:
    """bf16 'residual-stream activations': sparse non-negative combinations of random unit feature directions."""
    directions = F.normalize(torch.randn(features, width, device=dev()), dim=-1)
    out = torch.empty(rows, width, device=dev(), dtype=BF16)
    for start in range(0, rows, 8192):
        n = min(8192, rows - start)
        ids = torch.randint(features, (n, active), device=dev())
        weights = torch.rand(n, active, device=dev()) * 4
        out[start:start + n] = F.embedding_bag(ids, directions, per_sample_weights=weights, mode="sum").to(BF16)
    return out


def healthy_topk_sae_bf16(fixes: Fixes) -> Step:
    """A top-k sparse autoencoder on a language model's residual-stream activations (width 2048, 32768 latents,
    k = 64; 4096 activation vectors a step, normalised MSE; the decoder's columns renormalised after each step)
    with bf16 autocast and fused AdamW: four 4096x2048x32768 GEMMs forward and backward dominate; nothing
    planted."""
    width, latents, k, batch = pick(2048, 32), pick(32_768, 256), pick(64, 8), pick(4096, 16)
    rows = pick(131_072, 512)
    activations = synthetic_activations(rows, width, pick(65_536, 512), 32)
    sae = TopKSparseAutoencoder(width, latents, k).to(dev())
    opt = fused_adamw(sae.parameters())

    def step() -> float:
        x = activations[torch.randint(rows, (batch,), device=dev())].float()
        with autocast():
            reconstruction = sae(x)
        loss = ((reconstruction.float() - x) ** 2).sum(-1).mean() / ((x - x.mean(0)) ** 2).sum(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sae.normalise_decoder()
        return loss.item()
    return step


class ResidualBlock(nn.Module):
    """EDSR's residual block: conv-ReLU-conv without batch norm, scaled by 0.1 before the skip."""

    def __init__(self, width: int, scale: float = 0.1) -> None:
        super().__init__()
        self.scale = scale
        self.body = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(True),
                                  nn.Conv2d(width, width, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.body(x)


class EDSR(nn.Module):
    """EDSR: a head convolution, residual blocks and a global skip, a pixel-shuffle upsampler and a tail."""

    def __init__(self, width: int, blocks: int, upscale: int) -> None:
        super().__init__()
        self.head = nn.Conv2d(3, width, 3, padding=1)
        self.body = nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)), nn.Conv2d(width, width, 3, padding=1))
        self.upsample = nn.Sequential(nn.Conv2d(width, width * upscale ** 2, 3, padding=1), nn.PixelShuffle(upscale))
        self.tail = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, low: torch.Tensor) -> torch.Tensor:
        x = self.head(low)
        return self.tail(self.upsample(x + self.body(x)))


def healthy_edsr_channels_last(fixes: Fixes) -> Step:
    """EDSR x2 super-resolution (16 residual blocks of 128 channels; 32 low-resolution patches of 96x96 a step,
    their 192x192 originals as targets, L1 loss) in channels_last with bf16 autocast, cuDNN autotuning and fused
    AdamW: 3x3 convolutions over 300k pixels of 128 channels dominate; nothing planted."""
    width, blocks, upscale, batch, side = pick(128, 8), pick(16, 2), 2, pick(32, 2), pick(96, 16)
    torch.backends.cudnn.benchmark = True
    model = EDSR(width, blocks, upscale).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    pool = pick(256, 4)
    # smooth random images with a little fine detail, as stand-ins for the high-resolution photographs
    coarse = torch.rand(pool, 3, side * upscale // 8, side * upscale // 8, device=dev())
    high = F.interpolate(coarse, scale_factor=8, mode="bicubic") + 0.03 * torch.randn(pool, 3, side * upscale,
                                                                                      side * upscale, device=dev())
    high = high.clamp(0, 1).contiguous(memory_format=torch.channels_last)
    low = F.interpolate(high, scale_factor=1 / upscale, mode="bicubic", antialias=True)
    low = low.contiguous(memory_format=torch.channels_last)
    mean = high.mean((0, 2, 3), keepdim=True)

    def step() -> float:
        picked = torch.randint(pool, (batch,), device=dev())
        with autocast():
            restored = model(low[picked] - mean) + mean
        loss = F.l1_loss(restored.float(), high[picked])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


PROGRAMS = {
    "ft_transformer_norm_items": ["host_syncs"],
    "patchtst_numpy_window_sampler": ["host_work"],
    "nbeats_eager_block_stack": ["launch_bound"],
    "efficientnet_inline_decode": ["data_loader"],
    "colbert_gc_memory_monitor": ["gc_pauses"],
    "dlrm_checkpoint_every_step": ["checkpoint_in_step"],
    "hourglass_fp32_rmsprop_loop": ["precision", "optimizer_impl"],
    "vit_registers_eager_checkpoint": ["eager_attention", "activation_checkpointing"],
    "rangenet_pageable_empty_cache": ["pageable_copy", "allocator_churn"],
    "healthy_topk_sae_bf16": [],
    "healthy_edsr_channels_last": [],
}
WITH_STACK = {"colbert_gc_memory_monitor", "patchtst_numpy_window_sampler"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set_fixes(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
