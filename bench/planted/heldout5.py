"""A fifth held-out check of the advisor: fourteen programs of other architectures than bench/planted/corpus.py's,
heldout.py's, heldout2.py's, heldout3.py's and heldout4.py's (a SoundStream/EnCodec-style audio codec with residual
vector quantisation, a YOLOv3-style detector, an ODE-Net, ArcFace on a MobileFaceNet, a Nature DQN, a DCGAN, a
Show-and-Tell captioner, BERT masked language modelling, a compiled SchNet, Enformer, ConvNeXt, MeshGraphNets, a
Whisper-style recogniser and a compiled DiT), nine with one planted problem, three with two at once and two
healthy, written without reading the advisor's rules, with the same output format (OUT/NAME/trace +
planted.json), scored the same way:

    python bench/planted/heldout5.py OUT                  # on a GPU
    python bench/planted/heldout5.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout5.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT
    python bench/planted/fix_timelines.py heldout5 OUT2 NAME [NAME ...]   # a program as written and fixed

Each program's `build(fixes)` returns one training step; each problem sits behind `if CAUSE not in fixes` (or a
choice made from `fixes`) and its fix is what a user would change. A cause's planted cost is the step as written
less the step with that cause alone fixed; fixed_step_ms has every cause fixed (medians of 7 steps, each between
two synchronizes, profiler off). The tiny-batch program reports its times for the samples of the fixed batch (the
small step times the steps it takes to see them); its trace records single small steps. The programs whose
problem is on the host read their loss with `.item()` at the end of the step, as a loop that logs every step
does, so their traces serialise as their timing. The compiled programs run last (Inductor leaves a large Python
heap behind, which would lengthen the garbage collections of the program that collects every step). Without a GPU
the CUDA-only parts (graph capture, pinned memory, torch.cuda.empty_cache) are skipped, so in smoke mode a fix may
time the same as its problem.
"""

from __future__ import annotations

import gc
import math
import random
import tempfile
from collections.abc import Callable
from functools import cache, partial
from itertools import count
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


def scratch_folder(prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder in /dev/shm where there is one (a local disk's speed without touching it)."""
    shm = Path("/dev/shm")
    return tempfile.TemporaryDirectory(prefix=prefix, dir=shm if shm.is_dir() else None)


# ------------------------------------------------------------------------------------------------ host_syncs

class ResidualUnit(nn.Module):
    """SEANet's residual unit: ELU, a dilated 7-tap convolution to half the channels, ELU, a pointwise convolution
    back, a skip connection."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.ELU(), nn.Conv1d(channels, channels // 2, 7, dilation=dilation,
                                                      padding=3 * dilation),
                                  nn.ELU(), nn.Conv1d(channels // 2, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def seanet_encoder(channels: int, ratios: tuple[int, ...], dimension: int) -> nn.Sequential:
    """Waveform [B, 1, T] -> latents [B, dimension, T / prod(ratios)]: per ratio three residual units (dilations
    1, 3, 9), then a strided convolution that doubles the channels."""
    layers: list[nn.Module] = [nn.Conv1d(1, channels, 7, padding=3)]
    for ratio in ratios:
        layers += [ResidualUnit(channels, d) for d in (1, 3, 9)]
        layers += [nn.ELU(), nn.Conv1d(channels, 2 * channels, 2 * ratio, stride=ratio, padding=(ratio + 1) // 2)]
        channels *= 2
    return nn.Sequential(*layers, nn.ELU(), nn.Conv1d(channels, dimension, 3, padding=1))


def seanet_decoder(channels: int, ratios: tuple[int, ...], dimension: int) -> nn.Sequential:
    """The encoder mirrored: transposed strided convolutions that halve the channels, each followed by three
    residual units."""
    channels *= 2 ** len(ratios)
    layers: list[nn.Module] = [nn.Conv1d(dimension, channels, 7, padding=3)]
    for ratio in reversed(ratios):
        layers += [nn.ELU(), nn.ConvTranspose1d(channels, channels // 2, 2 * ratio, stride=ratio,
                                                padding=(ratio + 1) // 2, output_padding=ratio % 2)]
        channels //= 2
        layers += [ResidualUnit(channels, d) for d in (1, 3, 9)]
    return nn.Sequential(*layers, nn.ELU(), nn.Conv1d(channels, 1, 7, padding=3))


class EMACodebook(nn.Module):
    """A k-means codebook updated by exponential moving averages (no gradient), whose codes that fall out of use
    (EMA cluster size under `threshold`) are restarted from random vectors of the current batch."""

    def __init__(self, size: int, dim: int, on_device: bool, decay: float = 0.99, threshold: float = 2.0,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.size, self.decay, self.threshold, self.eps, self.on_device = size, decay, threshold, eps, on_device
        embed = torch.randn(size, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("embed_avg", embed.clone())
        self.register_buffer("cluster_size", torch.ones(size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] fp32 -> the straight-through quantised vectors and the commitment loss."""
        distance = x.pow(2).sum(1, keepdim=True) - 2 * x @ self.embed.t() + self.embed.pow(2).sum(1)
        codes = distance.argmin(1)
        quantised = F.embedding(codes, self.embed)
        if self.training:
            with torch.no_grad():
                if self.on_device:
                    self.expire_codes_on_device(x)
                else:
                    self.expire_codes(x)
                self.ema_update(x, codes)
        return x + (quantised - x).detach(), F.mse_loss(x, quantised.detach())

    def expire_codes(self, samples: torch.Tensor) -> None:
        """As vector-quantize-pytorch's codebook does it: return early when no code expired (a read of the mask),
        count the expired codes (another), overwrite them by boolean indexing (a nonzero each)."""
        expired = self.cluster_size < self.threshold
        if not torch.any(expired):
            return
        count_expired = int(expired.sum().item())
        chosen = samples[torch.randint(len(samples), (count_expired,), device=samples.device)]
        self.embed[expired] = chosen
        self.embed_avg[expired] = chosen * self.threshold
        self.cluster_size[expired] = self.threshold

    def expire_codes_on_device(self, samples: torch.Tensor) -> None:
        """The same restart as a select over the whole codebook: a candidate for every code, kept where it
        expired; nothing is read on the host."""
        expired = self.cluster_size < self.threshold
        chosen = samples[torch.randint(len(samples), (self.size,), device=samples.device)]
        self.embed.copy_(torch.where(expired[:, None], chosen, self.embed))
        self.embed_avg.copy_(torch.where(expired[:, None], chosen * self.threshold, self.embed_avg))
        self.cluster_size.copy_(torch.where(expired, self.threshold, self.cluster_size))

    def ema_update(self, x: torch.Tensor, codes: torch.Tensor) -> None:
        onehot = F.one_hot(codes, self.size).to(x.dtype)
        self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
        self.embed_avg.mul_(self.decay).add_(onehot.t() @ x, alpha=1 - self.decay)
        total = self.cluster_size.sum()
        smoothed = (self.cluster_size + self.eps) / (total + self.size * self.eps) * total
        self.embed.copy_(self.embed_avg / smoothed[:, None])


class ResidualVQ(nn.Module):
    """Residual vector quantisation: each codebook quantises what the codebooks before it left over. Runs in fp32
    (autocast off), as the codecs' quantisers do."""

    def __init__(self, codebooks: int, size: int, dim: int, on_device: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EMACodebook(size, dim, on_device) for _ in range(codebooks))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(z.device.type, enabled=False):
            residual, out, commitment = z.float(), torch.zeros_like(z, dtype=torch.float32), 0.0
            for layer in self.layers:
                quantised, loss = layer(residual)
                residual = residual - quantised.detach()
                out = out + quantised
                commitment = commitment + loss
        return out, commitment


def spectral_l1(x: torch.Tensor, y: torch.Tensor, n_fft: int) -> torch.Tensor:
    window = torch.hann_window(n_fft, device=x.device)
    spec = partial(torch.stft, n_fft=n_fft, hop_length=n_fft // 4, window=window, return_complex=True)
    return (spec(x).abs() - spec(y).abs()).abs().mean()


def soundstream_rvq_expire_codes(fixes: Fixes) -> Step:
    """A SoundStream/EnCodec-style neural audio codec (SEANet encoder and decoder from 32 channels, strides
    2-4-5-8, 128-d latents, 32 residual codebooks of 1024 codes as at 24 kbps; 16 clips of 1 s at 24 kHz, bf16
    autocast, the quantiser in fp32; L1 waveform and two STFT losses, no discriminators) whose codebooks restart
    dead codes as vector-quantize-pytorch does: `if not torch.any(expired): return`, `expired.sum().item()`,
    then `embed[expired] = ...` by boolean indexing: four or five device-to-host reads per codebook, over a
    hundred a step, each waiting for the GPU to drain between tiny quantiser kernels. Fix: restart with
    torch.where over the whole codebook (a random candidate for every code, kept where it expired), no host
    reads."""
    ratios = (2, 4, 5, 8)
    channels, dimension, codebooks, size = pick(32, 4), pick(128, 16), pick(32, 4), pick(1024, 32)
    batch, samples = pick(16, 2), pick(24_000, 3200)
    encoder = seanet_encoder(channels, ratios, dimension)
    decoder = seanet_decoder(channels, ratios, dimension)
    quantiser = ResidualVQ(codebooks, size, dimension, on_device="host_syncs" in fixes)
    model = nn.ModuleDict({"encoder": encoder, "quantiser": quantiser, "decoder": decoder}).to(dev())
    opt = fused_adamw(model.parameters())
    audio = torch.randn(batch, 1, samples, device=dev()).mul_(0.1).tanh_()

    def step() -> None:
        with autocast():
            z = encoder(audio)
            frames = z.shape[-1]
            q, commitment = quantiser(z.transpose(1, 2).reshape(-1, dimension))
            recon = decoder(q.view(batch, frames, dimension).transpose(1, 2)).float()
        wave, target = recon.squeeze(1), audio.squeeze(1)
        loss = (wave - target).abs().mean() + spectral_l1(wave, target, 512) + spectral_l1(wave, target, 2048) \
            + commitment
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- host_work

def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.LeakyReLU(0.1, inplace=True))


class DarkResidual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn(channels, channels // 2, 1), conv_bn(channels // 2, channels, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class YoloV3(nn.Module):
    """A YOLOv3-style detector: a Darknet trunk (stride-2 convolutions, residual blocks) and two detection scales
    (strides 32 and 16, the second fed by an upsampled route from the first), 3 anchors a scale."""

    def __init__(self, widths: tuple[int, ...], blocks: tuple[int, ...], classes: int) -> None:
        super().__init__()
        outputs = 3 * (5 + classes)
        stages: list[nn.Module] = []
        cin = widths[0]
        for width, n in zip(widths[1:], blocks):
            stages.append(nn.Sequential(conv_bn(cin, width, 3, 2), *[DarkResidual(width) for _ in range(n)]))
            cin = width
        self.stem, self.stages = conv_bn(3, widths[0], 3), nn.ModuleList(stages)
        c4, c5 = widths[-2], widths[-1]
        self.neck5 = nn.Sequential(conv_bn(c5, c5 // 2, 1), conv_bn(c5 // 2, c5, 3), conv_bn(c5, c5 // 2, 1))
        self.head5 = nn.Sequential(conv_bn(c5 // 2, c5, 3), nn.Conv2d(c5, outputs, 1))
        self.route = conv_bn(c5 // 2, c4 // 2, 1)
        self.head4 = nn.Sequential(conv_bn(c4 + c4 // 2, c4 // 2, 1), conv_bn(c4 // 2, c4, 3),
                                   nn.Conv2d(c4, outputs, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.stem(images)
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        c4, c5 = features[-2], features[-1]
        p5 = self.neck5(c5)
        p4 = torch.cat([F.interpolate(self.route(p5), scale_factor=2, mode="nearest"), c4], 1)
        return self.head5(p5), self.head4(p4)


ANCHORS = ((116, 90), (156, 198), (373, 326), (30, 61), (62, 45), (59, 119))
"""YOLOv3's anchors (pixels at 416) of the stride-32 scale, then of the stride-16 scale."""


def random_boxes(images: int, rng: np.random.Generator, classes: int) -> list[np.ndarray]:
    """Crowded scenes: 40 to 100 boxes an image, rows (class, cx, cy, w, h) normalised to the image."""
    boxes = []
    for _ in range(images):
        n = int(rng.integers(40, 101))
        wh = rng.uniform(0.02, 0.4, (n, 2))
        centre = rng.uniform(wh / 2, 1 - wh / 2)
        boxes.append(np.concatenate([rng.integers(classes, size=(n, 1)), centre, wh], 1).astype(np.float32))
    return boxes


def wh_iou(w: float, h: float, anchor_w: float, anchor_h: float) -> float:
    inter = min(w, anchor_w) * min(h, anchor_h)
    return inter / (w * h + anchor_w * anchor_h - inter)


def build_targets_python(batch: list[np.ndarray], grids: tuple[int, ...], image: int,
                         ignore: float = 0.5) -> list[torch.Tensor]:
    """The YOLOv3 targets as the reference loops write them, box by box on the host: the best of the six anchors
    by width-height IoU is responsible for the box in its grid cell (offsets, log size ratios, objectness,
    class); other anchors over the IoU threshold are not penalised for objectness there. Per scale: targets
    [B, 3, G, G, 6] and a no-object weight [B, 3, G, G], copied to the device."""
    targets = [np.zeros((len(batch), 3, g, g, 6), np.float32) for g in grids]
    noobj = [np.ones((len(batch), 3, g, g), np.float32) for g in grids]
    for b, boxes in enumerate(batch):
        for cls, cx, cy, w, h in boxes.tolist():
            ious = [wh_iou(w * image, h * image, aw, ah) for aw, ah in ANCHORS]
            best = max(range(len(ANCHORS)), key=ious.__getitem__)
            for k, iou in enumerate(ious):
                if iou > ignore or k == best:
                    scale, anchor = divmod(k, 3)
                    g = grids[scale]
                    noobj[scale][b, anchor, min(int(cy * g), g - 1), min(int(cx * g), g - 1)] = 0.0
            scale, anchor = divmod(best, 3)
            g = grids[scale]
            gx, gy = cx * g, cy * g
            gi, gj = min(int(gx), g - 1), min(int(gy), g - 1)
            aw, ah = ANCHORS[best]
            targets[scale][b, anchor, gj, gi] = (gx - gi, gy - gj, math.log(w * image / aw),
                                                 math.log(h * image / ah), 1.0, cls)
    return [torch.from_numpy(t).to(dev()) for t in (*targets, *noobj)]


def build_targets_on_device(boxes: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor, grids: tuple[int, ...],
                            image: int, ignore: float = 0.5) -> list[torch.Tensor]:
    """The same targets for the whole batch at once from padded boxes [B, M, 5] kept on the device: anchor IoUs
    [B, M, 6] and the best anchor by tensor ops, written with index_put_ at flat cell indices (boxes that do
    not belong go to a spare slot), no host reads."""
    b, m = valid.shape
    wh = boxes[..., 3:5] * image
    inter = torch.minimum(wh[..., None, :], anchors).prod(-1)
    ious = inter / (wh.prod(-1)[..., None] + anchors.prod(-1) - inter)
    best = ious.argmax(-1)
    image_index = torch.arange(b, device=boxes.device)[:, None].expand(b, m)
    targets, noobjs = [], []
    for scale, g in enumerate(grids):
        gx, gy = boxes[..., 1] * g, boxes[..., 2] * g
        gi, gj = gx.long().clamp(max=g - 1), gy.long().clamp(max=g - 1)
        spare = b * 3 * g * g
        hits = torch.zeros(spare + 1, device=boxes.device)
        for anchor in range(3):
            k = 3 * scale + anchor
            cell = ((image_index * 3 + anchor) * g + gj) * g + gi
            covered = valid & ((ious[..., k] > ignore) | (best == k))
            hits.index_put_((torch.where(covered, cell, spare).flatten(),), torch.ones(b * m, device=boxes.device),
                            accumulate=True)
        noobjs.append((hits[:spare] == 0).float().view(b, 3, g, g))
        anchor = best - 3 * scale
        mine = valid & (best // 3 == scale)
        cell = torch.where(mine, ((image_index * 3 + anchor.clamp(0, 2)) * g + gj) * g + gi, spare)
        chosen = anchors[best]
        values = torch.stack([gx - gi, gy - gj, torch.log(wh[..., 0] / chosen[..., 0]),
                              torch.log(wh[..., 1] / chosen[..., 1]), torch.ones_like(gx), boxes[..., 0]], -1)
        target = torch.zeros(spare + 1, 6, device=boxes.device)
        target.index_put_((cell.flatten(),), values.flatten(0, 1))
        targets.append(target[:spare].view(b, 3, g, g, 6))
    return [*targets, *noobjs]


def pad_boxes(boxes: list[np.ndarray], most: int) -> tuple[torch.Tensor, torch.Tensor]:
    padded = np.zeros((len(boxes), most, 5), np.float32)
    valid = np.zeros((len(boxes), most), bool)
    for i, b in enumerate(boxes):
        padded[i, :len(b)], valid[i, :len(b)] = b, True
    padded[~valid, 3:5] = 1.0  # unit boxes keep the log of the padding finite
    return torch.from_numpy(padded).to(dev()), torch.from_numpy(valid).to(dev())


def yolo_loss(prediction: torch.Tensor, target: torch.Tensor, noobj: torch.Tensor) -> torch.Tensor:
    """YOLOv3's loss on one scale: BCE on the centre offsets, squared error on the log sizes and cross-entropy
    on the class for responsible anchors, BCE on objectness everywhere but the ignored cells."""
    b, _, g, _ = prediction.shape
    p = prediction.float().view(b, 3, -1, g, g).permute(0, 1, 3, 4, 2)
    obj = target[..., 4]
    xy = F.binary_cross_entropy_with_logits(p[..., 0:2], target[..., 0:2], reduction="none").sum(-1)
    wh = (p[..., 2:4] - target[..., 2:4]).square().sum(-1)
    cls = F.cross_entropy(p[..., 5:].flatten(0, 3), target[..., 5].long().flatten(), reduction="none")
    conf = F.binary_cross_entropy_with_logits(p[..., 4], obj, reduction="none") * (obj + noobj)
    return (((xy + wh + cls.view_as(obj)) * obj).sum() + conf.sum()) / b


def yolo_python_build_targets(fixes: Fixes) -> Step:
    """A YOLOv3-style detector (a Darknet trunk of widths 32-1024 with 1-2-4-4-2 residual blocks, two detection
    scales, 80 classes) trained on crowded scenes (40-100 boxes an image, 16 images of 416x416 a step, the images
    already on the GPU, channels_last, bf16 autocast) whose targets are built as the reference loops do: box by
    box in Python on the host (six anchor IoUs, the responsible anchor's cell written into numpy arrays, the
    ignore mask), then copied in. Fix: keep the boxes padded on the device and build the targets for the whole
    batch with tensor ops (anchor IoUs, argmax, index_put_ at flat cell indices)."""
    torch.backends.cudnn.benchmark = True
    image, batch, classes = pick(416, 64), pick(16, 2), 80
    widths = (32, 64, 128, 256, 512, 1024) if on_gpu() else (4, 8, 8, 16, 16, 32)
    grids = (image // 32, image // 16)
    model = YoloV3(widths, pick((1, 2, 4, 4, 2), (1, 1, 1, 1, 1)), classes)
    model = model.to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    rng = np.random.default_rng(0)
    pool = pick(128, 8)
    boxes = random_boxes(pool, rng, classes)
    images = torch.rand(pool, 3, image, image, device=dev()).contiguous(memory_format=torch.channels_last)
    padded, valid = pad_boxes(boxes, 100)
    anchors = torch.tensor(ANCHORS, dtype=torch.float32, device=dev())
    batches = count()
    losses = []

    def step() -> None:
        start = next(batches) % (pool // batch) * batch
        if "host_work" in fixes:
            targets = build_targets_on_device(padded[start:start + batch], valid[start:start + batch], anchors, grids,
                                              image)
        else:
            targets = build_targets_python(boxes[start:start + batch], grids, image)
        with autocast():
            p5, p4 = model(images[start:start + batch])
        loss = yolo_loss(p5, targets[0], targets[2]) + yolo_loss(p4, targets[1], targets[3])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

class ConcatConv2d(nn.Module):
    """A 3x3 convolution that also sees the time t as a constant input channel (Chen et al.'s odenet code)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin + 1, cout, 3, padding=1)

    def forward(self, t: float, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([torch.ones_like(x[:, :1]) * t, x], 1))


class ODEFunc(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.GroupNorm(min(32, width), width) for _ in range(3))
        self.conv1, self.conv2 = ConcatConv2d(width, width), ConcatConv2d(width, width)

    def forward(self, t: float, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(t, F.relu(self.norm1(x)))
        return self.norm3(self.conv2(t, F.relu(self.norm2(x))))


class ODEBlock(nn.Module):
    """dx/dt = f(t, x) integrated from 0 to 1 with `steps` fixed steps of the classic Runge-Kutta method,
    backpropagated through the solver (as torchdiffeq's odeint with method='rk4' does without the adjoint)."""

    def __init__(self, func: nn.Module, steps: int) -> None:
        super().__init__()
        self.func, self.steps = func, steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, t = 1.0 / self.steps, 0.0
        for _ in range(self.steps):
            k1 = self.func(t, x)
            k2 = self.func(t + h / 2, x + h / 2 * k1)
            k3 = self.func(t + h / 2, x + h / 2 * k2)
            k4 = self.func(t + h, x + h * k3)
            x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            t += h
        return x


def ode_net_rk4_steps(fixes: Fixes) -> Step:
    """An ODE-Net classifier (Chen et al.: a downsampling stem to 64 channels at 16x16, one ODE block of two
    time-conditioned 3x3 convolutions with GroupNorm, a pooled linear head; CIFAR-sized images, batch 256, bf16
    weights) integrated with 20 fixed RK4 steps: four function evaluations a step, some 60 kernels of a few
    microseconds each per step forward and twice that backward, about 3,700 launches, each paid by the host.
    Fix: the ODE block's forward and backward each captured once as a CUDA graph with
    torch.cuda.make_graphed_callables and replayed (the stem, head and fused AdamW stay eager)."""
    width, batch, steps, size = pick(64, 8), pick(256, 4), pick(20, 4), pick(32, 16)
    stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.GroupNorm(min(32, width), width), nn.ReLU(),
                         nn.Conv2d(width, width, 4, 2, 1), nn.GroupNorm(min(32, width), width), nn.ReLU())
    block: nn.Module = ODEBlock(ODEFunc(width), steps)
    head = nn.Sequential(nn.GroupNorm(min(32, width), width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, 10))
    for module in (stem, block, head):
        module.to(dev(), BF16)
    parameters = [*stem.parameters(), *block.parameters(), *head.parameters()]
    if "launch_bound" in fixes and on_gpu():
        sample = torch.randn(batch, width, size // 2, size // 2, device=dev(), dtype=BF16, requires_grad=True)
        block = torch.cuda.make_graphed_callables(block, (sample,))
    opt = fused_adamw(parameters)
    images = torch.randn(batch, 3, size, size, device=dev(), dtype=BF16)
    labels = torch.randint(10, (batch,), device=dev())

    def step() -> None:
        logits = head(block(stem(images)))
        F.cross_entropy(logits.float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- precision

class DepthwiseBottleneck(nn.Module):
    """MobileFaceNet's bottleneck: 1x1 expansion, 3x3 depthwise (strided), 1x1 linear projection; BN and PReLU;
    a residual where the shape allows."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.PReLU(hidden),
                                  nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                                  nn.BatchNorm2d(hidden), nn.PReLU(hidden),
                                  nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


def mobilefacenet(embedding: int, width: int) -> nn.Sequential:
    """MobileFaceNet (Chen et al. 2018) for 112x112 faces: a strided 3x3 stem, a depthwise 3x3, the bottleneck
    table (t, c, n, s) = (2, 64, 5, 2), (4, 128, 1, 2), (2, 128, 6, 1), (4, 128, 1, 2), (2, 128, 2, 1), a 1x1 to
    512, a global depthwise 7x7 and a linear 1x1 to the embedding."""
    scale = width / 64
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.PReLU(width),
                               nn.Conv2d(width, width, 3, 1, 1, groups=width, bias=False), nn.BatchNorm2d(width),
                               nn.PReLU(width)]
    cin = width
    for t, c, n, s in ((2, 64, 5, 2), (4, 128, 1, 2), (2, 128, 6, 1), (4, 128, 1, 2), (2, 128, 2, 1)):
        c = int(c * scale)
        for i in range(n):
            layers.append(DepthwiseBottleneck(cin, c, s if i == 0 else 1, t))
            cin = c
    top = int(512 * scale)
    layers += [nn.Conv2d(cin, top, 1, bias=False), nn.BatchNorm2d(top), nn.PReLU(top),
               nn.Conv2d(top, top, 7, groups=top, bias=False), nn.BatchNorm2d(top),
               nn.Conv2d(top, embedding, 1, bias=False), nn.BatchNorm2d(embedding), nn.Flatten()]
    return nn.Sequential(*layers)


class ArcFaceHead(nn.Module):
    """ArcFace (additive angular margin m=0.5, scale s=64) over the identities' normalised class centres."""

    def __init__(self, embedding: int, classes: int, fp32_cosines: bool, margin: float = 0.5,
                 scale: float = 64.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.01 * torch.randn(classes, embedding))
        self.fp32_cosines, self.margin, self.scale = fp32_cosines, margin, scale

    def cosines(self, embeddings: torch.Tensor) -> torch.Tensor:
        if self.fp32_cosines:
            with torch.autocast(embeddings.device.type, enabled=False):
                return F.linear(F.normalize(embeddings.float()), F.normalize(self.weight))
        return F.linear(F.normalize(embeddings), F.normalize(self.weight)).float()

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cosine = self.cosines(embeddings).clamp(-1 + 1e-7, 1 - 1e-7)
        target = cosine.gather(1, labels[:, None])
        sine = (1 - target.square()).sqrt()
        with_margin = target * math.cos(self.margin) - sine * math.sin(self.margin)
        with_margin = torch.where(target > math.cos(math.pi - self.margin), with_margin,
                                  target - math.sin(math.pi - self.margin) * self.margin)
        return F.cross_entropy(self.scale * cosine.scatter(1, labels[:, None], with_margin), labels)


def arcface_fp32_cosine_head(fixes: Fixes) -> Step:
    """Face recognition with ArcFace on Glint360K's 360,232 identities (a MobileFaceNet to 512-d embeddings, 512
    faces of 112x112 a step, channels_last, bf16 autocast for the trunk, fused AdamW) whose margin head turns
    autocast off and upcasts ('the margin needs fp32 cosines'): the [512 x 512] x [512 x 360k] cosine GEMM and
    its two backward GEMMs run in full fp32 (TF32 off, PyTorch's default for matmuls). Fix: leave the cosine GEMM
    under autocast (bf16) and take its output to fp32 for the margin and the loss."""
    torch.backends.cudnn.benchmark = True
    embedding, batch, classes = 512, pick(512, 4), pick(360_232, 1000)
    trunk = mobilefacenet(embedding, pick(64, 16)).to(dev(), memory_format=torch.channels_last)
    head = ArcFaceHead(embedding, classes, fp32_cosines="precision" not in fixes).to(dev())
    opt = fused_adamw([*trunk.parameters(), *head.parameters()])
    faces = torch.randn(batch, 3, 112, 112, device=dev()).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(classes, (batch,), device=dev())

    def step() -> None:
        with autocast():
            loss = head(trunk(faces), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------ tiny_batch

class NatureQNetwork(nn.Module):
    """The Nature DQN network: three convolutions over 4 stacked 84x84 frames, a 512-unit layer, one Q-value an
    action."""

    def __init__(self, actions: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                                 nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
                                 nn.Linear(512, actions))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.net(frames.float() / 255)


def dqn_nature_batch_32(fixes: Fixes) -> Step:
    """Double DQN with the Nature network (18 actions, Huber loss, gamma 0.99, Adam with Rainbow's lr 6.25e-5 and
    eps 1.5e-4, gradient norm clipped at 10) on a replay buffer of 50k transitions kept on the GPU as uint8
    frames, updated with the paper's 32 transitions a step: three small networks' forwards, one backward and the
    optimizer on a batch that leaves the GPU mostly idle between launches. step_ms is the time for 512
    transitions (16 updates of 32). Fix: 512 transitions an update (one update for the same transitions)."""
    capacity, actions, gamma = pick(50_000, 256), 18, 0.99
    full = pick(512, 64)
    batch = full if "tiny_batch" in fixes else pick(32, 8)
    online, target = NatureQNetwork(actions).to(dev()), NatureQNetwork(actions).to(dev())
    target.load_state_dict(online.state_dict())
    target.requires_grad_(False)
    opt = torch.optim.Adam(online.parameters(), lr=6.25e-5, eps=1.5e-4, fused=on_gpu())
    observations = torch.randint(256, (capacity, 4, 84, 84), dtype=torch.uint8, device=dev())
    next_observations = torch.randint(256, (capacity, 4, 84, 84), dtype=torch.uint8, device=dev())
    taken = torch.randint(actions, (capacity,), device=dev())
    rewards = torch.randn(capacity, device=dev()).sign()
    done = torch.rand(capacity, device=dev()) < 0.01
    updates = count()

    def step() -> None:
        i = torch.randint(capacity, (batch,), device=dev())
        q = online(observations[i]).gather(1, taken[i, None]).squeeze(1)
        with torch.no_grad():
            following = next_observations[i]
            best = online(following).argmax(1, keepdim=True)
            bootstrap = target(following).gather(1, best).squeeze(1)
            goal = rewards[i] + gamma * bootstrap * (~done[i])
        F.smooth_l1_loss(q, goal).backward()
        nn.utils.clip_grad_norm_(online.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if next(updates) % 8000 == 7999:
            target.load_state_dict(online.state_dict())
    return PerSamples(step, full // batch)


# ---------------------------------------------------------------------------------------- checkpoint_in_step

def dcgan_generator(latent: int, width: int, size: int) -> nn.Sequential:
    """DCGAN's generator: a 4x4 transposed convolution from the latent, then transposed stride-2 convolutions
    that halve the channels and double the resolution up to `size`, BN and ReLU, tanh out."""
    channels = width * size // 8
    layers: list[nn.Module] = [nn.ConvTranspose2d(latent, channels, 4, 1, 0, bias=False), nn.BatchNorm2d(channels),
                               nn.ReLU(True)]
    resolution = 4
    while resolution < size // 2:
        layers += [nn.ConvTranspose2d(channels, channels // 2, 4, 2, 1, bias=False),
                   nn.BatchNorm2d(channels // 2), nn.ReLU(True)]
        channels, resolution = channels // 2, resolution * 2
    return nn.Sequential(*layers, nn.ConvTranspose2d(channels, 3, 4, 2, 1, bias=False), nn.Tanh())


def dcgan_discriminator(width: int, size: int) -> nn.Sequential:
    """DCGAN's discriminator: stride-2 convolutions that double the channels down to 4x4, BN and LeakyReLU, a 4x4
    convolution to one logit."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True)]
    channels, resolution = width, size // 2
    while resolution > 4:
        layers += [nn.Conv2d(channels, 2 * channels, 4, 2, 1, bias=False), nn.BatchNorm2d(2 * channels),
                   nn.LeakyReLU(0.2, True)]
        channels, resolution = 2 * channels, resolution // 2
    return nn.Sequential(*layers, nn.Conv2d(channels, 1, 4, 1, 0, bias=False), nn.Flatten())


def dcgan_save_every_iteration(fixes: Fixes) -> Step:
    """A DCGAN at 128x128 (generator and discriminator of widths 64-1024, 24M parameters together; 256 images a
    step, bf16 autocast, Adam(0.0002, betas (0.5, 0.999)), the discriminator step then the generator step) on a
    preemptible machine, so the loop ends every iteration with torch.save({'generator': G.state_dict(),
    'discriminator': D.state_dict(), ...}) to /dev/shm: 95 MB of fp32 copied to the host and written each
    iteration. Fix: save every 1000 iterations (none in the timed ones)."""
    torch.backends.cudnn.benchmark = True
    latent, width, size, batch = 100, pick(64, 4), pick(128, 32), pick(256, 4)
    generator = dcgan_generator(latent, width, size).to(dev(), memory_format=torch.channels_last)
    discriminator = dcgan_discriminator(width, size).to(dev(), memory_format=torch.channels_last)
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999), fused=on_gpu())
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999), fused=on_gpu())
    dataset = (torch.rand(pick(1024, 16), 3, size, size, device=dev()) * 2 - 1).contiguous(
        memory_format=torch.channels_last)
    folder = scratch_folder("dcgan-")
    every = 1000 if "checkpoint_in_step" in fixes else 1
    iterations, losses = count(1), []
    ones, zeros = torch.ones(batch, 1, device=dev()), torch.zeros(batch, 1, device=dev())

    def step() -> None:
        iteration = next(iterations)
        real = dataset[torch.randint(len(dataset), (batch,), device=dev())]
        z = torch.randn(batch, latent, 1, 1, device=dev())
        discriminator.zero_grad(set_to_none=True)
        with autocast():
            fake = generator(z)
            d_real, d_fake = discriminator(real), discriminator(fake.detach())
        loss_d = F.binary_cross_entropy_with_logits(d_real.float(), ones) + \
            F.binary_cross_entropy_with_logits(d_fake.float(), zeros)
        loss_d.backward()
        opt_d.step()
        generator.zero_grad(set_to_none=True)
        with autocast():
            d_generated = discriminator(fake)
        loss_g = F.binary_cross_entropy_with_logits(d_generated.float(), ones)
        loss_g.backward()
        opt_g.step()
        losses.append((loss_d.item(), loss_g.item()))
        if iteration % every == 0:
            torch.save({"generator": generator.state_dict(), "discriminator": discriminator.state_dict(),
                        "iteration": iteration}, Path(folder.name) / "latest.pt")
    return step


# ------------------------------------------------------------------------------------------------- gc_pauses

class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True),
                                  nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(True), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def resnet50_trunk(base: int) -> tuple[nn.Sequential, int]:
    """ResNet-50's convolutions (blocks 3-4-6-3), pooled: the module and its feature width."""
    layers: list[nn.Module] = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = base
    for i, n in enumerate((3, 4, 6, 3)):
        width = base * 2 ** i
        for j in range(n):
            layers.append(Bottleneck(cin, width, 2 if i and not j else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()), cin


class ShowAndTell(nn.Module):
    """Show and Tell (Vinyals et al.): the image's CNN features, projected, are the LSTM's first input; the
    caption's words follow (teacher forcing); a linear layer predicts the next word. The LSTM runs in fp32
    (autocast off: cuDNN's recurrent kernels)."""

    def __init__(self, base: int, vocab: int, width: int) -> None:
        super().__init__()
        self.encoder, features = resnet50_trunk(base)
        self.project = nn.Linear(features, width)
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.out = nn.Linear(width, vocab)

    def forward(self, images: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        inputs = torch.cat([self.project(self.encoder(images))[:, None], self.embed(words)], 1)
        with torch.autocast(inputs.device.type, enabled=False):
            hidden, _ = self.lstm(inputs.float())
        return self.out(hidden)


def show_and_tell_gc_collect(fixes: Fixes) -> Step:
    """Show-and-Tell captioning fine-tuning its encoder (a ResNet-50, 256 images of 224x224 a step, channels_last;
    an LSTM of 512 (fp32) over 20-word captions, a 10k-word vocabulary; bf16 autocast, fused AdamW) whose loop ends each
    step with `del images, logits, loss; gc.collect()` ('freed the memory after an OOM once'): a full
    collection of the process's heap every step, with the GPU idle. Profiled with stacks. Fix: drop the
    gc.collect() (nothing here makes reference cycles)."""
    torch.backends.cudnn.benchmark = True
    base, vocab, width = pick(64, 8), pick(10_000, 500), pick(512, 32)
    batch, size, words = pick(256, 2), pick(224, 64), 20
    model = ShowAndTell(base, vocab, width).to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    rng = np.random.default_rng(0)
    pool = pick(1024, 8)
    lengths = rng.integers(8, words + 1, pool)
    captions = torch.from_numpy(np.where(np.arange(words + 1) < lengths[:, None] + 1,
                                         rng.integers(1, vocab, (pool, words + 1)), 0)).to(dev())
    images = torch.randn(pool, 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    losses = []

    def step() -> None:
        chosen = torch.randint(pool, (batch,), device=dev())
        caption = captions[chosen]
        with autocast():
            logits = model(images[chosen], caption[:, :-1])
        loss = F.cross_entropy(logits[:, 1:].float().flatten(0, 1), caption[:, 1:].flatten(), ignore_index=0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del chosen, caption, logits, loss
        if "gc_pauses" not in fixes:
            gc.collect()
    return step


# ----------------------------------------------------------------------------------------------- data_loader

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def wordpiece_vocabulary(size: int) -> list[str]:
    """A WordPiece-like vocabulary: special tokens, whole words, then '##' continuation pieces (the last third)."""
    words = size - len(SPECIAL)
    return SPECIAL + [f"w{i}" for i in range(words * 2 // 3)] + [f"##p{i}" for i in range(words - words * 2 // 3)]


class PretokenisedCorpus(torch.utils.data.Dataset):
    """Documents already split into WordPiece ids, [CLS] ... [SEP] of `length` tokens, about a third of the
    pieces continuing the word before them."""

    def __init__(self, documents: int, length: int, vocabulary: list[str]) -> None:
        rng = np.random.default_rng(0)
        first_piece = len(SPECIAL) + (len(vocabulary) - len(SPECIAL)) * 2 // 3
        piece = rng.random((documents, length)) < 0.3
        ids = np.where(piece, rng.integers(first_piece, len(vocabulary), (documents, length)),
                       rng.integers(len(SPECIAL), first_piece, (documents, length)))
        ids[:, 0], ids[:, -1] = SPECIAL.index("[CLS]"), SPECIAL.index("[SEP]")
        self.ids = ids

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> list[int]:
        return self.ids[index % len(self.ids)].tolist()


class WholeWordMaskCollator:
    """Hugging Face's DataCollatorForWholeWordMask: per example, the ids turned back into tokens, the tokens
    grouped into words ('##' pieces join the word before), words drawn at random until 15% of the tokens are
    covered (in Python); then the 80/10/10 [MASK] / random / kept replacement on the batch."""

    def __init__(self, vocabulary: list[str], probability: float = 0.15) -> None:
        self.vocabulary, self.probability = vocabulary, probability
        self.mask_id = vocabulary.index("[MASK]")
        self.rng = random.Random(0)

    def __call__(self, examples: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.tensor(examples)
        covered = torch.tensor([self.whole_word_mask([self.vocabulary[i] for i in ids]) for ids in examples])
        return self.mask_tokens(inputs, covered.bool())

    def whole_word_mask(self, tokens: list[str], max_predictions: int = 512) -> list[int]:
        words: list[list[int]] = []
        for i, token in enumerate(tokens):
            if token in ("[CLS]", "[SEP]"):
                continue
            if words and token.startswith("##"):
                words[-1].append(i)
            else:
                words.append([i])
        self.rng.shuffle(words)
        wanted = min(max_predictions, max(1, round(len(tokens) * self.probability)))
        covered: set[int] = set()
        for word in words:
            if len(covered) >= wanted:
                break
            if len(covered) + len(word) > wanted:
                continue
            covered.update(word)
        return [1 if i in covered else 0 for i in range(len(tokens))]

    def mask_tokens(self, inputs: torch.Tensor, covered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels = inputs.masked_fill(~covered, -100)
        replaced = torch.bernoulli(torch.full(inputs.shape, 0.8)).bool() & covered
        randomised = torch.bernoulli(torch.full(inputs.shape, 0.5)).bool() & covered & ~replaced
        inputs = inputs.masked_fill(replaced, self.mask_id)
        inputs = torch.where(randomised, torch.randint(len(self.vocabulary), inputs.shape), inputs)
        return inputs, labels


class BertLayer(nn.Module):
    """BERT's post-norm encoder layer (SDPA, attention and hidden dropout 0.1)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ffn = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(0.1))
        self.norm1, self.norm2 = nn.LayerNorm(width, eps=1e-12), nn.LayerNorm(width, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        x = self.norm1(x + F.dropout(self.proj(attended.transpose(1, 2).reshape(b, s, w)), 0.1, self.training))
        return self.norm2(x + self.ffn(x))


class BertForMaskedLM(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int, length: int) -> None:
        super().__init__()
        self.words, self.positions = nn.Embedding(vocab, width, padding_idx=0), nn.Embedding(length, width)
        self.embed_norm = nn.LayerNorm(width, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(width, heads) for _ in range(depth))
        self.transform = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width, eps=1e-12))
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.embed_norm(self.words(ids) + self.positions.weight[:ids.shape[1]]), 0.1, self.training)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.transform(x), self.words.weight, self.bias)


def bert_mlm_collate_in_process(fixes: Fixes) -> Step:
    """BERT-base masked-language-model pretraining (12 layers of width 768, 12 heads, SDPA, 32 sequences of 512
    WordPiece tokens a step, bf16 autocast, fused AdamW) fed by a DataLoader with the Trainer's default
    num_workers=0 and Hugging Face's whole-word-mask collator, whose per-token Python (ids back to tokens,
    grouping pieces into words, drawing words to mask) runs in the training process every step, the GPU idle.
    Fix: num_workers=4 with persistent_workers=True (the collator runs in the workers, batches prefetched)."""
    vocab, width, heads, depth = pick(30_522, 500), pick(768, 32), pick(12, 2), pick(12, 2)
    batch, length = pick(32, 2), pick(512, 64)
    vocabulary = wordpiece_vocabulary(vocab)
    dataset = PretokenisedCorpus(pick(2048, 16), length, vocabulary)
    workers = {"num_workers": pick(4, 2), "persistent_workers": True} if "data_loader" in fixes else {}
    batches = iter(torch.utils.data.DataLoader(dataset, batch_size=batch, collate_fn=WholeWordMaskCollator(vocabulary),
                                               **workers))
    model = BertForMaskedLM(vocab, width, heads, depth, length).to(dev())
    opt = fused_adamw(model.parameters())
    losses = []

    def step() -> None:
        ids, labels = (t.to(dev()) for t in next(batches))
        with autocast():
            logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# --------------------------------------------------------------------------------------------- recompilation

def shifted_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x) - math.log(2.0)


class Interaction(nn.Module):
    """SchNet's interaction block: a continuous-filter convolution (a filter network on the expanded distances,
    times a cosine cutoff, multiplies the neighbours' features, summed into each atom), then an atom-wise MLP,
    residual."""

    def __init__(self, hidden: int, filters: int, gaussians: int) -> None:
        super().__init__()
        self.filter1, self.filter2 = nn.Linear(gaussians, filters), nn.Linear(filters, filters)
        self.into = nn.Linear(hidden, filters, bias=False)
        self.out1, self.out2 = nn.Linear(filters, hidden), nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor, expanded: torch.Tensor, cutoff: torch.Tensor, source: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        w = self.filter2(shifted_softplus(self.filter1(expanded))) * cutoff[:, None]
        messages = self.into(h)[source] * w
        summed = torch.zeros(h.shape[0], w.shape[1], device=h.device, dtype=messages.dtype).index_add_(
            0, target, messages)
        return h + self.out2(shifted_softplus(self.out1(summed)))


class SchNet(nn.Module):
    """SchNet (Schütt et al.) predicting a molecule's energy: atom-type embeddings, Gaussian-expanded interatomic
    distances with a cosine cutoff, interaction blocks, an atom-wise MLP summed per molecule. Each interaction
    block is compiled (regional torch.compile, `dynamic=False`: 'dynamic shapes made the kernels slower')."""

    def __init__(self, hidden: int, filters: int, blocks: int, gaussians: int = 50, cutoff: float = 5.0) -> None:
        super().__init__()
        self.cutoff = cutoff
        self.embed = nn.Embedding(100, hidden, padding_idx=0)
        self.register_buffer("offsets", torch.linspace(0, cutoff, gaussians), persistent=False)
        self.gamma = 0.5 / (cutoff / (gaussians - 1)) ** 2
        self.blocks = nn.ModuleList(Interaction(hidden, filters, gaussians) for _ in range(blocks))
        for block in self.blocks:
            block.compile(dynamic=False)
        self.readout1, self.readout2 = nn.Linear(hidden, hidden // 2), nn.Linear(hidden // 2, 1)

    def forward(self, atoms: torch.Tensor, positions: torch.Tensor, molecule: torch.Tensor, source: torch.Tensor,
                target: torch.Tensor, molecules: int) -> torch.Tensor:
        distance = (positions[source] - positions[target]).norm(dim=-1)
        expanded = torch.exp(-self.gamma * (distance[:, None] - self.offsets).square())
        cutoff = 0.5 * (torch.cos(distance * math.pi / self.cutoff) + 1) * (distance < self.cutoff)
        h = self.embed(atoms)
        for block in self.blocks:
            h = block(h, expanded, cutoff, source, target)
        energy = self.readout2(shifted_softplus(self.readout1(h))).squeeze(-1)
        return torch.zeros(molecules + 1, device=h.device, dtype=energy.dtype).index_add_(0, molecule, energy)


def random_conformers(number: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """QM9-like molecules: 9 to 29 atoms (H, C, N, O, F), positions a random walk of 1.0-1.6 A bonds."""
    molecules = []
    for _ in range(number):
        n = int(rng.integers(9, 30))
        steps = rng.normal(size=(n, 3))
        steps *= rng.uniform(1.0, 1.6, (n, 1)) / np.linalg.norm(steps, axis=1, keepdims=True)
        molecules.append((rng.choice([1, 6, 7, 8, 9], n, p=[0.5, 0.35, 0.07, 0.07, 0.01]),
                          np.cumsum(steps, 0).astype(np.float32)))
    return molecules


@cache
def ordered_pairs(atoms: int) -> np.ndarray:
    """Every ordered pair (i, j), i != j, of a molecule's atoms, [atoms * (atoms - 1), 2]."""
    return np.argwhere(~np.eye(atoms, dtype=bool))


def collate_molecules(chosen: list[tuple[np.ndarray, np.ndarray]], budget: tuple[int, int] | None
                      ) -> tuple[torch.Tensor, ...]:
    """A batch as one disconnected graph: atoms, positions, molecule index, and every ordered pair of atoms of a
    molecule as an edge. With a (nodes, edges) budget the batch is padded to exactly that size (trailing
    molecules dropped if it would not fit, never here): padding atoms are type 0 in a spare molecule, far from
    everything, padding edges join the last padding atom to itself."""
    atoms, positions, molecule, source, target = [], [], [], [], []
    offset, edges = 0, 0
    for i, (z, pos) in enumerate(chosen):
        n = len(z)
        if budget and (offset + n >= budget[0] or edges + n * (n - 1) > budget[1]):
            break
        pairs = ordered_pairs(n)
        atoms.append(z)
        positions.append(pos)
        molecule.append(np.full(n, i))
        source.append(pairs[:, 0] + offset)
        target.append(pairs[:, 1] + offset)
        offset, edges = offset + n, edges + n * (n - 1)
    if budget:
        nodes, spare_edges = budget[0] - offset, budget[1] - edges
        atoms.append(np.zeros(nodes, np.int64))
        positions.append(np.full((nodes, 3), 1e3, np.float32))
        molecule.append(np.full(nodes, len(chosen)))
        source.append(np.full(spare_edges, budget[0] - 1))
        target.append(np.full(spare_edges, budget[0] - 1))
    return tuple(torch.from_numpy(np.concatenate(a)).to(dev()) for a in (atoms, positions, molecule, source, target))


def schnet_compiled_varying_atoms(fixes: Fixes) -> Step:
    """SchNet on QM9-like molecules (9-29 atoms, all pairs within a molecule as edges, 6 interaction blocks of 128
    features and filters, 512 molecules a step, about 9.7k atoms and 190k edges) whose interaction blocks are
    compiled with `dynamic=False` and `torch._dynamo.config.cache_size_limit` raised to silence the warning: a
    batch's atom and edge counts differ from every earlier batch's, so each step fails the guards and compiles
    the block's forward and backward again. Fix: pad every batch to one fixed budget of atoms and edges (10% over
    the mean; padding atoms in a spare molecule, left out of the loss), one compiled shape. The batches are drawn
    afresh each run (unseeded), so that no compile cache left by an earlier run has seen their shapes."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    hidden, blocks, molecules = pick(128, 16), pick(6, 2), pick(512, 8)
    rng = np.random.default_rng(0)
    dataset = random_conformers(pick(20_000, 200), rng)
    pair_mean = np.mean([len(z) * (len(z) - 1) for z, _ in dataset])
    atom_mean = np.mean([len(z) for z, _ in dataset])
    budget = (int(1.1 * molecules * atom_mean), int(1.1 * molecules * pair_mean)) \
        if "recompilation" in fixes else None
    energies = torch.randn(len(dataset), device=dev())
    model = SchNet(hidden, hidden, blocks).to(dev())
    opt = fused_adamw(model.parameters())
    batches = np.random.default_rng()

    def step() -> None:
        chosen = batches.integers(len(dataset), size=molecules)
        graph = collate_molecules([dataset[i] for i in chosen], budget)
        predicted = model(*graph, molecules)[:molecules]
        F.mse_loss(predicted, energies[torch.from_numpy(chosen).to(dev())]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------- eager_attention + pageable_copy

class ConvBlock(nn.Module):
    """Enformer's convolution block: BatchNorm, GELU, convolution."""

    def __init__(self, cin: int, cout: int, kernel: int) -> None:
        super().__init__()
        self.norm, self.conv = nn.BatchNorm1d(cin), nn.Conv1d(cin, cout, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.gelu(self.norm(x)))


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class SoftmaxPool(nn.Module):
    """Enformer's attention pooling: pairs of positions weighted by a softmax over per-channel logits (a 1x1
    convolution initialised to 2 x identity)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.logits = nn.Conv1d(channels, channels, 1, bias=False)
        with torch.no_grad():
            self.logits.weight.copy_(2 * torch.eye(channels)[:, :, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, length = x.shape
        weights = self.logits(x).view(b, c, length // 2, 2).softmax(-1)
        return (x.view(b, c, length // 2, 2) * weights).sum(-1)


class RelativeAttention(nn.Module):
    """Multi-head self-attention with a learned bias per head and relative distance, attention dropout 0.05,
    written out as Enformer's code writes it (scores, + bias, softmax, dropout, times V) or through SDPA."""

    def __init__(self, width: int, heads: int, length: int, eager: bool) -> None:
        super().__init__()
        self.heads, self.length, self.eager = heads, length, eager
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.bias_table = nn.Parameter(torch.zeros(2 * length - 1, heads))
        index = torch.arange(length)
        self.register_buffer("relative", index[None, :] - index[:, None] + length - 1, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        bias = self.bias_table[self.relative].permute(2, 0, 1)[None]
        dropout = 0.05 if self.training else 0.0
        if self.eager:
            scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1) + bias
            attended = F.dropout(scores.softmax(-1), dropout, self.training).to(v.dtype) @ v
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout)
        return self.proj(attended.transpose(1, 2).reshape(b, s, w))


class EnformerLayer(nn.Module):
    def __init__(self, width: int, heads: int, length: int, eager: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = RelativeAttention(width, heads, length, eager)
        self.ffn = nn.Sequential(nn.Linear(width, 2 * width), nn.Dropout(0.4), nn.ReLU(), nn.Linear(2 * width, width),
                                 nn.Dropout(0.4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.norm1(x)), 0.4, self.training)
        return x + self.ffn(self.norm2(x))


class Enformer(nn.Module):
    """Enformer (Avsec et al.): a convolutional stem and a six-stage conv tower, each stage halving the length by
    attention pooling (DNA to 128-bp bins), transformer layers over the bins, the central bins cropped, a
    pointwise head to the tracks (softplus)."""

    def __init__(self, width: int, depth: int, heads: int, bins: int, crop: int, tracks: int, eager: bool) -> None:
        super().__init__()
        half = width // 2
        self.stem = nn.Sequential(nn.Conv1d(4, half, 15, padding=7), Residual(ConvBlock(half, half, 1)),
                                  SoftmaxPool(half))
        channels = [round(half * (width / half) ** (i / 5)) for i in range(6)]
        tower, cin = [], half
        for cout in channels:
            tower += [ConvBlock(cin, cout, 5), Residual(ConvBlock(cout, cout, 1)), SoftmaxPool(cout)]
            cin = cout
        self.tower = nn.Sequential(*tower)
        self.layers = nn.Sequential(*[EnformerLayer(width, heads, bins, eager) for _ in range(depth)])
        self.crop = crop
        self.pointwise = ConvBlock(width, 2 * width, 1)
        self.head = nn.Linear(2 * width, tracks)

    def forward(self, dna: torch.Tensor) -> torch.Tensor:
        x = self.tower(self.stem(dna.transpose(1, 2)))
        x = self.layers(x.transpose(1, 2))[:, self.crop:-self.crop]
        x = F.gelu(self.pointwise(x.transpose(1, 2))).transpose(1, 2)
        return F.softplus(self.head(x).float())


def enformer_eager_attention_pageable_targets(fixes: Fixes) -> Step:
    """Enformer (width 768, 11 transformer layers of 8 heads with a learned relative-position bias, 131,072-bp
    one-hot sequences pooled to 1,024 bins, the central 896 predicted for 5,313 human tracks, Poisson loss, 8
    sequences a step, bf16 autocast, fused AdamW) with two problems. Its attention is written out as Enformer's
    code does (scores + bias, softmax, dropout, times V), materialising [8, 8, 1024, 1024] scores and
    probabilities in every layer, forward and backward (fix: F.scaled_dot_product_attention with the bias as
    attn_mask and dropout_p). And the training set is held in host memory as float32 numpy arrays, each step's
    slice copied in with `.to('cuda')`: 17 MB of one-hot DNA and 152 MB of targets a step from pageable memory,
    the host blocked on it (fix: the arrays in pinned memory, copied with non_blocking=True)."""
    width, depth, heads, batch = pick(768, 32), pick(11, 1), pick(8, 2), pick(8, 2)
    length, tracks = pick(131_072, 8192), pick(5313, 16)
    bins = length // 128
    crop = bins // 16
    model = Enformer(width, depth, heads, bins, crop, tracks, eager="eager_attention" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    rng = np.random.default_rng(0)
    samples = pick(32, 4)
    dna = np.eye(4, dtype=np.float32)[rng.integers(4, size=(samples, length))]
    tile = rng.gamma(0.5, 2.0, (bins - 2 * crop, tracks)).astype(np.float32)
    targets = np.repeat(tile[None], samples, 0) * rng.uniform(0.5, 2.0, (samples, 1, 1)).astype(np.float32)
    pin = "pageable_copy" in fixes
    host = [pinned(torch.from_numpy(a)) for a in (dna, targets)] if pin else [dna, targets]
    slices = count()

    def fetch(array, start: int) -> torch.Tensor:
        part = array[start:start + batch]
        return part.to(dev(), non_blocking=True) if pin else torch.from_numpy(part).to(dev())

    def step() -> None:
        start = next(slices) % (samples // batch) * batch
        x, y = (fetch(array, start) for array in host)
        with autocast():
            predicted = model(x)
        F.poisson_nll_loss(predicted, y, log_input=False).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# -------------------------------------------------------------------------- optimizer_impl + allocator_churn

class ChannelsFirstNorm(nn.Module):
    """ConvNeXt's LayerNorm over the channels of an NCHW map, written out as its code does."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        variance = (x - mean).pow(2).mean(1, keepdim=True)
        return self.weight[:, None, None] * ((x - mean) / torch.sqrt(variance + self.eps)) + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, LayerNorm, pointwise 4x expansion with GELU, pointwise back, layer scale, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, depths: tuple[int, ...], dims: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.downsample_layers = nn.ModuleList([nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), ChannelsFirstNorm(dims[0]))])
        for a, b in zip(dims, dims[1:]):
            self.downsample_layers.append(nn.Sequential(ChannelsFirstNorm(a), nn.Conv2d(a, b, 2, 2)))
        self.stages = nn.ModuleList(nn.Sequential(*[ConvNeXtBlock(d) for _ in range(n)]) for n, d in zip(depths, dims))
        self.norm, self.head = nn.LayerNorm(dims[-1], eps=1e-6), nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for downsample, stage in zip(self.downsample_layers, self.stages):
            x = stage(downsample(x))
        return self.head(self.norm(x.mean((2, 3))))


def convnext_layer_id(name: str) -> int:
    """The ConvNeXt repository's layer id for layer-wise learning-rate decay (12 layers; the third stage's
    blocks in threes)."""
    parts = name.split(".")
    if parts[0] == "downsample_layers":
        return {0: 0, 1: 2, 2: 3, 3: 12}[int(parts[1])]
    if parts[0] == "stages":
        stage, block = int(parts[1]), int(parts[2])
        return stage + 1 if stage < 2 else 3 + block // 3 if stage == 2 else 12
    return 13


def layer_decay_groups(model: nn.Module, lr: float, weight_decay: float, decay: float, merged: bool) -> list[dict]:
    """AdamW parameter groups for fine-tuning with layer-wise lr decay: one group per parameter as written
    (its own lr scale and weight decay), or one per (layer, decayed or not) as the ConvNeXt repository groups
    them."""
    groups: dict[tuple, dict] = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        layer = convnext_layer_id(name)
        no_decay = p.ndim == 1 or name.endswith(".gamma")
        key = (layer, no_decay) if merged else (i,)
        group = groups.setdefault(key, {"params": [], "lr": lr * decay ** (13 - layer),
                                        "weight_decay": 0.0 if no_decay else weight_decay})
        group["params"].append(p)
    return list(groups.values())


def convnext_param_groups_empty_cache(fixes: Fixes) -> Step:
    """ConvNeXt-T fine-tuning (depths 3-3-9-3, widths 96-768, 32 images of 224x224 a step, channels_last, bf16
    autocast, label smoothing 0.1) with layer-wise lr decay 0.8, with two problems. Its AdamW gets one parameter
    group per parameter (each with its own lr scale and weight decay), so the optimizer runs its foreach update
    182 times over a single tensor each, some 2,000 small launches and the Python of 182 groups a step (fix:
    one group per layer and decay setting, as the ConvNeXt repository builds them, 16 groups, and
    AdamW(fused=True)). And a memory logger calls torch.cuda.empty_cache() before reading
    torch.cuda.memory_reserved() every step 'so the number means what the step needs': the allocator hands its
    cached blocks back and mallocs them again the next step (fix: log memory_reserved() without emptying)."""
    torch.backends.cudnn.benchmark = True
    depths, dims = ((3, 3, 9, 3), (96, 192, 384, 768)) if on_gpu() else ((1, 1, 3, 1), (8, 16, 16, 32))
    batch, size = pick(32, 2), pick(224, 64)
    model = ConvNeXt(depths, dims, 1000).to(dev(), memory_format=torch.channels_last)
    merged = "optimizer_impl" in fixes
    opt = torch.optim.AdamW(layer_decay_groups(model, 1e-4, 0.05, 0.8, merged), lr=1e-4,
                            fused=on_gpu() if merged else None)
    images = torch.randn(batch, 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(1000, (batch,), device=dev())
    memory_log = []

    def step() -> None:
        with autocast():
            logits = model(images)
        F.cross_entropy(logits.float(), labels, label_smoothing=0.1).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if "allocator_churn" not in fixes:
            release_cached_memory()
        if on_gpu():
            memory_log.append(torch.cuda.memory_reserved())
    return step


# ------------------------------------------------------------------------- precision + act. checkpointing

def mgn_mlp(cin: int, latent: int, norm: bool = True) -> nn.Sequential:
    """MeshGraphNets' MLP: two hidden ReLU layers of `latent`, a LayerNorm on the output (not for the decoder)."""
    layers: list[nn.Module] = [nn.Linear(cin, latent), nn.ReLU(), nn.Linear(latent, latent), nn.ReLU(),
                               nn.Linear(latent, latent)]
    return nn.Sequential(*layers, *([nn.LayerNorm(latent)] if norm else []))


class GraphNetBlock(nn.Module):
    """One message-passing step: edges updated from themselves and their two nodes, messages summed into each
    receiving node (in fp32), nodes updated from themselves and the sum; both residual."""

    def __init__(self, latent: int) -> None:
        super().__init__()
        self.edge_mlp, self.node_mlp = mgn_mlp(3 * latent, latent), mgn_mlp(2 * latent, latent)

    def forward(self, nodes: torch.Tensor, edges: torch.Tensor, senders: torch.Tensor,
                receivers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        updated = self.edge_mlp(torch.cat([edges, nodes[senders], nodes[receivers]], -1))
        summed = torch.zeros(nodes.shape[0], updated.shape[1], device=nodes.device).index_add_(
            0, receivers, updated.float())
        nodes = nodes + self.node_mlp(torch.cat([nodes, summed.to(nodes.dtype)], -1))
        return nodes, edges + updated


class MeshGraphNet(nn.Module):
    """MeshGraphNets (Pfaff et al.): encode nodes (velocity, node type) and mesh edges (relative position and
    length) to 128 latents, 15 unshared message-passing steps, decode each node's acceleration."""

    def __init__(self, node_features: int, edge_features: int, latent: int, steps: int, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.node_encoder, self.edge_encoder = mgn_mlp(node_features, latent), mgn_mlp(edge_features, latent)
        self.processor = nn.ModuleList(GraphNetBlock(latent) for _ in range(steps))
        self.decoder = mgn_mlp(latent, latent, norm=False)
        self.decoder.append(nn.Linear(latent, 2))

    def forward(self, nodes: torch.Tensor, edges: torch.Tensor, senders: torch.Tensor,
                receivers: torch.Tensor) -> torch.Tensor:
        nodes, edges = self.node_encoder(nodes), self.edge_encoder(edges)
        for block in self.processor:
            if self.checkpointed:
                nodes, edges = checkpoint(block, nodes, edges, senders, receivers, use_reentrant=False)
            else:
                nodes, edges = block(nodes, edges, senders, receivers)
        return self.decoder(nodes)


def triangle_mesh(side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A jittered side x side grid cut into triangles: positions, and the mesh edges in both directions."""
    rng = np.random.default_rng(0)
    ys, xs = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    positions = np.stack([xs, ys], -1).reshape(-1, 2) / side + rng.uniform(-0.2, 0.2, (side * side, 2)) / side
    index = np.arange(side * side).reshape(side, side)
    pairs = [(index[:, :-1], index[:, 1:]), (index[:-1, :], index[1:, :]), (index[:-1, :-1], index[1:, 1:])]
    a = np.concatenate([p.ravel() for p, _ in pairs])
    b = np.concatenate([q.ravel() for _, q in pairs])
    return positions.astype(np.float32), np.concatenate([a, b]), np.concatenate([b, a])


def meshgraphnet_fp32_checkpointed(fixes: Fixes) -> Step:
    """MeshGraphNets on a cylinder-flow-like mesh (a 128x128 triangulated grid, 16k nodes and 98k directed edges,
    latent 128, 15 message-passing steps, Adam) with two problems. It trains in fp32 with no autocast ('physics
    losses need fp32'), so every MLP's GEMMs (on 98k edges and 16k nodes, in each of 15 steps) run in full fp32
    with TF32 off, PyTorch's default for matmuls (fix: bf16 autocast around the model, the aggregation and the
    loss in fp32). And each message-passing step runs under torch.utils.checkpoint, a setting kept from the
    large 3-D meshes, so its forward runs again in the backward though these activations fit easily (fix: no
    checkpointing)."""
    side, latent, steps = pick(128, 12), pick(128, 16), pick(15, 2)
    positions, senders, receivers = triangle_mesh(side)
    relative = positions[senders] - positions[receivers]
    edge_features = torch.from_numpy(np.concatenate([relative, np.linalg.norm(relative, axis=1, keepdims=True)], 1))
    node_type = F.one_hot(torch.from_numpy(np.random.default_rng(1).choice(9, side * side, p=[0.9] + [0.0125] * 8)), 9)
    velocity = torch.randn(side * side, 2)
    node_features = torch.cat([velocity, node_type.float()], 1)
    nodes, edges = node_features.to(dev()), edge_features.to(dev())
    senders_, receivers_ = torch.from_numpy(senders).to(dev()), torch.from_numpy(receivers).to(dev())
    target = torch.randn(side * side, 2, device=dev())
    model = MeshGraphNet(11, 3, latent, steps, checkpointed="activation_checkpointing" not in fixes).to(dev())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=on_gpu())
    amp = "precision" in fixes

    def step() -> None:
        with autocast(enabled=amp):
            predicted = model(nodes, edges, senders_, receivers_)
        F.mse_loss(predicted.float(), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------------------------------- healthy

def sinusoids(length: int, width: int) -> torch.Tensor:
    scales = torch.exp(-math.log(10_000) * torch.arange(width // 2).float() / (width // 2 - 1))
    angles = torch.arange(length).float()[:, None] * scales
    return torch.cat([angles.sin(), angles.cos()], 1)


class WhisperBlock(nn.Module):
    """A pre-norm Whisper block: self-attention (causal in the decoder), cross-attention to the audio (decoder
    only), a 4x GELU MLP; attention through SDPA."""

    def __init__(self, width: int, heads: int, cross: bool) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm3 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.cross = cross
        if cross:
            self.norm2 = nn.LayerNorm(width)
            self.q, self.cross_proj = nn.Linear(width, width), nn.Linear(width, width)
            self.kv = nn.Linear(width, 2 * width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def heads_of(self, x: torch.Tensor, parts: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, parts, self.heads, -1).permute(2, 0, 3, 1, 4)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).flatten(2)

    def forward(self, x: torch.Tensor, audio: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.heads_of(self.qkv(self.norm1(x)), 3)
        x = x + self.proj(self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.cross)))
        if self.cross:
            q = self.heads_of(self.q(self.norm2(x)), 1)[0]
            k, v = self.heads_of(self.kv(audio), 2)
            x = x + self.cross_proj(self.merge(F.scaled_dot_product_attention(q, k, v)))
        return x + self.mlp(self.norm3(x))


class Whisper(nn.Module):
    """A Whisper-style recogniser: two convolutions over the log-mel frames (the second strided), sinusoidal
    positions, an encoder; a decoder of learned positions with tied output embeddings."""

    def __init__(self, mels: int, width: int, heads: int, depth: int, vocab: int, frames: int, tokens: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(mels, width, 3, padding=1), nn.Conv1d(width, width, 3, 2, padding=1)
        self.register_buffer("audio_positions", sinusoids(frames // 2, width), persistent=False)
        self.encoder = nn.ModuleList(WhisperBlock(width, heads, cross=False) for _ in range(depth))
        self.encoder_norm = nn.LayerNorm(width)
        self.embed, self.positions = nn.Embedding(vocab, width), nn.Parameter(0.01 * torch.randn(tokens, width))
        self.decoder = nn.ModuleList(WhisperBlock(width, heads, cross=True) for _ in range(depth))
        self.decoder_norm = nn.LayerNorm(width)

    def forward(self, mel: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        audio = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2) + self.audio_positions
        for block in self.encoder:
            audio = block(audio)
        audio = self.encoder_norm(audio)
        x = self.embed(tokens) + self.positions[:tokens.shape[1]]
        for block in self.decoder:
            x = block(x, audio)
        return self.decoder_norm(x) @ self.embed.weight.t()


def healthy_whisper_sdpa_bf16(fixes: Fixes) -> Step:
    """A Whisper-base-sized recogniser (6+6 blocks of width 512, 8 heads, 51,865 tokens; 32 clips of 30 s as
    80-bin log-mel frames, 3000 frames to 1500 positions; 128-token transcripts with padding ignored) with SDPA
    (flash) attention, bf16 autocast and fused AdamW: nothing planted."""
    mels, width, heads, depth = 80, pick(512, 32), pick(8, 2), pick(6, 1)
    vocab, frames, tokens, batch = pick(51_865, 500), pick(3000, 64), pick(128, 16), pick(32, 2)
    model = Whisper(mels, width, heads, depth, vocab, frames, tokens).to(dev())
    opt = fused_adamw(model.parameters())
    mel = torch.randn(batch, mels, frames, device=dev())
    text = torch.randint(vocab, (batch, tokens + 1), device=dev())
    lengths = torch.randint(tokens // 2, tokens + 1, (batch, 1), device=dev())
    labels = torch.where(torch.arange(tokens, device=dev()) < lengths, text[:, 1:], -100)

    def step() -> None:
        with autocast():
            logits = model(mel, text[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """A DiT block with adaLN-Zero: the conditioning regresses shift, scale and gate for the attention and the
    MLP; attention through SDPA."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        nn.init.zeros_(self.modulation[1].weight)
        nn.init.zeros_(self.modulation[1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c).chunk(6, 1)
        q, k, v = self.qkv(modulate(self.norm1(x), shift1, scale1)).view(b, s, 3, self.heads, -1).permute(
            2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, w)
        x = x + gate1[:, None] * self.proj(attended)
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


def sincos_2d(side: int, width: int) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(side).float(), torch.arange(side).float(), indexing="ij")
    return torch.cat([sinusoids(side * side, width // 2)[ys.flatten().long()],
                      sinusoids(side * side, width // 2)[xs.flatten().long()]], 1)


class DiT(nn.Module):
    """A class-conditional DiT (Peebles and Xie) on VAE latents: 2x2 patches, fixed 2-D sine-cosine positions,
    timestep and label embeddings summed as the conditioning, adaLN-Zero blocks (each compiled: regional
    torch.compile, one static shape), a modulated final layer predicting the noise."""

    def __init__(self, latent_side: int, channels: int, width: int, heads: int, depth: int, classes: int) -> None:
        super().__init__()
        self.patch, self.channels, self.classes = 2, channels, classes
        self.patchify = nn.Conv2d(channels, width, 2, 2)
        self.register_buffer("positions", sincos_2d(latent_side // 2, width), persistent=False)
        self.time_mlp = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        self.labels = nn.Embedding(classes + 1, width)
        self.blocks = nn.ModuleList(DiTBlock(width, heads) for _ in range(depth))
        for block in self.blocks:
            block.compile()
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.final = nn.Linear(width, 4 * channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.patchify(x).flatten(2).transpose(1, 2) + self.positions
        frequencies = torch.exp(-math.log(10_000) * torch.arange(128, device=x.device) / 128)
        angles = t[:, None].float() * frequencies
        cond = self.time_mlp(torch.cat([angles.cos(), angles.sin()], 1)) + self.labels(y)
        for block in self.blocks:
            tokens = block(tokens, cond)
        shift, scale = self.final_modulation(cond).chunk(2, 1)
        out = self.final(modulate(self.final_norm(tokens), shift, scale))
        out = out.view(b, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, c, h, w)


def healthy_dit_compiled(fixes: Fixes) -> Step:
    """A DiT-B/2 (12 blocks of width 768, 12 heads; 128 ImageNet latents of 4x32x32 a step, 256 tokens each,
    1000 classes with 10% label dropout for guidance) trained on the noise-prediction loss over a linear schedule
    of 1000 steps, each block compiled (regional torch.compile, one static shape, compiled in warm-up), bf16
    autocast, fused AdamW, an EMA of the weights with one torch._foreach_lerp_: nothing planted."""
    side, channels, classes = pick(32, 8), 4, 1000
    width, heads, depth, batch = pick(768, 32), pick(12, 2), pick(12, 2), pick(128, 2)
    model = DiT(side, channels, width, heads, depth, classes).to(dev())
    ema = [p.detach().clone() for p in model.parameters()]
    opt = fused_adamw(model.parameters())
    betas = torch.linspace(1e-4, 0.02, 1000, device=dev())
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    latents = torch.randn(batch, channels, side, side, device=dev())
    labels = torch.randint(classes, (batch,), device=dev())

    def step() -> None:
        t = torch.randint(1000, (batch,), device=dev())
        noise = torch.randn_like(latents)
        a = alphas_cumprod[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        y = torch.where(torch.rand(batch, device=dev()) < 0.1, classes, labels)
        with autocast():
            predicted = model(noisy, t, y)
        F.mse_loss(predicted.float(), noise).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 1 - 0.9999)
    return step


PROGRAMS = {
    "soundstream_rvq_expire_codes": ["host_syncs"],
    "yolo_python_build_targets": ["host_work"],
    "ode_net_rk4_steps": ["launch_bound"],
    "arcface_fp32_cosine_head": ["precision"],
    "dqn_nature_batch_32": ["tiny_batch"],
    "dcgan_save_every_iteration": ["checkpoint_in_step"],
    "show_and_tell_gc_collect": ["gc_pauses"],
    "bert_mlm_collate_in_process": ["data_loader"],
    "enformer_eager_attention_pageable_targets": ["eager_attention", "pageable_copy"],
    "convnext_param_groups_empty_cache": ["optimizer_impl", "allocator_churn"],
    "meshgraphnet_fp32_checkpointed": ["precision", "activation_checkpointing"],
    "healthy_whisper_sdpa_bf16": [],
    "schnet_compiled_varying_atoms": ["recompilation"],
    "healthy_dit_compiled": [],
}
WITH_STACK = {"show_and_tell_gc_collect"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set_fixes(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
