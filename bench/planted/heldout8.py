"""An eighth held-out check of the advisor: ten programs of other architectures than bench/planted/corpus.py's and
heldout.py's to heldout7.py's (EGNN, a GRU translator with additive attention, an FCOS detector, RetNet, a
wav2vec 2.0-style contrastive speech model, an R3D-18 video classifier, a sentence-embedding bi-encoder with
in-batch negatives, Perceiver IO, a BigGAN-style GAN and an EAGLE-style speculative-decoding draft model), five
with one planted problem, three with two at once and two healthy, written without reading the advisor's rules,
with the same output format (OUT/NAME/trace + planted.json), scored the same way:

    python bench/planted/heldout8.py OUT                  # on a GPU
    python bench/planted/heldout8.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout8.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT
    python bench/planted/fix_timelines.py heldout8 OUT2 NAME [NAME ...]   # a program as written and fixed

The programs, one sentence each:

    egnn_python_adamw_gc_collect    an E(n)-equivariant GNN on small molecules, trained with a hand-written AdamW
                                    loop over the parameters and a gc.collect() after every step
                                    (optimizer_impl, gc_pauses)
    gru_translator_eos_break        a GRU encoder-decoder with additive attention whose teacher-forced decoder loop
                                    asks `if finished.all(): break` at every target position (host_syncs)
    fcos_empty_cache_twice          an FCOS anchor-free detector that empties the CUDA cache before the backward and
                                    after the optimizer step (allocator_churn)
    retnet_fp32_retention           a RetNet language model with parallel retention, in plain fp32 with TF32 off
                                    (precision)
    wav2vec2_pageable_float64_audio a wav2vec 2.0-style contrastive speech model fed float64 waveforms straight from
                                    pageable numpy arrays (pageable_copy)
    r3d_yuv_loader_checkpointed     an R3D-18 video classifier whose clips are converted from YUV in the training
                                    process and whose every stage is checkpointed (data_loader,
                                    activation_checkpointing)
    biencoder_regex_tokenizer_eager a sentence-embedding bi-encoder with in-batch negatives, its text tokenized by a
                                    regex tokenizer each step and its attention written out (host_work,
                                    eager_attention)
    healthy_perceiver_io_bytes      Perceiver IO masked byte modelling, bf16 with SDPA cross- and self-attention
    healthy_biggan_hinge_bf16       a BigGAN-style class-conditional GAN, one discriminator and one generator
                                    update a step, bf16 and channels_last
    eagle_draft_compiled_ragged     an EAGLE-style one-layer draft model compiled with dynamic=False and fed
                                    length-grouped batches of a new length each step (recompilation)

Each program's `build(fixes)` returns one training step; each problem sits behind `if CAUSE not in fixes` (or a
choice made from `fixes`) and its fix is what a user would change. A cause's planted cost is the step as written
less the step with that cause alone fixed; fixed_step_ms has every cause fixed (medians of 7 steps, each between
two synchronizes, profiler off). The programs whose problem is on the host read their loss with `.item()` at the
end of the step, as a loop that logs every step does, so their traces serialise as their timing. The compiled
program runs last (Inductor leaves a large Python heap behind, which would lengthen the garbage collections of the
program that collects every step), and the program that collects runs first. Without a GPU the CUDA-only parts
(pinned memory, torch.cuda.empty_cache) are skipped, so in smoke mode a fix may time the same as its problem.
"""

from __future__ import annotations

import gc
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

from harness import (autocast, dev, fused_adamw, heads_of, merge_heads, pick, pinned, release_cached_memory,
                     run_set_fixes)

Fixes = frozenset[str]
Step = Callable[[], object]


def written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v as the paper writes it: the [B, H, S, S] scores materialised, softmax in fp32."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.float().softmax(-1).to(v.dtype) @ v


class SelfAttentionBlock(nn.Module):
    """A pre-norm Transformer block: multi-head self-attention (SDPA, or written out when `eager`), optionally
    causal or under a key mask ([B, 1, 1, S], True where a key may be attended), and a GELU MLP."""

    def __init__(self, width: int, heads: int, hidden: int, eager: bool = False, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.eager, self.causal = heads, eager, causal
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if self.eager:
            return written_out_attention(q, k, v, keep)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=self.causal and keep is None)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        x = x + self.proj(merge_heads(self.attend(q, k, v, keep)))
        return x + self.mlp(self.norm2(x))


# ------------------------------------------------------------------------------ optimizer_impl + gc_pauses

class EGNNLayer(nn.Module):
    """An E(n)-equivariant layer (Satorras et al. 2021) on dense molecules: messages from both atoms' features and
    their squared distance, soft edge weights, coordinates moved along the relative positions, features updated
    from the summed messages. Padding atoms are masked out of every sum."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.message = nn.Sequential(nn.Linear(2 * hidden + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                     nn.SiLU())
        self.edge_weight = nn.Sequential(nn.Linear(hidden, 1), nn.Sigmoid())
        self.coordinate = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1, bias=False))
        self.update = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, h: torch.Tensor, x: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[1]
        relative = x[:, :, None] - x[:, None]
        distance2 = relative.pow(2).sum(-1, keepdim=True)
        both = torch.cat([h[:, :, None].expand(-1, -1, n, -1), h[:, None].expand(-1, n, -1, -1),
                          distance2.to(h.dtype)], -1)
        m = self.message(both)
        m = m * self.edge_weight(m) * pairs
        x = x + (relative * self.coordinate(m) * pairs).sum(2) / (n - 1)
        h = h + self.update(torch.cat([h, m.sum(2)], -1))
        return h, x


class EGNN(nn.Module):
    def __init__(self, elements: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(elements, hidden)
        self.layers = nn.ModuleList(EGNNLayer(hidden) for _ in range(depth))
        self.readout = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, elements: torch.Tensor, positions: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
        pairs = (atoms[:, :, None] & atoms[:, None]).unsqueeze(-1)
        pairs = pairs & ~torch.eye(atoms.shape[1], dtype=torch.bool, device=atoms.device)[..., None]
        h, x = self.embed(elements), positions
        for layer in self.layers:
            h, x = layer(h, x, pairs.to(h.dtype))
        return (self.readout(h).squeeze(-1) * atoms).sum(1)


class PaperAdamW:
    """AdamW as Loshchilov & Hutter write it, one parameter at a time (decoupled decay, bias-corrected moments)."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        for p, (m, v) in zip(self.params, self.moments):
            if p.grad is None:
                continue
            p.mul_(1 - self.lr * self.weight_decay)
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            m_hat = m / (1 - beta1 ** self.steps)
            v_hat = v / (1 - beta2 ** self.steps)
            p.addcdiv_(m_hat, v_hat.sqrt().add_(self.eps), value=-self.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


ELEMENTS = ("H", "C", "N", "O", "F")


def molecule_records(count: int, largest: int, rng: random.Random) -> list[dict]:
    """Molecules as a JSON loader hands them over: element symbols, nested coordinate lists, a target energy."""
    records = []
    for index in range(count):
        atoms = rng.randint(largest // 2, largest)
        symbols = [rng.choice(ELEMENTS) for _ in range(atoms)]
        positions = [[rng.gauss(0, 1.5) for _ in range(3)] for _ in range(atoms)]
        records.append({"id": f"mol-{index:06d}", "symbols": symbols, "positions": positions,
                        "energy": rng.gauss(-400.0, 40.0)})
    return records


def dense_molecules(records: list[dict], largest: int) -> tuple[torch.Tensor, ...]:
    """The records padded to `largest` atoms, as device tensors: element ids, positions, atom mask, energies."""
    elements = torch.zeros(len(records), largest, dtype=torch.long)
    positions = torch.zeros(len(records), largest, 3)
    atoms = torch.zeros(len(records), largest, dtype=torch.bool)
    for i, record in enumerate(records):
        n = len(record["symbols"])
        elements[i, :n] = torch.tensor([ELEMENTS.index(s) for s in record["symbols"]])
        positions[i, :n] = torch.tensor(record["positions"])
        atoms[i, :n] = True
    energies = torch.tensor([r["energy"] for r in records])
    energies = (energies - energies.mean()) / energies.std()
    return tuple(t.to(dev()) for t in (elements, positions, atoms, energies))


def egnn_python_adamw_gc_collect(fixes: Fixes) -> Step:
    """An EGNN regressing molecular energies (QM9-sized molecules of up to 29 atoms padded densely, all atom pairs
    as edges, 9 layers of width 128, 96 molecules a step, bf16 autocast). The optimizer is AdamW written out from
    the paper as a Python loop over the ~120 parameters, ten small kernels each; and a `gc.collect()` after every
    step, added while chasing a memory leak, walks the whole Python heap (the parsed JSON records are kept for
    their ids). Fixes: torch.optim.AdamW(fused=True) (optimizer_impl); no collect in the step (gc_pauses)."""
    hidden, depth, largest, batch = pick(128, 8), pick(9, 2), 29, pick(96, 4)
    records = molecule_records(pick(2000, 40), largest, random.Random(0))
    elements, positions, atoms, energies = dense_molecules(records, largest)
    model = EGNN(len(ELEMENTS), hidden, depth).to(dev())
    opt = fused_adamw(model.parameters()) if "optimizer_impl" in fixes else PaperAdamW(model.parameters())

    def step() -> float:
        picked = torch.randint(len(records), (batch,), device=dev())
        with autocast():
            predicted = model(elements[picked], positions[picked], atoms[picked])
        loss = F.mse_loss(predicted.float(), energies[picked])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if "gc_pauses" not in fixes:
            gc.collect()
        return value
    return step


# ------------------------------------------------------------------------------------------------ host_syncs

PAD, BOS, EOS = 0, 1, 2


class AdditiveAttention(nn.Module):
    """Bahdanau attention: score = v^T tanh(W_q state + W_k memory), masked softmax over source positions."""

    def __init__(self, query: int, keys: int, hidden: int) -> None:
        super().__init__()
        self.query, self.keys = nn.Linear(query, hidden, bias=False), nn.Linear(keys, hidden)
        self.score = nn.Linear(hidden, 1, bias=False)

    def forward(self, state: torch.Tensor, memory: torch.Tensor, projected: torch.Tensor,
                keep: torch.Tensor) -> torch.Tensor:
        scores = self.score(torch.tanh(projected + self.query(state)[:, None])).squeeze(-1)
        weights = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        return (weights[:, None] @ memory).squeeze(1)


class GRUTranslator(nn.Module):
    """A bidirectional GRU encoder and a GRUCell decoder with additive attention, run teacher-forced one target
    position at a time; the vocabulary projection runs once over all decoder states."""

    def __init__(self, vocab: int, width: int, hidden: int) -> None:
        super().__init__()
        self.source_embed, self.target_embed = nn.Embedding(vocab, width), nn.Embedding(vocab, width)
        self.encoder = nn.GRU(width, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.attention = AdditiveAttention(hidden, 2 * hidden, hidden)
        self.cell = nn.GRUCell(width + 2 * hidden, hidden)
        self.out = nn.Linear(3 * hidden, vocab)

    def forward(self, source: torch.Tensor, keep: torch.Tensor, target: torch.Tensor,
                stop_when_finished: bool) -> torch.Tensor:
        """Logits for target[:, 1:], from target[:, :-1] fed in; with `stop_when_finished` the loop ends early once
        every sentence of the batch has reached its EOS."""
        memory, _ = self.encoder(self.source_embed(source))
        pooled = (memory * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        state, projected = torch.tanh(self.bridge(pooled)), self.attention.keys(memory)
        inputs = self.target_embed(target[:, :-1])
        finished = torch.zeros(len(source), dtype=torch.bool, device=source.device)
        outputs = []
        for t in range(inputs.shape[1]):
            context = self.attention(state, memory, projected, keep)
            state = self.cell(torch.cat([inputs[:, t], context], -1), state)
            outputs.append(torch.cat([state, context], -1))
            if stop_when_finished:
                finished |= target[:, t + 1] == EOS
                if finished.all():
                    break
        return self.out(torch.stack(outputs, 1))


def parallel_sentences(pairs: int, source_length: int, target_length: int, vocab: int,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id sentence pairs, padded: sources [N, S]; targets [N, T + 1] as BOS, words, EOS, padding. About one
    target in eight fills the whole length, so nearly every batch holds one."""
    lengths = (torch.rand(pairs, generator=generator) * 1.15 * target_length).long().clamp(4, target_length - 1)
    words = torch.randint(3, vocab, (pairs, target_length + 1), generator=generator)
    position = torch.arange(target_length + 1)
    targets = torch.where(position <= lengths[:, None], words, PAD)
    targets[:, 0] = BOS
    targets[torch.arange(pairs), lengths] = EOS
    source_lengths = (lengths * source_length // target_length).clamp(2, source_length)
    sources = torch.where(torch.arange(source_length) < source_lengths[:, None],
                          torch.randint(3, vocab, (pairs, source_length), generator=generator), PAD)
    return sources, targets


def gru_translator_eos_break(fixes: Fixes) -> Step:
    """A GRU translation model (bidirectional GRU encoder of 512 per direction, GRUCell decoder with Bahdanau
    attention, vocabulary 8000, 256 sentence pairs of up to 48 source and 40 target tokens a step, fp32 with TF32
    matmuls, fused AdamW). The teacher-forced decoder loop keeps a `finished` flag per sentence and asks
    `if finished.all(): break` after every target position, to skip the padding once the batch is done: a Python
    bool of a device tensor, so each of the 40 positions waits for the GPU to drain before launching the next.
    The batch's longest sentence always runs to the end, so the check never saves work. Fix: no per-position
    check; the loop runs over the padded length and padding is ignored by the loss."""
    torch.backends.cuda.matmul.allow_tf32 = True
    vocab, width, hidden = pick(8000, 64), pick(256, 16), pick(512, 32)
    source_length, target_length, batch = pick(48, 8), pick(40, 6), pick(256, 8)
    sources, targets = parallel_sentences(pick(50_000, 64), source_length, target_length, vocab,
                                          torch.Generator().manual_seed(0))
    sources, targets = sources.to(dev()), targets.to(dev())
    model = GRUTranslator(vocab, width, hidden).to(dev())
    opt = fused_adamw(model.parameters())
    check_eos = "host_syncs" not in fixes

    def step() -> float:
        picked = torch.randint(len(sources), (batch,), device=dev())
        source, target = sources[picked], targets[picked]
        logits = model(source, source != PAD, target, stop_when_finished=check_eos)
        gold = target[:, 1:logits.shape[1] + 1]
        loss = F.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=PAD)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------- allocator_churn

def conv_gn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(min(32, cout // 2), cout),
                         nn.ReLU(inplace=True))


class FCOS(nn.Module):
    """FCOS: a plain strided conv backbone (C3-C5), an FPN (P3-P5) and a head shared over levels with a
    classification tower and a box tower of four conv-GN-ReLU each; per location class logits, l/t/r/b distances
    (exp, scaled per level) and a centerness logit."""

    def __init__(self, classes: int, base: int, fpn: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv_gn(3, base, 2), conv_gn(base, 2 * base, 2))
        self.c3 = nn.Sequential(conv_gn(2 * base, 4 * base, 2), conv_gn(4 * base, 4 * base))
        self.c4 = nn.Sequential(conv_gn(4 * base, 8 * base, 2), conv_gn(8 * base, 8 * base))
        self.c5 = nn.Sequential(conv_gn(8 * base, 16 * base, 2), conv_gn(16 * base, 16 * base))
        self.lateral = nn.ModuleList(nn.Conv2d(c * base, fpn, 1) for c in (4, 8, 16))
        self.smooth = nn.ModuleList(nn.Conv2d(fpn, fpn, 3, padding=1) for _ in range(3))
        self.cls_tower = nn.Sequential(*(conv_gn(fpn, fpn) for _ in range(4)))
        self.box_tower = nn.Sequential(*(conv_gn(fpn, fpn) for _ in range(4)))
        self.cls_logits = nn.Conv2d(fpn, classes, 3, padding=1)
        self.box_pred, self.centerness = nn.Conv2d(fpn, 4, 3, padding=1), nn.Conv2d(fpn, 1, 3, padding=1)
        self.scales = nn.Parameter(torch.ones(3))
        nn.init.constant_(self.cls_logits.bias, -math.log(99))

    def forward(self, images: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        c3 = self.c3(self.stem(images))
        c4 = self.c4(c3)
        c5 = self.c5(c4)
        p5 = self.lateral[2](c5)
        p4 = self.lateral[1](c4) + F.interpolate(p5, scale_factor=2.0)
        p3 = self.lateral[0](c3) + F.interpolate(p4, scale_factor=2.0)
        outputs = []
        for level, p in enumerate(smooth(p) for smooth, p in zip(self.smooth, (p3, p4, p5))):
            box_features = self.box_tower(p)
            outputs.append((self.cls_logits(self.cls_tower(p)),
                            torch.exp(self.scales[level] * self.box_pred(box_features)),
                            self.centerness(box_features)))
        return outputs


def fcos_targets(batch: int, side: int, classes: int, strides: tuple[int, ...],
                 generator: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Per level: class ids (-1 background, ~3% of locations positive), l/t/r/b distances in stride units and the
    centerness they imply."""
    levels = []
    for stride in strides:
        size = side // stride
        labels = torch.randint(classes, (batch, size, size), generator=generator)
        labels = torch.where(torch.rand(batch, size, size, generator=generator) < 0.03, labels, -1)
        ltrb = torch.rand(batch, 4, size, size, generator=generator) * 6 + 0.5
        centerness = ((ltrb[:, [0, 2]].min(1).values / ltrb[:, [0, 2]].max(1).values)
                      * (ltrb[:, [1, 3]].min(1).values / ltrb[:, [1, 3]].max(1).values)).sqrt()
        levels.append(tuple(t.to(dev()) for t in (labels, ltrb, centerness)))
    return levels


def iou_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """-log IoU of two boxes given as l/t/r/b distances from the same point ([B, 4, H, W] -> [B, H, W])."""
    area_p = (predicted[:, 0] + predicted[:, 2]) * (predicted[:, 1] + predicted[:, 3])
    area_t = (target[:, 0] + target[:, 2]) * (target[:, 1] + target[:, 3])
    overlap = ((torch.minimum(predicted[:, 0], target[:, 0]) + torch.minimum(predicted[:, 2], target[:, 2]))
               * (torch.minimum(predicted[:, 1], target[:, 1]) + torch.minimum(predicted[:, 3], target[:, 3])))
    return -torch.log((overlap + 1) / (area_p + area_t - overlap + 1))


def fcos_loss(outputs: list[tuple[torch.Tensor, ...]], targets: list[tuple[torch.Tensor, ...]],
              classes: int) -> torch.Tensor:
    """Focal loss over all locations, IoU and centerness losses on the positives (weighted, no boolean indexing),
    normalised by the number of positives."""
    focal, box, center, positives = 0.0, 0.0, 0.0, 0.0
    for (logits, ltrb, centerness), (labels, target_ltrb, target_center) in zip(outputs, targets):
        positive = (labels >= 0).float()
        one_hot = F.one_hot(labels.clamp(min=0), classes).permute(0, 3, 1, 2).float() * positive[:, None]
        focal = focal + sigmoid_focal_loss(logits.float(), one_hot).sum()
        box = box + (iou_loss(ltrb.float(), target_ltrb) * target_center * positive).sum()
        center = center + (F.binary_cross_entropy_with_logits(centerness.float().squeeze(1), target_center,
                                                               reduction="none") * positive).sum()
        positives = positives + positive.sum()
    positives = positives.clamp(min=1)
    return (focal + box + center) / positives


def sigmoid_focal_loss(logits: torch.Tensor, target: torch.Tensor, alpha: float = 0.25,
                            gamma: float = 2.0) -> torch.Tensor:
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    return (alpha * target + (1 - alpha) * (1 - target)) * ce * (1 - p_t) ** gamma


def fcos_empty_cache_twice(fixes: Fixes) -> Step:
    """FCOS training on 512x512 images (batch 16, 20 classes, backbone widths 64-1024, FPN and head of 256, P3-P5,
    bf16 autocast, fused AdamW). Worried about fragmentation out-of-memory errors, the loop calls
    torch.cuda.empty_cache() after the forward ('to make room for the backward') and again after the optimizer
    step: every step hands the cached blocks back to the driver and allocates them again with cudaMalloc, each
    cudaFree waiting for the device. Fix: no empty_cache calls."""
    classes, batch, side = 20, pick(16, 2), pick(512, 64)
    model = FCOS(classes, base=pick(64, 4), fpn=pick(256, 16)).to(dev())
    opt = fused_adamw(model.parameters())
    generator = torch.Generator().manual_seed(0)
    pool = pick(4, 1)
    images = [torch.randn(batch, 3, side, side, generator=generator).to(dev()) for _ in range(pool)]
    targets = [fcos_targets(batch, side, classes, (8, 16, 32), generator) for _ in range(pool)]
    turn = iter(range(10 ** 9))
    churn = "allocator_churn" not in fixes

    def step() -> float:
        i = next(turn) % pool
        with autocast():
            outputs = model(images[i])
        loss = fcos_loss(outputs, targets[i], classes)
        if churn:
            release_cached_memory()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if churn:
            release_cached_memory()
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------- precision

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, -1)
    return torch.cat([-second, first], -1)


class MultiScaleRetention(nn.Module):
    """RetNet's retention in its parallel form: (Q K^T * D) V with a per-head exponential decay mask D (rows
    normalised), rotary positions on Q and K, a per-head GroupNorm and a swish gate."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.g, self.o = (nn.Linear(width, width, bias=False) for _ in range(5))
        self.norm = nn.GroupNorm(heads, width)
        gammas = 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float))
        self.register_buffer("log_gamma", gammas.log(), persistent=False)

    def decay(self, length: int) -> torch.Tensor:
        n = torch.arange(length, device=self.log_gamma.device)
        distance = n[:, None] - n[None]
        mask = (distance.clamp(min=0)[None] * self.log_gamma[:, None, None]).exp() * (distance >= 0)
        return mask / mask.sum(-1, keepdim=True).sqrt()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(proj(x), self.heads) for proj in (self.q, self.k, self.v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = (q @ k.transpose(-2, -1)) * k.shape[-1] ** -0.5 * self.decay(x.shape[1])
        scores = scores / scores.sum(-1, keepdim=True).abs().clamp(min=1)
        retained = self.norm(merge_heads(scores @ v).transpose(1, 2)).transpose(1, 2)
        return self.o(F.silu(self.g(x)) * retained)


class RetNetBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.retention = MultiScaleRetention(width, heads)
        self.ffn = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.retention(self.norm1(x), cos, sin)
        return x + self.ffn(self.norm2(x))


class RetNet(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(RetNetBlock(width, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        head_width = width // heads
        angles = torch.arange(length)[:, None] * 10000 ** (-torch.arange(0, head_width, 2) / head_width)
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos[:tokens.shape[1]], self.sin[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def retnet_fp32_retention(fixes: Fixes) -> Step:
    """A RetNet language model (width 1024, 8 retention heads, 8 layers, FFN 2048, vocabulary 16k; 16 sequences of
    512 tokens a step, fused AdamW) trained in plain fp32: no autocast, and TF32 matmuls left at PyTorch's default
    (off), so every projection, retention product and the vocabulary head run as full-precision fp32 GEMMs. Fix:
    bf16 autocast around the forward."""
    vocab, width, heads, depth = pick(16_000, 128), pick(1024, 32), pick(8, 2), pick(8, 2)
    length, batch = pick(512, 16), pick(16, 2)
    model = RetNet(vocab, width, heads, depth, length).to(dev())
    opt = fused_adamw(model.parameters())
    corpus = torch.randint(vocab, (pick(2_000_000, 10_000),), device=dev())
    offsets = torch.arange(length + 1, device=dev())
    mixed = "precision" in fixes

    def step() -> float:
        starts = torch.randint(len(corpus) - length - 1, (batch, 1), device=dev())
        window = corpus[starts + offsets]
        with autocast(enabled=mixed):
            logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# --------------------------------------------------------------------------------------------- pageable_copy

class FeatureEncoder(nn.Module):
    """wav2vec 2.0's waveform encoder: seven strided 1-D convolutions (total stride 320, 20 ms frames at 16 kHz),
    GroupNorm after the first, GELU after each."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        shapes = [(10, 5)] + [(3, 2)] * 4 + [(2, 2)] * 2
        layers: list[nn.Module] = []
        for i, (kernel, stride) in enumerate(shapes):
            layers.append(nn.Conv1d(1 if i == 0 else channels, channels, kernel, stride, bias=False))
            if i == 0:
                layers.append(nn.GroupNorm(channels, channels))
            layers.append(nn.GELU())
        self.convs = nn.Sequential(*layers)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        return self.convs(waveform[:, None]).transpose(1, 2)


class GumbelQuantizer(nn.Module):
    """Product quantisation of the encoder features: `groups` codebooks of `entries`, picked by a straight-through
    Gumbel softmax; returns the quantised targets and the codebook-diversity penalty."""

    def __init__(self, features: int, groups: int, entries: int, dim: int) -> None:
        super().__init__()
        self.groups, self.entries = groups, entries
        self.logits = nn.Linear(features, groups * entries)
        self.codebook = nn.Parameter(torch.randn(groups, entries, dim // groups))
        self.project = nn.Linear(dim, dim)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = features.shape
        logits = self.logits(features).float().view(b, t, self.groups, self.entries)
        choice = F.gumbel_softmax(logits, tau=2.0, hard=True)
        codes = torch.einsum("btge,ged->btgd", choice, self.codebook).flatten(2)
        average = logits.softmax(-1).mean((0, 1))
        perplexity = torch.exp(-(average * (average + 1e-7).log()).sum(-1)).sum()
        diversity = (self.groups * self.entries - perplexity) / (self.groups * self.entries)
        return self.project(codes), diversity


class Wav2Vec2(nn.Module):
    def __init__(self, channels: int, width: int, heads: int, depth: int, code_dim: int) -> None:
        super().__init__()
        self.encoder = FeatureEncoder(channels)
        self.feature_norm, self.post = nn.LayerNorm(channels), nn.Linear(channels, width)
        self.mask_embedding = nn.Parameter(torch.rand(width))
        self.position = nn.Conv1d(width, width, 63, padding=31, groups=16)
        self.blocks = nn.ModuleList(SelfAttentionBlock(width, heads, 4 * width) for _ in range(depth))
        self.final = nn.Linear(width, code_dim)
        self.quantizer = GumbelQuantizer(channels, 2, 320, code_dim)

    def forward(self, waveform: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        features = self.feature_norm(self.encoder(waveform))
        targets, diversity = self.quantizer(features)
        x = self.post(features)
        x = torch.where(masked[..., None], self.mask_embedding.to(x.dtype), x)
        x = x + F.gelu(self.position(x.transpose(1, 2))).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.final(x), targets, diversity


def encoded_frames(samples: int) -> int:
    """How many frames the feature encoder makes of `samples` samples."""
    for kernel, stride in [(10, 5)] + [(3, 2)] * 4 + [(2, 2)] * 2:
        samples = (samples - kernel) // stride + 1
    return samples


def span_mask(batch: int, frames: int, p: float = 0.065, span: int = 10) -> torch.Tensor:
    """wav2vec 2.0's masking: each frame starts a masked span of `span` frames with probability p."""
    starts = torch.rand(batch, frames, device=dev()) < p
    return F.pad(starts, (span - 1, 0)).unfold(-1, span, 1).any(-1)


def contrastive_loss(context: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, distractors: int,
                     temperature: float = 0.1) -> torch.Tensor:
    """InfoNCE at the masked frames: the context vector against its own quantised target and `distractors` targets
    drawn uniformly from the same utterance (all frames scored, unmasked ones weighted out)."""
    b, t, _ = context.shape
    similarity = F.normalize(context.float(), dim=-1) @ F.normalize(targets.float(), dim=-1).transpose(1, 2)
    positive = similarity.diagonal(dim1=1, dim2=2)[..., None]
    drawn = torch.randint(t, (b, t, distractors), device=context.device)
    logits = torch.cat([positive, similarity.gather(2, drawn)], -1) / temperature
    per_frame = F.cross_entropy(logits.flatten(0, 1), torch.zeros(b * t, dtype=torch.long, device=context.device),
                                reduction="none").view(b, t)
    return (per_frame * masked).sum() / masked.sum().clamp(min=1)


def recorded_speech(clips: int, samples: int, rng: np.random.Generator) -> np.ndarray:
    """Speech-like float64 waveforms (as soundfile.read returns them): a few gliding harmonics under noise."""
    t = np.arange(samples) / 16_000
    pitch = rng.uniform(90, 250, size=(clips, 1))
    wave = sum(np.sin(2 * np.pi * pitch * (h + 1) * t * (1 + 0.05 * np.sin(t))) / (h + 1) for h in range(3))
    return wave + 0.05 * rng.standard_normal((clips, samples))


def wav2vec2_pageable_float64_audio(fixes: Fixes) -> Step:
    """wav2vec 2.0-style self-supervised pretraining (conv feature encoder of 128 channels, 4 Transformer layers of
    width 384, 2x320 Gumbel codebooks, 20 distractors; 48 clips of 16 s at 16 kHz a step, bf16 autocast, fused
    AdamW). The clips come as float64 numpy arrays, as soundfile reads them, and each batch (98 MB) goes to the
    GPU with `torch.from_numpy(batch).to('cuda')` from pageable memory: a staged, synchronous copy. Fix: the
    batches held in pinned memory and copied with non_blocking=True."""
    clips, samples = pick(48, 2), pick(256_000, 16_000)
    model = Wav2Vec2(pick(128, 8), pick(384, 32), pick(6, 2), pick(4, 1), pick(256, 16)).to(dev())
    opt = fused_adamw(model.parameters())
    rng = np.random.default_rng(0)
    batches = [recorded_speech(clips, samples, rng) for _ in range(pick(3, 1))]
    pinned_batches = [pinned(torch.from_numpy(b)) for b in batches] if "pageable_copy" in fixes else None
    frames = encoded_frames(samples)
    turn = iter(range(10 ** 9))

    def to_device(i: int) -> torch.Tensor:
        if pinned_batches is None:
            return torch.from_numpy(batches[i]).to(dev())
        return pinned_batches[i].to(dev(), non_blocking=True)

    def step() -> float:
        wave = to_device(next(turn) % len(batches)).float()
        wave = (wave - wave.mean(-1, keepdim=True)) / (wave.std(-1, keepdim=True) + 1e-5)
        with autocast():
            masked = span_mask(clips, frames)
            context, targets, diversity = model(wave, masked)
        loss = contrastive_loss(context, targets, masked, distractors=20) + 0.1 * diversity
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------ data_loader + activation_checkpointing

class BasicBlock3d(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm3d(cout),
                                  nn.ReLU(inplace=True), nn.Conv3d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm3d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv3d(cin, cout, 1, stride, bias=False), nn.BatchNorm3d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class R3D18(nn.Module):
    """R3D-18 (Tran et al. 2018): a ResNet-18 with 3x3x3 convolutions; `checkpointed` recomputes each of the four
    stages in the backward instead of keeping their activations."""

    def __init__(self, classes: int, base: int, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.stem = nn.Sequential(nn.Conv3d(3, base, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False),
                                  nn.BatchNorm3d(base), nn.ReLU(inplace=True))
        widths = [base, 2 * base, 4 * base, 8 * base]
        self.stages = nn.ModuleList(
            nn.Sequential(BasicBlock3d(widths[max(i - 1, 0)], w, 1 if i == 0 else 2), BasicBlock3d(w, w, 1))
            for i, w in enumerate(widths))
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        x = self.stem(clips)
        for stage in self.stages:
            x = checkpoint(stage, x, use_reentrant=False) if self.checkpointed else stage(x)
        return self.fc(x.mean((2, 3, 4)))


class YUVClips(Dataset):
    """Decoded videos kept as the decoder hands them over (YUV 4:2:0 planes). A sample is a random window of
    `frames` frames, randomly cropped, converted to RGB with BT.601 integer arithmetic and flipped: uint8
    [T, H, W, 3] and the video's label."""

    def __init__(self, videos: int, length: int, height: int, width: int, frames: int, crop: int, classes: int,
                 epoch: int) -> None:
        rng = np.random.default_rng(0)
        self.luma = rng.integers(16, 236, (videos, length, height, width), dtype=np.uint8)
        self.chroma = rng.integers(16, 240, (videos, 2, length, height // 2, width // 2), dtype=np.uint8)
        self.labels = rng.integers(classes, size=videos)
        self.frames, self.crop, self.epoch = frames, crop, epoch

    def __len__(self) -> int:
        return self.epoch

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(index)
        video = index % len(self.luma)
        start = int(rng.integers(self.luma.shape[1] - self.frames + 1))
        window = slice(start, start + self.frames)
        # the crop is taken first, at even offsets so that it starts on a chroma sample
        top = 2 * int(rng.integers((self.luma.shape[2] - self.crop) // 2 + 1))
        left = 2 * int(rng.integers((self.luma.shape[3] - self.crop) // 2 + 1))
        rows, columns = slice(top, top + self.crop), slice(left, left + self.crop)
        half_rows, half_columns = slice(top // 2, (top + self.crop) // 2), slice(left // 2, (left + self.crop) // 2)
        y = self.luma[video, window, rows, columns].astype(np.int16)
        u, v = (plane.astype(np.int16).repeat(2, 1).repeat(2, 2) - 128
                for plane in self.chroma[video, :, window, half_rows, half_columns])
        rgb = np.stack([y + ((359 * v) >> 8), y - ((88 * u + 183 * v) >> 8), y + ((454 * u) >> 8)], -1)
        rgb = rgb.clip(0, 255).astype(np.uint8)
        if rng.random() < 0.5:
            rgb = rgb[:, :, ::-1]
        return np.ascontiguousarray(rgb), int(self.labels[video])


def endless(loader: DataLoader) -> Iterator:
    while True:
        yield from loader


def r3d_yuv_loader_checkpointed(fixes: Fixes) -> Step:
    """R3D-18 action recognition (16-frame 112x112 clips, 400 classes, batch 16, bf16 autocast, fused AdamW). The
    DataLoader runs in the training process (num_workers=0): each clip's 16 frames are cropped and converted from
    YUV 4:2:0 to RGB in numpy, and flipped before the GPU can start. And every ResNet stage is wrapped in
    torch.utils.checkpoint, copied from a long-clip config, though the activations take a few GB of the 80: the
    forward runs twice. Fixes: num_workers=8 with persistent workers and prefetching (data_loader); no
    checkpointing (activation_checkpointing)."""
    classes, batch, frames, crop = 400, pick(16, 2), pick(16, 4), pick(112, 16)
    dataset = YUVClips(pick(24, 2), pick(48, 8), pick(120, 24), pick(160, 32), frames, crop, classes, epoch=4096)
    workers = pick(8, 2) if "data_loader" in fixes else 0
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                        pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                        prefetch_factor=4 if workers else None)
    clips = endless(loader)
    model = R3D18(classes, pick(64, 4), checkpointed="activation_checkpointing" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    mean = torch.tensor([0.43, 0.39, 0.38], device=dev()).view(1, 3, 1, 1, 1) * 255
    std = torch.tensor([0.23, 0.22, 0.22], device=dev()).view(1, 3, 1, 1, 1) * 255

    def step() -> float:
        frames_uint8, labels = next(clips)
        video = frames_uint8.to(dev(), non_blocking=True).permute(0, 4, 1, 2, 3).float()
        with autocast():
            logits = model((video - mean) / std)
        loss = F.cross_entropy(logits.float(), labels.to(dev(), non_blocking=True))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------- host_work + eager_attention

CLS_ID, UNK_ID = 1, 2
WORD_PATTERN = re.compile(r"\w+|[^\w\s]")


class BasicTokenizer:
    """A BERT-style basic tokenizer: lower-case, split words from punctuation with a regex, look each piece up in
    the vocabulary; [CLS] first, truncated and padded to a fixed length."""

    def __init__(self, vocabulary: list[str]) -> None:
        self.ids = {word: i + 3 for i, word in enumerate(vocabulary)}
        self.ids.update({",": len(vocabulary) + 3, ".": len(vocabulary) + 4})
        self.size = len(self.ids) + 3

    def encode(self, text: str, length: int) -> list[int]:
        ids = [CLS_ID] + [self.ids.get(piece, UNK_ID) for piece in WORD_PATTERN.findall(text.lower())]
        ids = ids[:length]
        return ids + [PAD] * (length - len(ids))

    def __call__(self, texts: list[str], length: int) -> torch.Tensor:
        return torch.tensor([self.encode(text, length) for text in texts])


def made_up_words(count: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return list({"".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(count)})


def retrieval_pairs(count: int, vocabulary: list[str], passage_words: int,
                    rng: random.Random) -> list[tuple[str, str]]:
    """(query, passage) pairs: Zipf-distributed words with punctuation, the query a few of its passage's words."""
    weights = [1 / (rank + 1) for rank in range(len(vocabulary))]
    pairs = []
    for _ in range(count):
        words = rng.choices(vocabulary, weights, k=rng.randint(passage_words * 2 // 3, passage_words))
        passage = " ".join(w + ("." if i % 17 == 16 else "," if i % 7 == 6 else "") for i, w in enumerate(words))
        query = " ".join(rng.sample(words, min(len(words), rng.randint(6, 20)))).capitalize() + "?"
        pairs.append((query, passage.capitalize()))
    return pairs


class BiEncoder(nn.Module):
    """A BERT-style encoder shared by queries and passages, mean-pooled over the non-padding tokens."""

    def __init__(self, vocab: int, width: int, heads: int, depth: int, length: int, eager: bool) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Parameter(0.02 * torch.randn(length, width))
        self.blocks = nn.ModuleList(SelfAttentionBlock(width, heads, 4 * width, eager=eager) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        real = tokens != PAD
        x = self.embed(tokens) + self.position[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x, real[:, None, None])
        x = self.norm(x) * real[..., None]
        return x.sum(1) / real.sum(1, keepdim=True)


def biencoder_regex_tokenizer_eager(fixes: Fixes) -> Step:
    """A sentence-embedding bi-encoder trained with in-batch negatives (6-layer BERT-style encoder of width 512,
    8 heads; 128 query/passage pairs a step, queries 64 and passages 256 tokens; symmetric InfoNCE at temperature
    0.05; bf16 autocast, fused AdamW). The raw text of each batch is tokenized in the step by a regex basic
    tokenizer in Python (some 40k pieces) while the GPU waits; and the attention is written out as
    softmax(QK^T)V under the padding mask, materialising [256, 8, 256, 256] scores in every layer. Fixes: the
    corpus tokenized once before training, batches gathered on the device (host_work); SDPA with the padding
    mask (eager_attention)."""
    width, heads, depth = pick(512, 32), pick(8, 2), pick(6, 1)
    query_length, passage_length, batch = pick(64, 8), pick(256, 16), pick(128, 4)
    rng = random.Random(0)
    vocabulary = made_up_words(pick(30_000, 200), rng)
    pairs = retrieval_pairs(pick(4000, 32), vocabulary, passage_length, rng)
    tokenizer = BasicTokenizer(vocabulary)
    model = BiEncoder(tokenizer.size, width, heads, depth, passage_length,
                      eager="eager_attention" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    pretokenized = "host_work" in fixes
    if pretokenized:
        queries = tokenizer([q for q, _ in pairs], query_length).to(dev())
        passages = tokenizer([p for _, p in pairs], passage_length).to(dev())

    def batch_tokens() -> tuple[torch.Tensor, torch.Tensor]:
        if pretokenized:
            picked = torch.randint(len(pairs), (batch,), device=dev())
            return queries[picked], passages[picked]
        chosen = rng.sample(pairs, batch)
        return (tokenizer([q for q, _ in chosen], query_length).to(dev()),
                tokenizer([p for _, p in chosen], passage_length).to(dev()))

    def step() -> float:
        query_tokens, passage_tokens = batch_tokens()
        with autocast():
            q = F.normalize(model(query_tokens).float(), dim=-1)
            p = F.normalize(model(passage_tokens).float(), dim=-1)
        scores = q @ p.T / 0.05
        labels = torch.arange(len(scores), device=dev())
        loss = (F.cross_entropy(scores, labels) + F.cross_entropy(scores.T, labels)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------------ healthy

class CrossAttentionBlock(nn.Module):
    """Perceiver cross-attention: queries of one width attend to inputs of another (SDPA), then a GELU MLP on the
    queries; `residual` off for the decoder's output queries, as in Perceiver IO."""

    def __init__(self, query_width: int, input_width: int, width: int, heads: int, residual: bool = True) -> None:
        super().__init__()
        self.heads, self.residual = heads, residual
        self.query_norm, self.input_norm = nn.LayerNorm(query_width), nn.LayerNorm(input_width)
        self.q, self.kv = nn.Linear(query_width, width), nn.Linear(input_width, 2 * width)
        self.proj = nn.Linear(width, query_width)
        self.mlp = nn.Sequential(nn.LayerNorm(query_width), nn.Linear(query_width, 4 * query_width), nn.GELU(),
                                 nn.Linear(4 * query_width, query_width))

    def forward(self, queries: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        q = heads_of(self.q(self.query_norm(queries)), self.heads)
        k, v = (heads_of(t, self.heads) for t in self.kv(self.input_norm(inputs)).chunk(2, -1))
        attended = self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v)))
        x = queries + attended if self.residual else attended
        return x + self.mlp(x)


class PerceiverIO(nn.Module):
    """Perceiver IO over UTF-8 bytes: inputs cross-attended into a latent array, latent self-attention blocks, and
    position queries decoding every input position from the latents."""

    def __init__(self, length: int, input_width: int, latents: int, latent_width: int, heads: int,
                 depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(258, input_width)
        self.position = nn.Parameter(0.02 * torch.randn(length, input_width))
        self.latents = nn.Parameter(0.02 * torch.randn(latents, latent_width))
        self.encode = CrossAttentionBlock(latent_width, input_width, latent_width, heads)
        self.process = nn.ModuleList(
            SelfAttentionBlock(latent_width, heads, 4 * latent_width) for _ in range(depth))
        self.output_queries = nn.Parameter(0.02 * torch.randn(length, input_width))
        self.decode = CrossAttentionBlock(input_width, latent_width, latent_width, heads, residual=False)
        self.head = nn.Linear(input_width, 258)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs = self.embed(tokens) + self.position
        z = self.encode(self.latents.expand(len(tokens), -1, -1), inputs)
        for block in self.process:
            z = block(z)
        return self.head(self.decode(self.output_queries.expand(len(tokens), -1, -1), z))


MASK_BYTE = 256


def healthy_perceiver_io_bytes(fixes: Fixes) -> Step:
    """Perceiver IO masked language modelling on raw UTF-8 bytes (2048 bytes of width 256 into 256 latents of
    width 1024, 12 latent self-attention blocks of 8 heads, 2048 decoder queries; 64 sequences a step, 15% of
    bytes masked, loss on the masked bytes by weight). bf16 autocast, SDPA everywhere, fused AdamW, batches
    masked on the device, one loss `.item()` at the end."""
    length, batch = pick(2048, 64), pick(64, 2)
    model = PerceiverIO(length, pick(256, 16), pick(256, 8), pick(1024, 32), pick(8, 2), pick(12, 1)).to(dev())
    opt = fused_adamw(model.parameters())
    text = torch.randint(32, 127, (pick(8_000_000, 20_000),), dtype=torch.long, device=dev())
    offsets = torch.arange(length, device=dev())

    def step() -> float:
        starts = torch.randint(len(text) - length, (batch, 1), device=dev())
        original = text[starts + offsets]
        masked = torch.rand(batch, length, device=dev()) < 0.15
        with autocast():
            logits = model(torch.where(masked, MASK_BYTE, original))
        per_byte = F.cross_entropy(logits.float().flatten(0, 1), original.flatten(), reduction="none")
        loss = (per_byte * masked.flatten()).sum() / masked.sum().clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


class ConditionalBatchNorm(nn.Module):
    """BigGAN's class-conditional BatchNorm: gains and biases predicted from the shared class embedding and z."""

    def __init__(self, channels: int, condition: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels, affine=False)
        self.gain, self.bias = nn.Linear(condition, channels), nn.Linear(condition, channels)

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * (1 + self.gain(condition)[..., None, None]) + self.bias(condition)[..., None, None]


class GeneratorBlock(nn.Module):
    def __init__(self, cin: int, cout: int, condition: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = ConditionalBatchNorm(cin, condition), ConditionalBatchNorm(cout, condition)
        self.conv1, self.conv2 = nn.Conv2d(cin, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(F.relu(self.norm1(x, condition)), scale_factor=2.0)
        h = self.conv2(F.relu(self.norm2(self.conv1(h), condition)))
        return h + self.shortcut(F.interpolate(x, scale_factor=2.0))


class Generator(nn.Module):
    def __init__(self, z_dim: int, classes: int, ch: int) -> None:
        super().__init__()
        self.ch = ch
        self.embed = nn.Embedding(classes, 128)
        self.linear = nn.Linear(z_dim, 16 * ch * 4 * 4)
        widths = [16 * ch, 8 * ch, 4 * ch, 2 * ch, ch]
        self.blocks = nn.ModuleList(GeneratorBlock(a, b, z_dim + 128) for a, b in zip(widths, widths[1:]))
        self.out = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, 3, 3, padding=1), nn.Tanh())

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        condition = torch.cat([z, self.embed(labels)], -1)
        x = self.linear(z).view(len(z), 16 * self.ch, 4, 4).contiguous(memory_format=torch.channels_last)
        for block in self.blocks:
            x = block(x, condition)
        return self.out(x)


class DiscriminatorBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(cin, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(F.relu(self.conv1(F.relu(x))))
        return F.avg_pool2d(h, 2) + F.avg_pool2d(self.shortcut(x), 2)


class ProjectionDiscriminator(nn.Module):
    def __init__(self, classes: int, ch: int) -> None:
        super().__init__()
        widths = [3, ch, 2 * ch, 4 * ch, 8 * ch, 16 * ch]
        self.blocks = nn.Sequential(*(DiscriminatorBlock(a, b) for a, b in zip(widths, widths[1:])))
        self.linear, self.embed = nn.Linear(16 * ch, 1), nn.Embedding(classes, 16 * ch)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.blocks(images)).sum((2, 3))
        return self.linear(h).squeeze(-1) + (self.embed(labels) * h).sum(-1)


def blob_images(count: int, side: int, classes: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """'Real' images: smooth colour fields (upsampled noise) whose mean hue depends on the class."""
    labels = torch.randint(classes, (count,), generator=generator)
    hue = torch.stack([torch.sin(labels * 0.7 + k) for k in range(3)], 1)[..., None, None]
    noise = F.interpolate(torch.randn(count, 3, side // 8, side // 8, generator=generator), size=side,
                          mode="bilinear", align_corners=False)
    images = torch.tanh(0.5 * noise + hue)
    return images.to(dev()).contiguous(memory_format=torch.channels_last), labels.to(dev())


def healthy_biggan_hinge_bf16(fixes: Fixes) -> Step:
    """A BigGAN-style class-conditional GAN at 64x64 (generator with conditional BatchNorm and residual up-blocks,
    projection discriminator with residual down-blocks, ch 64, 100 classes, hinge loss; 256 images a step, one
    discriminator and one generator update). bf16 autocast, channels_last, fused Adam (betas 0, 0.999), real
    images on the device, both losses read with one `.tolist()` at the end."""
    classes, z_dim, ch, batch, side = 100, 120, pick(64, 4), pick(256, 4), 64
    generator, discriminator = Generator(z_dim, classes, ch), ProjectionDiscriminator(classes, ch)
    generator = generator.to(dev(), memory_format=torch.channels_last)
    discriminator = discriminator.to(dev(), memory_format=torch.channels_last)
    g_opt = torch.optim.Adam(generator.parameters(), lr=5e-5, betas=(0.0, 0.999), fused=True)
    d_opt = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.0, 0.999), fused=True)
    images, labels = blob_images(pick(8192, 16), side, classes, torch.Generator().manual_seed(0))

    def step() -> list[float]:
        picked = torch.randint(len(images), (batch,), device=dev())
        z, fake_labels = torch.randn(batch, z_dim, device=dev()), torch.randint(classes, (batch,), device=dev())
        with autocast():
            fake = generator(z, fake_labels)
            d_loss = (F.relu(1 - discriminator(images[picked], labels[picked]).float()).mean()
                      + F.relu(1 + discriminator(fake.detach(), fake_labels).float()).mean())
        d_loss.backward()
        d_opt.step()
        d_opt.zero_grad(set_to_none=True)
        with autocast():
            g_loss = -discriminator(fake, fake_labels).float().mean()
        g_loss.backward()
        g_opt.step()
        g_opt.zero_grad(set_to_none=True)
        d_opt.zero_grad(set_to_none=True)
        return torch.stack([d_loss.detach(), g_loss.detach()]).tolist()
    return step


# --------------------------------------------------------------------------------------------- recompilation

class DraftDecoder(nn.Module):
    """An EAGLE-style draft model: the target model's (frozen) token embeddings, one causal decoder layer and a
    vocabulary head, trained to predict the next token."""

    def __init__(self, vocab: int, width: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.embed.weight.requires_grad_(False)
        self.layer = SelfAttentionBlock(width, heads, 4 * width, causal=True)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layer(self.embed(tokens))))


def length_grouped_batches(lengths: np.ndarray, batch: int, multiple: int,
                           rng: np.random.Generator) -> Iterator[tuple[np.ndarray, int]]:
    """A length-grouped sampler (as Hugging Face's group_by_length): sequences sorted by length, cut into
    batches, the batches shuffled; each padded to its longest, rounded up to `multiple` (pad_to_multiple_of)."""
    order = np.argsort(lengths, kind="stable")
    groups = [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
    while True:
        for g in rng.permutation(len(groups)):
            longest = int(lengths[groups[g]].max())
            yield groups[g], -(-longest // multiple) * multiple


def eagle_draft_compiled_ragged(fixes: Fixes) -> Step:
    """Distilling an EAGLE-style draft model for speculative decoding (vocabulary 32k, width 1024, one decoder
    layer with 16 heads; 32 conversations a step, 64 to 1024 tokens, bf16 autocast, fused AdamW). The model is
    wrapped in torch.compile(dynamic=False) ('static shapes give the fastest kernels') and
    torch._dynamo.config.cache_size_limit raised to silence the recompile warning, while the length-grouped
    sampler pads each batch only to its own longest sequence (a multiple of 8): almost every step brings a new
    sequence length, and the forward and backward are compiled again. The batches are shuffled afresh each run
    (unseeded), so that no cache left by an earlier run has seen their shapes. Fix: torch.compile(dynamic=True),
    one graph for every length."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    vocab, width, heads, batch = pick(32_000, 128), pick(1024, 32), pick(16, 2), pick(32, 2)
    shortest, longest, multiple = pick(64, 8), pick(1024, 16), pick(8, 8)
    conversations = pick(40_000, 64)
    rng = np.random.default_rng()
    lengths = rng.integers(shortest, longest + 1, size=conversations)
    tokens = torch.randint(3, vocab, (conversations, longest + multiple), device=dev())
    positions = torch.arange(longest + multiple, device=dev())
    real_lengths = torch.from_numpy(lengths).to(dev())
    model = DraftDecoder(vocab, width, heads).to(dev())
    opt = fused_adamw([p for p in model.parameters() if p.requires_grad])
    compiled = torch.compile(model, dynamic="recompilation" in fixes)
    batches = length_grouped_batches(lengths, batch, multiple, rng)

    def step() -> float:
        group, padded = next(batches)
        picked = torch.from_numpy(group).to(dev())
        sequence = tokens[picked, :padded + 1]
        sequence = torch.where(positions[:padded + 1] < real_lengths[picked, None], sequence, PAD)
        with autocast():
            logits = compiled(sequence[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), sequence[:, 1:].flatten(), ignore_index=PAD)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


PROGRAMS = {
    "egnn_python_adamw_gc_collect": ["optimizer_impl", "gc_pauses"],
    "gru_translator_eos_break": ["host_syncs"],
    "fcos_empty_cache_twice": ["allocator_churn"],
    "retnet_fp32_retention": ["precision"],
    "wav2vec2_pageable_float64_audio": ["pageable_copy"],
    "r3d_yuv_loader_checkpointed": ["data_loader", "activation_checkpointing"],
    "biencoder_regex_tokenizer_eager": ["host_work", "eager_attention"],
    "healthy_perceiver_io_bytes": [],
    "healthy_biggan_hinge_bf16": [],
    "eagle_draft_compiled_ragged": ["recompilation"],
}
WITH_STACK = {"egnn_python_adamw_gc_collect", "biencoder_regex_tokenizer_eager", "gru_translator_eos_break"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set_fixes(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
