"""A third held-out check of the advisor: twelve programs of other architectures than bench/planted/corpus.py's,
bench/planted/heldout.py's and bench/planted/heldout2.py's (a PointNet segmenter, a NeRF, a capsule network, a
T5-style encoder-decoder, a Conformer-CTC speech recogniser, a convolutional VAE, a CLIP dual encoder, a
GraphSAGE with neighbour sampling, a temporal conv net, a Perceiver, a masked autoencoder and an R(2+1)D video
net), ten with one planted problem and two healthy, written without reading the advisor's rules, with the same
output format (OUT/NAME/trace + planted.json), scored the same way:

    python bench/planted/heldout3.py OUT                  # on a GPU (about 70 s on one H100)
    python bench/planted/heldout3.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout3.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT

Each program's `build(fixed)` returns one training step; its problem sits behind `if not fixed` (or a choice made
from `fixed`) and the fix is what a user would change. The planted cost is the step as written less the step as
fixed (medians of 7 steps, each between two synchronizes, profiler off). The programs whose problem is on the host
read their loss with `.item()` at the end of the step, as a loop that logs every step does, so their traces
serialise as their timing. Without a GPU the CUDA-only parts (graph capture, pinned memory,
torch.cuda.empty_cache) are skipped, so in smoke mode a fix may time the same as its problem.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import BF16, autocast, dev, fused_adamw, on_gpu, pick, pinned, run_set


def conv1x1(cin: int, cout: int) -> nn.Sequential:
    """A PointNet shared MLP layer: the same Linear on every point (a kernel-1 Conv1d), BatchNorm, ReLU."""
    return nn.Sequential(nn.Conv1d(cin, cout, 1), nn.BatchNorm1d(cout), nn.ReLU())


def dense(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(cin, cout), nn.BatchNorm1d(cout), nn.ReLU())


class TransformerBlock(nn.Module):
    """Pre-norm self-attention block with SDPA and a GELU MLP (used by the CLIP towers and the MAE)."""

    def __init__(self, width: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(self.norm2(x))


# ------------------------------------------------------------------------------------------------ host_syncs

def check_finite_blocking(h: torch.Tensor, where: str) -> torch.Tensor:
    """The activation check as written: a Python branch on a device value."""
    if not torch.isfinite(h).all():
        raise FloatingPointError(f"non-finite activations after {where}")
    return h


def check_finite_async(h: torch.Tensor, where: str) -> torch.Tensor:
    """The same check asserted on the device: it fails the stream instead of stopping the host."""
    torch._assert_async(torch.isfinite(h).all(), f"non-finite activations after {where}")
    return h


class TNet(nn.Module):
    """PointNet's alignment network: a k x k transform predicted from the whole cloud, near the identity."""

    def __init__(self, k: int, check) -> None:
        super().__init__()
        self.k, self.check = k, check
        self.features = nn.ModuleList([conv1x1(k, 64), conv1x1(64, 128), conv1x1(128, 1024)])
        self.fc = nn.ModuleList([dense(1024, 512), dense(512, 256)])
        self.out = nn.Linear(256, k * k)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.features):
            x = self.check(layer(x), f"tnet{self.k}.conv{i}")
        x = x.amax(-1)
        for i, layer in enumerate(self.fc):
            x = self.check(layer(x), f"tnet{self.k}.fc{i}")
        return self.out(x).view(-1, self.k, self.k) + torch.eye(self.k, device=x.device, dtype=x.dtype)


class PointNetSegmenter(nn.Module):
    """PointNet part segmentation: input and feature transforms, shared MLPs, a global max-pooled feature
    concatenated back onto every point, a per-point classifier."""

    def __init__(self, parts: int, check) -> None:
        super().__init__()
        self.check = check
        self.input_transform, self.feature_transform = TNet(3, check), TNet(64, check)
        self.local = nn.ModuleList([conv1x1(3, 64), conv1x1(64, 64)])
        self.expand = nn.ModuleList([conv1x1(64, 128), conv1x1(128, 1024)])
        self.head = nn.ModuleList([conv1x1(1088, 512), conv1x1(512, 256), conv1x1(256, 128)])
        self.classify = nn.Conv1d(128, parts, 1)

    def forward(self, points: torch.Tensor):
        x = torch.bmm(self.input_transform(points).transpose(1, 2), points)
        for i, layer in enumerate(self.local):
            x = self.check(layer(x), f"local{i}")
        transform = self.feature_transform(x)
        local = torch.bmm(transform.transpose(1, 2), x)
        x = local
        for i, layer in enumerate(self.expand):
            x = self.check(layer(x), f"expand{i}")
        x = torch.cat([local, x.amax(-1, keepdim=True).expand(-1, -1, local.shape[-1])], 1)
        for i, layer in enumerate(self.head):
            x = self.check(layer(x), f"head{i}")
        return self.classify(x), transform


def pointnet_finite_checks(fixed: bool):
    """PointNet part segmentation (32 clouds of 2048 points, bf16 autocast) with a 'debug' check after every
    shared-MLP and FC layer, `if not torch.isfinite(h).all(): raise`, 17 of them: each a device-to-host read that
    stops the host until the GPU has caught up. Fix: the same check with torch._assert_async (no host read)."""
    clouds, points, parts = pick(32, 2), pick(2048, 128), 50
    check = check_finite_async if fixed else check_finite_blocking
    model = PointNetSegmenter(parts, check).to(dev())
    opt = fused_adamw(model.parameters())
    xyz = torch.randn(clouds, 3, points, device=dev())
    labels = torch.randint(parts, (clouds, points), device=dev())
    eye = torch.eye(64, device=dev())

    def step():
        with autocast():
            logits, transform = model(xyz)
        orthogonality = (transform.float() @ transform.float().transpose(1, 2) - eye).square().sum((1, 2)).mean()
        (F.cross_entropy(logits.float(), labels) + 1e-3 * orthogonality).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- host_work

def positional_encoding(x: torch.Tensor, frequencies: int) -> torch.Tensor:
    """NeRF's encoding: x, then sin and cos of x * 2^k * pi for k < frequencies."""
    scales = math.pi * 2.0 ** torch.arange(frequencies, device=x.device, dtype=x.dtype)
    angles = (x.unsqueeze(-1) * scales).flatten(-2)
    return torch.cat([x, angles.sin(), angles.cos()], -1)


class NeRF(nn.Module):
    """The NeRF MLP: 8 layers on the encoded position with a skip at the fifth, a density head, and a colour head
    that also sees the encoded view direction."""

    def __init__(self, width: int, position_freqs: int = 10, direction_freqs: int = 4) -> None:
        super().__init__()
        self.position_freqs, self.direction_freqs = position_freqs, direction_freqs
        position_dim, direction_dim = 3 + 6 * position_freqs, 3 + 6 * direction_freqs
        self.layers = nn.ModuleList([nn.Linear(position_dim, width)] + [
            nn.Linear(width + (position_dim if i == 4 else 0), width) for i in range(7)])
        self.density = nn.Linear(width, 1)
        self.feature = nn.Linear(width, width)
        self.colour = nn.Sequential(nn.Linear(width + direction_dim, width // 2), nn.ReLU(),
                                    nn.Linear(width // 2, 3))

    def forward(self, points: torch.Tensor, directions: torch.Tensor):
        encoded = positional_encoding(points, self.position_freqs)
        h = encoded
        for i, layer in enumerate(self.layers):
            h = F.relu(layer(torch.cat([h, encoded], -1) if i == 5 else h))
        view = positional_encoding(directions, self.direction_freqs).unsqueeze(1).expand(-1, points.shape[1], -1)
        rgb = torch.sigmoid(self.colour(torch.cat([self.feature(h), view], -1)))
        return F.relu(self.density(h)).squeeze(-1), rgb


def volume_render(density: torch.Tensor, rgb: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    gaps = torch.cat([depths[:, 1:] - depths[:, :-1], torch.full_like(depths[:, :1], 1e10)], -1)
    alpha = 1 - torch.exp(-density * gaps)
    through = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
    return ((alpha * through).unsqueeze(-1) * rgb).sum(1)


def rays_in_python(pose: np.ndarray, image: np.ndarray, xs: np.ndarray, ys: np.ndarray, focal: float):
    """Ray origins, unit directions and target colours for the sampled pixels, one pixel at a time."""
    height, width = image.shape[:2]
    rotation, origin = pose[:, :3].tolist(), pose[:, 3].tolist()
    origins, directions, colours = [], [], []
    for x, y in zip(xs.tolist(), ys.tolist()):
        camera = ((x + 0.5 - width / 2) / focal, -(y + 0.5 - height / 2) / focal, -1.0)
        world = [row[0] * camera[0] + row[1] * camera[1] + row[2] * camera[2] for row in rotation]
        norm = math.sqrt(sum(c * c for c in world))
        directions.append([c / norm for c in world])
        origins.append(origin)
        colours.append([c / 255.0 for c in image[y, x].tolist()])
    return (torch.tensor(origins, device=dev()), torch.tensor(directions, device=dev()),
            torch.tensor(colours, device=dev()))


def rays_on_device(pose: torch.Tensor, image: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor, focal: float):
    height, width = image.shape[:2]
    camera = torch.stack([(xs + 0.5 - width / 2) / focal, -(ys + 0.5 - height / 2) / focal,
                          -torch.ones_like(xs, dtype=torch.float32)], -1)
    directions = F.normalize(camera @ pose[:, :3].T, dim=-1)
    return pose[:, 3].expand_as(directions), directions, image[ys, xs].float() / 255


def nerf_python_ray_batch(fixed: bool):
    """A NeRF (8x256 MLP, 192 samples a ray, bf16 autocast) whose 1024 training rays are built each step in
    Python: per pixel, the camera direction rotated by the pose, normalised, and the target colour read from the
    numpy image, then torch.tensor of the lists. Profiled with stacks. Fix: the same rays from index tensors on the
    device (one matrix product and a gather from the images kept on the GPU)."""
    rays, samples, width, views, size = pick(1024, 32), pick(192, 16), pick(256, 32), 20, pick(400, 32)
    focal, near, far = 1.2 * size, 2.0, 6.0
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (views, size, size, 3), dtype=np.uint8)
    angles = rng.uniform(0, 2 * math.pi, views)
    poses = np.zeros((views, 3, 4), dtype=np.float32)
    for v, a in enumerate(angles):
        poses[v, :, :3] = [[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]]
        poses[v, :, 3] = [4 * math.sin(a), 0, 4 * math.cos(a)]
    images_dev, poses_dev = torch.from_numpy(images).to(dev()), torch.from_numpy(poses).to(dev())
    model = NeRF(width).to(dev())
    opt = fused_adamw(model.parameters())
    losses = []

    def step():
        v = int(rng.integers(views))
        xs, ys = rng.integers(size, size=rays), rng.integers(size, size=rays)
        if fixed:
            origins, directions, target = rays_on_device(
                poses_dev[v], images_dev[v], torch.from_numpy(xs).to(dev()), torch.from_numpy(ys).to(dev()), focal)
        else:
            origins, directions, target = rays_in_python(poses[v], images[v], xs, ys, focal)
        bins = torch.linspace(near, far, samples + 1, device=dev())
        depths = bins[:-1] + (bins[1] - bins[0]) * torch.rand(rays, samples, device=dev())
        points = origins.unsqueeze(1) + depths.unsqueeze(-1) * directions.unsqueeze(1)
        with autocast():
            density, rgb = model(points, directions)
        loss = F.mse_loss(volume_render(density.float(), rgb.float(), depths), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

def squash(s: torch.Tensor) -> torch.Tensor:
    squared = s.square().sum(-1, keepdim=True)
    return squared / (1 + squared) * s / torch.sqrt(squared + 1e-8)


class CapsuleRouting(nn.Module):
    """Dynamic routing by agreement (Sabour et al.) from `inputs` capsules to `outputs` capsules."""

    def __init__(self, inputs: int, in_dim: int, outputs: int, out_dim: int, iterations: int = 3) -> None:
        super().__init__()
        self.iterations = iterations
        self.weight = nn.Parameter(0.05 * torch.randn(inputs, outputs, out_dim, in_dim))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        predictions = torch.einsum("iodk,bik->biod", self.weight, u)
        logits = predictions.new_zeros(predictions.shape[:3])
        for i in range(self.iterations):
            coupling = logits.softmax(-1)
            v = squash((coupling.unsqueeze(-1) * predictions).sum(1))
            if i + 1 < self.iterations:
                logits = logits + (predictions * v.unsqueeze(1)).sum(-1)
        return v


class CapsNetLoss(nn.Module):
    """A capsule network on 28x28 digits (conv, primary capsules, two routed capsule layers, reconstruction
    decoder) that returns its training loss: margin loss plus the scaled reconstruction error."""

    def __init__(self, primary: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.primary_types = primary
        self.conv = nn.Conv2d(1, 256, 9)
        self.primary = nn.Conv2d(256, primary * 8, 9, stride=2)
        self.hidden = CapsuleRouting(primary * 6 * 6, 8, 32, 12)
        self.digits = CapsuleRouting(32, 12, classes, 16)
        self.decoder = nn.Sequential(nn.Linear(16 * classes, 512), nn.ReLU(), nn.Linear(512, 1024), nn.ReLU(),
                                     nn.Linear(1024, 784), nn.Sigmoid())

    def forward(self, images: torch.Tensor, one_hot: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        u = self.primary(F.relu(self.conv(images))).view(b, self.primary_types, 8, 36).permute(0, 1, 3, 2)
        u = u.reshape(b, -1, 8)
        v = self.digits(self.hidden(squash(u)))
        lengths = v.float().norm(dim=-1)
        margin = one_hot * F.relu(0.9 - lengths).square() + 0.5 * (1 - one_hot) * F.relu(lengths - 0.1).square()
        reconstruction = self.decoder((v * one_hot.unsqueeze(-1).to(v.dtype)).flatten(1))
        error = (reconstruction.float() - images.float().flatten(1)).square().sum(-1)
        return margin.sum(-1).mean() + 5e-4 * error.mean()


def capsnet_dynamic_routing(fixed: bool):
    """A capsule network on 28x28 digits (two routed capsule layers of 3 iterations each, reconstruction decoder,
    bf16 weights) at batch 128: a few hundred kernels of a few microseconds each, forward and backward, launched
    one by one from Python. Fix: capture the forward and backward in CUDA graphs (torch.cuda.make_graphed_callables
    on the module that computes the loss); the fused optimizer step stays eager."""
    batch = pick(128, 4)
    model = CapsNetLoss(pick(32, 4)).to(dev(), BF16)
    opt = fused_adamw(model.parameters())
    images = torch.rand(batch, 1, 28, 28, device=dev(), dtype=BF16)
    one_hot = F.one_hot(torch.randint(10, (batch,), device=dev()), 10).float()
    loss_fn = model
    if fixed and on_gpu():
        loss_fn = torch.cuda.make_graphed_callables(model, (images, one_hot))

    def step():
        loss_fn(images, one_hot).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------------- precision

def relative_position_buckets(queries: int, keys: int, bidirectional: bool, buckets: int = 32,
                              max_distance: int = 128) -> torch.Tensor:
    """T5's bucketed relative positions: exact for small distances, logarithmic up to max_distance."""
    relative = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]
    offset = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        offset = (relative > 0).long() * buckets
        relative = relative.abs()
    else:
        relative = -relative.clamp(max=0)
    exact = buckets // 2
    large = exact + (torch.log(relative.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (buckets - exact)).long()
    return offset + torch.where(relative < exact, relative, large.clamp(max=buckets - 1))


class T5Attention(nn.Module):
    """T5 attention: no bias terms, no 1/sqrt(d) scaling, an additive position bias (SDPA with a float mask)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b, s, w = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = (proj(memory).view(b, memory.shape[1], self.heads, -1).transpose(1, 2) for proj in (self.k, self.v))
        mask = None if bias is None else bias.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.o(out.transpose(1, 2).reshape(b, s, w))


class GatedGelu(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.wi_0, self.wi_1 = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.wo = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class T5Layer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, cross: bool) -> None:
        super().__init__()
        self.self_norm, self.self_attention = nn.RMSNorm(width, eps=1e-6), T5Attention(width, heads)
        self.cross_norm = nn.RMSNorm(width, eps=1e-6) if cross else None
        self.cross_attention = T5Attention(width, heads) if cross else None
        self.ff_norm, self.ff = nn.RMSNorm(width, eps=1e-6), GatedGelu(width, hidden)

    def forward(self, x, bias, memory=None):
        h = self.self_norm(x)
        x = x + self.self_attention(h, h, bias)
        if self.cross_attention is not None:
            x = x + self.cross_attention(self.cross_norm(x), memory, None)
        return x + self.ff(self.ff_norm(x))


class T5(nn.Module):
    """A T5 v1.1-style encoder-decoder: shared embedding, relative position biases computed once per stack,
    RMSNorm, gated-GELU feed-forward, tied output projection."""

    def __init__(self, vocab: int, width: int, heads: int, hidden: int, depth: int, source: int, target: int):
        super().__init__()
        self.width = width
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.ModuleList(T5Layer(width, heads, hidden, cross=False) for _ in range(depth))
        self.decoder = nn.ModuleList(T5Layer(width, heads, hidden, cross=True) for _ in range(depth))
        self.encoder_bias, self.decoder_bias = nn.Embedding(32, heads), nn.Embedding(32, heads)
        self.encoder_norm, self.decoder_norm = nn.RMSNorm(width, eps=1e-6), nn.RMSNorm(width, eps=1e-6)
        self.register_buffer("encoder_buckets", relative_position_buckets(source, source, True), persistent=False)
        self.register_buffer("decoder_buckets", relative_position_buckets(target, target, False), persistent=False)
        causal = torch.full((target, target), float("-inf")).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        encoder_bias = self.encoder_bias(self.encoder_buckets).permute(2, 0, 1).unsqueeze(0).contiguous()
        decoder_bias = (self.decoder_bias(self.decoder_buckets).permute(2, 0, 1) + self.causal).unsqueeze(0)
        decoder_bias = decoder_bias.contiguous()
        memory = self.embed(source)
        for layer in self.encoder:
            memory = layer(memory, encoder_bias)
        memory = self.encoder_norm(memory)
        x = self.embed(target)
        for layer in self.decoder:
            x = layer(x, decoder_bias, memory)
        return (self.decoder_norm(x) * self.width ** -0.5) @ self.embed.weight.T


def t5_fp32_highest_precision(fixed: bool):
    """A T5-style encoder-decoder (6+6 layers, width 512, 32 pairs of 512 source and 128 target tokens, vocab
    32k) trained in fp32 after torch.set_float32_matmul_precision('highest') 'for reproducible results': every
    matrix product in full fp32 off the tensor cores. Fix: set_float32_matmul_precision('high') (TF32 tensor
    cores for the fp32 matrix products)."""
    torch.set_float32_matmul_precision("high" if fixed else "highest")
    vocab, width, heads = pick(32128, 512), pick(512, 64), pick(8, 4)
    batch, source, target, depth = pick(32, 2), pick(512, 32), pick(128, 16), pick(6, 2)
    model = T5(vocab, width, heads, pick(1024, 128), depth, source, target).to(dev())
    opt = fused_adamw(model.parameters())
    inputs = torch.randint(vocab, (batch, source), device=dev())
    labels = torch.randint(vocab, (batch, target + 1), device=dev())

    def step():
        logits = model(inputs, labels[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# -------------------------------------------------------------------------------------------- optimizer_impl

class FeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.SiLU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvModule(nn.Module):
    """Conformer's convolution module: pointwise conv + GLU, depthwise conv, BatchNorm, SiLU, pointwise conv."""

    def __init__(self, width: int, kernel: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.pointwise_in, self.pointwise_out = nn.Linear(width, 2 * width), nn.Linear(width, width)
        self.depthwise = nn.Conv1d(width, width, kernel, padding=kernel // 2, groups=width)
        self.batch_norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.pointwise_in(self.norm(x)), -1).transpose(1, 2)
        h = F.silu(self.batch_norm(self.depthwise(h))).transpose(1, 2)
        return self.pointwise_out(h)


class ConformerBlock(nn.Module):
    """Half-step feed-forward, self-attention (SDPA), convolution module, half-step feed-forward, LayerNorm."""

    def __init__(self, width: int, heads: int, kernel: int) -> None:
        super().__init__()
        self.heads = heads
        self.ff1, self.ff2 = FeedForward(width), FeedForward(width)
        self.attention_norm = nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.conv = ConvModule(width, kernel)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(x)
        b, t, w = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, w))
        x = x + self.conv(x)
        return self.norm(x + 0.5 * self.ff2(x))


class ConformerCTC(nn.Module):
    """A Conformer acoustic model: 4x convolutional subsampling of log-mel frames, Conformer blocks, a linear
    layer to character log-probabilities for CTC."""

    def __init__(self, mels: int, width: int, depth: int, heads: int, kernel: int, vocab: int) -> None:
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, width, 3, 2), nn.ReLU(), nn.Conv2d(width, width, 3, 2),
                                       nn.ReLU())
        self.project = nn.Linear(width * (((mels - 1) // 2 - 1) // 2), width)
        self.blocks = nn.Sequential(*[ConformerBlock(width, heads, kernel) for _ in range(depth)])
        self.classify = nn.Linear(width, vocab)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.subsample(features.unsqueeze(1))
        h = self.project(h.permute(0, 2, 1, 3).flatten(2))
        return self.classify(self.blocks(h))


class NesterovSGD(torch.optim.Optimizer):
    """SGD with Nesterov momentum and L2 weight decay (the update torch.optim.SGD makes), written as a custom
    optimizer that updates one parameter at a time."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 1e-6) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if "momentum_buffer" in state:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(d_p)
                else:
                    state["momentum_buffer"] = d_p.clone()
                p.add_(d_p.add(state["momentum_buffer"], alpha=group["momentum"]), alpha=-group["lr"])


def conformer_ctc_hand_written_sgd(fixed: bool):
    """A Conformer-CTC speech recogniser (12 blocks of width 512, 32 utterances of 10 s of 80-bin log-mel frames,
    bf16 weights) trained ESPnet-style (clip the gradient norm, skip the update if it is not finite: the GPU is
    idle once the check has read the norm) with a custom Nesterov SGD whose step() updates the 370 parameter
    tensors one at a time, five small kernels each. Fix: torch.optim.SGD(nesterov=True, weight_decay=...,
    foreach=True), the same update."""
    mels, vocab, batch, frames = pick(80, 40), 32, pick(32, 2), pick(1000, 48)
    model = ConformerCTC(mels, pick(512, 32), pick(12, 2), pick(8, 2), pick(31, 7), vocab).to(dev(), BF16)
    if fixed:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True, weight_decay=1e-6,
                              foreach=True)
    else:
        opt = NesterovSGD(model.parameters(), lr=1e-3)
    features = torch.randn(batch, frames, mels, device=dev(), dtype=BF16)
    steps_out = ((frames - 1) // 2 - 1) // 2
    target_lengths = torch.randint(steps_out // 4, steps_out // 2, (batch,)).tolist()
    targets = torch.randint(1, vocab, (sum(target_lengths),), device=dev())
    losses = []

    def step():
        log_probs = model(features).float().log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, [log_probs.shape[0]] * batch, target_lengths, zero_infinity=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        if torch.isfinite(grad_norm):
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# ------------------------------------------------------------------------------------------- allocator_churn

class ConvVAE(nn.Module):
    """A convolutional VAE: four stride-2 stages down to a 256-d latent and four transposed-conv stages back."""

    def __init__(self, size: int, widths=(64, 128, 256, 512), latent: int = 256) -> None:
        super().__init__()
        self.bottom, self.width = size // 2 ** len(widths), widths[-1]
        down, cin = [], 3
        for w in widths:
            down += [nn.Conv2d(cin, w, 4, stride=2, padding=1), nn.BatchNorm2d(w), nn.LeakyReLU(0.2),
                     nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.LeakyReLU(0.2)]
            cin = w
        self.encoder = nn.Sequential(*down)
        self.posterior = nn.Linear(widths[-1] * self.bottom ** 2, 2 * latent)
        self.expand = nn.Linear(latent, widths[-1] * self.bottom ** 2)
        up = []
        for w, w_next in zip(widths[::-1], (*widths[-2::-1], widths[0] // 2)):
            up += [nn.ConvTranspose2d(w, w_next, 4, stride=2, padding=1), nn.BatchNorm2d(w_next), nn.ReLU(),
                   nn.Conv2d(w_next, w_next, 3, padding=1), nn.BatchNorm2d(w_next), nn.ReLU()]
        self.decoder = nn.Sequential(*up, nn.Conv2d(widths[0] // 2, 3, 3, padding=1))

    def forward(self, x: torch.Tensor):
        mean, log_var = self.posterior(self.encoder(x).flatten(1)).chunk(2, -1)
        z = mean + torch.randn_like(mean) * (0.5 * log_var).exp()
        h = self.expand(z).view(-1, self.width, self.bottom, self.bottom)
        return self.decoder(h.contiguous(memory_format=torch.channels_last)), mean, log_var


class Validator:
    """Every `every` steps: the reconstruction error on a held-out batch, kept for the log; then, as written,
    torch.cuda.empty_cache() 'to hand the evaluation activations back'."""

    def __init__(self, model: nn.Module, images: torch.Tensor, every: int, release_memory: bool) -> None:
        self.model, self.images, self.every, self.release_memory = model, images, every, release_memory
        self.calls, self.history = 0, []

    @torch.no_grad()
    def __call__(self) -> None:
        self.calls += 1
        if self.calls % self.every:
            return
        self.model.eval()
        with autocast():
            reconstruction, _, _ = self.model(self.images)
        self.history.append(F.mse_loss(reconstruction.float(), self.images))
        self.model.train()
        if self.release_memory and torch.cuda.is_available():
            torch.cuda.empty_cache()


def vae_validation_empty_cache(fixed: bool):
    """A convolutional VAE (128x128 images, batch 128, channels_last, bf16 autocast) with a validation hook run
    every step (64 held-out images) that ends with torch.cuda.empty_cache(): the next step's activations and
    gradients come back through cudaMalloc. Fix: drop the empty_cache() call from the hook."""
    size = pick(128, 32)
    model = ConvVAE(size, (64, 128, 256, 512) if on_gpu() else (8, 16, 32, 64))
    model = model.to(dev(), memory_format=torch.channels_last)
    opt = fused_adamw(model.parameters())
    images = torch.rand(pick(128, 4), 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    held_out = torch.rand(pick(64, 2), 3, size, size, device=dev()).contiguous(memory_format=torch.channels_last)
    validate = Validator(model, held_out, every=1, release_memory=not fixed)

    def step():
        with autocast():
            reconstruction, mean, log_var = model(images)
        kl = -0.5 * (1 + log_var.float() - mean.float().square() - log_var.float().exp()).sum(-1).mean()
        (F.mse_loss(reconstruction.float(), images, reduction="sum") / images.shape[0] + kl).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        validate()
    return step


# ---------------------------------------------------------------------------------------- checkpoint_in_step

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ImageTower(nn.Module):
    """A CLIP ResNet image encoder, slimmed: a 3-conv stem, four stages of two basic blocks, average pooling."""

    def __init__(self, widths, embed: int) -> None:
        super().__init__()
        stem = widths[0]
        layers: list[nn.Module] = [nn.Conv2d(3, stem // 2, 3, 2, 1, bias=False), nn.BatchNorm2d(stem // 2),
                                   nn.ReLU(inplace=True), nn.Conv2d(stem // 2, stem, 3, 1, 1, bias=False),
                                   nn.BatchNorm2d(stem), nn.ReLU(inplace=True), nn.AvgPool2d(2)]
        cin = stem
        for i, width in enumerate(widths):
            layers += [BasicBlock(cin, width, 1 if i == 0 else 2), BasicBlock(width, width, 1)]
            cin = width
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.project = nn.Linear(cin, embed, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.project(self.body(images))


class TextTower(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int, embed: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.01 * torch.randn(1, context, width))
        self.blocks = nn.Sequential(*[TransformerBlock(width, heads, causal=True) for _ in range(depth)])
        self.norm, self.project = nn.LayerNorm(width), nn.Linear(width, embed, bias=False)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.blocks(self.tokens(text) + self.position))
        end = text.argmax(-1)  # the end-of-text token has the largest id
        return self.project(x[torch.arange(x.shape[0], device=x.device), end])


def caption_batch(batch: int, context: int, vocab: int) -> torch.Tensor:
    lengths = torch.randint(8, context, (batch,))
    text = torch.randint(1, vocab - 1, (batch, context))
    text[torch.arange(context) >= lengths.unsqueeze(1)] = 0
    text[torch.arange(batch), lengths - 1] = vocab - 1
    return text.to(dev())


def clip_rollback_snapshot(fixed: bool):
    """A CLIP-style dual encoder (a slim ResNet image tower at 224x224, a 4-layer causal text transformer of width
    256, 7M parameters, batch 512, channels_last, bf16 autocast, symmetric contrastive loss) that keeps a 'last
    good' copy of its weights for rolling back after a loss spike: every step, before the update,
    torch.save(model.state_dict()) into an io.BytesIO (28 MB copied to the host and serialised). Fix: keep the
    copy on the GPU (torch._foreach_copy_ into preallocated tensors)."""
    image, vocab, context, width = pick(224, 32), pick(4096, 512), pick(77, 16), pick(256, 32)
    depth, heads, batch = pick(4, 2), pick(4, 2), pick(512, 4)
    widths = (32, 64, 128, 256) if on_gpu() else (8, 8, 16, 16)
    model = nn.ModuleDict({"image": ImageTower(widths, width),
                           "text": TextTower(vocab, context, width, depth, heads, width)})
    model = model.to(dev(), memory_format=torch.channels_last)
    logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), device=dev()))
    model.register_parameter("logit_scale", logit_scale)
    opt = fused_adamw(model.parameters())
    images = torch.randn(batch, 3, image, image, device=dev()).contiguous(memory_format=torch.channels_last)
    text = caption_batch(batch, context, vocab)
    targets = torch.arange(batch, device=dev())
    live = list(model.state_dict().values())
    last_good = {"device": [t.detach().clone() for t in live], "bytes": None}
    losses = []

    def snapshot():
        if fixed:
            torch._foreach_copy_(last_good["device"], live)
        else:
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            last_good["bytes"] = buffer

    def step():
        with autocast():
            image_embed = F.normalize(model["image"](images).float(), dim=-1)
            text_embed = F.normalize(model["text"](text).float(), dim=-1)
        logits = logit_scale.exp() * image_embed @ text_embed.T
        loss = (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2
        loss.backward()
        snapshot()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# ----------------------------------------------------------------------------------------------- data_loader

def random_csr_graph(nodes: int, mean_degree: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A random directed graph with heavy-tailed degrees as CSR (indptr, indices)."""
    rng = np.random.default_rng(seed)
    degrees = np.minimum(rng.zipf(1.8, nodes) + mean_degree // 2, 50 * mean_degree)
    indptr = np.zeros(nodes + 1, dtype=np.int64)
    np.cumsum(degrees, out=indptr[1:])
    return indptr, rng.integers(nodes, size=int(indptr[-1]), dtype=np.int64)


class NeighbourSampler(torch.utils.data.Dataset):
    """One training node per sample with its sampled 2-hop neighbourhood (GraphSAGE): `fanouts[0]` neighbours,
    then `fanouts[1]` neighbours of each, drawn with replacement from the CSR adjacency."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, fanouts: tuple[int, int]) -> None:
        self.indptr, self.indices, self.fanouts = indptr, indices, fanouts
        self.rng = None

    def __len__(self) -> int:
        return 1 << 30

    def neighbours(self, nodes: np.ndarray, k: int) -> np.ndarray:
        start, degree = self.indptr[nodes], self.indptr[nodes + 1] - self.indptr[nodes]
        offsets = (self.rng.random((len(nodes), k)) * degree[:, None]).astype(np.int64)
        return self.indices[start[:, None] + offsets]

    def __getitem__(self, index: int):
        if self.rng is None:  # one generator per process (the main one or a worker)
            info = torch.utils.data.get_worker_info()
            self.rng = np.random.default_rng(None if info is None else info.seed % 2 ** 32)
        seed = np.array([index % (len(self.indptr) - 1)])
        hop1 = self.neighbours(seed, self.fanouts[0])[0]
        hop2 = self.neighbours(hop1, self.fanouts[1])
        return torch.from_numpy(seed), torch.from_numpy(hop1), torch.from_numpy(hop2)


class GraphSAGE(nn.Module):
    """A node-feature MLP encoder, then two mean-aggregator SAGE layers over the sampled 2-hop tree."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                    nn.Linear(hidden, hidden), nn.GELU())
        self.self1, self.neigh1 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden, bias=False)
        self.self2, self.neigh2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden, bias=False)
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, classes)

    def forward(self, seed: torch.Tensor, hop1: torch.Tensor, hop2: torch.Tensor) -> torch.Tensor:
        h0, h1, h2 = self.encode(seed), self.encode(hop1), self.encode(hop2)
        h1 = F.relu(self.self1(h1) + self.neigh1(h2.mean(2)))
        h0 = F.relu(self.self1(h0) + self.neigh1(h1.mean(1)))
        out = self.self2(h0) + self.neigh2(h1.mean(1))
        return self.head(self.norm(out))


def graphsage_sampler_in_process(fixed: bool):
    """GraphSAGE node classification on a 200k-node graph (2-hop neighbourhoods of 512 nodes a batch, fanouts
    25 x 20, a 3-layer node-feature encoder of width 2048, bf16 autocast) fed by a DataLoader with num_workers=0
    whose __getitem__ samples one node's neighbourhood with numpy: 512 calls and the collation in the training
    process every step. Fix: num_workers=6, persistent_workers=True."""
    nodes, features, classes = pick(200_000, 2000), 256, 64
    batch, fanouts, hidden = pick(512, 8), (pick(25, 4), pick(20, 3)), pick(2048, 32)
    indptr, indices = random_csr_graph(nodes, 15)
    workers = {"num_workers": 6, "persistent_workers": True} if fixed else {"num_workers": 0}
    batches = iter(torch.utils.data.DataLoader(NeighbourSampler(indptr, indices, fanouts), batch_size=batch,
                                               shuffle=False, **workers))
    x = torch.randn(nodes, features, device=dev())
    y = torch.randint(classes, (nodes,), device=dev())
    model = GraphSAGE(features, hidden, classes).to(dev())
    opt = fused_adamw(model.parameters())
    losses = []

    def step():
        seed, hop1, hop2 = (t.to(dev()) for t in next(batches))
        seed = seed.squeeze(1)
        with autocast():
            logits = model(x[seed], x[hop1], x[hop2])
        loss = F.cross_entropy(logits.float(), y[seed])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


# --------------------------------------------------------------------------------------------- pageable_copy

class CausalConvBlock(nn.Module):
    """Two dilated causal convolutions (left padding only) with a residual connection."""

    def __init__(self, channels: int, dilation: int, kernel: int = 3) -> None:
        super().__init__()
        self.pad = (kernel - 1) * dilation
        self.conv1 = nn.Conv1d(channels, channels, kernel, dilation=dilation)
        self.conv2 = nn.Conv1d(channels, channels, kernel, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.conv1(F.pad(x, (self.pad, 0))))
        return x + F.gelu(self.conv2(F.pad(h, (self.pad, 0))))


def temporal_conv_net(sensors: int, channels: int, levels: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv1d(sensors, channels, 1), *[CausalConvBlock(channels, 2 ** i) for i in range(levels)],
                         nn.Conv1d(channels, sensors, 1))


def tcn_pageable_series(fixed: bool):
    """A temporal conv net forecasting the next value of 128 sensor channels (8 dilated causal blocks of 256
    channels, bf16 autocast) on windows of 4096 steps, 32 a batch, sliced from a float32 archive in host memory
    and moved with .to('cuda'): 67 MB a step copied from pageable memory, the host waiting on it. Fix: pin the
    archive once (pin_memory()) and copy with non_blocking=True."""
    batch, sensors, length = pick(32, 2), pick(128, 8), pick(4096, 256)
    archive = torch.randn(4 * batch, sensors, length + 1)
    if fixed:
        archive = pinned(archive)
    model = temporal_conv_net(sensors, pick(256, 16), pick(8, 3)).to(dev())
    opt = fused_adamw(model.parameters())
    count = iter(range(1 << 30))

    def step():
        i = next(count) % 4
        window = archive[i * batch:(i + 1) * batch].to(dev(), non_blocking=fixed)
        with autocast():
            predicted = model(window[..., :-1])
        F.mse_loss(predicted.float(), window[..., 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ------------------------------------------------------------------------------------------- eager_attention

def attention_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V, written out."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


def attention_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


class PerceiverAttention(nn.Module):
    """Latents attending to `context` (cross-attention) or to themselves, then an MLP; pre-norm, residual."""

    def __init__(self, width: int, context_width: int, heads: int, attend, cross: bool) -> None:
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm_q, self.norm_mlp = nn.LayerNorm(width), nn.LayerNorm(width)
        self.norm_kv = nn.LayerNorm(context_width) if cross else None
        self.q, self.kv, self.out = nn.Linear(width, width), nn.Linear(context_width, 2 * width), \
            nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, latents: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, n, w = latents.shape
        h = self.norm_q(latents)
        context = h if context is None else self.norm_kv(context)
        q = self.q(h).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(context).view(b, context.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        latents = latents + self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, n, w))
        return latents + self.mlp(self.norm_mlp(latents))


class Perceiver(nn.Module):
    """A Perceiver classifier on raw bytes: one cross-attention from 256 latents to the byte array, then latent
    self-attention blocks."""

    def __init__(self, length: int, context_width: int, latents: int, width: int, heads: int, depth: int,
                 classes: int, attend) -> None:
        super().__init__()
        self.bytes = nn.Embedding(256, context_width)
        self.position = nn.Parameter(0.02 * torch.randn(1, length, context_width))
        self.latents = nn.Parameter(0.02 * torch.randn(latents, width))
        self.cross = PerceiverAttention(width, context_width, heads, attend, cross=True)
        self.blocks = nn.ModuleList(PerceiverAttention(width, width, heads, attend, cross=False)
                                    for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        context = self.bytes(data) + self.position
        x = self.cross(self.latents.expand(data.shape[0], -1, -1), context)
        for block in self.blocks:
            x = block(x, None)
        return self.head(self.norm(x).mean(1))


def perceiver_eager_cross_attention(fixed: bool):
    """A Perceiver byte classifier (32 documents of 8192 bytes, 256 latents of width 1024, 8 heads, 6 latent
    blocks, bf16 autocast) whose attention is written out as softmax(QK^T/sqrt(d))V: the cross-attention
    materialises [32, 8, 256, 8192] scores and fp32 probabilities, forward and backward. Fix:
    F.scaled_dot_product_attention (a flash kernel) for every attention."""
    length, latents, width, heads = pick(8192, 256), pick(256, 16), pick(1024, 64), pick(8, 2)
    model = Perceiver(length, pick(256, 32), latents, width, heads, pick(6, 2), 100,
                      attention_fused if fixed else attention_by_hand).to(dev())
    opt = fused_adamw(model.parameters())
    data = torch.randint(256, (pick(32, 2), length), device=dev())
    labels = torch.randint(100, (data.shape[0],), device=dev())

    def step():
        with autocast():
            logits = model(data)
        F.cross_entropy(logits.float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------------------------------- healthy

class MaskedAutoencoder(nn.Module):
    """MAE: a ViT encoder on a random quarter of the patches, a narrower decoder on all of them that predicts the
    (per-patch normalised) pixels of the masked ones."""

    def __init__(self, image: int, patch: int, width: int, depth: int, heads: int, decoder_width: int,
                 decoder_depth: int, decoder_heads: int) -> None:
        super().__init__()
        self.patch, patches = patch, (image // patch) ** 2
        self.embed = nn.Linear(3 * patch * patch, width)
        self.position = nn.Parameter(0.02 * torch.randn(1, patches, width))
        self.encoder = nn.Sequential(*[TransformerBlock(width, heads) for _ in range(depth)], nn.LayerNorm(width))
        self.bridge = nn.Linear(width, decoder_width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_width))
        self.decoder_position = nn.Parameter(0.02 * torch.randn(1, patches, decoder_width))
        self.decoder = nn.Sequential(*[TransformerBlock(decoder_width, decoder_heads) for _ in range(decoder_depth)],
                                     nn.LayerNorm(decoder_width))
        self.predict = nn.Linear(decoder_width, 3 * patch * patch)

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        p = self.patch
        return images.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, p * p * c)

    def forward(self, images: torch.Tensor, keep: float = 0.25) -> torch.Tensor:
        patches = self.patchify(images)
        b, n, _ = patches.shape
        kept = int(n * keep)
        order = torch.rand(b, n, device=images.device).argsort(1)
        restore = order.argsort(1)
        visible = order[:, :kept]
        x = self.embed(patches) + self.position
        x = self.encoder(torch.gather(x, 1, visible.unsqueeze(-1).expand(-1, -1, x.shape[-1])))
        x = torch.cat([self.bridge(x), self.mask_token.expand(b, n - kept, -1).to(x.dtype)], 1)
        x = torch.gather(x, 1, restore.unsqueeze(-1).expand(-1, -1, x.shape[-1])) + self.decoder_position
        predicted = self.predict(self.decoder(x)).float()
        target = F.layer_norm(patches.float(), patches.shape[-1:])
        masked = (restore >= kept).float()
        return ((predicted - target).square().mean(-1) * masked).sum() / masked.sum()


def healthy_mae_vit_bf16(fixed: bool):
    """A masked autoencoder (ViT-B/16 encoder on 25% of the patches, 8-block width-512 decoder, 256 images of
    224x224), bf16 autocast, SDPA, fused AdamW: nothing planted."""
    image = pick(224, 32)
    model = MaskedAutoencoder(image, 16, pick(768, 32), pick(12, 2), pick(12, 2), pick(512, 32), pick(8, 1),
                              pick(16, 2))
    model = model.to(dev())
    opt = fused_adamw(model.parameters())
    images = torch.randn(pick(256, 4), 3, image, image, device=dev())

    def step():
        with autocast():
            loss = model(images)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def conv2plus1d(cin: int, cout: int, stride: int) -> nn.Sequential:
    """A (2+1)D convolution: a spatial 1x3x3 convolution, BatchNorm, ReLU, then a temporal 3x1x1 convolution."""
    middle = (cin * cout * 27) // (cin * 9 + 3 * cout)
    return nn.Sequential(nn.Conv3d(cin, middle, (1, 3, 3), (1, stride, stride), (0, 1, 1), bias=False),
                         nn.BatchNorm3d(middle), nn.ReLU(inplace=True),
                         nn.Conv3d(middle, cout, (3, 1, 1), (stride, 1, 1), (1, 0, 0), bias=False))


class Block2plus1D(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv2plus1d(cin, cout, stride), nn.BatchNorm3d(cout), nn.ReLU(inplace=True),
                                  conv2plus1d(cout, cout, 1), nn.BatchNorm3d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv3d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm3d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def r2plus1d(classes: int, widths=(64, 128, 256, 512)) -> nn.Sequential:
    stem = widths[0] * 45 // 64
    layers: list[nn.Module] = [nn.Conv3d(3, stem, (1, 7, 7), (1, 2, 2), (0, 3, 3), bias=False),
                               nn.BatchNorm3d(stem), nn.ReLU(inplace=True),
                               nn.Conv3d(stem, widths[0], (3, 1, 1), padding=(1, 0, 0), bias=False),
                               nn.BatchNorm3d(widths[0]), nn.ReLU(inplace=True)]
    cin = widths[0]
    for i, width in enumerate(widths):
        layers += [Block2plus1D(cin, width, 1 if i == 0 else 2), Block2plus1D(width, width, 1)]
        cin = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(cin, classes))


def healthy_r2plus1d_video_bf16(fixed: bool):
    """An R(2+1)D-18 action classifier on 24 clips of 16 frames at 112x112, channels_last_3d, bf16 autocast,
    cudnn.benchmark, fused AdamW: nothing planted."""
    torch.backends.cudnn.benchmark = True
    model = r2plus1d(400, (64, 128, 256, 512) if on_gpu() else (16, 16, 32, 32))
    model = model.to(dev(), memory_format=torch.channels_last_3d)
    opt = fused_adamw(model.parameters())
    frames, size = pick(16, 4), pick(112, 32)
    clips = torch.randn(pick(24, 2), 3, frames, size, size, device=dev())
    clips = clips.contiguous(memory_format=torch.channels_last_3d)
    labels = torch.randint(400, (clips.shape[0],), device=dev())

    def step():
        with autocast():
            logits = model(clips)
        F.cross_entropy(logits.float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


PROGRAMS = {
    "pointnet_finite_checks": ["host_syncs"],
    "nerf_python_ray_batch": ["host_work"],
    "capsnet_dynamic_routing": ["launch_bound"],
    "t5_fp32_highest_precision": ["precision"],
    "conformer_ctc_hand_written_sgd": ["optimizer_impl"],
    "vae_validation_empty_cache": ["allocator_churn"],
    "clip_rollback_snapshot": ["checkpoint_in_step"],
    "graphsage_sampler_in_process": ["data_loader"],
    "tcn_pageable_series": ["pageable_copy"],
    "perceiver_eager_cross_attention": ["eager_attention"],
    "healthy_mae_vit_bf16": [],
    "healthy_r2plus1d_video_bf16": [],
}
WITH_STACK = {"nerf_python_ray_batch"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
