"""A second held-out check of the advisor: twelve programs written after its rules, of other architectures than
bench/planted/corpus.py's and bench/planted/heldout.py's (a graph attention net, packed documents, a GRU, a U-Net,
a hand-written mixture of experts, a 1-D conv audio net, a distilled ViT, an LSTM language model, a diffusion
noise predictor, a click-log recommender, a bottleneck ResNet and an MLP-Mixer), ten with one planted problem and
two healthy, with the same output format (OUT/NAME/trace + planted.json), scored the same way:

    python bench/planted/heldout2.py OUT                  # on a GPU (about a minute on one H200)
    python bench/planted/heldout2.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout2.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT

Each program's `build(fixed)` returns one training step; its problem sits behind `if not fixed` and the fix is
what a user would change. The planted cost is the step as written less the step as fixed (medians of 7 steps,
each between two synchronizes, profiler off). The programs whose problem is on the host read their loss with
`.item()` at the end of the step, as a loop that logs every step does, so their traces serialise as their timing.
"""

from __future__ import annotations

import gc
import math
import random
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import BF16, autocast, dev, fused_adamw, on_gpu, pick, pinned, run_set


def scatter_sum(values: torch.Tensor, index: torch.Tensor, dim_size: int | None = None) -> torch.Tensor:
    """Rows of `values` summed into `dim_size` rows by `index`; like torch_scatter, `dim_size` defaults to
    index.max() + 1."""
    if dim_size is None:
        dim_size = int(index.max()) + 1
    return values.new_zeros((dim_size, *values.shape[1:])).index_add_(0, index, values)


def scatter_max(values: torch.Tensor, index: torch.Tensor, dim_size: int | None = None) -> torch.Tensor:
    if dim_size is None:
        dim_size = int(index.max()) + 1
    out = values.new_full((dim_size, *values.shape[1:]), float("-inf"))
    return out.scatter_reduce_(0, index.view(-1, 1).expand_as(values), values, "amax")


class GraphAttention(nn.Module):
    """One GAT layer: per-edge scores, a softmax over each node's incoming edges, a weighted sum of messages."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width, bias=False)
        self.att_src = nn.Parameter(0.1 * torch.randn(heads, width // heads))
        self.att_dst = nn.Parameter(0.1 * torch.randn(heads, width // heads))

    def forward(self, h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, num_nodes: int | None = None):
        z = self.lin(self.norm(h)).view(h.shape[0], self.heads, -1)
        from_src, to_dst = (z * self.att_src).sum(-1), (z * self.att_dst).sum(-1)
        score = F.leaky_relu(from_src.index_select(0, src) + to_dst.index_select(0, dst), 0.2)
        score = (score - scatter_max(score.detach(), dst, num_nodes).index_select(0, dst)).exp()
        weight = score / scatter_sum(score, dst, num_nodes).index_select(0, dst)
        out = scatter_sum(z.index_select(0, src) * weight.unsqueeze(-1), dst, num_nodes)
        return h + F.elu(out.flatten(1))


def random_graph(nodes: int, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random edges plus a self-loop per node, sorted by destination."""
    src = torch.cat([torch.randint(nodes, (nodes * degree,)), torch.arange(nodes)])
    dst = torch.cat([torch.randint(nodes, (nodes * degree,)), torch.arange(nodes)])
    order = dst.argsort()
    return src[order].to(dev()), dst[order].to(dev())


def gat_scatter_size_from_index(fixed: bool):
    """A 16-layer graph attention net whose scatter helper sizes its output from index.max() + 1 (torch_scatter's
    default): three device-to-host reads per layer. Fix: pass the node count (dim_size=x.shape[0])."""
    nodes, width, classes = pick(8_000, 500), 128, 16
    layers = nn.ModuleList(GraphAttention(width, 4) for _ in range(16)).to(dev(), BF16)
    head = nn.Linear(width, classes).to(dev(), BF16)
    opt = fused_adamw(list(layers.parameters()) + list(head.parameters()))
    src, dst = random_graph(nodes, 15)
    x = torch.randn(nodes, width, device=dev(), dtype=BF16)
    labels = torch.randint(classes, (nodes,), device=dev())

    def step():
        h = x
        for layer in layers:
            h = layer(h, src, dst, num_nodes=h.shape[0] if fixed else None)
        F.cross_entropy(head(h).float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- host_work

def draw_document_lengths(rng: random.Random, rows: int, seq: int) -> list[list[int]]:
    """Each row of the batch packed with whole documents of random length, the last one cut to fit."""
    batch = []
    for _ in range(rows):
        lengths, left = [], seq
        while left > 0:
            lengths.append(min(left, rng.randint(16, 512)))
            left -= lengths[-1]
        batch.append(lengths)
    return batch


def python_positions(batch_lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids restarting at each document, and a mask that drops each document's first target."""
    positions, keep = [], []
    for lengths in batch_lengths:
        row_positions, row_keep = [], []
        for n in lengths:
            for i in range(n):
                row_positions.append(i)
                row_keep.append(0.0 if i == 0 else 1.0)
        positions.append(row_positions)
        keep.append(row_keep)
    return torch.tensor(positions, device=dev()), torch.tensor(keep, device=dev())


def device_positions(batch_lengths: list[list[int]], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([n for row in batch_lengths for n in row], device=dev())
    starts = lengths.cumsum(0) - lengths
    total = len(batch_lengths) * seq
    document = torch.repeat_interleave(torch.arange(len(lengths), device=dev()), lengths, output_size=total)
    positions = (torch.arange(total, device=dev()) - starts[document]).view(-1, seq)
    return positions, (positions != 0).float()


class PackedTokenModel(nn.Module):
    def __init__(self, vocab: int, seq: int, width: int, depth: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def packed_documents_python_positions(fixed: bool):
    """Documents packed into 16 rows of 2048 tokens; each step's position ids and loss mask are built token by
    token in Python lists (32k tokens) and then copied in. Fix: compute them on the device from the document
    lengths (cumsum, repeat_interleave)."""
    rows, seq, vocab, width = pick(16, 2), pick(2048, 256), pick(8192, 512), pick(1024, 64)
    model = PackedTokenModel(vocab, seq, width, 2).to(dev())
    opt = fused_adamw(model.parameters())
    tokens = torch.randint(vocab, (rows, seq + 1), device=dev())
    rng, losses = random.Random(0), []

    def step():
        batch_lengths = draw_document_lengths(rng, rows, seq)
        positions, keep = device_positions(batch_lengths, seq) if fixed else python_positions(batch_lengths)
        with autocast():
            logits = model(tokens[:, :-1], positions)
        per_token = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        loss = (per_token * keep.flatten()).sum() / keep.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

def gru_cell_unrolled(fixed: bool):
    """A character-level GRU (hidden 256) run with nn.GRUCell in a Python loop over 96 time steps at batch 16, fp32:
    about ten small kernels a time step, forward and backward. Fix: nn.GRU over the whole sequence (cuDNN)."""
    vocab, embed_dim, hidden, steps, batch = 96, 128, 256, pick(96, 24), 16
    embed, head = nn.Embedding(vocab, embed_dim).to(dev()), nn.Linear(hidden, vocab).to(dev())
    rnn = (nn.GRU(embed_dim, hidden, batch_first=True) if fixed else nn.GRUCell(embed_dim, hidden)).to(dev())
    opt = fused_adamw([*embed.parameters(), *rnn.parameters(), *head.parameters()])
    text = torch.randint(vocab, (batch, steps + 1), device=dev())

    def step():
        x = embed(text[:, :-1])
        if fixed:
            out, _ = rnn(x)
        else:
            h, outs = x.new_zeros(batch, hidden), []
            for t in range(steps):
                h = rnn(x[:, t], h)
                outs.append(h)
            out = torch.stack(outs, 1)
        F.cross_entropy(head(out).flatten(0, 1), text[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# -------------------------------------------------------------------------------------------- optimizer_impl

def conv_unit(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


def double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(conv_unit(cin, cout), conv_unit(cout, cout))


class UNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 256)) -> None:
        super().__init__()
        self.stem = double_conv(3, widths[0])
        self.down = nn.ModuleList(double_conv(a, b) for a, b in zip(widths, widths[1:]))
        self.up = nn.ModuleList(nn.ConvTranspose2d(b, a, 2, stride=2) for a, b in zip(widths, widths[1:]))
        self.merge = nn.ModuleList(double_conv(2 * a, a) for a in widths[:-1])
        self.head = nn.Conv2d(widths[0], 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.stem(x)]
        for block in self.down:
            skips.append(block(F.max_pool2d(skips[-1], 2)))
        h = skips.pop()
        for up, merge in zip(reversed(self.up), reversed(self.merge)):
            h = merge(torch.cat([up(h), skips.pop()], 1))
        return self.head(h)


class HandWrittenAdamW:
    """AdamW as in the paper, one parameter tensor at a time."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        b1, b2 = self.betas
        correction1, correction2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        for p, (m, v) in zip(self.params, self.moments):
            if p.grad is None:
                continue
            p.data.mul_(1 - self.lr * self.weight_decay)
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v / correction2).sqrt_().add_(self.eps)
            p.data.addcdiv_(m, denom, value=-self.lr / correction1)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def unet_hand_written_adamw(fixed: bool):
    """A segmentation U-Net (64 parameter tensors) trained with a hand-written AdamW that updates one parameter at
    a time: about eight small kernels per tensor. Fix: torch.optim.AdamW(fused=True)."""
    model = UNet().to(dev(), memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True) if fixed \
        else HandWrittenAdamW(model.parameters())
    size = pick(128, 32)
    images = torch.randn(16, 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    masks = (torch.rand(16, 1, size, size, device=dev()) > 0.5).float()

    def step():
        with autocast():
            logits = model(images)
        F.binary_cross_entropy_with_logits(logits.float(), masks).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------- allocator_churn

class HandWrittenMoE(nn.Module):
    """Top-2 of several experts with a capacity limit; tokens dispatched by index (no host reads)."""

    def __init__(self, width: int, hidden: int, experts: int, release_cache: bool) -> None:
        super().__init__()
        self.experts, self.release_cache = experts, release_cache
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, width, hidden) / width ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, width) / hidden ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        capacity = int(1.25 * 2 * tokens / self.experts)
        h = self.norm(x)
        gate, expert = self.router(h).float().softmax(-1).topk(2, dim=-1)
        expert, gate = expert.t().reshape(-1), gate.t().reshape(-1).to(x.dtype)
        one_hot = F.one_hot(expert, self.experts).t().contiguous()
        position = (one_hot.cumsum(1) * one_hot).sum(0) - 1
        kept = position < capacity
        slot = torch.where(kept, expert * capacity + position, self.experts * capacity)
        dispatch = h.new_zeros(self.experts * capacity + 1, width).index_copy(0, slot, h.repeat(2, 1))
        expert_in = dispatch[:-1].view(self.experts, capacity, width)
        expert_out = torch.bmm(F.gelu(torch.bmm(expert_in, self.w_in)), self.w_out).view(-1, width)
        combined = F.pad(expert_out, (0, 0, 0, 1)).index_select(0, slot) * (gate * kept).unsqueeze(-1)
        if self.release_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return x + combined.view(2, tokens, width).sum(0)


def moe_empty_cache_in_forward(fixed: bool):
    """Six hand-written top-2 mixture-of-experts layers (8 experts, 8192 tokens, bf16), each calling
    torch.cuda.empty_cache() at the end of its forward to release the dispatch buffers. Fix: drop the call."""
    width, hidden, tokens = pick(1024, 64), pick(4096, 128), pick(8192, 256)
    model = nn.Sequential(*[HandWrittenMoE(width, hidden, 8, release_cache=not fixed) for _ in range(6)])
    model = model.to(dev(), BF16)
    opt = fused_adamw(model.parameters())
    x = torch.randn(tokens, width, device=dev(), dtype=BF16)

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- precision

def audio_encoder(channels: int) -> nn.Sequential:
    """A wav2vec-style strided 1-D conv feature encoder (a 320x downsampling of the waveform)."""
    layers = [nn.Conv1d(1, channels, 10, stride=5, bias=False), nn.GroupNorm(channels, channels), nn.GELU()]
    for kernel in (3, 3, 3, 3, 2, 2):
        layers += [nn.Conv1d(channels, channels, kernel, stride=2, bias=False), nn.GELU()]
    return nn.Sequential(*layers)


def fp32_conv1d_audio(fixed: bool):
    """A keyword-spotting net on raw 2-second waveforms (1-D conv encoder, 512 channels, batch 32) in fp32 with
    TF32 off for cuDNN and matmuls: every convolution on the SIMT cores. Fix: bf16 autocast."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    channels = pick(512, 32)
    model = nn.Sequential(audio_encoder(channels), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(channels, 35))
    model = model.to(dev())
    opt = fused_adamw(model.parameters())
    waves = torch.randn(pick(32, 4), 1, pick(32000, 8000), device=dev())
    labels = torch.randint(35, (waves.shape[0],), device=dev())

    def step():
        with autocast(enabled=fixed):
            logits = model(waves)
        F.cross_entropy(logits.float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------------------------- pageable_copy

class ViTStudent(nn.Module):
    def __init__(self, width: int, depth: int, heads: int, teacher_width: int, image: int, patch: int) -> None:
        super().__init__()
        self.patchify = nn.Conv2d(3, width, patch, stride=patch)
        self.position = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, activation="gelu", batch_first=True,
                                           norm_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.project = nn.Linear(width, teacher_width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patchify(images).flatten(2).transpose(1, 2) + self.position
        return self.project(self.encoder(tokens))


def vit_distill_pageable_teacher(fixed: bool):
    """Feature distillation of a small ViT (6 layers, width 384, 128 images of 224x224) against a teacher's
    per-patch features cached in host memory: each step copies 77 MB of fp32 features (and the uint8 images) to
    the device from pageable memory. Fix: pin the host caches once and copy with non_blocking=True."""
    batch, image, teacher_width = pick(128, 4), pick(224, 64), pick(768, 64)
    student = ViTStudent(pick(384, 64), 6, 6 if on_gpu() else 2, teacher_width, image, 16).to(dev())
    opt = fused_adamw(student.parameters())
    tokens = (image // 16) ** 2
    images = torch.randint(0, 256, (2, batch, 3, image, image), dtype=torch.uint8)
    teacher = torch.randn(2, batch, tokens, teacher_width)
    if fixed:
        images, teacher = pinned(images), pinned(teacher)
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev()).view(1, 3, 1, 1)
    count = iter(range(1 << 30))

    def step():
        i = next(count) % 2
        x = images[i].to(dev(), non_blocking=fixed).float().div_(255).sub_(mean)
        target = teacher[i].to(dev(), non_blocking=fixed)
        with autocast():
            predicted = student(x)
        F.smooth_l1_loss(predicted.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- gc_pauses

class WordLSTM(nn.Module):
    def __init__(self, vocab: int, embed_dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, state):
        out, state = self.lstm(self.embed(tokens), state)
        return self.head(out), state


def tokenized_corpus(documents: int, vocab: int) -> list[list[int]]:
    """The training corpus as the tokenizer left it: one Python list of token ids per document."""
    rng = np.random.default_rng(0)
    return [rng.integers(vocab, size=int(n)).tolist() for n in rng.integers(40, 120, size=documents)]


def lstm_gc_after_detach(fixed: bool):
    """A word-level LSTM language model trained with truncated backpropagation (2 layers, hidden 1024, 64 streams
    x 128 tokens) that calls gc.collect() after detaching the carried state 'to free the last chunk's graph', in a
    process holding its tokenized corpus (20k documents) as Python lists. Profiled with stacks. Fix: no collect
    (detaching already frees the graph)."""
    vocab, streams, chunk = pick(16384, 512), pick(64, 4), pick(128, 16)
    documents = tokenized_corpus(pick(20_000, 2_000), vocab)
    flat = [t for doc in documents for t in doc]
    stream = torch.tensor(flat[: len(flat) // streams * streams], device=dev()).view(streams, -1)
    model = WordLSTM(vocab, pick(512, 32), pick(1024, 64)).to(dev())
    opt = fused_adamw(model.parameters())
    state, position, losses = None, 0, []

    def step():
        nonlocal state, position
        if state is not None:
            state = tuple(s.detach() for s in state)
            if not fixed:
                gc.collect()
        if position + chunk + 1 > stream.shape[1]:
            position, state = 0, None
        window = stream[:, position:position + chunk + 1]
        position += chunk
        with autocast():
            logits, state = model(window[:, :-1], state)
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        return len(documents)
    return step


# ---------------------------------------------------------------------------------------- checkpoint_in_step

def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(10_000) * torch.arange(dim // 2, device=t.device) / (dim // 2))
    angles = t.float().unsqueeze(-1) * freqs
    return torch.cat([angles.cos(), angles.sin()], -1)


class NoisePredictor(nn.Module):
    """A residual MLP that predicts the noise added to a latent vector at diffusion time step t."""

    def __init__(self, dim: int, width: int, depth: int) -> None:
        super().__init__()
        self.time = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        self.inp = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.SiLU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.time(timestep_embedding(t, 256))
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h + emb)
        return self.out(h)


def diffusion_ema_on_host(fixed: bool):
    """A diffusion noise-prediction MLP (6 blocks, width 768, 31M parameters) whose EMA weights are kept on the
    host: every step copies the whole state_dict to the CPU (124 MB) and averages it there. Fix: keep the EMA on the
    device (torch._foreach_lerp_ over the parameters, as timm's ModelEmaV3 does)."""
    dim, width, rows, decay = pick(1024, 64), pick(768, 64), pick(16384, 256), 0.999
    model = NoisePredictor(dim, width, 6).to(dev())
    opt = fused_adamw(model.parameters())
    latents = torch.randn(rows, dim, device=dev())
    alphas_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, device=dev()), 0)
    params = list(model.parameters())
    device_ema = [p.detach().clone() for p in params]
    host_ema = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}

    def update_ema():
        if fixed:
            with torch.no_grad():
                torch._foreach_lerp_(device_ema, params, 1 - decay)
            return
        snapshot = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        for name, average in host_ema.items():
            average.lerp_(snapshot[name], 1 - decay)

    def step():
        t = torch.randint(1000, (rows,), device=dev())
        noise = torch.randn_like(latents)
        a = alphas_bar[t].unsqueeze(-1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        with autocast():
            predicted = model(noisy, t)
        F.mse_loss(predicted.float(), noise).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_ema()
    return step


# ----------------------------------------------------------------------------------------------- data_loader

FIELDS, HOTS = 26, 3


def click_log_lines(count: int) -> list[str]:
    """Criteo-style tab-separated lines: a click label, 13 integer counts and 26 categorical fields of up to 3
    comma-separated hex ids."""
    rng = random.Random(0)
    lines = []
    for _ in range(count):
        counts = [str(rng.randint(0, 5000)) if rng.random() > 0.1 else "" for _ in range(13)]
        cats = [",".join(f"{rng.getrandbits(32):08x}" for _ in range(rng.randint(1, HOTS))) for _ in range(FIELDS)]
        lines.append("\t".join([str(rng.randint(0, 1)), *counts, *cats]))
    return lines


class ClickLogDataset(torch.utils.data.Dataset):
    """Each sample parsed from its text line: log-scaled counts and hashed categorical ids."""

    def __init__(self, lines: list[str], buckets: int) -> None:
        self.lines, self.buckets = lines, buckets

    def __len__(self) -> int:
        return 1 << 24

    def __getitem__(self, index: int):
        fields = self.lines[index % len(self.lines)].split("\t")
        dense = [math.log1p(float(v)) if v else 0.0 for v in fields[1:14]]
        sparse = []
        for f, value in enumerate(fields[14:]):
            ids = [zlib.crc32(f"{f}:{v}".encode()) % self.buckets + f * self.buckets for v in value.split(",")]
            sparse.append(ids + [ids[0]] * (HOTS - len(ids)))
        return torch.tensor(dense), torch.tensor(sparse), torch.tensor(float(fields[0]))


class ClickModel(nn.Module):
    """DLRM-style: an EmbeddingBag per categorical field (one shared table), a bottom MLP for the counts, a top
    MLP over the concatenation."""

    def __init__(self, buckets: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.bags = nn.EmbeddingBag(FIELDS * buckets, dim, mode="mean")
        self.bottom = nn.Sequential(nn.Linear(13, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear((FIELDS + 1) * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        bags = self.bags(sparse.flatten(0, 1)).view(sparse.shape[0], -1)
        return self.top(torch.cat([self.bottom(dense), bags], 1)).squeeze(-1)


def click_log_loader_no_workers(fixed: bool):
    """A DLRM-style click model fed by a DataLoader with num_workers=0 whose __getitem__ parses a text line per
    sample (13 counts, 26 multi-hot fields hashed with crc32), batch 512. Fix: num_workers=4,
    persistent_workers=True."""
    buckets, batch = pick(50_000, 1000), pick(512, 32)
    dataset = ClickLogDataset(click_log_lines(pick(8192, 256)), buckets)
    workers = {"num_workers": 4, "persistent_workers": True} if fixed else {"num_workers": 0}
    batches = iter(torch.utils.data.DataLoader(dataset, batch_size=batch, **workers))
    model = ClickModel(buckets, 64, pick(4096, 128)).to(dev())
    opt = fused_adamw(model.parameters())
    losses = []

    def step():
        dense, sparse, clicked = next(batches)
        with autocast():
            logits = model(dense.to(dev()), sparse.to(dev()))
        loss = F.binary_cross_entropy_with_logits(logits.float(), clicked.to(dev()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# --------------------------------------------------------------------------------------------------- healthy

class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def bottleneck_resnet(classes: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for width, stride in ((64, 1), (128, 2), (256, 2)):
        layers += [Bottleneck(cin, width, stride), Bottleneck(4 * width, width, 1)]
        cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def healthy_bottleneck_resnet_bf16(fixed: bool):
    """A bottleneck ResNet (1x1-3x3-1x1 blocks, 64-1024 channels) on 256 images of 128x128, channels_last, bf16
    autocast, fused AdamW: nothing planted."""
    model = bottleneck_resnet(1000).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    size = pick(128, 32)
    images = torch.randn(pick(256, 4), 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(1000, (images.shape[0],), device=dev())

    def step():
        with autocast():
            logits = model(images)
        F.cross_entropy(logits.float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


class MixerBlock(nn.Module):
    def __init__(self, patches: int, width: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.tokens = nn.Sequential(nn.Linear(patches, token_hidden), nn.GELU(), nn.Linear(token_hidden, patches))
        self.channels = nn.Sequential(nn.Linear(width, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


def healthy_mlp_mixer_bf16(fixed: bool):
    """An MLP-Mixer (8 blocks, 256 patches, width 1024, channel MLP 4096) on 128 images, bf16 weights and
    activations, fused AdamW: large GEMMs back to back, nothing planted."""
    patches, width, batch = 256, pick(1024, 64), pick(128, 4)
    model = nn.Sequential(nn.Linear(768, width), *[MixerBlock(patches, width, 512, 4 * width) for _ in range(8)],
                          nn.LayerNorm(width)).to(dev(), BF16)
    head = nn.Linear(width, 1000).to(dev(), BF16)
    opt = fused_adamw([*model.parameters(), *head.parameters()])
    x = torch.randn(batch, patches, 768, device=dev(), dtype=BF16)
    labels = torch.randint(1000, (batch,), device=dev())

    def step():
        F.cross_entropy(head(model(x).mean(1)).float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


PROGRAMS = {
    "gat_scatter_size_from_index": ["host_syncs"],
    "packed_documents_python_positions": ["host_work"],
    "gru_cell_unrolled": ["launch_bound"],
    "unet_hand_written_adamw": ["optimizer_impl"],
    "moe_empty_cache_in_forward": ["allocator_churn"],
    "fp32_conv1d_audio": ["precision"],
    "vit_distill_pageable_teacher": ["pageable_copy"],
    "lstm_gc_after_detach": ["gc_pauses"],
    "diffusion_ema_on_host": ["checkpoint_in_step"],
    "click_log_loader_no_workers": ["data_loader"],
    "healthy_bottleneck_resnet_bf16": [],
    "healthy_mlp_mixer_bf16": [],
}
WITH_STACK = {"lstm_gc_after_detach"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
