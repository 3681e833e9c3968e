"""A sixth held-out check of the advisor: ten programs of other architectures than bench/planted/corpus.py's and
heldout.py's to heldout5.py's (a Transformer-XL with segment memory, DeepFM with sampled negatives, a Tacotron-style
decoder, a rational-quadratic neural spline flow, a 3-D U-Net, a RetinaNet-style detector trained with LAMB, a
WGAN-GP, QANet, a Performer on protein sequences and an OSTrack-style one-stream tracker), six with one planted
problem, three with two at once and one healthy, written without reading the advisor's rules, with the same
output format (OUT/NAME/trace + planted.json), scored the same way:

    python bench/planted/heldout6.py OUT                  # on a GPU
    python bench/planted/heldout6.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout6.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT
    python bench/planted/fix_timelines.py heldout6 OUT2 NAME [NAME ...]   # a program as written and fixed

Each program's `build(fixes)` returns one training step; each problem sits behind `if CAUSE not in fixes` (or a
choice made from `fixes`) and its fix is what a user would change. A cause's planted cost is the step as written
less the step with that cause alone fixed; fixed_step_ms has every cause fixed (medians of 7 steps, each between
two synchronizes, profiler off). The programs whose problem is on the host read their loss with `.item()` at the
end of the step, as a loop that logs every step does, so their traces serialise as their timing. Without a GPU
the CUDA-only parts (graph capture, pinned memory, synchronize, torch.cuda.empty_cache) are skipped, so in smoke
mode a fix may time the same as its problem.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from harness import (BF16, autocast, dev, device_synchronize, fused_adamw, heads_of, merge_heads, on_gpu, pick, pinned,
                     release_cached_memory, run_set_fixes)

Fixes = frozenset[str]
Step = Callable[[], object]


# ------------------------------------------------------------------------------------------------ host_syncs

class XLLayer(nn.Module):
    """A pre-norm Transformer-XL layer: queries from the segment, keys and values from [memory; segment] (causal,
    the memory fully visible), SDPA; a GELU MLP. Rows whose document ended clear their memory: as written the rows
    are found with torch.nonzero and zeroed by index_fill (a host read per layer), fixed by a multiply."""

    def __init__(self, width: int, heads: int, sync_reset: bool) -> None:
        super().__init__()
        self.heads, self.sync_reset = heads, sync_reset
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.kv, self.proj = nn.Linear(width, width), nn.Linear(width, 2 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
        if self.sync_reset:
            rows = torch.nonzero(reset).flatten()
            if rows.numel():
                memory = memory.index_fill(0, rows, 0.0)
        else:
            memory = memory * (~reset).to(memory.dtype)[:, None, None]
        h = self.norm1(x)
        context = torch.cat([memory.to(h.dtype), h], 1)
        k, v = self.kv(context).chunk(2, -1)
        s, m = x.shape[1], memory.shape[1]
        visible = torch.ones(s, m + s, dtype=torch.bool, device=x.device).tril(m)
        attended = F.scaled_dot_product_attention(heads_of(self.q(h), self.heads), heads_of(k, self.heads),
                                                  heads_of(v, self.heads), attn_mask=visible)
        x = x + self.proj(merge_heads(attended))
        return x + self.mlp(self.norm2(x))


class TransformerXL(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int, sync_reset: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(XLLayer(width, heads, sync_reset) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor, memories: list[torch.Tensor],
                reset: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x, new_memories = self.embed(ids), []
        for layer, memory in zip(self.layers, memories):
            new_memories.append(x.detach().float())
            x = layer(x, memory, reset)
        return self.norm(x) @ self.embed.weight.t(), new_memories


def transformer_xl_memory_reset_nonzero(fixes: Fixes) -> Step:
    """A Transformer-XL language model (8 layers of width 512, 8 heads, a 32k vocabulary; 32 streams, four
    consecutive 128-token segments a step, each attending to the previous segment's cached hidden states; bf16
    autocast, fused AdamW) over packed documents. Where a document ends, its stream's memory is cleared: each layer
    finds those rows with `torch.nonzero(reset)` and `if rows.numel(): memory.index_fill(...)`, and the loss keeps
    the real tokens by boolean indexing `logits[targets != pad]`: some 36 device-to-host reads a step, each draining
    the GPU between small kernels. Fix: multiply the memory by the keep mask and use cross_entropy's ignore_index."""
    vocab, width, heads, depth = pick(32_000, 300), pick(512, 32), pick(8, 2), pick(8, 2)
    streams, length, segments, pad = pick(32, 2), pick(128, 16), 4, 0
    sync = "host_syncs" not in fixes
    model = TransformerXL(vocab, width, heads, depth, sync_reset=sync).to(dev())
    opt = fused_adamw(model.parameters())
    tokens = torch.randint(1, vocab, (segments, streams, length + 1), device=dev())
    tokens[..., -8:] = torch.where(torch.rand(segments, streams, 1, device=dev()) < 0.3, pad, tokens[..., -8:])
    resets = torch.rand(segments, streams, device=dev()) < 0.25

    def step() -> None:
        memories = [torch.zeros(streams, length, width, device=dev()) for _ in range(depth)]
        total = 0.0
        for s in range(segments):
            inputs, targets = tokens[s, :, :-1], tokens[s, :, 1:]
            with autocast():
                logits, memories = model(inputs, memories, resets[s])
            if sync:
                keep = targets != pad
                total = total + F.cross_entropy(logits[keep].float(), targets[keep])
            else:
                total = total + F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=pad)
        (total / segments).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- host_work

class DeepFM(nn.Module):
    """DeepFM: one embedding table for every field (offsets per field), a first-order term, the factorisation
    machine's pairwise term, and an MLP over the concatenated embeddings."""

    def __init__(self, field_sizes: list[int], dim: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("offsets", torch.tensor(np.cumsum([0] + field_sizes[:-1])), persistent=False)
        self.embed = nn.Embedding(sum(field_sizes), dim)
        self.linear = nn.Embedding(sum(field_sizes), 1)
        self.mlp = nn.Sequential(nn.Linear(len(field_sizes) * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        ids = fields + self.offsets
        e = self.embed(ids)
        pairwise = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        return self.linear(ids).sum((1, 2)) + pairwise + self.mlp(e.flatten(1)).squeeze(1)


def numpy_negatives(users: np.ndarray, history: list[set[int]], cdf: np.ndarray, per_row: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Popularity-weighted negatives drawn row by row on the host, redrawn while they hit the user's history."""
    out = np.empty((len(users), per_row), np.int64)
    for i, user in enumerate(users.tolist()):
        seen = history[user]
        for j in range(per_row):
            item = int(np.searchsorted(cdf, rng.random()))
            while item in seen:
                item = int(np.searchsorted(cdf, rng.random()))
            out[i, j] = item
    return out


def deepfm_numpy_negatives(fixes: Fixes) -> Step:
    """DeepFM click-through training on implicit feedback (1M users, 200k items, 24 other categorical fields,
    16-d embeddings, an MLP of 3x1024; 4096 clicks a step, each with 4 sampled negatives; bf16 autocast, fused
    AdamW). The negatives are drawn on the host, row by row: a numpy searchsorted over the popularity CDF per
    negative, redrawn while it hits the user's history (a Python set), then copied over: 16k draws in Python a
    step, the GPU idle meanwhile. Fix: torch.multinomial over the popularity on the device (an occasional
    collision with the history is accepted, as most recommenders do)."""
    users_n, items_n, other, dim, hidden = pick(1_000_000, 1000), pick(200_000, 500), 24, 16, pick(1024, 32)
    batch, per_row = pick(4096, 16), 4
    rng = np.random.default_rng(0)
    popularity = rng.zipf(1.3, items_n).astype(np.float64)
    popularity /= popularity.sum()
    cdf = np.cumsum(popularity)
    cdf[-1] = 1.0
    history = [set(rng.integers(items_n, size=int(rng.integers(5, 30))).tolist()) for _ in range(pick(50_000, 200))]
    field_sizes = [users_n, items_n] + [pick(1000, 20)] * other
    model = DeepFM(field_sizes, dim, hidden).to(dev())
    opt = fused_adamw(model.parameters())
    item_popularity = torch.from_numpy(popularity).float().to(dev())
    context = torch.randint(field_sizes[-1], (batch, other), device=dev())

    def step() -> float:
        users = rng.integers(len(history), size=batch)
        clicked = torch.multinomial(item_popularity, batch, replacement=True)
        if "host_work" in fixes:
            negatives = torch.multinomial(item_popularity, batch * per_row, replacement=True).view(batch, per_row)
        else:
            negatives = torch.from_numpy(numpy_negatives(users, history, cdf, per_row, rng)).to(dev())
        user_ids = torch.from_numpy(users).to(dev()).repeat_interleave(per_row + 1)
        items = torch.cat([clicked[:, None], negatives], 1).flatten()
        fields = torch.cat([user_ids[:, None], items[:, None], context.repeat_interleave(per_row + 1, 0)], 1)
        labels = torch.zeros(batch, per_row + 1, device=dev())
        labels[:, 0] = 1.0
        with autocast():
            logits = model(fields)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

class LocationAttention(nn.Module):
    """Tacotron 2's location-sensitive attention: energies from the query, the encoder outputs and a convolution
    over the cumulative alignment."""

    def __init__(self, query: int, memory: int, dim: int) -> None:
        super().__init__()
        self.query, self.memory = nn.Linear(query, dim, bias=False), nn.Linear(memory, dim, bias=False)
        self.location = nn.Sequential(nn.Conv1d(1, 32, 31, padding=15, bias=False), nn.Conv1d(32, dim, 1))
        self.v = nn.Linear(dim, 1, bias=False)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, memory: torch.Tensor,
                cumulative: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        location = self.location(cumulative[:, None]).transpose(1, 2)
        energies = self.v(torch.tanh(self.query(q)[:, None] + keys + location)).squeeze(2)
        weights = energies.softmax(1)
        return torch.bmm(weights[:, None], memory).squeeze(1), weights


class TacotronDecoder(nn.Module):
    """Tacotron 2's autoregressive decoder, teacher-forced: a prenet on the previous frames, an attention LSTM
    cell, location-sensitive attention, a decoder LSTM cell and projections to `r` mel frames and a stop logit,
    one Python iteration per decoder step."""

    def __init__(self, mels: int, memory: int, width: int, r: int) -> None:
        super().__init__()
        self.mels, self.r, self.width = mels, r, width
        self.prenet = nn.Sequential(nn.Linear(mels * r, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.attention_rnn = nn.LSTMCell(256 + memory, width)
        self.attention = LocationAttention(width, memory, 128)
        self.decoder_rnn = nn.LSTMCell(width + memory, width)
        self.project = nn.Linear(width + memory, mels * r + 1)

    def forward(self, memory: torch.Tensor, mel: torch.Tensor) -> torch.Tensor:
        b, frames = mel.shape[0], mel.shape[1] // self.r
        previous = torch.cat([mel.new_zeros(b, 1, self.mels * self.r),
                              mel.reshape(b, frames, -1)[:, :-1]], 1)
        inputs = self.prenet(previous)
        keys = self.attention.memory(memory)
        h1 = c1 = h2 = c2 = memory.new_zeros(b, self.width)
        context, cumulative = memory.new_zeros(b, memory.shape[2]), memory.new_zeros(b, memory.shape[1])
        outputs = []
        for t in range(frames):
            h1, c1 = self.attention_rnn(torch.cat([inputs[:, t], context], 1), (h1, c1))
            context, weights = self.attention(h1, keys, memory, cumulative)
            cumulative = cumulative + weights
            h2, c2 = self.decoder_rnn(torch.cat([h1, context], 1), (h2, c2))
            outputs.append(self.project(torch.cat([h2, context], 1)))
        return torch.stack(outputs, 1)


def tacotron_decoder_frame_loop(fixes: Fixes) -> Step:
    """A Tacotron 2-style text-to-speech model (a character embedding and three 5-tap convolutions of 512 as the
    encoder; the autoregressive decoder with 1024-unit LSTM cells and location-sensitive attention, 2 frames of 80
    mels a step; 32 utterances of 120 characters and 300 frames, teacher-forced, fp32 throughout, fused Adam):
    the decoder is a Python loop of 150 iterations, each some 25 small kernels forward and twice that backward,
    each a few microseconds of GPU work behind its launch. Fix: the decoder's forward and backward captured once
    as CUDA graphs with torch.cuda.make_graphed_callables and replayed (the encoder and the optimizer stay
    eager)."""
    vocab, width, chars, frames, mels, r = 80, pick(1024, 32), pick(120, 12), pick(300, 8), 80, 2
    batch, channels = pick(32, 2), pick(512, 32)
    encoder = nn.Sequential(nn.Conv1d(channels, channels, 5, padding=2), nn.BatchNorm1d(channels), nn.ReLU(),
                            nn.Conv1d(channels, channels, 5, padding=2), nn.BatchNorm1d(channels), nn.ReLU(),
                            nn.Conv1d(channels, channels, 5, padding=2), nn.BatchNorm1d(channels), nn.ReLU())
    embed = nn.Embedding(vocab, channels)
    decoder = TacotronDecoder(mels, channels, width, r)
    model = nn.ModuleList([embed, encoder, decoder]).to(dev())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=on_gpu())
    text = torch.randint(vocab, (batch, chars), device=dev())
    mel = torch.randn(batch, frames, mels, device=dev())
    stop = torch.zeros(batch, frames // r, device=dev())
    stop[:, -1] = 1.0
    run_decoder: Callable[..., torch.Tensor] = decoder
    if "launch_bound" in fixes and on_gpu():
        sample = torch.randn(batch, chars, channels, device=dev(), requires_grad=True)
        run_decoder = torch.cuda.make_graphed_callables(decoder, (sample, mel))

    def step() -> None:
        memory = encoder(embed(text).transpose(1, 2)).transpose(1, 2)
        out = run_decoder(memory, mel)
        predicted = out[..., :-1].reshape(batch, frames, mels)
        loss = F.mse_loss(predicted, mel) + F.binary_cross_entropy_with_logits(out[..., -1], stop)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- precision

def rational_quadratic_spline(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor, d: torch.Tensor,
                              bound: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The monotonic rational-quadratic spline of Durkan et al. on [-bound, bound] (identity outside), bins from
    unnormalised widths/heights [N, D, K] and inner derivatives [N, D, K-1]: the outputs and log |dy/dx| [N]."""
    k, min_bin = w.shape[-1], 1e-3
    widths = min_bin + (1 - min_bin * k) * w.softmax(-1)
    heights = min_bin + (1 - min_bin * k) * h.softmax(-1)
    knots_x = F.pad(widths.cumsum(-1), (1, 0)) * 2 * bound - bound
    knots_y = F.pad(heights.cumsum(-1), (1, 0)) * 2 * bound - bound
    derivatives = F.pad(1e-3 + F.softplus(d), (1, 1), value=1.0)
    inside = (x > -bound) & (x < bound)
    xc = x.clamp(-bound + 1e-6, bound - 1e-6)
    index = ((xc[..., None] >= knots_x[..., 1:]).sum(-1, keepdim=True)).clamp(max=k - 1)
    x0, x1 = knots_x.gather(-1, index).squeeze(-1), knots_x.gather(-1, index + 1).squeeze(-1)
    y0, y1 = knots_y.gather(-1, index).squeeze(-1), knots_y.gather(-1, index + 1).squeeze(-1)
    d0, d1 = derivatives.gather(-1, index).squeeze(-1), derivatives.gather(-1, index + 1).squeeze(-1)
    slope = (y1 - y0) / (x1 - x0)
    theta = (xc - x0) / (x1 - x0)
    between = theta * (1 - theta)
    denominator = slope + (d0 + d1 - 2 * slope) * between
    y = y0 + (y1 - y0) * (slope * theta ** 2 + d0 * between) / denominator
    dydx = slope ** 2 * (d1 * theta ** 2 + 2 * slope * between + d0 * (1 - theta) ** 2) / denominator ** 2
    return torch.where(inside, y, x), torch.where(inside, dydx.log(), 0.0).sum(-1)


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int, blocks: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(d_in, width), nn.Linear(width, d_out)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                  nn.Linear(width, width)) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


class SplineCoupling(nn.Module):
    """A coupling layer: half the dimensions condition a residual MLP that gives the other half's spline bins.
    As written the conditioner runs in fp32 (the author turned autocast off for the whole flow 'for the spline');
    fixed, the conditioner runs under bf16 autocast and only the spline in fp32."""

    def __init__(self, dim: int, width: int, bins: int, blocks: int, mixed: bool) -> None:
        super().__init__()
        self.half, self.bins, self.mixed = dim // 2, bins, mixed
        self.conditioner = ResidualMLP(self.half, width, (dim - self.half) * (3 * bins - 1), blocks)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fixed, moved = x[:, :self.half], x[:, self.half:]
        with torch.autocast(x.device.type, dtype=BF16, enabled=self.mixed):
            params = self.conditioner(fixed)
        params = params.float().view(len(x), moved.shape[1], 3 * self.bins - 1)
        w, h, d = params.split([self.bins, self.bins, self.bins - 1], -1)
        y, logdet = rational_quadratic_spline(moved, w, h, d)
        return torch.cat([y, fixed], 1), logdet


def spline_flow_fp32_conditioners(fixes: Fixes) -> Step:
    """A rational-quadratic neural spline flow (Durkan et al.) on 64-d data: 8 coupling layers, each a residual
    MLP conditioner of width 1024 (3 blocks) giving 8 bins a dimension; 16384 samples a step, maximum likelihood
    under a standard normal base, fused AdamW. The whole flow runs with autocast disabled and TF32 off because
    'the spline needs fp32', so every conditioner matmul runs in full fp32. Fix: the conditioners under bf16
    autocast, their outputs cast to fp32 before the spline (which stays in fp32)."""
    dim, width, bins, blocks, layers = 64, pick(1024, 32), 8, pick(3, 1), pick(8, 2)
    batch = pick(16_384, 64)
    mixed = "precision" in fixes
    flow = nn.ModuleList(SplineCoupling(dim, width, bins, blocks, mixed) for _ in range(layers)).to(dev())
    opt = fused_adamw(flow.parameters())
    data = torch.randn(pick(65_536, 256), dim, device=dev()) @ torch.randn(dim, dim, device=dev()) * 0.3
    data = data.tanh() * 2

    def step() -> None:
        x = data[torch.randint(len(data), (batch,), device=dev())]
        total = torch.zeros(batch, device=dev())
        for coupling in flow:
            x, logdet = coupling(x)
            total = total + logdet
        log_prob = -0.5 * (x.pow(2).sum(1) + dim * math.log(2 * math.pi)) + total
        (-log_prob.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------------------------- pageable_copy

def double_conv3d(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(True),
                         nn.Conv3d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(True))


class UNet3D(nn.Module):
    """A 3-D U-Net: four levels of two 3x3x3 convolutions (GroupNorm, ReLU), max-pooled down, transposed
    convolutions up with skip connections, a 1x1x1 convolution to the classes."""

    def __init__(self, base: int, classes: int) -> None:
        super().__init__()
        widths = [base * 2 ** i for i in range(4)]
        self.down = nn.ModuleList(double_conv3d(cin, cout) for cin, cout in zip([1] + widths[:-1], widths))
        self.up = nn.ModuleList(nn.ConvTranspose3d(widths[i + 1], widths[i], 2, 2) for i in range(3))
        self.merge = nn.ModuleList(double_conv3d(2 * widths[i], widths[i]) for i in range(3))
        self.head = nn.Conv3d(base, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, level in enumerate(self.down):
            x = level(x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        for i in reversed(range(3)):
            x = self.merge[i](torch.cat([self.up[i](x), skips[i]], 1))
        return self.head(x)


def unet3d_pageable_onehot_labels(fixes: Fixes) -> Step:
    """A 3-D U-Net segmenting CT patches (widths 16-128, 4 patches of 128^3 voxels a step, 8 organ classes,
    channels-last-3d, bf16 autocast, fused AdamW, soft Dice plus cross-entropy) fed by a loader that returns each
    batch as fp32 volumes and fp32 one-hot label volumes (the Dice loss wants them) in ordinary host memory,
    copied with `.to('cuda')`: 34 MB of images and 268 MB of labels a step through the pageable staging path,
    the host blocked on it. Fix: the loader pins its batches (pin_memory=True) and the step copies them with
    non_blocking=True."""
    base, classes, batch, side = pick(16, 8), 8, pick(4, 1), pick(128, 16)
    model = UNet3D(base, classes).to(dev(), memory_format=torch.channels_last_3d)
    opt = fused_adamw(model.parameters())
    pin = "pageable_copy" in fixes
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        volume = torch.from_numpy(rng.standard_normal((batch, 1, side, side, side), np.float32))
        labels = torch.from_numpy(rng.integers(classes, size=(batch, side, side, side)))
        onehot = F.one_hot(labels, classes).permute(0, 4, 1, 2, 3).float().contiguous()
        batches.append([pinned(t) for t in (volume, onehot)] if pin else [volume, onehot])
    index = [0]

    def step() -> None:
        volume, onehot = batches[index[0] % len(batches)]
        index[0] += 1
        volume, onehot = volume.to(dev(), non_blocking=pin), onehot.to(dev(), non_blocking=pin)
        with autocast():
            logits = model(volume.contiguous(memory_format=torch.channels_last_3d))
        probabilities = logits.float().softmax(1)
        overlap = (probabilities * onehot).sum((2, 3, 4))
        dice = 1 - (2 * overlap + 1) / (probabilities.sum((2, 3, 4)) + onehot.sum((2, 3, 4)) + 1)
        loss = dice.mean() + F.cross_entropy(logits.float(), onehot.argmax(1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# -------------------------------------------------------------------------------------------- optimizer_impl

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(32, cout),
                                  nn.ReLU(True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.GroupNorm(32, cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(32, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class RetinaNet(nn.Module):
    """A RetinaNet-style detector: a ResNet-34 layout with GroupNorm (strides 8, 16, 32 tapped), an FPN of 256
    channels (P3-P5), and classification and box heads of four 3x3 convolutions (GroupNorm) shared over levels."""

    def __init__(self, base: int, fpn: int, anchors: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.GroupNorm(32, base), nn.ReLU(True),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], base
        for i, n in enumerate((3, 4, 6, 3)):
            cout = base * 2 ** i
            stages.append(nn.Sequential(*[BasicBlock(cin if j == 0 else cout, cout, 2 if i and j == 0 else 1)
                                          for j in range(n)]))
            cin = cout
        self.stages = nn.ModuleList(stages)
        self.lateral = nn.ModuleList(nn.Conv2d(base * 2 ** i, fpn, 1) for i in (1, 2, 3))
        self.smooth = nn.ModuleList(nn.Conv2d(fpn, fpn, 3, padding=1) for _ in range(3))

        def head(out: int) -> nn.Sequential:
            layers: list[nn.Module] = []
            for _ in range(4):
                layers += [nn.Conv2d(fpn, fpn, 3, padding=1), nn.GroupNorm(32, fpn), nn.ReLU(True)]
            return nn.Sequential(*layers, nn.Conv2d(fpn, out, 3, padding=1))
        self.cls_head, self.box_head = head(anchors * classes), head(anchors * 4)
        self.classes = classes

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, taps = self.stem(images), []
        for stage in self.stages:
            x = stage(x)
            taps.append(x)
        laterals = [conv(t) for conv, t in zip(self.lateral, taps[1:])]
        for i in (1, 0):
            laterals[i] = laterals[i] + F.interpolate(laterals[i + 1], scale_factor=2, mode="nearest")
        levels = [conv(p) for conv, p in zip(self.smooth, laterals)]
        cls = torch.cat([self.cls_head(p).permute(0, 2, 3, 1).flatten(1, 2) for p in levels], 1)
        box = torch.cat([self.box_head(p).permute(0, 2, 3, 1).flatten(1, 2) for p in levels], 1)
        return cls.unflatten(2, (-1, self.classes)).flatten(1, 2), box.unflatten(2, (-1, 4)).flatten(1, 2)


class LAMB:
    """LAMB (You et al.): Adam's update scaled per tensor by the trust ratio |w| / |update|. `per_tensor=True` is
    the reference loop over parameters in Python (some 18 kernels each); otherwise the same arithmetic over the
    whole list with torch._foreach_* ops and the trust ratios as one tensor."""

    def __init__(self, params: list[nn.Parameter], per_tensor: bool, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01) -> None:
        self.params, self.per_tensor, self.lr, self.betas, self.eps, self.wd = params, per_tensor, lr, betas, eps, \
            weight_decay
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        if self.per_tensor:
            for p, m, v in zip(self.params, self.m, self.v):
                g = p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (m / c1) / ((v / c2).sqrt() + self.eps) + self.wd * p
                w_norm, u_norm = p.norm(), update.norm()
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.sub_(self.lr * ratio * update)
            return
        grads = [p.grad for p in self.params]
        torch._foreach_mul_(self.m, b1)
        torch._foreach_add_(self.m, grads, alpha=1 - b1)
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - b2)
        denominator = torch._foreach_div(self.v, c2)
        torch._foreach_sqrt_(denominator)
        torch._foreach_add_(denominator, self.eps)
        updates = torch._foreach_div(self.m, c1)
        torch._foreach_div_(updates, denominator)
        torch._foreach_add_(updates, self.params, alpha=self.wd)
        w_norm, u_norm = torch.stack(torch._foreach_norm(self.params)), torch.stack(torch._foreach_norm(updates))
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        torch._foreach_mul_(updates, list((-self.lr * ratio).unbind()))
        torch._foreach_add_(self.params, updates)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def sigmoid_focal_loss(logits: torch.Tensor, targets: torch.Tensor, alpha: float = 0.25,
                       gamma: float = 2.0) -> torch.Tensor:
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    return ((alpha * targets + (1 - alpha) * (1 - targets)) * ce * (1 - p_t) ** gamma).sum()


def retinanet_python_lamb(fixes: Fixes) -> Step:
    """A RetinaNet-style detector (a ResNet-34 layout with GroupNorm, an FPN of 256 channels over P3-P5, 9 anchors
    and 80 classes, four-convolution heads; 16 images of 320x320 a step, channels_last, bf16 autocast; sigmoid
    focal loss and smooth L1 on anchors pre-assigned on the device) trained large-batch-style with LAMB written as
    the paper's per-parameter loop: some 180 parameter tensors, each a chain of ~18 small kernels launched from
    Python, so the optimizer alone takes longer to launch than the backward pass runs. Fix: the same LAMB over
    the whole parameter list with torch._foreach_* ops (the trust ratios as one tensor)."""
    torch.backends.cudnn.benchmark = True
    base, fpn, anchors, classes = pick(64, 32), pick(256, 32), 9, pick(80, 4)
    batch, size = pick(16, 2), pick(320, 64)
    model = RetinaNet(base, fpn, anchors, classes).to(dev(), memory_format=torch.channels_last)
    opt = LAMB(list(model.parameters()), per_tensor="optimizer_impl" not in fixes)
    images = torch.randn(batch, 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    count = anchors * sum((size // s) ** 2 for s in (8, 16, 32))
    labels = torch.randint(-1, classes, (batch, count), device=dev())
    labels = torch.where(torch.rand(batch, count, device=dev()) < 0.9, -1, labels)
    targets = F.one_hot(labels.clamp(min=0), classes).float() * (labels >= 0)[..., None].float()
    box_targets = torch.randn(batch, count, 4, device=dev()) * 0.1
    positive = (labels >= 0).float()

    def step() -> None:
        with autocast():
            cls, box = model(images)
        normaliser = positive.sum().clamp(min=1)
        loss = sigmoid_focal_loss(cls.float(), targets) / normaliser + \
            (F.smooth_l1_loss(box.float(), box_targets, reduction="none").sum(-1) * positive).sum() / normaliser
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


# ------------------------------------------------------------------------------------ gc_pauses + allocator_churn

def wgan_critic(width: int) -> nn.Sequential:
    """A DCGAN-shaped critic for 64x64 images without batch norm (the gradient penalty forbids it): LayerNorm-free
    stride-2 convolutions with LeakyReLU, a linear output."""
    return nn.Sequential(nn.Conv2d(3, width, 4, 2, 1), nn.LeakyReLU(0.2),
                         nn.Conv2d(width, 2 * width, 4, 2, 1), nn.LeakyReLU(0.2),
                         nn.Conv2d(2 * width, 4 * width, 4, 2, 1), nn.LeakyReLU(0.2),
                         nn.Conv2d(4 * width, 8 * width, 4, 2, 1), nn.LeakyReLU(0.2), nn.Flatten(),
                         nn.Linear(8 * width * 16, 1))


def wgan_generator(latent: int, width: int) -> nn.Sequential:
    return nn.Sequential(nn.Unflatten(1, (latent, 1, 1)),
                         nn.ConvTranspose2d(latent, 8 * width, 4, 1, 0), nn.BatchNorm2d(8 * width), nn.ReLU(True),
                         nn.ConvTranspose2d(8 * width, 4 * width, 4, 2, 1), nn.BatchNorm2d(4 * width), nn.ReLU(True),
                         nn.ConvTranspose2d(4 * width, 2 * width, 4, 2, 1), nn.BatchNorm2d(2 * width), nn.ReLU(True),
                         nn.ConvTranspose2d(2 * width, width, 4, 2, 1), nn.BatchNorm2d(width), nn.ReLU(True),
                         nn.ConvTranspose2d(width, 3, 4, 2, 1), nn.Tanh())


def gradient_penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    mix = torch.rand(len(real), 1, 1, 1, device=real.device)
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    with autocast():
        scores = critic(between)
    grads, = torch.autograd.grad(scores.float().sum(), between, create_graph=True)
    return (grads.flatten(1).norm(dim=1) - 1).pow(2).mean()


def wgan_gp_gc_empty_cache(fixes: Fixes) -> Step:
    """A WGAN-GP on 64x64 images (DCGAN-shaped generator and batch-norm-free critic of width 64; 64 images a
    batch, five critic updates with a gradient penalty (double backward) per generator update, bf16 autocast,
    fused Adam(1e-4, betas (0, 0.9))) whose author fought a memory leak from create_graph=True: after every
    critic update `del` the graph's tensors, then `gc.collect()` (five full collections of the heap a step, the
    GPU idle; the larger cost) and `torch.cuda.empty_cache()` (every activation block of the next update
    allocated again with cudaMalloc, each free a device synchronisation). Profiled with stacks. Fix: drop both
    (nothing leaks; the graph is freed when the loss goes out of scope)."""
    latent, width, batch, critic_steps = 128, pick(64, 4), pick(64, 2), 5
    generator = wgan_generator(latent, width).to(dev())
    critic = wgan_critic(width).to(dev())
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4, betas=(0.0, 0.9), fused=on_gpu())
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9), fused=on_gpu())
    dataset = torch.rand(pick(2048, 16), 3, 64, 64, device=dev()) * 2 - 1
    losses = []

    def step() -> None:
        for _ in range(critic_steps):
            real = dataset[torch.randint(len(dataset), (batch,), device=dev())]
            with torch.no_grad(), autocast():
                fake = generator(torch.randn(batch, latent, device=dev()))
            with autocast():
                gap = critic(fake).float().mean() - critic(real).float().mean()
            loss_c = gap + 10 * gradient_penalty(critic, real, fake.float())
            loss_c.backward()
            opt_c.step()
            opt_c.zero_grad(set_to_none=True)
            del real, fake, gap, loss_c
            if "gc_pauses" not in fixes:
                gc.collect()
            if "allocator_churn" not in fixes:
                release_cached_memory()
        with autocast():
            loss_g = -critic(generator(torch.randn(batch, latent, device=dev()))).float().mean()
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
        losses.append(loss_g.detach())
    return step


# ------------------------------------------------------------------------------------ eager_attention + data_loader

class QADataset(torch.utils.data.Dataset):
    """Raw question-answering examples: a context paragraph and a question as strings, the answer's word span."""

    def __init__(self, examples: int, context_words: int, question_words: int, vocabulary: int) -> None:
        rng = np.random.default_rng(0)
        words = [f"word{i}" for i in range(vocabulary)]
        self.examples = []
        for _ in range(examples):
            context = " ".join(words[i] for i in rng.integers(vocabulary, size=context_words))
            question = " ".join(words[i] for i in rng.integers(vocabulary, size=question_words)) + "?"
            start = int(rng.integers(context_words - 8))
            self.examples.append((context, question, start, start + int(rng.integers(1, 8))))

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> tuple[str, str, int, int]:
        return self.examples[index % len(self.examples)]


class QACollator:
    """Tokenises in Python: lowercase, strip punctuation, split on spaces, look each word up (unknown words to 1),
    pad to a fixed length; stacks the answer spans."""

    def __init__(self, vocabulary: int, context_len: int, question_len: int) -> None:
        self.lookup = {f"word{i}": i + 2 for i in range(vocabulary)}
        self.context_len, self.question_len = context_len, question_len

    def ids(self, text: str, length: int) -> list[int]:
        tokens = [self.lookup.get(w.strip(".,?!").lower(), 1) for w in text.split(" ")][:length]
        return tokens + [0] * (length - len(tokens))

    def __call__(self, batch: list[tuple[str, str, int, int]]) -> tuple[torch.Tensor, ...]:
        context = torch.tensor([self.ids(c, self.context_len) for c, _, _, _ in batch])
        question = torch.tensor([self.ids(q, self.question_len) for _, q, _, _ in batch])
        spans = torch.tensor([(s, e) for _, _, s, e in batch])
        return context, question, spans[:, 0], spans[:, 1]


class QANetBlock(nn.Module):
    """QANet's encoder block: depthwise-separable convolutions, multi-head self-attention under a padding mask, a
    feed-forward layer, each pre-norm and residual. `eager` writes the attention out (fp32 scores, masked_fill,
    softmax, dropout, [B, H, S, S] materialised); otherwise SDPA with the boolean mask."""

    def __init__(self, width: int, heads: int, convs: int, eager: bool) -> None:
        super().__init__()
        self.heads, self.eager = heads, eager
        self.convs = nn.ModuleList(nn.Sequential(nn.Conv1d(width, width, 7, padding=3, groups=width),
                                                 nn.Conv1d(width, width, 1)) for _ in range(convs))
        self.conv_norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(convs))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ffn = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def attend(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(x).chunk(3, -1))
        keep = mask[:, None, None, :]
        if not self.eager:
            return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                              dropout_p=0.1 if self.training else 0.0))
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        probabilities = F.dropout(scores.masked_fill(~keep, -1e30).softmax(-1), 0.1, self.training)
        return merge_heads(probabilities.to(v.dtype) @ v)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.conv_norms):
            x = x + conv(norm(x).transpose(1, 2)).transpose(1, 2)
        x = x + self.proj(self.attend(self.norm1(x), mask))
        return x + self.ffn(self.norm2(x))


class QANet(nn.Module):
    """QANet: word embeddings, an embedding encoder block shared by context and question, trilinear
    context-query attention, a model encoder of `depth` blocks run three times, start and end pointers."""

    def __init__(self, vocabulary: int, width: int, heads: int, depth: int, eager: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary + 2, width, padding_idx=0)
        self.embedding_encoder = QANetBlock(width, heads, 4, eager)
        self.trilinear = nn.Linear(3 * width, 1, bias=False)
        self.resize = nn.Linear(4 * width, width)
        self.model_encoder = nn.ModuleList(QANetBlock(width, heads, 2, eager) for _ in range(depth))
        self.start, self.end = nn.Linear(2 * width, 1), nn.Linear(2 * width, 1)

    def context_query(self, c: torch.Tensor, q: torch.Tensor, c_mask: torch.Tensor,
                      q_mask: torch.Tensor) -> torch.Tensor:
        w_c, w_q, w_cq = self.trilinear.weight.chunk(3, 1)
        similarity = (c @ w_c.t()) + (q @ w_q.t()).transpose(1, 2) + (c * w_cq) @ q.transpose(1, 2)
        similarity = similarity.float()
        s1 = similarity.masked_fill(~q_mask[:, None], -1e30).softmax(2).to(c.dtype)
        s2 = similarity.masked_fill(~c_mask[:, :, None], -1e30).softmax(1).to(c.dtype)
        a = s1 @ q
        b = s1 @ (s2.transpose(1, 2) @ c)
        return self.resize(torch.cat([c, a, c * a, c * b], -1))

    def forward(self, context: torch.Tensor, question: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c_mask, q_mask = context != 0, question != 0
        c = self.embedding_encoder(self.embed(context), c_mask)
        q = self.embedding_encoder(self.embed(question), q_mask)
        x, passes = self.context_query(c, q, c_mask, q_mask), []
        for _ in range(3):
            for block in self.model_encoder:
                x = block(x, c_mask)
            passes.append(x)
        start = self.start(torch.cat(passes[:2], -1)).squeeze(-1).float().masked_fill(~c_mask, -1e30)
        end = self.end(torch.cat([passes[0], passes[2]], -1)).squeeze(-1).float().masked_fill(~c_mask, -1e30)
        return start, end


def qanet_eager_attention_tokenise_in_loop(fixes: Fixes) -> Step:
    """QANet extractive question answering over long passages (width 256, 8 heads, a model encoder of 4 blocks run
    three times; 16 examples a step of 1024-word contexts and 48-word questions, a 50k-word vocabulary; bf16
    autocast, fused AdamW). Its self-attention is written out with fp32 scores, masked_fill and dropout, 13
    materialised [16, 8, 1024, 1024] score tensors a step and their backward (the larger cost, fix:
    F.scaled_dot_product_attention with the padding mask as attn_mask); and its DataLoader runs with
    num_workers=0, so the Python tokeniser (split, strip, lowercase, dictionary look-up per word) runs in the
    training process each step (fix: num_workers=4, persistent_workers=True)."""
    vocabulary, width, heads, depth = pick(50_000, 500), pick(256, 32), pick(8, 2), pick(4, 1)
    batch, context_len, question_len = pick(16, 2), pick(1024, 64), pick(48, 8)
    model = QANet(vocabulary, width, heads, depth, eager="eager_attention" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    dataset = QADataset(pick(512, 8), context_len - 16, question_len - 4, vocabulary)
    workers = 4 if "data_loader" in fixes else 0
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, collate_fn=QACollator(vocabulary, context_len,
                                                                                          question_len),
                                         num_workers=workers, persistent_workers=workers > 0,
                                         pin_memory=on_gpu())
    batches = iter(loader)

    def step() -> float:
        context, question, start, end = (t.to(dev(), non_blocking=True) for t in next(batches))
        with autocast():
            start_logits, end_logits = model(context, question)
        loss = F.cross_entropy(start_logits, start) + F.cross_entropy(end_logits, end)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------- activation_checkpointing + host_syncs

def favor_features(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """FAVOR+ positive random features: exp(w.x - |x|^2 / 2 - max) / sqrt(m), in fp32."""
    x = x.float() * x.shape[-1] ** -0.25
    projected = x @ projection.t()
    return torch.exp(projected - x.pow(2).sum(-1, keepdim=True) / 2 - projected.amax(-1, keepdim=True)) \
        * projection.shape[0] ** -0.5


class PerformerBlock(nn.Module):
    """A pre-norm Performer block: bidirectional FAVOR+ linear attention (a fixed random feature projection per
    block), a GELU MLP."""

    def __init__(self, width: int, heads: int, features: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.register_buffer("projection", torch.randn(features, width // heads), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        qf, kf = favor_features(q, self.projection), favor_features(k, self.projection)
        kv = kf.transpose(-1, -2) @ v.float()
        normaliser = qf @ kf.sum(2, keepdim=True).transpose(-1, -2)
        attended = (qf @ kv) / normaliser.clamp(min=1e-6)
        x = x + self.proj(merge_heads(attended.to(x.dtype)))
        return x + self.mlp(self.norm2(x))


class BlockTimer:
    """Per-block forward times for a throughput dashboard: forward pre- and post-hooks that synchronize the GPU
    and read the clock."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.times: dict[int, list[float]] = {}
        self.started = 0.0
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self.start)
            block.register_forward_hook(lambda module, args, out, i=i: self.stop(i))

    def start(self, module: nn.Module, args: tuple) -> None:
        device_synchronize()
        self.started = time.perf_counter()

    def stop(self, index: int) -> None:
        device_synchronize()
        self.times.setdefault(index, []).append(time.perf_counter() - self.started)


def performer_protein_checkpointed_timed(fixes: Fixes) -> Step:
    """A Performer masked language model on protein sequences (8 blocks of width 512, 8 heads, FAVOR+ with 128
    random features, 25 amino-acid tokens; 16 sequences of 2048 residues a step, 15% masked; bf16 autocast, the
    features in fp32, fused AdamW). Every block runs through torch.utils.checkpoint although the activations fit
    several times over (the larger cost: each block's forward again in the backward; fix: call the blocks
    directly); and a BlockTimer left on from profiling synchronizes the GPU before and after each block's forward,
    recomputations included (fix: remove the hooks)."""
    vocab, width, heads, depth, features = 25, pick(512, 32), pick(8, 2), pick(8, 2), pick(128, 16)
    batch, length = pick(16, 2), pick(2048, 64)
    blocks = nn.ModuleList(PerformerBlock(width, heads, features) for _ in range(depth))
    model = nn.ModuleDict({"embed": nn.Embedding(vocab + 1, width), "blocks": blocks,
                           "norm": nn.LayerNorm(width), "out": nn.Linear(width, vocab)}).to(dev())
    positions = nn.Parameter(0.02 * torch.randn(length, width, device=dev()))
    opt = fused_adamw([*model.parameters(), positions])
    if "host_syncs" not in fixes:
        BlockTimer(blocks)
    checkpointed = "activation_checkpointing" not in fixes
    sequences = torch.randint(vocab, (batch, length), device=dev())

    def step() -> None:
        masked = torch.rand(batch, length, device=dev()) < 0.15
        targets = sequences.masked_fill(~masked, -100)
        with autocast():
            x = model["embed"](sequences.masked_fill(masked, vocab)) + positions
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
            logits = model["out"](model["norm"](x))
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------------------------------- healthy

class ViTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        x = x + self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v)))
        return x + self.mlp(self.norm2(x))


class OSTrack(nn.Module):
    """A one-stream tracker (OSTrack): template and search patches embedded by one ViT together, then a
    convolutional centre head on the search tokens: a centre score map, sub-cell offsets and box sizes."""

    def __init__(self, width: int, heads: int, depth: int, template: int, search: int) -> None:
        super().__init__()
        self.side = search // 16
        self.patch = nn.Conv2d(3, width, 16, 16)
        self.template_pos = nn.Parameter(0.02 * torch.randn((template // 16) ** 2, width))
        self.search_pos = nn.Parameter(0.02 * torch.randn(self.side ** 2, width))
        self.blocks = nn.ModuleList(ViTBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Sequential(nn.Conv2d(width, 256, 3, padding=1), nn.GELU(), nn.Conv2d(256, 256, 3, padding=1),
                                  nn.GELU(), nn.Conv2d(256, 5, 1))

    def forward(self, template: torch.Tensor, search: torch.Tensor) -> torch.Tensor:
        z = self.patch(template).flatten(2).transpose(1, 2) + self.template_pos
        x = self.patch(search).flatten(2).transpose(1, 2) + self.search_pos
        tokens = torch.cat([z, x], 1)
        for block in self.blocks:
            tokens = block(tokens)
        searched = self.norm(tokens[:, z.shape[1]:]).transpose(1, 2).unflatten(2, (self.side, self.side))
        return self.head(searched)


def healthy_ostrack_sdpa_bf16(fixes: Fixes) -> Step:
    """An OSTrack-style one-stream tracker (a ViT-B: 12 blocks of width 768, 12 heads; 128x128 templates and
    256x256 search regions, 320 tokens together; 64 pairs a step; a centre head trained with a focal-style score
    loss and L1 on offsets and sizes) with SDPA (flash) attention, bf16 autocast and fused AdamW: nothing
    planted."""
    width, heads, depth, batch = pick(768, 32), pick(12, 2), pick(12, 2), pick(64, 2)
    template, search = pick(128, 32), pick(256, 64)
    model = OSTrack(width, heads, depth, template, search).to(dev())
    opt = fused_adamw(model.parameters())
    templates = torch.randn(batch, 3, template, template, device=dev())
    searches = torch.randn(batch, 3, search, search, device=dev())
    side = search // 16
    centres = torch.randint(side, (batch, 2), device=dev())
    grid = torch.stack(torch.meshgrid(torch.arange(side, device=dev()), torch.arange(side, device=dev()),
                                      indexing="ij"), 0).float()
    heat = torch.exp(-((grid[None] - centres[:, :, None, None]) ** 2).sum(1) / 4)
    boxes = torch.rand(batch, 4, device=dev())

    def step() -> None:
        with autocast():
            out = model(templates, searches).float()
        score = out[:, 0].sigmoid().clamp(1e-4, 1 - 1e-4)
        focal = -(heat * (1 - score) ** 2 * score.log() + (1 - heat) ** 4 * score ** 2 * (1 - score).log()).mean()
        picked = out[torch.arange(batch, device=dev()), 1:, centres[:, 0], centres[:, 1]]
        (focal + F.l1_loss(picked.sigmoid(), boxes)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


PROGRAMS = {
    "transformer_xl_memory_reset_nonzero": ["host_syncs"],
    "deepfm_numpy_negatives": ["host_work"],
    "tacotron_decoder_frame_loop": ["launch_bound"],
    "spline_flow_fp32_conditioners": ["precision"],
    "unet3d_pageable_onehot_labels": ["pageable_copy"],
    "retinanet_python_lamb": ["optimizer_impl"],
    "wgan_gp_gc_empty_cache": ["gc_pauses", "allocator_churn"],
    "qanet_eager_attention_tokenise_in_loop": ["eager_attention", "data_loader"],
    "performer_protein_checkpointed_timed": ["activation_checkpointing", "host_syncs"],
    "healthy_ostrack_sdpa_bf16": [],
}
WITH_STACK = {"wgan_gp_gc_empty_cache"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set_fixes(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
