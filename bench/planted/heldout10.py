"""A tenth held-out check of the advisor: ten programs of other architectures than bench/planted/corpus.py's and
heldout.py's to heldout9.py's (MobileNetV3, a Conformer-CTC speech recognizer, TabNet, a DreamerV2 world model,
Demucs, MoCo v3, an AlphaFold-style Evoformer, the Temporal Fusion Transformer, S4D and Longformer), six with one
planted problem, two with two at once and two healthy, written without reading the advisor's rules, with the same
output format (OUT/NAME/trace + planted.json), scored the same way:

    python bench/planted/heldout10.py OUT                  # on a GPU
    python bench/planted/heldout10.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout10.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT
    python bench/planted/fix_timelines.py heldout10 OUT2 NAME [NAME ...]   # a program as written and fixed

The programs, one sentence each:

    mobilenetv3_grad_norm_items     a MobileNetV3-Large ImageNet classifier whose training monitor reads the
                                    gradient norm and the weight norm of each of its parameters with `.item()`
                                    between the backward and the optimizer step (host_syncs)
    conformer_ctc_fbank_collate     a Conformer-CTC speech recognizer whose collate function computes every
                                    utterance's log-mel filterbank and SpecAugment masks in numpy, one utterance at a
                                    time, in a DataLoader with num_workers=0 (data_loader)
    tabnet_ghost_bn_chunks          TabNet on Covertype-sized tabular data whose ghost batch normalization runs
                                    BatchNorm1d on each 512-row virtual batch in a Python loop (launch_bound)
    dreamer_rssm_batch_16           a DreamerV2 world model (conv encoder and decoder, a categorical RSSM unrolled
                                    over 50 steps) trained with the paper's 16 sequences a step (tiny_batch)
    demucs_pageable_stems           Demucs music source separation whose stems are cached in ordinary (pageable)
                                    host memory and copied to the GPU segment by segment (pageable_copy)
    mocov3_fp32_momentum_encoder    MoCo v3 with a ViT-S/16 whose momentum encoder runs its forward in a no_grad
                                    block written after the autocast block, in fp32 (precision)
    evoformer_empty_cache_eager     an AlphaFold-style Evoformer stack whose gated attentions are written out as
                                    softmax(QK^T + bias)V and which empties the CUDA cache after every step
                                    (allocator_churn, eager_attention)
    tft_host_calendar_foreach_adam  a Temporal Fusion Transformer on electricity-load windows whose calendar
                                    covariates are built from datetimes in Python each step and whose Adam runs with
                                    foreach=False over 310 parameter tensors (host_work, optimizer_impl)
    healthy_s4d_speech_commands     an S4D classifier on raw one-second 16 kHz clips, bf16 projections and fp32 FFT
                                    convolutions
    healthy_longformer_mlm_4096     Longformer masked language modelling on 4096-token documents, its sliding-window
                                    attention as blocked SDPA calls, bf16

Each program's `build(fixes)` returns one training step; each problem sits behind `if CAUSE not in fixes` (or a
choice made from `fixes`) and its fix is what a user would change. A cause's planted cost is the step as written
less the step with that cause alone fixed; fixed_step_ms has every cause fixed (medians of 7 steps, each between
two synchronizes, profiler off). The tiny-batch program reports its times for the samples of the fixed batch (the
small step times the steps it takes to see them); its trace records single small steps. The programs read their
loss with `.item()` at the end of the step, as a loop that logs every step does (the tiny-batch one reads
nothing), so the traces of those whose problem is on the host serialise as their timing. No program here
compiles or collects garbage by hand, so the order of the programs does not matter. Without a GPU the CUDA-only
parts (pinned memory, torch.cuda.empty_cache, autocast LSTMs) are skipped, so in smoke mode a fix may time the same as
its problem.
"""

from __future__ import annotations

import bisect
import copy
import datetime
import itertools
import math
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from harness import (PerSamples, autocast, dev, heads_of, mel_filterbank, merge_heads, on_gpu, pick, pinned,
                     release_cached_memory, run_set_fixes)

Fixes = frozenset[str]
Step = Callable[[], object]


def adam(params, lr: float, **options) -> torch.optim.Adam:
    """Adam, fused where there is a GPU (the fused kernels are CUDA-only)."""
    return torch.optim.Adam(params, lr=lr, fused=on_gpu(), **options)


def adamw(params, lr: float, **options) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, fused=on_gpu(), **options)


def endless(loader: DataLoader) -> Iterator:
    while True:
        yield from loader


def lstm_autocast() -> torch.autocast:
    """Autocast for nn.LSTM on the GPU (where autocast runs cuDNN's LSTM in fp16); on the CPU, where oneDNN has no
    bf16 LSTM, the LSTM runs in fp32 (smoke mode only)."""
    return torch.autocast(dev(), dtype=torch.bfloat16, enabled=on_gpu())


class SelfAttentionBlock(nn.Module):
    """A pre-norm Transformer block: multi-head self-attention (SDPA) and a GELU MLP."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        x = x + self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v)))
        return x + self.mlp(self.norm2(x))


# ------------------------------------------------------------------------------------------------ host_syncs

def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1,
            activation: type[nn.Module] | None = None) -> nn.Sequential:
    """A bias-free convolution and BatchNorm (TF's epsilon and momentum), optionally an activation."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01)]
    if activation is not None:
        layers.append(activation())
    return nn.Sequential(*layers)


def make_divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class SqueezeExcite(nn.Module):
    """MobileNetV3's squeeze-and-excitation: global average, a quarter-width 1x1 bottleneck, hard sigmoid."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        squeeze = make_divisible(channels / 4)
        self.reduce, self.expand = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidual(nn.Module):
    """MobileNetV3's bneck: 1x1 expansion, depthwise convolution, optional squeeze-excite, linear 1x1 projection."""

    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, squeeze_excite: bool, hard_swish: bool,
                 stride: int) -> None:
        super().__init__()
        activation = nn.Hardswish if hard_swish else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(conv_bn(cin, expanded, 1, activation=activation))
        layers.append(conv_bn(expanded, expanded, kernel, stride, groups=expanded, activation=activation))
        if squeeze_excite:
            layers.append(SqueezeExcite(expanded))
        layers.append(conv_bn(expanded, cout, 1))
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


MOBILENETV3_LARGE = [  # kernel, expanded, out, squeeze-excite, hard-swish, stride
    (3, 16, 16, False, False, 1), (3, 64, 24, False, False, 2), (3, 72, 24, False, False, 1),
    (5, 72, 40, True, False, 2), (5, 120, 40, True, False, 1), (5, 120, 40, True, False, 1),
    (3, 240, 80, False, True, 2), (3, 200, 80, False, True, 1), (3, 184, 80, False, True, 1),
    (3, 184, 80, False, True, 1), (3, 480, 112, True, True, 1), (3, 672, 112, True, True, 1),
    (5, 672, 160, True, True, 2), (5, 960, 160, True, True, 1), (5, 960, 160, True, True, 1)]


class MobileNetV3(nn.Module):
    """MobileNetV3-Large (Howard et al. 2019): a hard-swish stem, fifteen bnecks, a 960-channel 1x1 convolution,
    global pooling and a 1280-wide classifier with dropout."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [conv_bn(3, 16, 3, 2, activation=nn.Hardswish)]
        cin = 16
        for kernel, expanded, cout, squeeze_excite, hard_swish, stride in MOBILENETV3_LARGE:
            layers.append(InvertedResidual(cin, kernel, expanded, cout, squeeze_excite, hard_swish, stride))
            cin = cout
        layers.append(conv_bn(cin, 960, 1, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(960, 1280), nn.Hardswish(), nn.Dropout(0.2),
                                        nn.Linear(1280, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class LayerStatsMonitor:
    """A training monitor's per-layer dashboard: the gradient norm and the weight norm of every parameter, logged
    every step (the last 100 steps kept)."""

    def __init__(self, model: nn.Module) -> None:
        self.names, self.params = zip(*model.named_parameters())
        self.keys = [f"grad_norm/{n}" for n in self.names] + [f"weight_norm/{n}" for n in self.names]
        self.history: list[dict[str, float]] = []

    def read_each(self) -> dict[str, float]:
        """As the monitor was written: each statistic a Python float, read with `.item()` as it is computed."""
        grads = {f"grad_norm/{n}": p.grad.norm().item() for n, p in zip(self.names, self.params)}
        weights = {f"weight_norm/{n}": p.detach().norm().item() for n, p in zip(self.names, self.params)}
        return {**grads, **weights}

    def gather(self) -> torch.Tensor:
        """Every statistic in one device tensor, read later together with the loss."""
        grads = torch._foreach_norm([p.grad for p in self.params])
        weights = torch._foreach_norm([p.detach() for p in self.params])
        return torch.stack([*grads, *weights])

    def record(self, stats: dict[str, float]) -> None:
        self.history = self.history[-99:] + [stats]


def imagenet_like_pool(count: int, side: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [count, 3, side, side] on the device, each a smooth colour field under noise, and labels."""
    fields = F.interpolate(torch.rand(count, 3, 8, 8, device=dev()), size=side, mode="bicubic", align_corners=False)
    images = ((0.7 * fields + 0.3 * torch.rand(count, 3, side, side, device=dev())).clamp(0, 1) * 255)
    return images.to(torch.uint8), torch.randint(classes, (count,), device=dev())


def mobilenetv3_grad_norm_items(fixes: Fixes) -> Step:
    """MobileNetV3-Large on ImageNet-sized data (224x224 random crops with flips from 256x256 images on the device,
    1000 classes; 128 images a step, the paper's per-chip batch; label-smoothed cross-entropy; bf16 autocast,
    channels_last; RMSprop with momentum 0.9, TF-style epsilon and weight decay 1e-5, as the paper trains it). A
    training monitor feeds a per-layer dashboard: after the backward it reads the gradient norm and the weight
    norm of each of the 174 parameter tensors with `.item()`, 348 small reductions each followed by a wait for
    the GPU and a copy to the host, while the optimizer step waits behind them. Fix: the same norms computed with
    torch._foreach_norm into one device tensor and read with the loss at the end of the step (one transfer)."""
    classes, side, crop, batch = 1000, pick(256, 40), pick(224, 32), pick(128, 2)
    model = MobileNetV3(classes).to(dev()).to(memory_format=torch.channels_last)
    opt = torch.optim.RMSprop(model.parameters(), lr=0.1 * batch / 4096, alpha=0.9, eps=0.0316, momentum=0.9,
                              weight_decay=1e-5, foreach=True)
    monitor = LayerStatsMonitor(model)
    pool, pool_labels = imagenet_like_pool(pick(1024, 8), side, classes)
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev()).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev()).view(1, 3, 1, 1) * 255
    rng = np.random.default_rng(0)
    read_each = "host_syncs" not in fixes

    def images() -> tuple[torch.Tensor, torch.Tensor]:
        picked = torch.randint(len(pool), (batch,), device=dev())
        top, left = (int(v) for v in rng.integers(0, side - crop + 1, size=2))
        x = pool[picked, :, top:top + crop, left:left + crop]
        x = torch.where(torch.rand(batch, 1, 1, 1, device=dev()) < 0.5, x.flip(-1), x)
        return ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last), pool_labels[picked]

    def step() -> float:
        x, labels = images()
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
        loss.backward()
        if read_each:
            stats = monitor.read_each()
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()
        else:
            gathered = monitor.gather()
            opt.step()
            opt.zero_grad(set_to_none=True)
            value, *numbers = torch.cat([loss.detach()[None], gathered]).tolist()
            stats = dict(zip(monitor.keys, numbers))
        monitor.record(stats)
        return value
    return step


# ----------------------------------------------------------------------------------------------- data_loader

SPEECH_RATE, FRAME, FRAME_HOP, SPEECH_FFT, FBANKS = 16_000, 400, 160, 512, 80
ALPHABET = " 'abcdefghijklmnopqrstuvwxyz"
CHAR_IDS = {c: i + 1 for i, c in enumerate(ALPHABET)}  # 0 is the CTC blank


def made_up_words(count: int, rng: np.random.Generator) -> list[str]:
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    return ["".join(rng.choice(list(consonants)) + rng.choice(list(vowels))
                    for _ in range(int(rng.integers(1, 4)))) for _ in range(count)]


def spoken_utterances(count: int, seconds: tuple[float, float],
                      rng: np.random.Generator) -> list[tuple[np.ndarray, str]]:
    """LibriSpeech-like utterances as a FLAC reader hands them over (int16 at 16 kHz) with their transcripts: eight
    harmonics of a pitch glide weighted by two formant-like resonances, syllable-rate amplitude modulation, noise;
    about 14 characters of transcript a second."""
    vocabulary = made_up_words(2000, rng)
    utterances = []
    for _ in range(count):
        t = np.arange(int(rng.uniform(*seconds) * SPEECH_RATE)) / SPEECH_RATE
        pitch = rng.uniform(90, 220) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.2, 1.0) * t))
        phase = 2 * np.pi * np.cumsum(pitch) / SPEECH_RATE
        formants = rng.uniform(300, 900), rng.uniform(1000, 2500)
        voiced = sum(np.sin(h * phase) * sum(math.exp(-((h * pitch.mean() - f) / 300) ** 2) for f in formants)
                     for h in range(1, 9))
        syllables = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(3, 5) * t) ** 2
        audio = 4000 * voiced * syllables / 4 + 200 * rng.standard_normal(len(t))
        words, chars = [], 0
        while chars < 14 * t[-1]:
            words.append(vocabulary[int(rng.integers(len(vocabulary)))])
            chars += len(words[-1]) + 1
        utterances.append((np.clip(audio, -32768, 32767).astype(np.int16), " ".join(words)))
    return utterances


class Utterances(Dataset):
    """The decoded recordings and transcripts, an epoch of `epoch` draws from them."""

    def __init__(self, utterances: list[tuple[np.ndarray, str]], epoch: int) -> None:
        self.utterances, self.epoch = utterances, epoch

    def __len__(self) -> int:
        return self.epoch

    def __getitem__(self, index: int) -> tuple[np.ndarray, str]:
        return self.utterances[index % len(self.utterances)]


def log_mel_filterbank(audio: np.ndarray, basis: np.ndarray, window: np.ndarray) -> np.ndarray:
    """NeMo's preprocessor in numpy: pre-emphasis, 25 ms Hann frames every 10 ms, 512-point power spectrum, 80
    mel filterbanks, log: [frames, 80]."""
    x = audio.astype(np.float32) / 32768
    x = np.concatenate([x[:1], x[1:] - 0.97 * x[:-1]])
    frames = np.lib.stride_tricks.sliding_window_view(x, FRAME)[::FRAME_HOP] * window
    power = np.abs(np.fft.rfft(frames, n=SPEECH_FFT)) ** 2
    return np.log(power @ basis.T + 2 ** -24).astype(np.float32)


def spec_augment(features: np.ndarray, rng: np.random.Generator, freq_masks: int = 2, freq_width: int = 27,
                 time_masks: int = 10, time_ratio: float = 0.05) -> np.ndarray:
    """SpecAugment (LibriSpeech "LD" policy as Conformer uses it): two frequency masks of up to 27 bins and ten
    time masks of up to 5% of the utterance each, zeroed in place."""
    frames = len(features)
    for _ in range(freq_masks):
        width = int(rng.integers(0, freq_width + 1))
        start = int(rng.integers(0, FBANKS - width + 1))
        features[:, start:start + width] = 0
    for _ in range(time_masks):
        width = int(rng.integers(0, int(time_ratio * frames) + 1))
        start = int(rng.integers(0, frames - width + 1))
        features[start:start + width] = 0
    return features


class FbankCollate:
    """The collate function: for each utterance of the batch, its log-mel filterbank, per-utterance mean and
    variance normalisation and SpecAugment, and its transcript as character ids; then everything padded into
    tensors (features [B, T, 80], frame counts, targets [B, S], target lengths)."""

    def __init__(self) -> None:
        self.basis = mel_filterbank(SPEECH_RATE, SPEECH_FFT, FBANKS, 0.0, 8000.0)
        self.window = np.hanning(FRAME).astype(np.float32)

    def __call__(self, items: list[tuple[np.ndarray, str]]) -> tuple[torch.Tensor, ...]:
        rng = np.random.default_rng(random.getrandbits(64))
        features, transcripts = [], []
        for audio, text in items:
            fbank = log_mel_filterbank(audio, self.basis, self.window)
            fbank = (fbank - fbank.mean(0)) / (fbank.std(0) + 1e-5)
            features.append(spec_augment(fbank, rng))
            transcripts.append([CHAR_IDS[c] for c in text])
        frames = torch.tensor([len(f) for f in features])
        padded = np.zeros((len(items), int(frames.max()), FBANKS), np.float32)
        for row, fbank in zip(padded, features):
            row[:len(fbank)] = fbank
        target_lengths = torch.tensor([len(t) for t in transcripts])
        targets = torch.zeros(len(items), int(target_lengths.max()), dtype=torch.long)
        for row, ids in zip(targets, transcripts):
            row[:len(ids)] = torch.tensor(ids)
        return torch.from_numpy(padded), frames, targets, target_lengths


def one_blas_thread(worker: int) -> None:
    """worker_init_fn: one BLAS thread in each loader worker (eight workers share the machine's cores)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(1)


def subsampled(frames: torch.Tensor) -> torch.Tensor:
    """Frame counts after the two unpadded stride-2 3x3 convolutions."""
    return ((frames - 3) // 2 + 1 - 3) // 2 + 1


def sinusoids(length: int, width: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(-math.log(10_000) * torch.arange(0, width, 2, dtype=torch.float32) / width)
    return torch.cat([torch.sin(position * frequency), torch.cos(position * frequency)], -1)


def feed_forward(width: int) -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.SiLU(), nn.Linear(4 * width, width))


class ConformerBlock(nn.Module):
    """A Conformer block (Gulati et al. 2020): half-step FFN, multi-head self-attention (SDPA, padded frames
    masked), the convolution module (pointwise + GLU, depthwise kernel 31, BatchNorm, SiLU, pointwise), half-step
    FFN, LayerNorm."""

    def __init__(self, width: int, heads: int, kernel: int = 31) -> None:
        super().__init__()
        self.heads = heads
        self.ffn1, self.ffn2 = feed_forward(width), feed_forward(width)
        self.attention_norm, self.conv_norm, self.out_norm = (nn.LayerNorm(width) for _ in range(3))
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.pointwise_in = nn.Conv1d(width, 2 * width, 1)
        self.depthwise = nn.Conv1d(width, width, kernel, padding=kernel // 2, groups=width)
        self.batch_norm = nn.BatchNorm1d(width)
        self.pointwise_out = nn.Conv1d(width, width, 1)

    def forward(self, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ffn1(x)
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.attention_norm(x)).chunk(3, -1))
        x = x + self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None])))
        c = F.glu(self.pointwise_in(self.conv_norm(x).transpose(1, 2)), dim=1) * real[:, None]
        x = x + self.pointwise_out(F.silu(self.batch_norm(self.depthwise(c)))).transpose(1, 2)
        x = x + 0.5 * self.ffn2(x)
        return self.out_norm(x)


class ConformerCTC(nn.Module):
    """Conformer-CTC: 4x convolutional subsampling of the filterbanks, sinusoidal positions (in place of the
    relative ones), Conformer blocks, a linear CTC head over the characters and the blank."""

    def __init__(self, width: int, heads: int, depth: int, vocab: int) -> None:
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, width, 3, 2), nn.ReLU(), nn.Conv2d(width, width, 3, 2), nn.ReLU())
        self.project = nn.Linear(width * (((FBANKS - 3) // 2 + 1 - 3) // 2 + 1), width)
        self.register_buffer("position", sinusoids(4096, width), persistent=False)
        self.blocks = nn.ModuleList(ConformerBlock(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, features: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        x = self.subsample(features[:, None]).permute(0, 2, 1, 3).flatten(2)
        x = self.project(x) + self.position[:x.shape[1]]
        for block in self.blocks:
            x = block(x, real)
        return self.head(x)


def conformer_ctc_fbank_collate(fixes: Fixes) -> Step:
    """Conformer-CTC-Large speech recognition (width 512, 17 blocks of 8 heads, convolution kernel 31; 80 log-mel
    filterbanks, 4x subsampling, 28 characters and the blank; 32 utterances of 4 to 9 s a step; CTC loss; bf16
    autocast, fused AdamW with betas 0.9, 0.98 and a Noam schedule). The DataLoader hands over decoded 16 kHz
    audio and transcripts, and its collate function does the feature work, one utterance after another in numpy
    (pre-emphasis, framing, 512-point FFTs, mel filterbank, log, normalisation, SpecAugment's 12 masks, character
    ids); with num_workers=0 all of it runs in the training process before each step can start. Fix: num_workers=8
    with persistent workers, a prefetch factor of 4 and one BLAS thread each (the collate function then runs in
    the workers)."""
    width, heads, depth, batch = pick(512, 16), pick(8, 2), pick(17, 2), pick(32, 2)
    seconds = (4.0, 9.0) if on_gpu() else (0.3, 0.6)
    utterances = spoken_utterances(pick(128, 4), seconds, np.random.default_rng(0))
    workers = pick(8, 2) if "data_loader" in fixes else 0
    loader = DataLoader(Utterances(utterances, epoch=1_000_000), batch_size=batch, shuffle=True,
                        num_workers=workers, collate_fn=FbankCollate(), drop_last=True,
                        worker_init_fn=one_blas_thread, pin_memory=torch.cuda.is_available(),
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    batches = endless(loader)
    model = ConformerCTC(width, heads, depth, len(ALPHABET) + 1).to(dev())
    opt = adamw(model.parameters(), 1.0, betas=(0.9, 0.98), weight_decay=1e-3)
    warmup = 10_000
    noam = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda done: 2.0 / math.sqrt(width) * min((done + 1) ** -0.5, (done + 1) * warmup ** -1.5))

    def step() -> float:
        features, frames, targets, target_lengths = next(batches)
        lengths = subsampled(frames)
        features, targets = features.to(dev(), non_blocking=True), targets.to(dev(), non_blocking=True)
        real = torch.arange(int(lengths.max()), device=dev()) < lengths.to(dev(), non_blocking=True)[:, None]
        with autocast():
            logits = model(features, real)
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, lengths, target_lengths, zero_infinity=True)
        loss.backward()
        opt.step()
        noam.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

class GhostBatchNorm(nn.Module):
    """Ghost batch normalization (Hoffer et al. 2017) as TabNet uses it: BatchNorm statistics per virtual batch of
    `virtual` rows. `chunked` is pytorch-tabnet's implementation: the batch cut into chunks, BatchNorm1d on each
    in a Python loop, the results concatenated. Otherwise the virtual batches are normalised at once, and the
    running statistics take the same sequence of momentum updates in closed form."""

    def __init__(self, channels: int, virtual: int, chunked: bool, momentum: float = 0.02) -> None:
        super().__init__()
        self.virtual, self.chunked = virtual, chunked
        self.bn = nn.BatchNorm1d(channels, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunked:
            return torch.cat([self.bn(chunk) for chunk in x.chunk(math.ceil(len(x) / self.virtual), 0)], 0)
        if not self.training:
            return self.bn(x)
        bn, count = self.bn, len(x) // self.virtual
        groups = x.float().view(count, self.virtual, -1)
        var, mean = torch.var_mean(groups, dim=1, correction=0, keepdim=True)
        y = (groups - mean) * torch.rsqrt(var + bn.eps) * bn.weight + bn.bias
        with torch.no_grad():  # running = (1-m)^n running + sum_k m (1-m)^(n-1-k) stat_k, as n updates in turn
            m = bn.momentum
            weights = m * (1 - m) ** torch.arange(count - 1, -1, -1, device=x.device, dtype=torch.float32)
            unbiased = var * self.virtual / (self.virtual - 1)
            bn.running_mean.mul_((1 - m) ** count).add_((weights[:, None] * mean[:, 0]).sum(0))
            bn.running_var.mul_((1 - m) ** count).add_((weights[:, None] * unbiased[:, 0]).sum(0))
            bn.num_batches_tracked.add_(count)
        return y.view_as(x).to(x.dtype)


class FeatureTransformer(nn.Module):
    """TabNet's feature transformer: four FC -> ghost BN -> GLU layers (the first two FCs shared by every step, the
    last two the step's own), each after the first added to its input and scaled by sqrt(1/2)."""

    def __init__(self, shared: nn.ModuleList, width: int, virtual: int, chunked: bool) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.ModuleList(nn.Linear(width, 2 * width, bias=False) for _ in range(2))
        self.norms = nn.ModuleList(GhostBatchNorm(2 * width, virtual, chunked) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (fc, norm) in enumerate(zip([*self.shared, *self.own], self.norms)):
            y = F.glu(norm(fc(x)), -1)
            x = y if i == 0 else (x + y) * math.sqrt(0.5)
        return x


def sparsemax(z: torch.Tensor) -> torch.Tensor:
    """Sparsemax (Martins & Astudillo 2016) over the last dimension, by sorting."""
    z = z.float()
    z = z - z.max(-1, keepdim=True).values
    ordered = z.sort(-1, descending=True).values
    cumulative = ordered.cumsum(-1) - 1
    rank = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    support = (rank * ordered > cumulative).sum(-1, keepdim=True)
    tau = cumulative.gather(-1, support - 1) / support
    return (z - tau).clamp(min=0)


class TabNet(nn.Module):
    """TabNet (Arik & Pfister 2021): an initial BatchNorm of the features, then decision steps in which an
    attentive transformer (FC, ghost BN, scaled by the prior, sparsemax) masks the features, a feature
    transformer processes them, and a ReLU'd half of its output adds to the decision. Returns the logits and the
    masks' mean entropy (the sparsity regulariser)."""

    def __init__(self, features: int, classes: int, n_d: int, n_a: int, steps: int, gamma: float, virtual: int,
                 chunked: bool) -> None:
        super().__init__()
        self.n_d, self.gamma = n_d, gamma
        width = n_d + n_a
        self.initial_bn = nn.BatchNorm1d(features, momentum=0.01)
        shared = nn.ModuleList([nn.Linear(features, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)])
        self.splitter = FeatureTransformer(shared, width, virtual, chunked)
        self.transformers = nn.ModuleList(FeatureTransformer(shared, width, virtual, chunked) for _ in range(steps))
        self.attentive_fcs = nn.ModuleList(nn.Linear(n_a, features, bias=False) for _ in range(steps))
        self.attentive_norms = nn.ModuleList(GhostBatchNorm(features, virtual, chunked) for _ in range(steps))
        self.head = nn.Linear(n_d, classes, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.initial_bn(x)
        prior = torch.ones_like(x)
        attended = self.splitter(x)[:, self.n_d:]
        decision, entropy = 0, 0
        for transformer, fc, norm in zip(self.transformers, self.attentive_fcs, self.attentive_norms):
            mask = sparsemax(norm(fc(attended)) * prior)
            entropy = entropy + (-mask * torch.log(mask + 1e-15)).sum(1).mean()
            prior = prior * (self.gamma - mask)
            h = transformer(mask * x)
            decision = decision + F.relu(h[:, :self.n_d])
            attended = h[:, self.n_d:]
        return self.head(decision), entropy / len(self.transformers)


def covertype_like(rows: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Covertype-shaped data on the device: 10 standardised continuous columns, a one-hot wilderness area (4) and
    soil type (40); labels from a fixed random two-layer network of them."""
    continuous = torch.randn(rows, 10, device=dev())
    wilderness = F.one_hot(torch.randint(4, (rows,), device=dev()), 4).float()
    soil = F.one_hot(torch.randint(40, (rows,), device=dev()), 40).float()
    x = torch.cat([continuous, wilderness, soil], 1)
    teacher = torch.randn(54, 64, device=dev()), torch.randn(64, classes, device=dev())
    return x, (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)


def tabnet_ghost_bn_chunks(fixes: Fixes) -> Step:
    """TabNet with the paper's Forest Covertype configuration (54 features, 7 classes; N_d = N_a = 64, 5 decision
    steps, gamma 1.5, sparsity coefficient 1e-4; batch 16384 with virtual batches of 512; the data on the device;
    bf16 autocast, fused Adam at lr 0.02). The ghost batch normalization is pytorch-tabnet's: the batch chunked
    into 32 virtual batches and nn.BatchNorm1d run on each in a Python loop, in each of the 29 ghost BN layers:
    some 900 BatchNorm calls in the forward and as many in the backward, each a few microseconds of GPU work,
    the host launching them the whole step. Fix: the ghost BN vectorised, the batch viewed as [32, 512, C] and
    every virtual batch's statistics taken at once (the running statistics updated to the same values)."""
    rows, batch, virtual = pick(1_000_000, 4096), pick(16384, 64), pick(512, 16)
    width = pick(64, 8)
    x_all, y_all = covertype_like(rows, 7)
    model = TabNet(54, 7, width, width, 5, 1.5, virtual, chunked="launch_bound" not in fixes).to(dev())
    opt = adam(model.parameters(), 0.02)

    def step() -> float:
        rows_picked = torch.randint(len(x_all), (batch,), device=dev())
        with autocast():
            logits, entropy = model(x_all[rows_picked])
        loss = F.cross_entropy(logits.float(), y_all[rows_picked]) + 1e-4 * entropy
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------ tiny_batch

class LayerNormGRUCell(nn.Module):
    """DreamerV2's GRU cell: one linear layer of [input, state] to the three gates, LayerNorm, update bias -1."""

    def __init__(self, cin: int, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(cin + hidden, 3 * hidden, bias=False)
        self.norm = nn.LayerNorm(3 * hidden)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        reset, candidate, update = self.norm(self.linear(torch.cat([x, h], -1))).chunk(3, -1)
        candidate = torch.tanh(torch.sigmoid(reset) * candidate)
        update = torch.sigmoid(update - 1)
        return update * candidate + (1 - update) * h


def straight_through_categorical(logits: torch.Tensor, classes: int) -> torch.Tensor:
    """A one-hot sample of each group of `classes` logits (Gumbel-max), with straight-through gradients."""
    logits = logits.float().unflatten(-1, (-1, classes))
    probs = logits.softmax(-1)
    gumbel = -torch.empty_like(logits).exponential_().log()
    one_hot = torch.zeros_like(probs).scatter_(-1, (logits + gumbel).argmax(-1, keepdim=True), 1.0)
    return (one_hot + probs - probs.detach()).flatten(-2)


def categorical_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, classes: int) -> torch.Tensor:
    """KL(p || q) of groups of categoricals, summed over the groups."""
    log_p = p_logits.float().unflatten(-1, (-1, classes)).log_softmax(-1)
    log_q = q_logits.float().unflatten(-1, (-1, classes)).log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum((-1, -2))


class RSSM(nn.Module):
    """DreamerV2's recurrent state-space model: a deterministic GRU state and a stochastic state of 32 categoricals
    of 32 classes; the prior from the GRU state, the posterior from it and the image embedding."""

    def __init__(self, actions: int, embed: int, deter: int, hidden: int, groups: int, classes: int) -> None:
        super().__init__()
        self.deter, self.classes, self.stoch = deter, classes, groups * classes
        self.img_in = nn.Linear(self.stoch + actions, hidden)
        self.gru = LayerNormGRUCell(hidden, deter)
        self.prior = nn.Sequential(nn.Linear(deter, hidden), nn.ELU(), nn.Linear(hidden, self.stoch))
        self.posterior = nn.Sequential(nn.Linear(deter + embed, hidden), nn.ELU(), nn.Linear(hidden, self.stoch))

    def observe(self, embed: torch.Tensor, actions: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Unrolls the posterior over the sequence, one time step after another: features [B, T, deter + stoch],
        posterior and prior logits [B, T, stoch]."""
        batch, length = embed.shape[:2]
        h = torch.zeros(batch, self.deter, device=embed.device)
        z = torch.zeros(batch, self.stoch, device=embed.device)
        previous_action = torch.zeros_like(actions[:, 0])
        features, posteriors, priors = [], [], []
        for t in range(length):
            keep = 1 - first[:, t, None]
            h, z, previous_action = h * keep, z * keep, previous_action * keep
            h = self.gru(F.elu(self.img_in(torch.cat([z, previous_action], -1))), h)
            prior = self.prior(h)
            posterior = self.posterior(torch.cat([h, embed[:, t]], -1))
            z = straight_through_categorical(posterior, self.classes)
            features.append(torch.cat([h, z], -1))
            posteriors.append(posterior)
            priors.append(prior)
            previous_action = actions[:, t]
        return torch.stack(features, 1), torch.stack(posteriors, 1), torch.stack(priors, 1)


def dreamer_encoder(depth: int) -> nn.Sequential:
    """DreamerV2's image encoder: four 4x4 stride-2 convolutions with ELU, 64x64 -> 2x2, flattened."""
    return nn.Sequential(nn.Conv2d(3, depth, 4, 2), nn.ELU(), nn.Conv2d(depth, 2 * depth, 4, 2), nn.ELU(),
                         nn.Conv2d(2 * depth, 4 * depth, 4, 2), nn.ELU(), nn.Conv2d(4 * depth, 8 * depth, 4, 2),
                         nn.ELU(), nn.Flatten())


def dreamer_decoder(features: int, depth: int) -> nn.Sequential:
    """DreamerV2's image decoder: a linear layer to 1x1, four transposed convolutions to 64x64 (the mean of a
    unit-variance Gaussian)."""
    return nn.Sequential(nn.Linear(features, 32 * depth), nn.Unflatten(1, (32 * depth, 1, 1)),
                         nn.ConvTranspose2d(32 * depth, 4 * depth, 5, 2), nn.ELU(),
                         nn.ConvTranspose2d(4 * depth, 2 * depth, 5, 2), nn.ELU(),
                         nn.ConvTranspose2d(2 * depth, depth, 6, 2), nn.ELU(), nn.ConvTranspose2d(depth, 3, 6, 2))


def elu_mlp(cin: int, hidden: int, layers: int, cout: int) -> nn.Sequential:
    modules: list[nn.Module] = []
    for i in range(layers):
        modules += [nn.Linear(cin if i == 0 else hidden, hidden), nn.ELU()]
    return nn.Sequential(*modules, nn.Linear(hidden, cout))


def control_episodes(count: int, length: int, actions: int) -> tuple[torch.Tensor, ...]:
    """DMC-like episodes on the device: 64x64 frames of a coloured blob driven by the first two action dimensions
    over a textured background, the actions, and rewards for staying near the centre."""
    acts = torch.tanh(torch.randn(count, length, actions, device=dev()))
    position = (0.05 * acts[..., :2]).cumsum(1).clamp(-0.8, 0.8)
    grid = torch.linspace(-1, 1, 64, device=dev())
    dy = grid.view(1, 1, 64, 1) - position[..., 1, None, None]
    dx = grid.view(1, 1, 1, 64) - position[..., 0, None, None]
    blob = torch.exp(-(dx ** 2 + dy ** 2) / 0.02)
    background = F.interpolate(torch.rand(count, 3, 8, 8, device=dev()), size=64, mode="bilinear")
    colour = torch.rand(count, 3, device=dev())
    frames = 0.4 * background[:, None] + 0.6 * blob[:, :, None] * colour[:, None, :, None, None]
    rewards = 1 - position.norm(dim=-1)
    return (frames.clamp(0, 1) * 255).to(torch.uint8), acts, rewards


def dreamer_rssm_batch_16(fixes: Fixes) -> Step:
    """A DreamerV2 world model (Hafner et al. 2021) on DMC-like 64x64 episodes on the device (100 episodes of 500
    steps, 6-d actions): conv encoder and decoder of depth 48, an RSSM with a 600-d GRU state and 32x32 categorical
    latents unrolled over sequences of 50 steps, a 4x400 reward MLP; image and reward log-likelihoods and the KL
    with balancing 0.8; bf16 autocast, fused Adam at 2e-4 with eps 1e-5 and gradient clipping at 100. It trains
    with the paper's batch of 16 sequences: the 50-step unroll is some 2000 small kernels in the forward and as
    many in the backward, for 800 frames of convolutions, and the GPU waits on the launches. step_ms is the time
    for 256 sequences (16 steps of 16). Fix: 256 sequences a step (one step for the same sequences)."""
    episodes, length, actions, window = pick(100, 4), pick(500, 40), 6, pick(50, 6)
    full = pick(256, 8)
    batch = full if "tiny_batch" in fixes else pick(16, 2)
    depth, deter, hidden, groups, classes = pick(48, 4), pick(600, 16), pick(600, 16), pick(32, 4), pick(32, 4)
    frames, acts, rewards = control_episodes(episodes, length, actions)
    encoder = dreamer_encoder(depth).to(dev())
    rssm = RSSM(actions, 32 * depth, deter, hidden, groups, classes).to(dev())
    decoder = dreamer_decoder(deter + groups * classes, depth).to(dev())
    reward_head = elu_mlp(deter + groups * classes, pick(400, 16), 4, 1).to(dev())
    params = [*encoder.parameters(), *rssm.parameters(), *decoder.parameters(), *reward_head.parameters()]
    opt = adam(params, 2e-4, eps=1e-5, weight_decay=1e-6)
    offsets = torch.arange(window, device=dev())

    def step() -> None:
        episode = torch.randint(episodes, (batch, 1), device=dev())
        start = torch.randint(length - window + 1, (batch, 1), device=dev())
        t = start + offsets
        images = frames[episode, t].float() / 255 - 0.5
        first = (t == 0).float()
        with autocast():
            embed = encoder(images.flatten(0, 1)).unflatten(0, (batch, window))
            features, posterior, prior = rssm.observe(embed, acts[episode, t], first)
            reconstruction = decoder(features.flatten(0, 1)).unflatten(0, (batch, window))
            predicted_reward = reward_head(features).squeeze(-1)
        image_loss = 0.5 * (reconstruction.float() - images).pow(2).sum((-1, -2, -3)).mean()
        reward_loss = 0.5 * (predicted_reward.float() - rewards[episode, t]).pow(2).mean()
        kl = (0.8 * categorical_kl(posterior.detach(), prior, classes)
              + 0.2 * categorical_kl(posterior, prior.detach(), classes)).mean()
        (image_loss + reward_loss + kl).backward()
        nn.utils.clip_grad_norm_(params, 100.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return PerSamples(step, full // batch)


# --------------------------------------------------------------------------------------------- pageable_copy

MUSIC_RATE = 44_100
STEMS = ("drums", "bass", "other", "vocals")


def center_trim(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The middle of `tensor` as long as `reference` along the last dimension."""
    excess = tensor.shape[-1] - reference.shape[-1]
    return tensor[..., excess // 2:tensor.shape[-1] - (excess - excess // 2)]


class BLSTM(nn.Module):
    """Demucs's bottleneck: a two-layer bidirectional LSTM and a linear layer back to the channels."""

    def __init__(self, channels: int, layers: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(channels, channels, num_layers=layers, bidirectional=True)
        self.linear = nn.Linear(2 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with lstm_autocast():
            y = self.lstm(x.permute(2, 0, 1) if on_gpu() else x.permute(2, 0, 1).float())[0]
        return self.linear(y).permute(1, 2, 0)


class Demucs(nn.Module):
    """Demucs v2 (Defossez et al. 2019), without the 2x input resampling: a waveform U-Net of six encoder layers
    (kernel-8 stride-4 convolution, ReLU, 1x1 convolution to twice the channels, GLU; the channels doubling from
    48), the BiLSTM, and six decoder layers (context-3 convolution and GLU, stride-4 transposed convolution), with
    skip connections; the mixture normalised by its mono standard deviation."""

    def __init__(self, sources: int = 4, audio_channels: int = 2, channels: int = 48, depth: int = 6,
                 kernel: int = 8, stride: int = 4, context: int = 3) -> None:
        super().__init__()
        self.sources, self.audio_channels = sources, audio_channels
        self.depth, self.kernel, self.stride, self.context = depth, kernel, stride, context
        self.encoder, self.decoder = nn.ModuleList(), nn.ModuleList()
        cin = audio_channels
        for index in range(depth):
            self.encoder.append(nn.Sequential(nn.Conv1d(cin, channels, kernel, stride), nn.ReLU(),
                                              nn.Conv1d(channels, 2 * channels, 1), nn.GLU(1)))
            cout = sources * audio_channels if index == 0 else cin
            decode: list[nn.Module] = [nn.Conv1d(channels, 2 * channels, context), nn.GLU(1),
                                       nn.ConvTranspose1d(channels, cout, kernel, stride)]
            if index > 0:
                decode.append(nn.ReLU())
            self.decoder.insert(0, nn.Sequential(*decode))
            cin, channels = channels, 2 * channels
        self.lstm = BLSTM(cin)

    def valid_length(self, length: int) -> int:
        """The input length nearest above `length` that every convolution divides without remainder."""
        for _ in range(self.depth):
            length = max(1, math.ceil((length - self.kernel) / self.stride) + 1) + self.context - 1
        for _ in range(self.depth):
            length = (length - 1) * self.stride + self.kernel
        return length

    def forward(self, mix: torch.Tensor) -> torch.Tensor:
        mono = mix.mean(1, keepdim=True)
        mean, std = mono.mean(-1, keepdim=True), mono.std(-1, keepdim=True)
        x = (mix - mean) / (1e-5 + std)
        saved = []
        for encode in self.encoder:
            x = encode(x)
            saved.append(x)
        x = self.lstm(x)
        for decode in self.decoder:
            x = decode(x + center_trim(saved.pop(-1), x))
        x = x * std + mean
        return x.unflatten(1, (self.sources, self.audio_channels))


def multitrack_stems(tracks: int, seconds: float, rng: np.random.Generator) -> list[np.ndarray]:
    """MUSDB-like multitracks as the training script caches them: per track, float32 [samples, 4 stems, 2
    channels] (time-major, so that a segment is one contiguous block): drum hits, a bass line, chords and a
    vibrato voice, each panned."""
    samples = int(seconds * MUSIC_RATE)
    t = np.arange(samples, dtype=np.float32) / MUSIC_RATE
    stems = []
    for _ in range(tracks):
        beat = 60 / rng.uniform(80, 160)
        since_hit = np.mod(t, beat / 2)
        drums = np.exp(-since_hit * 30) * rng.standard_normal(samples).astype(np.float32)
        note = np.floor(t / (2 * beat)).astype(np.int64)
        roots = 55 * 2 ** (rng.integers(0, 12, size=note.max() + 1) / 12)
        bass = np.sin(2 * np.pi * np.cumsum(roots[note]) / MUSIC_RATE)
        other = sum(np.sin(2 * np.pi * 4 * roots[note] * ratio * t) for ratio in (1.0, 1.26, 1.5)) / 3
        vocals = np.sin(2 * np.pi * np.cumsum(rng.uniform(200, 400) * (1 + 0.02 * np.sin(2 * np.pi * 5 * t)))
                        / MUSIC_RATE) * (np.sin(np.pi * t / beat) ** 2)
        track = np.empty((samples, len(STEMS), 2), np.float32)
        for s, source in enumerate((drums, bass, other, vocals)):
            pan = rng.uniform(0.2, 0.8)
            track[:, s, 0], track[:, s, 1] = 0.3 * pan * source, 0.3 * (1 - pan) * source
        stems.append(track)
    return stems


def demucs_augment(sources: torch.Tensor) -> torch.Tensor:
    """Demucs's augmentations on the device: channel swaps and sign flips per source, gains in [0.25, 1.25], and
    each stem remixed with another example's (sources [B, 4, 2, T])."""
    batch, count = sources.shape[:2]
    swap = torch.rand(batch, count, 1, 1, device=sources.device) < 0.5
    sources = torch.where(swap, sources.flip(2), sources)
    sign = torch.where(torch.rand(batch, count, 1, 1, device=sources.device) < 0.5, -1.0, 1.0)
    gain = torch.empty(batch, count, 1, 1, device=sources.device).uniform_(0.25, 1.25)
    sources = sources * sign * gain
    shuffle = torch.rand(batch, count, device=sources.device).argsort(0)
    return sources.gather(0, shuffle[:, :, None, None].expand_as(sources))


def demucs_pageable_stems(fixes: Fixes) -> Step:
    """Demucs v2 music source separation (four stems, stereo, 44.1 kHz; 48 initial channels, depth 6, a 2-layer
    BiLSTM of 1536 at the bottleneck; 16 segments of 8 s a step; L1 loss; bf16 autocast, fused Adam at 3e-4). The
    training script caches the decoded multitracks in host memory as float32 numpy arrays (8 tracks of a minute
    here) and copies each example's 8-s, 4-stem window to the GPU with `torch.from_numpy(window).to('cuda')`:
    16 copies of 11 MB a step out of pageable memory, each staged by the driver and each blocking the host while
    the GPU waits for it. Fix: the cache pinned once when it is loaded (pin_memory) and the windows copied with
    non_blocking=True."""
    channels, batch, seconds = pick(48, 4), pick(16, 2), 8.0 if on_gpu() else 0.05
    model = Demucs(channels=channels, depth=pick(6, 3)).to(dev())
    length = model.valid_length(int(seconds * MUSIC_RATE))
    stems = multitrack_stems(pick(8, 2), 60.0 if on_gpu() else 0.2, np.random.default_rng(0))
    pinned_cache = "pageable_copy" in fixes
    cache = [pinned(torch.from_numpy(track)) for track in stems] if pinned_cache else stems
    opt = adam(model.parameters(), 3e-4)
    rng = np.random.default_rng(1)

    def window(track: int, start: int) -> torch.Tensor:
        if pinned_cache:
            return cache[track][start:start + length].to(dev(), non_blocking=True)
        return torch.from_numpy(cache[track][start:start + length]).to(dev())

    def step() -> float:
        picked = [(int(rng.integers(len(stems))), int(rng.integers(len(stems[0]) - length + 1)))
                  for _ in range(batch)]
        sources = demucs_augment(torch.stack([window(*p) for p in picked]).permute(0, 2, 3, 1))
        mix = sources.sum(1)
        with autocast():
            estimates = model(mix)
        loss = F.l1_loss(estimates.float(), center_trim(sources, estimates))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------- precision

def sincos_2d(grid: int, width: int) -> torch.Tensor:
    """MoCo v3's fixed 2-D sine-cosine position embedding: [grid * grid, width]."""
    y, x = torch.meshgrid(torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32),
                          indexing="ij")
    frequency = 1 / 10_000 ** (torch.arange(width // 4, dtype=torch.float32) / (width // 4))
    out_x, out_y = x.flatten()[:, None] * frequency, y.flatten()[:, None] * frequency
    return torch.cat([out_x.sin(), out_x.cos(), out_y.sin(), out_y.cos()], 1)


class VisionTransformer(nn.Module):
    """A ViT backbone as MoCo v3 trains it: a frozen random patch projection, fixed sine-cosine positions, a class
    token, pre-norm blocks; returns the normalised class token."""

    def __init__(self, side: int, patch: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, patch, patch).requires_grad_(False)
        self.register_buffer("position", sincos_2d(side // patch, width)[None], persistent=False)
        self.cls = nn.Parameter(1e-6 * torch.randn(1, 1, width))
        self.blocks = nn.ModuleList(SelfAttentionBlock(width, heads, 4 * width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + self.position
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[:, 0]


def bn_mlp(cin: int, hidden: int, cout: int, layers: int) -> nn.Sequential:
    """MoCo v3's projector and predictor MLPs: Linear, BatchNorm, ReLU, ... and a last BatchNorm without affine."""
    modules: list[nn.Module] = []
    for i in range(layers):
        last = i == layers - 1
        modules.append(nn.Linear(cin if i == 0 else hidden, cout if last else hidden, bias=False))
        modules += [nn.BatchNorm1d(cout, affine=False)] if last else [nn.BatchNorm1d(hidden), nn.ReLU(inplace=True)]
    return nn.Sequential(*modules)


def contrastive(q: torch.Tensor, k: torch.Tensor, temperature: float) -> torch.Tensor:
    """MoCo v3's InfoNCE: each query's positive is the key of the same image; scaled by 2 * temperature."""
    logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / temperature
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device)) * 2 * temperature


def two_crops(pool: torch.Tensor, picked: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MoCo v3's two augmented views on the device: random resized crops (scale 0.08-1, ratio 3/4-4/3) with flips
    through one grid_sample, colour jitter (brightness, contrast, saturation) with p 0.8, grayscale with p 0.2,
    solarisation of the second view with p 0.2; normalised."""
    source = pool[picked].float() / 255
    batch = len(picked)
    mean = torch.tensor([0.485, 0.456, 0.406], device=pool.device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=pool.device).view(1, 3, 1, 1)
    grey_weights = torch.tensor([0.299, 0.587, 0.114], device=pool.device).view(1, 3, 1, 1)
    views = []
    for view in range(2):
        area = torch.empty(batch, device=pool.device).uniform_(0.08, 1.0)
        ratio = torch.exp(torch.empty(batch, device=pool.device).uniform_(math.log(3 / 4), math.log(4 / 3)))
        w, h = (area * ratio).sqrt().clamp(max=1), (area / ratio).sqrt().clamp(max=1)
        cx = (torch.rand(batch, device=pool.device) * 2 - 1) * (1 - w)
        cy = (torch.rand(batch, device=pool.device) * 2 - 1) * (1 - h)
        flip = torch.where(torch.rand(batch, device=pool.device) < 0.5, -1.0, 1.0)
        zero = torch.zeros_like(w)
        theta = torch.stack([w * flip, zero, cx, zero, h, cy], 1).view(batch, 2, 3)
        grid = F.affine_grid(theta, [batch, 3, side, side], align_corners=False)
        x = F.grid_sample(source, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        jitter = (torch.rand(batch, 1, 1, 1, device=pool.device) < 0.8).float()
        brightness, contrast, saturation = (1 + jitter * torch.empty(batch, 1, 1, 1, device=pool.device)
                                            .uniform_(-s, s) for s in (0.4, 0.4, 0.2))
        x = (x * brightness).clamp(0, 1)
        grey = (x * grey_weights).sum(1, keepdim=True)
        x = ((x - grey.mean((2, 3), keepdim=True)) * contrast + grey.mean((2, 3), keepdim=True)).clamp(0, 1)
        grey = (x * grey_weights).sum(1, keepdim=True)
        x = ((x - grey) * saturation + grey).clamp(0, 1)
        x = torch.where(torch.rand(batch, 1, 1, 1, device=pool.device) < 0.2, (x * grey_weights).sum(1, True), x)
        if view == 1:
            x = torch.where((torch.rand(batch, 1, 1, 1, device=pool.device) < 0.2) & (x >= 0.5), 1 - x, x)
        views.append((x - mean) / std)
    return views[0], views[1]


def mocov3_fp32_momentum_encoder(fixes: Fixes) -> Step:
    """MoCo v3 (Chen, Xie & He 2021) with a ViT-S/16 on 224x224 views of 256x256 images on the device (a 3-layer
    projector and 2-layer predictor of 4096 hidden units to 256, temperature 0.2, symmetrised loss; 128 images,
    two views each, a step; fused AdamW at 1.5e-4 x 128 / 256 with weight decay 0.1; the momentum 0.99 on a cosine
    schedule to 1, applied with one torch._foreach_lerp_). The query encoder runs under bf16 autocast, but the
    momentum encoder's forward sits in the `torch.no_grad()` block written after the autocast block, beside the
    momentum update: two ViT-S forwards over 256 views a step as fp32 GEMMs with TF32 off, about a quarter of
    the step's FLOPs at a tenth of the speed. Fix: the momentum encoder's forward under the same bf16 autocast."""
    side, crop, patch = pick(256, 36), pick(224, 32), pick(16, 8)
    width, depth, heads, hidden, batch = pick(384, 24), pick(12, 2), pick(6, 2), pick(4096, 32), pick(128, 4)
    backbone = VisionTransformer(crop, patch, width, depth, heads).to(dev())
    projector, predictor = bn_mlp(width, hidden, 256, 3).to(dev()), bn_mlp(256, hidden, 256, 2).to(dev())
    momentum_encoder = nn.Sequential(copy.deepcopy(backbone), copy.deepcopy(projector)).requires_grad_(False)
    online = [*backbone.parameters(), *projector.parameters()]
    momentum_params = list(momentum_encoder.parameters())
    opt = adamw([*online, *predictor.parameters()], 1.5e-4 * batch / 256, weight_decay=0.1)
    pool = imagenet_like_pool(pick(1024, 8), side, 1000)[0]
    total_steps = 300 * 1_281_167 // 4096
    steps = itertools.count()
    momentum_in_bf16 = "precision" in fixes

    def step() -> float:
        x1, x2 = two_crops(pool, torch.randint(len(pool), (batch,), device=dev()), crop)
        m = 1 - 0.01 * (math.cos(math.pi * next(steps) / total_steps) + 1) / 2
        with autocast():
            q1, q2 = (predictor(projector(backbone(x))) for x in (x1, x2))
        with torch.no_grad():
            torch._foreach_lerp_(momentum_params, online, 1 - m)
            with autocast(enabled=momentum_in_bf16):
                k1, k2 = momentum_encoder(x1), momentum_encoder(x2)
        loss = contrastive(q1.float(), k2.float(), 0.2) + contrastive(q2.float(), k1.float(), 0.2)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ---------------------------------------------------------------------- allocator_churn + eager_attention

def written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """OpenFold's _attention: softmax(Q K^T / sqrt(c) + bias) V, the scores materialised."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, -1), v)


class GatedAttention(nn.Module):
    """AlphaFold's gated multi-head attention over the second-to-last axis of x [B, R, Q, C], with an optional
    additive bias [B, 1, H, Q, Q] shared by the R rows; the output gated by a sigmoid of x."""

    def __init__(self, cin: int, hidden: int, heads: int, eager: bool) -> None:
        super().__init__()
        self.heads, self.eager = heads, eager
        self.q, self.k, self.v = (nn.Linear(cin, hidden * heads, bias=False) for _ in range(3))
        self.gate, self.out = nn.Linear(cin, hidden * heads), nn.Linear(hidden * heads, cin)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        batch, rows, length, _ = x.shape
        q, k, v = (heads_of(proj(x).flatten(0, 1), self.heads) for proj in (self.q, self.k, self.v))
        if bias is not None:
            bias = bias.expand(batch, rows, -1, -1, -1).flatten(0, 1)
        if self.eager:
            o = written_out_attention(q, k, v, bias)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype))
        o = merge_heads(o).unflatten(0, (batch, rows))
        return self.out(torch.sigmoid(self.gate(x)) * o)


class TriangleMultiplication(nn.Module):
    """The triangle multiplicative update, outgoing (z_ij from edges ik and jk) or incoming (ki and kj)."""

    def __init__(self, c_z: int, hidden: int, outgoing: bool) -> None:
        super().__init__()
        self.outgoing = outgoing
        self.norm, self.out_norm = nn.LayerNorm(c_z), nn.LayerNorm(hidden)
        self.a, self.a_gate, self.b, self.b_gate = (nn.Linear(c_z, hidden) for _ in range(4))
        self.gate, self.out = nn.Linear(c_z, c_z), nn.Linear(hidden, c_z)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.norm(z)
        a = torch.sigmoid(self.a_gate(z)) * self.a(z)
        b = torch.sigmoid(self.b_gate(z)) * self.b(z)
        x = torch.einsum("bikc,bjkc->bijc" if self.outgoing else "bkic,bkjc->bijc", a, b)
        return torch.sigmoid(self.gate(z)) * self.out(self.out_norm(x))


class EvoformerBlock(nn.Module):
    """An Evoformer block (Jumper et al. 2021): MSA row attention with pair bias, MSA column attention, MSA
    transition, outer product mean, triangle multiplications (outgoing, incoming), triangle attention (starting,
    ending node), pair transition."""

    def __init__(self, c_m: int, c_z: int, eager: bool) -> None:
        super().__init__()
        self.row_norm, self.col_norm, self.pair_bias_norm = nn.LayerNorm(c_m), nn.LayerNorm(c_m), nn.LayerNorm(c_z)
        self.row_attention = GatedAttention(c_m, 32, 8, eager)
        self.pair_bias = nn.Linear(c_z, 8, bias=False)
        self.col_attention = GatedAttention(c_m, 32, 8, eager)
        self.msa_transition = nn.Sequential(nn.LayerNorm(c_m), nn.Linear(c_m, 4 * c_m), nn.ReLU(),
                                            nn.Linear(4 * c_m, c_m))
        self.outer_norm = nn.LayerNorm(c_m)
        self.outer_a, self.outer_b = nn.Linear(c_m, 32), nn.Linear(c_m, 32)
        self.outer_out = nn.Linear(32 * 32, c_z)
        self.tri_out, self.tri_in = TriangleMultiplication(c_z, c_z, True), TriangleMultiplication(c_z, c_z, False)
        self.start_norm, self.end_norm = nn.LayerNorm(c_z), nn.LayerNorm(c_z)
        self.start_bias, self.end_bias = nn.Linear(c_z, 4, bias=False), nn.Linear(c_z, 4, bias=False)
        self.start_attention = GatedAttention(c_z, 32, 4, eager)
        self.end_attention = GatedAttention(c_z, 32, 4, eager)
        self.pair_transition = nn.Sequential(nn.LayerNorm(c_z), nn.Linear(c_z, 4 * c_z), nn.ReLU(),
                                             nn.Linear(4 * c_z, c_z))

    @staticmethod
    def bias_of(linear: nn.Linear, z: torch.Tensor) -> torch.Tensor:
        """[B, N, N, c] -> [B, 1, H, N, N]."""
        return linear(z).permute(0, 3, 1, 2).contiguous().unsqueeze(1)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = m + self.row_attention(self.row_norm(m), self.bias_of(self.pair_bias, self.pair_bias_norm(z)))
        m = m + self.col_attention(self.col_norm(m).transpose(1, 2)).transpose(1, 2)
        m = m + self.msa_transition(m)
        normed = self.outer_norm(m)
        a, b = self.outer_a(normed), self.outer_b(normed)
        outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2) / m.shape[1]
        z = z + self.outer_out(outer)
        z = z + self.tri_out(z)
        z = z + self.tri_in(z)
        normed = self.start_norm(z)
        z = z + self.start_attention(normed, self.bias_of(self.start_bias, normed))
        normed = self.end_norm(z).transpose(1, 2)
        z = z + self.end_attention(normed, self.bias_of(self.end_bias, normed)).transpose(1, 2)
        return m, z + self.pair_transition(z)


class EvoformerStack(nn.Module):
    """Input embedding (MSA one-hot and target features to the MSA representation; target outer sum and relative
    positions clipped at 32 to the pair representation), Evoformer blocks, and the two training heads: masked-MSA
    logits over 23 classes and distogram logits over 64 bins."""

    def __init__(self, c_m: int, c_z: int, depth: int, eager: bool) -> None:
        super().__init__()
        self.msa_in, self.target_msa = nn.Linear(23, c_m), nn.Linear(21, c_m)
        self.left, self.right, self.relpos = nn.Linear(21, c_z), nn.Linear(21, c_z), nn.Linear(65, c_z)
        self.blocks = nn.ModuleList(EvoformerBlock(c_m, c_z, eager) for _ in range(depth))
        self.msa_head, self.distogram_head = nn.Linear(c_m, 23), nn.Linear(c_z, 64)

    def forward(self, msa: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = target.shape[1]
        residue = torch.arange(length, device=target.device)
        relative = (residue[None] - residue[:, None]).clamp(-32, 32) + 32
        m = self.msa_in(F.one_hot(msa, 23).float()) + self.target_msa(target)[:, None]
        z = (self.left(target)[:, :, None] + self.right(target)[:, None]
             + self.relpos(F.one_hot(relative, 65).float())[None])
        for block in self.blocks:
            m, z = block(m, z)
        return self.msa_head(m), self.distogram_head(z + z.transpose(1, 2))


def synthetic_protein(length: int, sequences: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A protein crop on the device: residue types, a C-alpha trace as a 3.8-A random walk and an MSA of its
    homologues (each residue substituted with probability 0.3, 21 for a gap with 0.05)."""
    residues = torch.randint(20, (1, length), device=dev())
    steps = F.normalize(torch.randn(1, length, 3, device=dev()) + 0.8 * torch.randn(1, 1, 3, device=dev()), dim=-1)
    coords = (3.8 * steps).cumsum(1)
    substitute = torch.rand(1, sequences, length, device=dev())
    msa = torch.where(substitute < 0.3, torch.randint(20, (1, sequences, length), device=dev()), residues[:, None])
    msa = torch.where(substitute > 0.95, 21, msa)
    msa[:, 0] = residues
    return msa, residues, coords


def evoformer_empty_cache_eager(fixes: Fixes) -> Step:
    """An AlphaFold-style Evoformer trained on one 256-residue crop with 128 MSA sequences (c_m 256, c_z 128, 4
    blocks; masked-MSA loss on 15% of the MSA and a distogram loss over 64 bins of C-alpha distances; bf16
    autocast, fused Adam at 1e-3 with clipping at 0.1), written after OpenFold with two of its habits. Its gated
    attentions (MSA row attention with pair bias, column attention, triangle attention around the starting and
    ending node) are OpenFold's _attention, softmax(QK^T + bias)V written out, materialising scores of [128, 8,
    256, 256], [256, 8, 128, 128] and twice [256, 4, 256, 256] in every block; and the step ends with
    torch.cuda.empty_cache(), copied from the long-crop scripts to fight fragmentation: every step's activations
    are allocated afresh with cudaMalloc and freed with cudaFree, the host waiting on both. Fixes: the step
    without empty_cache() (allocator_churn); F.scaled_dot_product_attention with the pair bias as its additive
    mask (eager_attention)."""
    length, sequences, c_m, c_z, depth = pick(256, 16), pick(128, 8), pick(256, 16), pick(128, 8), pick(4, 1)
    model = EvoformerStack(c_m, c_z, depth, eager="eager_attention" not in fixes).to(dev())
    opt = adam(model.parameters(), 1e-3, eps=1e-6)
    empty_cache = "allocator_churn" not in fixes
    edges = torch.linspace(2.3125, 21.6875, 63, device=dev())
    crops = [synthetic_protein(length, sequences) for _ in range(pick(8, 2))]
    turn = itertools.count()

    def step() -> float:
        msa, residues, coords = crops[next(turn) % len(crops)]
        masked = torch.rand(msa.shape, device=dev()) < 0.15
        corrupted = torch.where(masked, 22, msa)
        target = F.one_hot(residues, 21).float()
        with autocast():
            msa_logits, distogram_logits = model(corrupted, target)
        msa_loss = (F.cross_entropy(msa_logits.float().flatten(0, 2), msa.flatten(), reduction="none")
                    * masked.flatten()).sum() / masked.sum().clamp(min=1)
        bins = torch.bucketize(torch.cdist(coords, coords), edges)
        distogram_loss = F.cross_entropy(distogram_logits.float().flatten(0, 2), bins.flatten())
        loss = msa_loss + 0.3 * distogram_loss
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if empty_cache:
            release_cached_memory()
        return value
    return step


# ----------------------------------------------------------------------------------- host_work + optimizer_impl

class GRN(nn.Module):
    """The TFT's gated residual network: ELU(W1 x + W3 context), W2, dropout, a GLU gate, and LayerNorm of the
    sum with the (projected) input."""

    def __init__(self, cin: int, hidden: int, cout: int, context: int | None = None) -> None:
        super().__init__()
        self.skip = nn.Linear(cin, cout) if cin != cout else None
        self.fc1, self.fc2 = nn.Linear(cin, hidden), nn.Linear(hidden, hidden)
        self.context = nn.Linear(context, hidden, bias=False) if context else None
        self.glu, self.norm, self.dropout = nn.Linear(hidden, 2 * cout), nn.LayerNorm(cout), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc1(x)
        if context is not None:
            h = h + self.context(context)
        h = self.dropout(self.fc2(F.elu(h)))
        return self.norm(F.glu(self.glu(h), -1) + (x if self.skip is None else self.skip(x)))


class GateAddNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.glu, self.norm = nn.Linear(width, 2 * width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(F.glu(self.glu(x), -1) + residual)


class VariableSelection(nn.Module):
    """The TFT's variable selection network: softmax weights over the variables from a GRN of all of them
    (conditioned on the static context), each variable through its own GRN, the weighted sum."""

    def __init__(self, count: int, hidden: int, context: bool = True) -> None:
        super().__init__()
        self.flat = GRN(count * hidden, hidden, count, context=hidden if context else None)
        self.singles = nn.ModuleList(GRN(hidden, hidden, hidden) for _ in range(count))

    def forward(self, inputs: list[torch.Tensor], context: torch.Tensor | None = None) -> torch.Tensor:
        weights = self.flat(torch.cat(inputs, -1), context).softmax(-1)
        processed = torch.stack([grn(x) for grn, x in zip(self.singles, inputs)], -1)
        return (processed * weights.unsqueeze(-2)).sum(-1)


CALENDAR_CATEGORIES = (24, 7, 31, 12)  # hour, weekday, day of month, month
KNOWN_REALS = 5  # holiday, hours since start, days to the next holiday, load 24 h and 168 h before
OBSERVED_REALS = 2  # load, its trailing 24-h mean


class TemporalFusionTransformer(nn.Module):
    """The Temporal Fusion Transformer (Lim et al. 2021): embeddings and per-variable linear prescalers, static,
    encoder and decoder variable selection, four static context GRNs, an LSTM encoder-decoder started from the
    static state, static enrichment, interpretable multi-head attention (per-head queries and keys, one shared
    value, heads averaged; causal), position-wise GRN and quantile outputs for the decoder steps."""

    def __init__(self, series: int, hidden: int, heads: int, quantiles: int) -> None:
        super().__init__()
        self.hidden, self.heads = hidden, heads
        self.series_embedding = nn.Embedding(series, hidden)
        self.calendar_embeddings = nn.ModuleList(nn.Embedding(n, hidden) for n in CALENDAR_CATEGORIES)
        self.prescalers = nn.ModuleList(nn.Linear(1, hidden) for _ in range(KNOWN_REALS + OBSERVED_REALS))
        known = len(CALENDAR_CATEGORIES) + KNOWN_REALS
        self.static_selection = VariableSelection(1, hidden, context=False)
        self.encoder_selection = VariableSelection(known + OBSERVED_REALS, hidden)
        self.decoder_selection = VariableSelection(known, hidden)
        self.static_contexts = nn.ModuleList(GRN(hidden, hidden, hidden) for _ in range(4))
        self.encoder_lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.decoder_lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.post_lstm = GateAddNorm(hidden)
        self.enrichment = GRN(hidden, hidden, hidden, context=hidden)
        head = hidden // heads
        self.queries = nn.ModuleList(nn.Linear(hidden, head) for _ in range(heads))
        self.keys = nn.ModuleList(nn.Linear(hidden, head) for _ in range(heads))
        self.value, self.attention_out = nn.Linear(hidden, head), nn.Linear(head, hidden)
        self.post_attention = GateAddNorm(hidden)
        self.positionwise = GRN(hidden, hidden, hidden)
        self.pre_output = GateAddNorm(hidden)
        self.output = nn.Linear(hidden, quantiles)

    def embedded(self, categorical: torch.Tensor, reals: torch.Tensor, first_real: int) -> list[torch.Tensor]:
        return ([emb(categorical[..., i]) for i, emb in enumerate(self.calendar_embeddings)]
                + [self.prescalers[first_real + i](reals[..., i:i + 1]) for i in range(reals.shape[-1])])

    def forward(self, series: torch.Tensor, categorical: torch.Tensor, known: torch.Tensor, observed: torch.Tensor,
                decoder_length: int) -> torch.Tensor:
        encoder_length = categorical.shape[1] - decoder_length
        static = self.static_selection([self.series_embedding(series)])
        selection, enrichment, state_h, state_c = (grn(static) for grn in self.static_contexts)
        inputs = self.embedded(categorical, known, 0)
        encoder_inputs = [x[:, :encoder_length] for x in inputs] + [
            self.prescalers[KNOWN_REALS + i](observed[..., i:i + 1]) for i in range(OBSERVED_REALS)]
        past = self.encoder_selection(encoder_inputs, selection[:, None])
        future = self.decoder_selection([x[:, encoder_length:] for x in inputs], selection[:, None])
        with lstm_autocast():
            cast = (lambda t: t) if on_gpu() else (lambda t: t.float())
            encoded, state = self.encoder_lstm(cast(past), (cast(state_h)[None], cast(state_c)[None]))
            decoded, _ = self.decoder_lstm(cast(future), state)
        selected = torch.cat([past, future], 1)
        temporal = self.post_lstm(torch.cat([encoded, decoded], 1), selected)
        enriched = self.enrichment(temporal, enrichment[:, None])
        q = torch.stack([query(enriched) for query in self.queries], 1)
        k = torch.stack([key(enriched) for key in self.keys], 1)
        v = self.value(enriched)[:, None].expand(-1, self.heads, -1, -1)
        attended = self.attention_out(F.scaled_dot_product_attention(q, k, v, is_causal=True).mean(1))
        x = self.post_attention(attended, enriched)
        x = self.pre_output(self.positionwise(x), temporal)
        return self.output(x[:, encoder_length:])


def holidays_between(start: datetime.date, end: datetime.date) -> list[datetime.date]:
    """A fixed calendar of public holidays (the same dates every year) between two dates, sorted."""
    fixed = ((1, 1), (5, 1), (5, 8), (7, 14), (8, 15), (11, 1), (11, 11), (12, 25), (12, 26))
    return [datetime.date(year, month, day) for year in range(start.year, end.year + 2) for month, day in fixed]


def calendar_row(moment: datetime.datetime, start: datetime.datetime, holidays: list[datetime.date],
                 holiday_set: set[datetime.date]) -> tuple:
    """One time step's known covariates, as the dataset's feature function writes them: hour, weekday, day of
    month and month (categorical), holiday flag, hours since the start of the data (in thousands), days to the
    next holiday (in tens)."""
    day = moment.date()
    following = holidays[bisect.bisect_left(holidays, day)]
    return (moment.hour, moment.weekday(), moment.day - 1, moment.month - 1, float(day in holiday_set),
            (moment - start).total_seconds() / 3600 / 1000, (following - day).days / 10)


def electricity_load(series: int, hours: int, rng: np.random.Generator) -> np.ndarray:
    """Hourly loads of `series` customers (daily and weekly cycles, a trend, noise), as float32 [series, hours]."""
    t = np.arange(hours)
    scale = rng.lognormal(3, 1, size=(series, 1))
    daily = 1 + 0.5 * np.sin(2 * np.pi * (t / 24 - rng.uniform(0, 1, (series, 1))))
    weekly = 1 + 0.2 * (t // 24 % 7 < 5)
    noise = 1 + 0.1 * rng.standard_normal((series, hours))
    return (scale * daily * weekly * noise * (1 + t / hours / 4)).astype(np.float32)


def tft_host_calendar_foreach_adam(fixes: Fixes) -> Step:
    """A Temporal Fusion Transformer on electricity-load windows (370 customers, three years of hourly loads; the
    paper's electricity configuration: 168 encoder and 24 decoder hours, hidden 160, 4 heads, dropout 0.1, batch
    64, quantiles 0.1/0.5/0.9; bf16 autocast; Adam at 1e-3 with clipping at 0.01). The sampler builds each
    window on the host: for every one of its 192 hours the calendar covariates from a datetime (hour, weekday,
    day, month, holiday flag, hours since the start, days to the next holiday by bisection), then the lags and
    the trailing 24-h mean of the standardised load in numpy, 12k datetime rows a step before the GPU can start.
    And the optimizer is Adam(foreach=False), copied from an old config, stepping its 310 parameter tensors one
    at a time, a dozen small kernels each. Fixes: the covariate, lag and trailing-mean tables computed once for
    the whole timeline, kept on the device and windows gathered there (host_work); Adam(fused=True)
    (optimizer_impl)."""
    series, hours = pick(370, 6), pick(26_304, 600)
    encoder_length, decoder_length, hidden, batch = pick(168, 24), pick(24, 6), pick(160, 16), pick(64, 2)
    window = encoder_length + decoder_length
    rng = np.random.default_rng(0)
    load = electricity_load(series, hours, rng)
    standardised = (load - load.mean(1, keepdims=True)) / load.std(1, keepdims=True)
    start = datetime.datetime(2012, 1, 1)
    timeline = [start + datetime.timedelta(hours=h) for h in range(hours)]
    holidays = holidays_between(start.date(), timeline[-1].date())
    holiday_set = set(holidays)
    earliest = 168  # the weekly lag must exist
    model = TemporalFusionTransformer(series, hidden, 4, 3).to(dev())
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3, fused=on_gpu()) if "optimizer_impl" in fixes
           else torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False))
    quantiles = torch.tensor([0.1, 0.5, 0.9], device=dev())

    def host_window(s: int, t0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = [calendar_row(moment, start, holidays, holiday_set) for moment in timeline[t0:t0 + window]]
        categorical = np.array([row[:4] for row in rows], np.int64)
        usage = standardised[s]
        lags = np.stack([usage[t0 - 24:t0 - 24 + window], usage[t0 - 168:t0 - 168 + window]], 1)
        known = np.concatenate([np.array([row[4:] for row in rows], np.float32), lags], 1)
        trailing = np.convolve(usage[t0 - 23:t0 + window], np.full(24, 1 / 24, np.float32), mode="valid")
        observed = np.stack([usage[t0:t0 + window], trailing], 1).astype(np.float32)
        return categorical, known, observed

    def host_batch() -> tuple[torch.Tensor, ...]:
        picked = [(int(rng.integers(series)), int(rng.integers(earliest, hours - window + 1))) for _ in range(batch)]
        windows = [host_window(s, t0) for s, t0 in picked]
        categorical, known, observed = (torch.from_numpy(np.stack(parts)).to(dev()) for parts in zip(*windows))
        return torch.tensor([s for s, _ in picked], device=dev()), categorical, known, observed

    if "host_work" in fixes:
        table = [calendar_row(moment, start, holidays, holiday_set) for moment in timeline]
        all_categorical = torch.tensor([row[:4] for row in table], device=dev())
        usage = torch.from_numpy(standardised).to(dev())
        lag24, lag168 = F.pad(usage, (24, 0))[:, :hours], F.pad(usage, (168, 0))[:, :hours]
        summed = F.pad(usage.double().cumsum(1), (24, 0))
        trailing = ((summed[:, 24:] - summed[:, :-24]) / 24).float()
        all_calendar = torch.tensor([row[4:] for row in table], device=dev(), dtype=torch.float32)
        offsets = torch.arange(window, device=dev())

    def device_batch() -> tuple[torch.Tensor, ...]:
        s = torch.randint(series, (batch,), device=dev())
        t = torch.randint(earliest, hours - window + 1, (batch, 1), device=dev()) + offsets
        rows = s[:, None]
        known = torch.cat([all_calendar[t], lag24[rows, t, None], lag168[rows, t, None]], -1)
        observed = torch.stack([usage[rows, t], trailing[rows, t]], -1)
        return s, all_categorical[t], known, observed

    batches = device_batch if "host_work" in fixes else host_batch

    def step() -> float:
        s, categorical, known, observed = batches()
        with autocast():
            predicted = model(s, categorical, known, observed[:, :encoder_length], decoder_length)
        errors = observed[:, encoder_length:, :1] - predicted.float()
        loss = torch.maximum(quantiles * errors, (quantiles - 1) * errors).mean()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------------ healthy

class S4DKernel(nn.Module):
    """S4D's convolution kernel (Gu et al. 2022): a diagonal state matrix with S4D-Lin initialisation
    (A = -1/2 + i pi n), learned step sizes, zero-order-hold discretisation, and the kernel of length L as a
    Vandermonde product, computed in fp32 / complex64."""

    def __init__(self, channels: int, state: int, dt_min: float = 1e-3, dt_max: float = 1e-1) -> None:
        super().__init__()
        self.log_dt = nn.Parameter(torch.rand(channels) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.c = nn.Parameter(torch.view_as_real(torch.randn(channels, state // 2, dtype=torch.cfloat)))
        self.log_a_real = nn.Parameter(torch.log(0.5 * torch.ones(channels, state // 2)))
        self.a_imag = nn.Parameter(math.pi * torch.arange(state // 2).float().repeat(channels, 1))

    def forward(self, length: int) -> torch.Tensor:
        dt = self.log_dt.exp()
        c = torch.view_as_complex(self.c)
        a = -self.log_a_real.exp() + 1j * self.a_imag
        dt_a = a * dt[:, None]
        powers = dt_a[:, :, None] * torch.arange(length, device=a.device)
        c = c * (dt_a.exp() - 1.0) / a
        return 2 * torch.einsum("hn,hnl->hl", c, powers.exp()).real


class S4DBlock(nn.Module):
    """A pre-norm S4D layer: LayerNorm, the causal long convolution of every channel with its kernel through fp32
    FFTs plus a skip term, GELU, a 1x1 convolution to twice the channels and GLU, the residual."""

    def __init__(self, channels: int, state: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.kernel = S4DKernel(channels, state)
        self.d = nn.Parameter(torch.randn(channels))
        self.output = nn.Linear(channels, 2 * channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        u = self.norm(x).float().transpose(1, 2)
        k = self.kernel(length)
        y = torch.fft.irfft(torch.fft.rfft(u, n=2 * length) * torch.fft.rfft(k, n=2 * length), n=2 * length)
        y = y[..., :length] + u * self.d[:, None]
        return x + F.glu(self.output(F.gelu(y).transpose(1, 2)), -1)


class S4DClassifier(nn.Module):
    def __init__(self, channels: int, state: int, depth: int, classes: int) -> None:
        super().__init__()
        self.encoder = nn.Linear(1, channels)
        self.blocks = nn.ModuleList(S4DBlock(channels, state) for _ in range(depth))
        self.norm, self.decoder = nn.LayerNorm(channels), nn.Linear(channels, classes)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        x = self.encoder(audio[..., None])
        for block in self.blocks:
            x = block(x)
        return self.decoder(self.norm(x).mean(1))


def keyword_clips(count: int, samples: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Speech-Commands-like one-second clips on the device: each class a two-tone chirp pattern, each clip it
    shifted in time and pitch under noise."""
    labels = torch.randint(classes, (count,), device=dev())
    t = torch.arange(samples, device=dev()) / samples
    base = 200 + 40 * torch.arange(classes, device=dev()).float()
    pitch = base[labels, None] * torch.empty(count, 1, device=dev()).uniform_(0.9, 1.1)
    glide = 1 + 0.3 * torch.sin(math.pi * (labels[:, None] % 5 + 1) * t)
    onset = torch.rand(count, 1, device=dev()) * 0.4
    envelope = torch.exp(-((t - onset - 0.3) / 0.15) ** 2)
    phase = 2 * math.pi * (pitch * glide).cumsum(1) / 16_000
    clip = envelope * (torch.sin(phase) + 0.5 * torch.sin(2 * phase + labels[:, None]))
    return clip + 0.05 * torch.randn(count, samples, device=dev()), labels


def healthy_s4d_speech_commands(fixes: Fixes) -> Step:
    """An S4D classifier on raw Speech-Commands-like clips (35 classes, 16000 samples; 6 pre-norm S4D layers of
    128 channels and state size 64, mean pooling; 32 clips a step). bf16 autocast for the projections, the
    kernels and FFT convolutions in fp32 as the reference keeps them, fused AdamW with the SSM parameters in their
    own group (lr 1e-3, no weight decay) and the rest at lr 1e-2 with weight decay 0.01, the clips on the device,
    one loss `.item()` at the end."""
    samples, channels, depth, batch = pick(16_000, 256), pick(128, 8), pick(6, 2), pick(32, 2)
    model = S4DClassifier(channels, 64, depth, 35).to(dev())
    ssm = [p for name, p in model.named_parameters() if ".kernel." in name]
    others = [p for name, p in model.named_parameters() if ".kernel." not in name]
    opt = torch.optim.AdamW([{"params": ssm, "lr": 1e-3, "weight_decay": 0.0},
                             {"params": others, "lr": 1e-2, "weight_decay": 0.01}], fused=on_gpu())
    clips, labels = keyword_clips(pick(4096, 16), samples, 35)

    def step() -> float:
        picked = torch.randint(len(clips), (batch,), device=dev())
        with autocast():
            logits = model(clips[picked])
        loss = F.cross_entropy(logits.float(), labels[picked])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


class SlidingWindowLayer(nn.Module):
    """A Longformer layer (RoBERTa's post-norm layer with sliding-window attention): every token attends to the
    `window` tokens on either side. The sequence is cut into blocks of `window` queries, each attending to its
    own block and both neighbours (3 x window keys) under a band mask, as one SDPA call over all blocks."""

    def __init__(self, width: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
        batch, heads, length, head = q.shape
        w, blocks = self.window, length // self.window
        q = q.view(batch, heads, blocks, w, head).transpose(1, 2).flatten(0, 1)
        k, v = (F.pad(t, (0, 0, w, w)).unfold(2, 3 * w, w).permute(0, 2, 1, 4, 3).flatten(0, 1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        return o.unflatten(0, (batch, blocks)).transpose(1, 2).flatten(2, 3)

    def forward(self, x: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(x).chunk(3, -1))
        x = self.norm1(x + self.proj(merge_heads(self.attend(q, k, v, band))))
        return self.norm2(x + self.mlp(x))


def band_mask(length: int, window: int, batch: int, device: str) -> torch.Tensor:
    """[batch * blocks, 1, window, 3 * window]: query i of block b may see key j of its three-block span when
    |i - j| <= window in the sequence and the key is inside it."""
    blocks = length // window
    query = torch.arange(blocks, device=device)[:, None, None] * window + torch.arange(window, device=device)[:, None]
    key = (torch.arange(blocks, device=device)[:, None, None] - 1) * window + torch.arange(3 * window, device=device)
    allowed = ((query - key).abs() <= window) & (key >= 0) & (key < length)
    return allowed[:, None].repeat(batch, 1, 1, 1)


class Longformer(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int, length: int, window: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.embed_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(SlidingWindowLayer(width, heads, window) for _ in range(depth))
        self.lm_dense, self.lm_norm = nn.Linear(width, width), nn.LayerNorm(width)
        self.lm_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens: torch.Tensor, band: torch.Tensor, predict_at: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.tokens(tokens) + self.positions.weight[:tokens.shape[1]])
        for layer in self.layers:
            x = layer(x, band)
        x = x.gather(1, predict_at[..., None].expand(-1, -1, x.shape[-1]))
        return self.lm_norm(F.gelu(self.lm_dense(x))) @ self.tokens.weight.T + self.lm_bias


def healthy_longformer_mlm_4096(fixes: Fixes) -> Step:
    """Longformer masked language modelling (Beltagy et al. 2020) on 4096-token documents (RoBERTa's 50,265-token
    vocabulary, width 768, 12 heads, 6 layers, attention windows of 512; 4 documents a step; 15% of the positions
    masked, 80/10/10, their logits only, with the tied output embedding; bf16 autocast, fused AdamW at 3e-5).
    The sliding-window attention is blocked SDPA over 256-query blocks with a band mask, the corpus on the device,
    the masked positions drawn as a fixed count per document (no boolean indexing), one loss `.item()` at the
    end."""
    vocab, width, heads, depth = pick(50_265, 500), pick(768, 32), pick(12, 2), pick(6, 2)
    length, window, batch = pick(4096, 64), pick(256, 16), pick(4, 2)
    model = Longformer(vocab, width, heads, depth, length, window).to(dev())
    opt = adamw(model.parameters(), 3e-5, weight_decay=0.01)
    corpus = torch.randint(4, vocab, (pick(8_000_000, 20_000),), device=dev())
    offsets = torch.arange(length, device=dev())
    band = band_mask(length, window, batch, dev())
    predicted = int(0.15 * length)
    mask_id = 3

    def step() -> float:
        tokens = corpus[torch.randint(len(corpus) - length, (batch, 1), device=dev()) + offsets]
        positions = torch.rand(batch, length, device=dev()).argsort(1)[:, :predicted]
        originals = tokens.gather(1, positions)
        roll = torch.rand(batch, predicted, device=dev())
        replaced = torch.where(roll < 0.8, mask_id,
                               torch.where(roll < 0.9, torch.randint_like(originals, 4, vocab), originals))
        with autocast():
            logits = model(tokens.scatter(1, positions, replaced), band, positions)
        loss = F.cross_entropy(logits.float().flatten(0, 1), originals.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


PROGRAMS = {
    "mobilenetv3_grad_norm_items": ["host_syncs"],
    "conformer_ctc_fbank_collate": ["data_loader"],
    "tabnet_ghost_bn_chunks": ["launch_bound"],
    "dreamer_rssm_batch_16": ["tiny_batch"],
    "demucs_pageable_stems": ["pageable_copy"],
    "mocov3_fp32_momentum_encoder": ["precision"],
    "evoformer_empty_cache_eager": ["allocator_churn", "eager_attention"],
    "tft_host_calendar_foreach_adam": ["host_work", "optimizer_impl"],
    "healthy_s4d_speech_commands": [],
    "healthy_longformer_mlm_4096": [],
}
WITH_STACK = {"mobilenetv3_grad_norm_items", "tft_host_calendar_foreach_adam", "conformer_ctc_fbank_collate"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set_fixes(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
