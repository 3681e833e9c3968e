"""A ninth held-out check of the advisor: ten programs of other architectures than bench/planted/corpus.py's and
heldout.py's to heldout8.py's (SASRec, Prototypical Networks, SAC-N, a Decision Transformer, HiFi-GAN, gMLP, a Set
Transformer, Hyena, SegFormer and a DALL-E-style discrete VAE), five with one planted problem, three with two at
once and two healthy, written without reading the advisor's rules, with the same output format (OUT/NAME/trace +
planted.json), scored the same way:

    python bench/planted/heldout9.py OUT                  # on a GPU
    python bench/planted/heldout9.py OUT NAME [NAME ...]  # some of them
    python bench/planted/heldout9.py OUT --device cpu     # smoke mode: the same code paths, small sizes, CPU only
    python bench/planted/confusion.py OUT
    python bench/planted/fix_timelines.py heldout9 OUT2 NAME [NAME ...]   # a program as written and fixed

The programs, one sentence each:

    sasrec_rss_guard_checkpoints    a SASRec sequential recommender whose step-end callbacks save the weights to a
                                    new file every step and run gc.collect() whenever the resident set is over a
                                    limit it always exceeds (gc_pauses, checkpoint_in_step)
    protonet_unique_class_masks     Prototypical Networks (Conv-4) whose prototypes are found with torch.unique and
                                    a boolean mask per class of the episode (host_syncs)
    sac_n_critic_loop               SAC-N offline RL whose ten Q-networks are separate small MLPs run one after
                                    another: about a thousand microsecond kernels a step (launch_bound)
    decision_transformer_batch_64   a Decision Transformer trained with the paper's 64 trajectory windows a step,
                                    which leave the GPU idle between launches (tiny_batch)
    hifigan_resample_on_load        a HiFi-GAN vocoder whose dataset resamples every 48 kHz clip and computes its
                                    mel spectrogram in numpy, in the training process (data_loader)
    gmlp_fp32_gating_checkpointed   a gMLP masked language model whose spatial gating runs in fp32 outside autocast
                                    and whose every block is checkpointed (precision, activation_checkpointing)
    set_transformer_host_sampling   a Set Transformer classifying point clouds sampled from meshes in numpy each
                                    step, its attention written out (host_work, eager_attention)
    healthy_hyena_fftconv_bf16      a Hyena language model, bf16 projections and fp32 FFT long convolutions
    healthy_segformer_bf16          SegFormer semantic segmentation at 512x512, bf16 with SDPA efficient attention
    dvae_compiled_annealed_gumbel   a DALL-E-style discrete VAE whose compiled Gumbel-softmax quantizer computes its
                                    temperature from the Python step number (recompilation)

Each program's `build(fixes)` returns one training step; each problem sits behind `if CAUSE not in fixes` (or a
choice made from `fixes`) and its fix is what a user would change. A cause's planted cost is the step as written
less the step with that cause alone fixed; fixed_step_ms has every cause fixed (medians of 7 steps, each between
two synchronizes, profiler off). The tiny-batch program reports its times for the samples of the fixed batch (the
small step times the steps it takes to see them); its trace records single small steps. The programs whose
problem is on the host read their loss with `.item()` at the end of the step, as a loop that logs every step does,
so their traces serialise as their timing. The compiled program runs last (Inductor leaves a large Python heap
behind, which would lengthen the garbage collections of the program that collects), and the program that collects
runs first. Without a GPU the CUDA-only parts (pinned memory, waiting for the device) are skipped, so in smoke mode a
fix may time the same as its problem.
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

from harness import (PerSamples, autocast, dev, fused_adamw, heads_of, mel_filterbank, merge_heads, on_gpu, pick,
                     run_set_fixes)

Fixes = frozenset[str]
Step = Callable[[], object]


class SelfAttentionBlock(nn.Module):
    """A pre-norm Transformer block: multi-head self-attention (SDPA, optionally causal) and a GELU MLP."""

    def __init__(self, width: int, heads: int, hidden: int, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads_of(t, self.heads) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        x = x + self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)))
        return x + self.mlp(self.norm2(x))


def adam(params, lr: float, **options) -> torch.optim.Adam:
    """Adam, fused where there is a GPU (the fused kernels are CUDA-only)."""
    return torch.optim.Adam(params, lr=lr, fused=on_gpu(), **options)


def endless(loader: DataLoader) -> Iterator:
    while True:
        yield from loader


# --------------------------------------------------------------------------- gc_pauses + checkpoint_in_step

PAD = 0


class SASRec(nn.Module):
    """SASRec (Kang & McAuley 2018): item embeddings (shared with the output layer) plus learned positions through
    causal self-attention blocks; padded positions are zeroed after every block, as in the paper's code. It scores
    every catalogue item as the next one at every position (the full cross-entropy variant)."""

    def __init__(self, items: int, width: int, heads: int, depth: int, length: int) -> None:
        super().__init__()
        self.width = width
        self.items = nn.Embedding(items + 1, width, padding_idx=PAD)
        self.position = nn.Parameter(0.02 * torch.randn(length, width))
        self.blocks = nn.ModuleList(SelfAttentionBlock(width, heads, 4 * width, causal=True) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        real = (history != PAD).unsqueeze(-1)
        x = (self.items(history) * self.width ** 0.5 + self.position[:history.shape[1]]) * real
        for block in self.blocks:
            x = block(x) * real
        return self.norm(x) @ self.items.weight.T


def interaction_histories(users: int, items: int, shortest: int, longest: int,
                          rng: np.random.Generator) -> dict[str, list[int]]:
    """Per-user item sequences as a JSON-lines loader hands them over (user id -> list of item ids, oldest first),
    popularity-skewed."""
    lengths = rng.integers(shortest, longest + 1, size=users)
    flat = (rng.random(int(lengths.sum())) ** 3 * items).astype(np.int64) + 1
    ends = np.cumsum(lengths)
    return {f"user-{u:07d}": flat[end - n:end].tolist() for u, (end, n) in enumerate(zip(ends, lengths))}


def left_padded(histories: dict[str, list[int]], length: int) -> torch.Tensor:
    """The last `length` items of every history, left-padded with PAD, as one device tensor [users, length]."""
    rows = np.zeros((len(histories), length), np.int64)
    for row, items in zip(rows, histories.values()):
        kept = items[-length:]
        row[length - len(kept):] = kept
    return torch.from_numpy(rows).to(dev())


class RotatingCheckpoints:
    """A ModelCheckpoint-style step-end callback: the model's weights saved with torch.save to step-NNNNNNN.pt
    every `every` steps, only the newest `keep` files kept."""

    def __init__(self, every: int, keep: int = 3) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="sasrec_checkpoints_")
        self.every, self.keep = every, keep
        self.steps, self.saved = 0, []

    def on_step_end(self, model: nn.Module) -> None:
        self.steps += 1
        if self.steps % self.every:
            return
        path = Path(self.folder.name) / f"step-{self.steps:07d}.pt"
        torch.save(model.state_dict(), path)
        self.saved.append(path)
        while len(self.saved) > self.keep:
            self.saved.pop(0).unlink(missing_ok=True)


class ResidentMemoryGuard:
    """A step-end callback copied from the data-preparation scripts: a full garbage collection whenever the
    resident set is over `limit_mb`."""

    def __init__(self, limit_mb: float) -> None:
        self.limit_mb = limit_mb

    def on_step_end(self) -> None:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        if resident_pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20 > self.limit_mb:
            gc.collect()


def sasrec_rss_guard_checkpoints(fixes: Fixes) -> Step:
    """SASRec next-item recommendation (a 20k-item catalogue, width 256, 4 causal blocks of 4 heads, the last 200
    interactions of 256 users a step, full cross-entropy over the catalogue; bf16 autocast, fused AdamW). The 40k
    users' histories stay in memory as Python lists (3.2M entries; the evaluation filters seen items with them).
    Two step-end callbacks: a rotating checkpointer saves the weights (8.3M parameters, 33 MB) to a new file after
    every step and deletes the oldest; and a memory guard from the data-preparation scripts runs gc.collect()
    whenever the resident set is over 256 MB, which a process holding CUDA and the histories always is: a full
    collection walks the histories every step, the GPU idle. Fixes: raise the guard's limit to the machine's real
    budget (64 GB), so it never collects (gc_pauses); save every 2000 steps (checkpoint_in_step)."""
    items, width, heads, depth = pick(20_000, 300), pick(256, 16), pick(4, 2), pick(4, 1)
    length, batch, users = pick(200, 16), pick(256, 4), pick(40_000, 400)
    histories = interaction_histories(users, items, 10, 150, np.random.default_rng(0))
    sequences = left_padded(histories, length + 1)
    model = SASRec(items, width, heads, depth, length).to(dev())
    opt = fused_adamw(model.parameters())
    saver = RotatingCheckpoints(every=2000 if "checkpoint_in_step" in fixes else 1)
    guard = ResidentMemoryGuard(limit_mb=65_536 if "gc_pauses" in fixes else 256)

    def step() -> float:
        history = sequences[torch.randint(len(histories), (batch,), device=dev())]
        with autocast():
            logits = model(history[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), history[:, 1:].flatten(), ignore_index=PAD)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        saver.on_step_end(model)
        guard.on_step_end()
        return value
    return step


# ------------------------------------------------------------------------------------------------ host_syncs

def conv4(width: int) -> nn.Sequential:
    """The few-shot Conv-4 backbone: four 3x3 convolution, BatchNorm, ReLU and 2x2 max-pool blocks, flattened."""
    layers: list[nn.Module] = []
    cin = 3
    for _ in range(4):
        layers += [nn.Conv2d(cin, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                   nn.MaxPool2d(2)]
        cin = width
    return nn.Sequential(*layers, nn.Flatten())


def few_shot_images(classes: int, per_class: int, side: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 images [classes, per_class, 3, side, side] on the device: each class a smooth colour pattern of its
    own, each image that pattern under noise."""
    images = torch.empty(classes, per_class, 3, side, side, dtype=torch.uint8)
    for c in range(classes):
        pattern = F.interpolate(torch.rand(1, 3, 6, 6, generator=generator), size=side, mode="bilinear",
                                align_corners=False)
        noise = torch.rand(per_class, 3, side, side, generator=generator)
        images[c] = ((0.6 * pattern + 0.4 * noise) * 255).to(torch.uint8)
    return images.to(dev())


def prototypes_by_class_masks(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each class's mean embedding, the classes found with torch.unique and each one's rows with a boolean mask,
    as the reference implementation writes it."""
    return torch.stack([embeddings[labels == c].mean(0) for c in torch.unique(labels)])


def prototypes_by_index_add(embeddings: torch.Tensor, labels: torch.Tensor, way: int, shot: int) -> torch.Tensor:
    """Each class's mean embedding as one index_add_ over the support set (every class has `shot` examples)."""
    sums = torch.zeros(way, embeddings.shape[1], device=embeddings.device, dtype=embeddings.dtype)
    return sums.index_add_(0, labels, embeddings) / shot


def protonet_unique_class_masks(fixes: Fixes) -> Step:
    """Prototypical Networks (Snell et al. 2017) on miniImageNet-sized episodes (Conv-4 backbone of 64 channels on
    84x84 images, 1600-d embeddings; 30-way 5-shot episodes with 15 queries a class, 600 images a step; squared
    Euclidean distances to the prototypes; bf16 autocast, fused Adam), the images on the device. The prototypes are
    computed as the reference code does: `torch.unique` of the support labels, then `embeddings[labels == c].mean(0)`
    for each class: the unique and each of the 30 boolean masks wait for the GPU to finish before the host can
    launch the next kernel. Fix: one `index_add_` of the support embeddings by label, divided by the shot count."""
    way, shot, queries = pick(30, 4), 5, pick(15, 2)
    side, width = pick(84, 28), pick(64, 8)
    images = few_shot_images(pick(64, 8), pick(60, 8), side, torch.Generator().manual_seed(0))
    encoder = conv4(width).to(dev())
    opt = adam(encoder.parameters(), lr=1e-3)
    mean = torch.tensor([0.47, 0.45, 0.41], device=dev()).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.28, 0.27, 0.29], device=dev()).view(1, 3, 1, 1) * 255
    by_mask = "host_syncs" not in fixes

    def step() -> float:
        classes = torch.randperm(len(images), device=dev())[:way]
        drawn = torch.rand(way, images.shape[1], device=dev()).argsort(1)[:, :shot + queries]
        episode = images[classes[:, None], drawn]
        order = torch.randperm(way * shot, device=dev())  # the episode sampler hands the support set shuffled
        support = episode[:, :shot].flatten(0, 1)[order]
        support_labels = torch.arange(way, device=dev()).repeat_interleave(shot)[order]
        query = episode[:, shot:].flatten(0, 1)
        query_labels = torch.arange(way, device=dev()).repeat_interleave(queries)
        pixels = (torch.cat([support, query]).float() - mean) / std
        with autocast():
            embedded = encoder(pixels).float()
        z_support, z_query = embedded[:len(support)], embedded[len(support):]
        prototypes = (prototypes_by_class_masks(z_support, support_labels) if by_mask
                      else prototypes_by_index_add(z_support, support_labels, way, shot))
        distances = (z_query[:, None] - prototypes[None]).pow(2).sum(-1)
        loss = F.cross_entropy(-distances, query_labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ---------------------------------------------------------------------------------------------- launch_bound

def relu_mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers with a ReLU between each two."""
    layers: list[nn.Module] = []
    for i, (cin, cout) in enumerate(zip(sizes, sizes[1:])):
        layers += [nn.Linear(cin, cout)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


class CriticList(nn.Module):
    """N Q-networks (state, action) -> Q as separate MLPs in an nn.ModuleList, evaluated one after another: [N, B]."""

    def __init__(self, state_dim: int, action_dim: int, hidden: int, ensemble: int) -> None:
        super().__init__()
        self.members = nn.ModuleList(relu_mlp([state_dim + action_dim, hidden, hidden, hidden, 1])
                                     for _ in range(ensemble))

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        state_action = torch.cat([state, action], -1)
        return torch.stack([member(state_action).squeeze(-1) for member in self.members])


class VectorizedLinear(nn.Module):
    """N independent linear layers applied at once, [N, B, in] -> [N, B, out], as one batched matmul (the ensemble
    layer of CORL's SAC-N); each member initialised as nn.Linear would be."""

    def __init__(self, cin: int, cout: int, ensemble: int) -> None:
        super().__init__()
        bound = 1 / math.sqrt(cin)
        self.weight = nn.Parameter(torch.empty(ensemble, cin, cout).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(ensemble, 1, cout).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class VectorizedCritic(nn.Module):
    """The same N Q-networks as one stack of VectorizedLinear layers: [N, B]."""

    def __init__(self, state_dim: int, action_dim: int, hidden: int, ensemble: int) -> None:
        super().__init__()
        sizes = [state_dim + action_dim, hidden, hidden, hidden, 1]
        self.ensemble = ensemble
        self.layers = nn.ModuleList(VectorizedLinear(cin, cout, ensemble) for cin, cout in zip(sizes, sizes[1:]))

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([state, action], -1).expand(self.ensemble, -1, -1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x.squeeze(-1)


class TanhGaussianActor(nn.Module):
    """SAC's policy: an MLP to the mean and log-std of a Gaussian, sampled with the reparameterisation trick and
    squashed by tanh; returns the action and its log-probability."""

    def __init__(self, state_dim: int, action_dim: int, hidden: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(relu_mlp([state_dim, hidden, hidden, hidden]), nn.ReLU())
        self.mean, self.log_std = nn.Linear(hidden, action_dim), nn.Linear(hidden, action_dim)

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(state)
        mean, log_std = self.mean(h), self.log_std(h).clamp(-5, 2)
        pre_tanh = mean + log_std.exp() * torch.randn_like(mean)
        gaussian = (-0.5 * (pre_tanh - mean).pow(2) * (-2 * log_std).exp() - log_std
                    - 0.5 * math.log(2 * math.pi)).sum(-1)
        # log |d tanh(x) / dx| written stably
        squash = (2 * (math.log(2) - pre_tanh - F.softplus(-2 * pre_tanh))).sum(-1)
        return torch.tanh(pre_tanh), gaussian - squash


def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging of the target network, one parameter at a time (as CORL writes it)."""
    with torch.no_grad():
        for target_param, source_param in zip(target.parameters(), source.parameters()):
            target_param.copy_((1 - tau) * target_param + tau * source_param)


def offline_transitions(capacity: int, state_dim: int, action_dim: int,
                        generator: torch.Generator) -> list[torch.Tensor]:
    """A D4RL-sized offline dataset on the device: states, actions in [-1, 1], rewards, next states, done flags."""
    states = torch.randn(capacity, state_dim, generator=generator)
    actions = torch.tanh(torch.randn(capacity, action_dim, generator=generator))
    next_states = states + 0.1 * torch.randn(capacity, state_dim, generator=generator)
    rewards = next_states[:, 0] - states[:, 0] - 0.1 * actions.pow(2).sum(-1)
    done = (torch.rand(capacity, generator=generator) < 1e-3).float()
    return [t.to(dev()) for t in (states, actions, rewards, next_states, done)]


def sac_n_critic_loop(fixes: Fixes) -> Step:
    """SAC-N offline RL (An et al. 2021) on a HalfCheetah-sized dataset (17-d states, 6-d actions, 1M transitions
    on the device; 10 Q-networks and a tanh-Gaussian actor, MLPs of three 256-wide layers; batch 256, gamma 0.99,
    tau 5e-3, learned entropy temperature; fused Adam). The ensemble is an nn.ModuleList of ten separate MLPs, run
    one after another for the actor's Q-values, the critics' Q-values and the target Q-values, and the Polyak
    update loops over all 80 target parameters: some 900 kernels a step of a few microseconds each, so the GPU
    mostly waits for the host to launch them. Fix: the ensemble as VectorizedLinear layers (weights [10, in, out],
    one baddbmm a layer, as CORL implements SAC-N): some 200 launches a step for the same arithmetic."""
    state_dim, action_dim, hidden, ensemble = 17, 6, pick(256, 16), pick(10, 3)
    batch, gamma, tau = pick(256, 8), 0.99, 5e-3
    buffer = offline_transitions(pick(1_000_000, 1000), state_dim, action_dim, torch.Generator().manual_seed(0))
    critic_class = VectorizedCritic if "launch_bound" in fixes else CriticList
    critic = critic_class(state_dim, action_dim, hidden, ensemble).to(dev())
    target_critic = copy.deepcopy(critic).requires_grad_(False)
    actor = TanhGaussianActor(state_dim, action_dim, hidden).to(dev())
    log_alpha = torch.zeros(1, device=dev(), requires_grad=True)
    actor_opt, critic_opt = adam(actor.parameters(), 3e-4), adam(critic.parameters(), 3e-4)
    alpha_opt = adam([log_alpha], 3e-4)
    target_entropy = -float(action_dim)

    def step() -> float:
        rows = torch.randint(len(buffer[0]), (batch,), device=dev())
        state, action, reward, next_state, done = (t[rows] for t in buffer)
        alpha = log_alpha.exp().detach()
        policy_action, log_prob = actor(state)
        actor_loss = (alpha * log_prob - critic(state, policy_action).min(0).values).mean()
        alpha_loss = -(log_alpha * (log_prob.detach() + target_entropy)).mean()
        (actor_loss + alpha_loss).backward()
        actor_opt.step()
        alpha_opt.step()
        actor_opt.zero_grad(set_to_none=True)
        alpha_opt.zero_grad(set_to_none=True)
        critic_opt.zero_grad(set_to_none=True)  # the actor loss left gradients in the critics
        with torch.no_grad():
            next_action, next_log_prob = actor(next_state)
            next_q = target_critic(next_state, next_action).min(0).values - alpha * next_log_prob
            target_q = reward + gamma * (1 - done) * next_q
        critic_loss = (critic(state, action) - target_q).pow(2).mean(1).sum()
        critic_loss.backward()
        critic_opt.step()
        critic_opt.zero_grad(set_to_none=True)
        soft_update(target_critic, critic, tau)
        return critic_loss.item()
    return step


# ------------------------------------------------------------------------------------------------ tiny_batch

class DecisionTransformer(nn.Module):
    """The Decision Transformer (Chen et al. 2021): return-to-go, state and action of every time step embedded as
    three tokens (plus a time-step embedding) through a causal GPT; the action predicted from each state's token."""

    def __init__(self, state_dim: int, action_dim: int, width: int, heads: int, depth: int, episode_length: int):
        super().__init__()
        self.timestep = nn.Embedding(episode_length, width)
        self.embed_return, self.embed_state = nn.Linear(1, width), nn.Linear(state_dim, width)
        self.embed_action = nn.Linear(action_dim, width)
        self.norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(SelfAttentionBlock(width, heads, 4 * width, causal=True) for _ in range(depth))
        self.final = nn.LayerNorm(width)
        self.predict_action = nn.Sequential(nn.Linear(width, action_dim), nn.Tanh())

    def forward(self, states: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor,
                timesteps: torch.Tensor) -> torch.Tensor:
        time = self.timestep(timesteps)
        tokens = torch.stack([self.embed_return(returns) + time, self.embed_state(states) + time,
                              self.embed_action(actions) + time], 2).flatten(1, 2)  # R1 s1 a1 R2 s2 a2 ...
        x = self.norm(tokens)
        for block in self.blocks:
            x = block(x)
        return self.predict_action(self.final(x).unflatten(1, (-1, 3))[:, :, 1])


def locomotion_trajectories(count: int, length: int, state_dim: int, action_dim: int,
                            generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Hopper-sized offline trajectories on the device: normalised states drifting under the actions, actions in
    [-1, 1], and the returns-to-go (scaled by 1/1000, as the paper does)."""
    actions = torch.tanh(torch.randn(count, length, action_dim, generator=generator))
    drift = torch.randn(count, length, state_dim, generator=generator) + actions.mean(-1, keepdim=True)
    states = drift.cumsum(1) / math.sqrt(length)
    states = (states - states.mean((0, 1))) / states.std((0, 1))
    rewards = 1 + states[..., 5] - 1e-3 * actions.pow(2).sum(-1)
    returns = rewards.flip(1).cumsum(1).flip(1) / 1000
    return states.to(dev()), actions.to(dev()), returns.to(dev())


def decision_transformer_batch_64(fixes: Fixes) -> Step:
    """A Decision Transformer on Hopper-sized offline data (11-d states, 3-d actions, 1000 trajectories of 1000
    steps on the device; context of 20 steps, 60 tokens; 3 causal layers of width 128, 1 head; action MSE; bf16
    autocast, fused AdamW with linear warm-up and gradient clipping at 0.25) trained with the paper's batch of 64
    windows, 3840 tokens a step: some 250 kernels of a few microseconds each, the GPU mostly idle between
    launches. step_ms is the time for 1024 windows (16 steps of 64). Fix: 1024 windows a step (one step for the
    same windows)."""
    state_dim, action_dim, context = 11, 3, 20
    trajectories, length = pick(1000, 20), pick(1000, 100)
    full = pick(1024, 32)
    batch = full if "tiny_batch" in fixes else pick(64, 4)
    states, actions, returns = locomotion_trajectories(trajectories, length, state_dim, action_dim,
                                                       torch.Generator().manual_seed(0))
    model = DecisionTransformer(state_dim, action_dim, pick(128, 16), 1, pick(3, 1), length).to(dev())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4, fused=on_gpu())
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda done: min((done + 1) / 10_000, 1.0))
    offsets = torch.arange(context, device=dev())

    def step() -> None:
        episode = torch.randint(trajectories, (batch, 1), device=dev())
        timesteps = torch.randint(length - context + 1, (batch, 1), device=dev()) + offsets
        target = actions[episode, timesteps]
        with autocast():
            predicted = model(states[episode, timesteps], target, returns[episode, timesteps].unsqueeze(-1),
                              timesteps)
        F.mse_loss(predicted.float(), target).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        warmup.step()
        opt.zero_grad(set_to_none=True)
    return PerSamples(step, full // batch)


# ----------------------------------------------------------------------------------------------- data_loader

LRELU = 0.1


class ResBlock(nn.Module):
    """HiFi-GAN's ResBlock1: three residual pairs of a dilated and an undilated convolution, LeakyReLU before each."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...] = (1, 3, 5)) -> None:
        super().__init__()
        self.dilated = nn.ModuleList(nn.Conv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2)
                                     for d in dilations)
        self.plain = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2)
                                   for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for dilated, plain in zip(self.dilated, self.plain):
            x = x + plain(F.leaky_relu(dilated(F.leaky_relu(x, LRELU)), LRELU))
        return x


class HiFiGANGenerator(nn.Module):
    """HiFi-GAN's generator: a mel spectrogram upsampled 8x8x2x2 by transposed convolutions, each followed by a
    multi-receptive-field fusion (the mean of ResBlocks of kernels 3, 7 and 11), to a waveform in [-1, 1]."""

    def __init__(self, mels: int, channels: int, rates: tuple[int, ...] = (8, 8, 2, 2),
                 kernels: tuple[int, ...] = (16, 16, 4, 4)) -> None:
        super().__init__()
        self.pre = nn.Conv1d(mels, channels, 7, padding=3)
        self.ups, self.fusions = nn.ModuleList(), nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(rates, kernels)):
            cin, cout = channels // 2 ** i, channels // 2 ** (i + 1)
            self.ups.append(nn.ConvTranspose1d(cin, cout, kernel, rate, padding=(kernel - rate) // 2))
            self.fusions.append(nn.ModuleList(ResBlock(cout, k) for k in (3, 7, 11)))
        self.post = nn.Conv1d(cout, 1, 7, padding=3)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.pre(mel)
        for up, fusion in zip(self.ups, self.fusions):
            x = up(F.leaky_relu(x, LRELU))
            x = sum(block(x) for block in fusion) / len(fusion)
        return torch.tanh(self.post(F.leaky_relu(x)))


class PeriodDiscriminator(nn.Module):
    """A multi-period discriminator: the waveform folded into [T / p, p] and judged by (5, 1) convolutions."""

    def __init__(self, period: int, base: int) -> None:
        super().__init__()
        self.period = period
        widths = [1, base, 4 * base, 16 * base, 32 * base, 32 * base]
        self.convs = nn.ModuleList(nn.Conv2d(cin, cout, (5, 1), (3 if i < 4 else 1, 1), padding=(2, 0))
                                   for i, (cin, cout) in enumerate(zip(widths, widths[1:])))
        self.post = nn.Conv2d(widths[-1], 1, (3, 1), padding=(1, 0))

    def forward(self, audio: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if audio.shape[-1] % self.period:
            audio = F.pad(audio, (0, self.period - audio.shape[-1] % self.period), mode="reflect")
        x = audio.unflatten(-1, (-1, self.period))
        features = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), LRELU)
            features.append(x)
        return self.post(x).flatten(1), features


class ScaleDiscriminator(nn.Module):
    """A multi-scale discriminator: strided, grouped 1-D convolutions over the (possibly pooled) waveform."""

    def __init__(self, base: int) -> None:
        super().__init__()
        layers = [(1, base, 15, 1, 1), (base, base, 41, 2, 4), (base, 2 * base, 41, 2, 16),
                  (2 * base, 4 * base, 41, 4, 16), (4 * base, 8 * base, 41, 4, 16), (8 * base, 8 * base, 41, 1, 16),
                  (8 * base, 8 * base, 5, 1, 1)]
        self.convs = nn.ModuleList(nn.Conv1d(cin, cout, kernel, stride, kernel // 2, groups=min(groups, cin))
                                   for cin, cout, kernel, stride, groups in layers)
        self.post = nn.Conv1d(8 * base, 1, 3, padding=1)

    def forward(self, audio: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x, features = audio, []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), LRELU)
            features.append(x)
        return self.post(x).flatten(1), features


class HiFiGANDiscriminators(nn.Module):
    """The multi-period discriminators (periods 2, 3, 5, 7, 11) and the multi-scale ones (the waveform, and it
    average-pooled 2x and 4x)."""

    def __init__(self, period_base: int, scale_base: int) -> None:
        super().__init__()
        self.periods = nn.ModuleList(PeriodDiscriminator(p, period_base) for p in (2, 3, 5, 7, 11))
        self.scales = nn.ModuleList(ScaleDiscriminator(scale_base) for _ in range(3))

    def forward(self, audio: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        outputs = [d(audio) for d in self.periods]
        for i, d in enumerate(self.scales):
            if i:
                audio = F.avg_pool1d(audio, 4, 2, padding=2)
            outputs.append(d(audio))
        return outputs


def periodic_hann(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)


N_FFT, HOP, MELS, RATE, SOURCE_RATE = 1024, 256, 80, 22_050, 48_000


def log_mel_numpy(audio: np.ndarray, basis: np.ndarray, window: np.ndarray) -> np.ndarray:
    """HiFi-GAN's log-mel spectrogram in numpy: reflect-padded frames of N_FFT every HOP, |STFT|, mel, log."""
    pad = (N_FFT - HOP) // 2
    frames = np.lib.stride_tricks.sliding_window_view(np.pad(audio, pad, mode="reflect"), N_FFT)[::HOP] * window
    magnitude = np.sqrt(np.abs(np.fft.rfft(frames, axis=-1)) ** 2 + 1e-9)
    return np.log(np.maximum(basis @ magnitude.T, 1e-5)).astype(np.float32)


class LogMel(nn.Module):
    """The same log-mel spectrogram on the device (torch.stft), for the generated waveforms."""

    def __init__(self, basis: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("basis", torch.from_numpy(basis), persistent=False)
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        pad = (N_FFT - HOP) // 2
        padded = F.pad(audio[:, None], (pad, pad), mode="reflect")[:, 0]
        spectrum = torch.view_as_real(torch.stft(padded, N_FFT, HOP, window=self.window, center=False,
                                                 return_complex=True))
        magnitude = (spectrum.pow(2).sum(-1) + 1e-9).sqrt()
        return (self.basis @ magnitude).clamp(min=1e-5).log()


def fft_resample(audio: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    """Band-limited resampling with one FFT of the whole signal (librosa's res_type='fft', scipy.signal.resample)."""
    n_out = round(len(audio) * rate / source_rate)
    spectrum = np.fft.rfft(audio)[:n_out // 2 + 1]
    return np.fft.irfft(spectrum, n_out) * (n_out / len(audio))


def recorded_clips(count: int, tenths: tuple[int, int], rng: np.random.Generator) -> list[np.ndarray]:
    """VCTK-like speech clips as a wav reader returns them: int16 at 48 kHz, a whole number of tenths of a second
    long, gliding harmonics under an envelope and noise."""
    clips = []
    for _ in range(count):
        t = np.arange(SOURCE_RATE // 10 * int(rng.integers(*tenths))) / SOURCE_RATE
        pitch = rng.uniform(90, 250) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.3, 2) * t))
        phase = 2 * np.pi * np.cumsum(pitch) / SOURCE_RATE
        voiced = sum(np.sin((h + 1) * phase) / (h + 1) for h in range(4)) * np.sin(np.pi * t / t[-1]) ** 2
        clips.append((8000 * (voiced + 0.02 * rng.standard_normal(len(t)))).astype(np.int16))
    return clips


class ResampledMelClips(Dataset):
    """HiFi-GAN's MelDataset over 48 kHz recordings: an item loads a whole clip and resamples it to 22.05 kHz (as
    librosa.load(sr=22050) does), peak-normalises it, cuts a random segment and computes the segment's log-mel
    spectrogram, all in numpy."""

    def __init__(self, clips: list[np.ndarray], segment: int, epoch: int) -> None:
        self.clips, self.segment, self.epoch = clips, segment, epoch
        self.basis = mel_filterbank(RATE, N_FFT, MELS, 0.0, 8000.0)
        self.window = periodic_hann(N_FFT)

    def __len__(self) -> int:
        return self.epoch

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(index)
        audio = fft_resample(self.clips[index % len(self.clips)].astype(np.float32) / 32768, SOURCE_RATE, RATE)
        audio = 0.95 * audio / max(float(np.abs(audio).max()), 1e-5)
        start = int(rng.integers(len(audio) - self.segment + 1))
        segment = audio[start:start + self.segment].astype(np.float32)
        return segment, log_mel_numpy(segment, self.basis, self.window)


def discriminator_loss(real: list, fake: list) -> torch.Tensor:
    """Least-squares GAN loss of every discriminator: real scored towards 1, generated towards 0."""
    return sum((1 - r.float()).pow(2).mean() + f.float().pow(2).mean() for (r, _), (f, _) in zip(real, fake))


def generator_adversarial_losses(real: list, fake: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares adversarial loss and the feature-matching loss (L1 between every feature map)."""
    adversarial = sum((1 - f.float()).pow(2).mean() for f, _ in fake)
    matching = sum(F.l1_loss(f.float(), r.float()) for (_, real_maps), (_, fake_maps) in zip(real, fake)
                   for r, f in zip(real_maps, fake_maps))
    return adversarial, matching


def hifigan_resample_on_load(fixes: Fixes) -> Step:
    """HiFi-GAN V1 vocoder training (generator of 512 initial channels, multi-period and multi-scale
    discriminators; 16 segments of 8192 samples at 22.05 kHz a step; least-squares adversarial, feature-matching
    and 45x mel L1 losses; bf16 autocast, fused AdamW with betas 0.8, 0.99) on 48 kHz recordings of 1.5 to 3 s.
    The dataset is HiFi-GAN's MelDataset adapted to them: every item loads its whole clip, resamples it to
    22.05 kHz with an FFT of the whole signal, peak-normalises it and computes the segment's mel spectrogram in
    numpy; and the DataLoader runs in the training process (num_workers=0), so each batch's 16 resamplings come
    before the GPU can start. Fix: num_workers=8 with persistent workers and prefetching."""
    segment, batch, channels = pick(8192, 1024), pick(16, 2), pick(512, 16)
    clips = recorded_clips(pick(200, 4), (15, 31) if on_gpu() else (1, 3), np.random.default_rng(0))
    dataset = ResampledMelClips(clips, segment, epoch=100_000)
    workers = pick(8, 2) if "data_loader" in fixes else 0
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                        pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                        prefetch_factor=4 if workers else None)
    batches = endless(loader)
    generator = HiFiGANGenerator(MELS, channels).to(dev())
    discriminators = HiFiGANDiscriminators(pick(32, 2), pick(128, 4)).to(dev())
    log_mel = LogMel(dataset.basis).to(dev())
    g_opt = torch.optim.AdamW(generator.parameters(), lr=2e-4, betas=(0.8, 0.99), fused=on_gpu())
    d_opt = torch.optim.AdamW(discriminators.parameters(), lr=2e-4, betas=(0.8, 0.99), fused=on_gpu())

    def step() -> list[float]:
        audio, mel = (t.to(dev(), non_blocking=True) for t in next(batches))
        audio = audio[:, None]
        with autocast():
            fake = generator(mel)
            d_loss = discriminator_loss(discriminators(audio), discriminators(fake.detach()))
        d_loss.backward()
        d_opt.step()
        d_opt.zero_grad(set_to_none=True)
        with autocast():
            with torch.no_grad():
                real_outputs = discriminators(audio)
            adversarial, matching = generator_adversarial_losses(real_outputs, discriminators(fake))
        g_loss = adversarial + 2 * matching + 45 * F.l1_loss(log_mel(fake.float()[:, 0]), mel)
        g_loss.backward()
        g_opt.step()
        g_opt.zero_grad(set_to_none=True)
        d_opt.zero_grad(set_to_none=True)
        return torch.stack([d_loss.detach(), g_loss.detach()]).tolist()
    return step


# --------------------------------------------------------------------------- precision + activation_checkpointing

class SpatialGatingUnit(nn.Module):
    """gMLP's spatial gating unit: the channels split in two, one half normalised and mixed across positions by a
    learned [n, n] projection (initialised near zero with a bias of one, as the paper does) and multiplied into
    the other half. With `full_precision` the mixing runs in fp32 outside autocast."""

    def __init__(self, channels: int, length: int, full_precision: bool) -> None:
        super().__init__()
        self.full_precision = full_precision
        self.norm = nn.LayerNorm(channels // 2)
        self.spatial = nn.Parameter(torch.empty(length, length).uniform_(-1e-3 / length, 1e-3 / length))
        self.bias = nn.Parameter(torch.ones(length, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v = x.chunk(2, -1)
        v = self.norm(v)
        if self.full_precision:
            # written for fear that bf16 would round the near-zero spatial weights away: an fp32 GEMM, TF32 off
            with torch.autocast(dev(), enabled=False):
                v = torch.einsum("bnd,mn->bmd", v.float(), self.spatial.float()) + self.bias
        else:
            v = torch.einsum("bnd,mn->bmd", v, self.spatial) + self.bias
        return u * v


class GMLPBlock(nn.Module):
    def __init__(self, width: int, hidden: int, length: int, full_precision: bool) -> None:
        super().__init__()
        self.norm, self.up = nn.LayerNorm(width), nn.Linear(width, hidden)
        self.gate = SpatialGatingUnit(hidden, length, full_precision)
        self.down = nn.Linear(hidden // 2, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.gate(F.gelu(self.up(self.norm(x)))))


class GMLPEncoder(nn.Module):
    """gMLP (Liu et al. 2021) for masked language modelling: token embeddings, gMLP blocks (no attention; position
    enters through the spatial projections), a final norm and the tied output embedding. With `checkpointed`
    every block is recomputed in the backward."""

    def __init__(self, vocab: int, width: int, hidden: int, length: int, depth: int, full_precision: bool,
                 checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(GMLPBlock(width, hidden, length, full_precision) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.norm(x) @ self.embed.weight.T


MASK_ID, IGNORE = 3, -100


def gmlp_fp32_gating_checkpointed(fixes: Fixes) -> Step:
    """gMLP masked language modelling (vocabulary 30,522, width 512, 12 blocks with 3072 hidden channels and
    spatial projections over 512 positions; 32 sequences of 512 tokens a step, 15% masked, loss on the masked
    ones; bf16 autocast, fused AdamW). Every spatial gating unit leaves autocast and mixes the positions in fp32,
    written for fear that bf16 would round its near-zero initial weights away: a quarter of the blocks' FLOPs
    run as fp32 GEMMs with TF32 off. And every block is wrapped in torch.utils.checkpoint, copied from the
    48-block long-sequence config, though its activations take a few GB of the 80: the forward runs twice. Fixes:
    the gating under autocast like the rest, in bf16 (precision); no checkpointing (activation_checkpointing)."""
    vocab, width, hidden, depth = pick(30_522, 300), pick(512, 32), pick(3072, 64), pick(12, 2)
    length, batch = pick(512, 32), pick(32, 2)
    model = GMLPEncoder(vocab, width, hidden, length, depth, full_precision="precision" not in fixes,
                        checkpointed="activation_checkpointing" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    corpus = torch.randint(5, vocab, (pick(4_000_000, 20_000),), device=dev())
    offsets = torch.arange(length, device=dev())

    def step() -> float:
        tokens = corpus[torch.randint(len(corpus) - length, (batch, 1), device=dev()) + offsets]
        masked = torch.rand(batch, length, device=dev()) < 0.15
        with autocast():
            logits = model(torch.where(masked, MASK_ID, tokens))
        loss = F.cross_entropy(logits.float().flatten(0, 1), torch.where(masked, tokens, IGNORE).flatten(),
                               ignore_index=IGNORE)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------- host_work + eager_attention

class MultiheadAttentionBlock(nn.Module):
    """The Set Transformer's MAB (Lee et al. 2019): O = LN(Q' + Attention(Q', K', V')), then LN(O + ReLU(W O)),
    Q', K', V' the projected queries, keys and values and the scores scaled by the full width, as in the paper's
    code. `eager` writes the attention out as that code does: heads folded into the batch, softmax(Q K^T) V."""

    def __init__(self, query_dim: int, key_dim: int, width: int, heads: int, eager: bool) -> None:
        super().__init__()
        self.width, self.heads, self.eager = width, heads, eager
        self.fc_q, self.fc_o = nn.Linear(query_dim, width), nn.Linear(width, width)
        self.fc_k, self.fc_v = nn.Linear(key_dim, width), nn.Linear(key_dim, width)
        self.ln0, self.ln1 = nn.LayerNorm(width), nn.LayerNorm(width)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.eager:
            split = self.width // self.heads
            q_, k_, v_ = (torch.cat(t.split(split, 2), 0) for t in (q, k, v))
            weights = torch.softmax(q_.bmm(k_.transpose(1, 2)) / math.sqrt(self.width), 2)
            return torch.cat(weights.bmm(v_).split(len(q), 0), 2)
        attended = F.scaled_dot_product_attention(heads_of(q, self.heads), heads_of(k, self.heads),
                                                  heads_of(v, self.heads), scale=1 / math.sqrt(self.width))
        return merge_heads(attended)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        q = self.fc_q(queries)
        o = self.ln0(q + self.attend(q, self.fc_k(keys), self.fc_v(keys)))
        return self.ln1(o + F.relu(self.fc_o(o)))


class SetTransformer(nn.Module):
    """A Set Transformer classifier: SAB blocks (MABs of the set with itself) encode the points, PMA (a learned
    seed attending to them) pools them, a linear layer classifies."""

    def __init__(self, classes: int, width: int, heads: int, depth: int, eager: bool) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(MultiheadAttentionBlock(3 if i == 0 else width, 3 if i == 0 else width, width,
                                                             heads, eager) for i in range(depth))
        self.seed = nn.Parameter(0.02 * torch.randn(1, 1, width))
        self.pool = MultiheadAttentionBlock(width, width, width, heads, eager)
        self.head = nn.Linear(width, classes)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x = points
        for sab in self.encoder:
            x = sab(x, x)
        return self.head(self.pool(self.seed.expand(len(points), -1, -1), x).squeeze(1))


def superquadric_meshes(classes: int, per_class: int, rings: int, segments: int,
                        rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Closed triangle meshes of superquadrics on one shared latitude-longitude grid: vertices [M, V, 3], the
    shared faces [F, 3] and labels [M]. A class fixes the two exponents and the three axes; every instance varies
    them by up to 10%."""
    lat = np.linspace(-np.pi / 2, np.pi / 2, rings)[:, None]
    lon = np.linspace(-np.pi, np.pi, segments, endpoint=False)[None]

    def signed_power(x: np.ndarray, e: float) -> np.ndarray:
        return np.sign(x) * np.abs(x) ** e

    vertices, labels = [], []
    for c in range(classes):
        exponents, axes = rng.uniform(0.3, 2.0, 2), rng.uniform(0.5, 1.5, 3)
        for _ in range(per_class):
            (e1, e2), (a, b, h) = exponents * rng.uniform(0.9, 1.1, 2), axes * rng.uniform(0.9, 1.1, 3)
            ring, height = signed_power(np.cos(lat), e1), signed_power(np.sin(lat), e1)
            x, y = a * ring * signed_power(np.cos(lon), e2), b * ring * signed_power(np.sin(lon), e2)
            vertices.append(np.stack([x, y, np.broadcast_to(h * height, x.shape)], -1).reshape(-1, 3))
            labels.append(c)
    r, s = np.meshgrid(np.arange(rings - 1), np.arange(segments), indexing="ij")

    def corner(dr: int, ds: int) -> np.ndarray:
        """The vertex index of every grid cell's corner (dr, ds), the longitude wrapping around."""
        return ((r + dr) * segments + (s + ds) % segments).ravel()

    faces = np.concatenate([np.stack([corner(0, 0), corner(1, 0), corner(1, 1)], 1),
                            np.stack([corner(0, 0), corner(1, 1), corner(0, 1)], 1)])
    return np.stack(vertices).astype(np.float32), faces, np.array(labels)


def normalised_and_augmented(cloud: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Centred, scaled into the unit sphere, rotated about the vertical axis at random and jittered."""
    cloud = cloud - cloud.mean(0)
    cloud = cloud / np.linalg.norm(cloud, axis=1).max()
    angle = rng.uniform(0, 2 * np.pi)
    rotation = np.array([[np.cos(angle), -np.sin(angle), 0], [np.sin(angle), np.cos(angle), 0], [0, 0, 1]])
    return cloud @ rotation.T + rng.normal(0, 0.01, cloud.shape)


def sample_surface_numpy(vertices: np.ndarray, faces: np.ndarray, points: int,
                         rng: np.random.Generator) -> np.ndarray:
    """`points` points uniformly on a mesh's surface: triangles drawn by area, barycentric coordinates at random."""
    triangles = vertices[faces].astype(np.float64)
    areas = 0.5 * np.linalg.norm(np.cross(triangles[:, 1] - triangles[:, 0], triangles[:, 2] - triangles[:, 0]),
                                 axis=1)
    chosen = triangles[rng.choice(len(faces), size=points, p=areas / areas.sum())]
    r1, r2 = np.sqrt(rng.random((points, 1))), rng.random((points, 1))
    cloud = (1 - r1) * chosen[:, 0] + r1 * (1 - r2) * chosen[:, 1] + r1 * r2 * chosen[:, 2]
    return normalised_and_augmented(cloud, rng)


def sample_surface_torch(triangles: torch.Tensor, areas: torch.Tensor, points: int) -> torch.Tensor:
    """The same sampling for a batch of meshes on the device: triangles [B, F, 3, 3], areas [B, F] -> [B, N, 3]."""
    b = len(triangles)
    chosen = torch.multinomial(areas, points, replacement=True)
    corners = triangles.gather(1, chosen[..., None, None].expand(-1, -1, 3, 3))
    r1 = torch.rand(b, points, 1, device=triangles.device).sqrt()
    r2 = torch.rand(b, points, 1, device=triangles.device)
    cloud = (1 - r1) * corners[:, :, 0] + r1 * (1 - r2) * corners[:, :, 1] + r1 * r2 * corners[:, :, 2]
    cloud = cloud - cloud.mean(1, keepdim=True)
    cloud = cloud / cloud.norm(dim=-1).amax(1)[:, None, None]
    angle = torch.rand(b, device=triangles.device) * 2 * math.pi
    cos, sin, zero, one = angle.cos(), angle.sin(), torch.zeros_like(angle), torch.ones_like(angle)
    rotation = torch.stack([cos, -sin, zero, sin, cos, zero, zero, zero, one], 1).view(b, 3, 3)
    return cloud @ rotation.transpose(1, 2) + 0.01 * torch.randn_like(cloud)


def set_transformer_host_sampling(fixes: Fixes) -> Step:
    """A Set Transformer classifying shapes from point clouds (40 classes of superquadric meshes, 1000 meshes of
    4096 triangles; 64 clouds of 1024 points a step; 4 SAB blocks of width 256 and 4 heads, PMA pooling; bf16
    autocast, fused AdamW). Each step the batch's clouds are sampled from their meshes on the host, one mesh at a
    time in numpy (triangle areas, area-weighted choice, barycentric points, normalisation, random rotation and
    jitter) while the GPU waits; and the attention is the reference code's, heads folded into the batch and
    softmax(QK^T)V written out, materialising [256, 1024, 1024] scores in every block. Fixes: the meshes kept on
    the GPU as one triangle tensor and the clouds sampled there (torch.multinomial over the areas) (host_work);
    F.scaled_dot_product_attention with the same scale (eager_attention)."""
    classes, per_class, points, batch = 40, pick(25, 2), pick(1024, 64), pick(64, 4)
    width, heads, depth = pick(256, 16), 4, pick(4, 2)
    vertices, faces, labels = superquadric_meshes(classes, per_class, pick(33, 9), pick(64, 16),
                                                  np.random.default_rng(0))
    model = SetTransformer(classes, width, heads, depth, eager="eager_attention" not in fixes).to(dev())
    opt = fused_adamw(model.parameters())
    on_device = "host_work" in fixes
    rng = np.random.default_rng(1)
    if on_device:
        triangles = torch.from_numpy(vertices[:, faces]).to(dev())
        edges = triangles[:, :, 1:] - triangles[:, :, :1]
        areas = 0.5 * torch.linalg.cross(edges[:, :, 0], edges[:, :, 1]).norm(dim=-1)
        device_labels = torch.from_numpy(labels).to(dev())

    def batch_clouds() -> tuple[torch.Tensor, torch.Tensor]:
        if on_device:
            picked = torch.randint(len(labels), (batch,), device=dev())
            return sample_surface_torch(triangles[picked], areas[picked], points), device_labels[picked]
        picked = rng.integers(len(labels), size=batch)
        clouds = np.stack([sample_surface_numpy(vertices[i], faces, points, rng) for i in picked])
        return torch.from_numpy(clouds).float().to(dev()), torch.from_numpy(labels[picked]).to(dev())

    def step() -> float:
        clouds, targets = batch_clouds()
        with autocast():
            logits = model(clouds)
        loss = F.cross_entropy(logits.float(), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------------------------ healthy

class Sine(nn.Module):
    """sin(w x) with a learned frequency per channel (Hyena's filter activation)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.frequency = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.frequency * x)


class ImplicitFilter(nn.Module):
    """Hyena's implicit long filter: an FFN with sine activations over positional features of t (t and cosines and
    sines of a few frequencies) gives one length-L filter a channel, windowed by an exponential decay that is fast
    for some channels and slow for others."""

    def __init__(self, channels: int, length: int, features: int = 33, hidden: int = 64) -> None:
        super().__init__()
        t = torch.linspace(0, 1, length)[:, None]
        bands = (features - 1) // 2
        frequencies = torch.linspace(1e-4, bands - 1, bands)[None]
        self.register_buffer("t", t, persistent=False)
        self.register_buffer("z", torch.cat([t, torch.cos(2 * math.pi * frequencies * t),
                                             torch.sin(2 * math.pi * frequencies * t)], -1), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * bands + 1, hidden), Sine(hidden), nn.Linear(hidden, hidden),
                                 Sine(hidden), nn.Linear(hidden, channels, bias=False))
        fast, slow = math.log(1e-2) / 0.3, math.log(1e-2) / 1.5
        self.register_buffer("decay", torch.linspace(slow, fast, channels).abs()[None], persistent=False)

    def forward(self) -> torch.Tensor:
        return (self.mlp(self.z) * torch.exp(-self.t * self.decay)).T


def fft_long_conv(u: torch.Tensor, k: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """Causal convolution of every channel of u [B, C, L] with its own length-L filter k [C, L], through FFTs
    zero-padded to 2L, in fp32; plus a per-channel skip."""
    length = u.shape[-1]
    n = 2 * length
    u = u.float()
    spectrum = torch.fft.rfft(u, n=n) * (torch.fft.rfft(k.float(), n=n) / n)
    return torch.fft.irfft(spectrum, n=n, norm="forward")[..., :length] + u * skip[:, None]


class HyenaOperator(nn.Module):
    """The order-2 Hyena operator (Poli et al. 2023): a projection to three streams, a short depthwise causal
    convolution, then gate * long_conv(gate * value) with the implicit filter."""

    def __init__(self, width: int, length: int) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.short_filter = nn.Conv1d(3 * width, 3 * width, 3, padding=2, groups=3 * width)
        self.filter = ImplicitFilter(width, length)
        self.skip = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        streams = self.short_filter(self.in_proj(x).transpose(1, 2))[..., :length]
        gate_out, gate_in, value = streams.chunk(3, 1)
        mixed = fft_long_conv(value * gate_in, self.filter()[:, :length], self.skip)
        return self.out_proj((mixed * gate_out).transpose(1, 2))


class HyenaBlock(nn.Module):
    def __init__(self, width: int, length: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mixer = HyenaOperator(width, length)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HyenaLM(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(HyenaBlock(width, length) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T


def healthy_hyena_fftconv_bf16(fixes: Fixes) -> Step:
    """A Hyena language model (vocabulary 32k, width 768, 8 blocks of an order-2 Hyena operator and a GELU MLP,
    implicit filters over 2048 positions; 16 sequences of 2048 tokens a step). bf16 autocast for the projections
    and MLPs, the long convolutions as fp32 FFTs (as the reference implementation keeps them), fused AdamW, batches
    cut from a corpus on the device, one loss `.item()` at the end."""
    vocab, width, depth, length, batch = pick(32_000, 256), pick(768, 32), pick(8, 2), pick(2048, 64), pick(16, 2)
    model = HyenaLM(vocab, width, depth, length).to(dev())
    opt = fused_adamw(model.parameters())
    corpus = torch.randint(vocab, (pick(8_000_000, 20_000),), device=dev())
    offsets = torch.arange(length + 1, device=dev())

    def step() -> float:
        window = corpus[torch.randint(len(corpus) - length - 1, (batch, 1), device=dev()) + offsets]
        with autocast():
            logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


class OverlapPatchEmbed(nn.Module):
    """SegFormer's overlapping patch embedding: a strided convolution, its grid flattened into tokens, LayerNorm."""

    def __init__(self, cin: int, width: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.proj, self.norm = nn.Conv2d(cin, width, kernel, stride, kernel // 2), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x = self.proj(x)
        return self.norm(x.flatten(2).transpose(1, 2)), x.shape[2], x.shape[3]


def tokens_to_grid(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, H*W, C] -> [B, C, H, W]."""
    return x.transpose(1, 2).unflatten(2, (h, w))


class EfficientSelfAttention(nn.Module):
    """SegFormer's attention (SDPA): keys and values from the token grid reduced `reduction`x per side by a strided
    convolution and LayerNorm."""

    def __init__(self, width: int, heads: int, reduction: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.proj = nn.Linear(width, width), nn.Linear(width, 2 * width), nn.Linear(width, width)
        self.reduce = nn.Conv2d(width, width, reduction, reduction) if reduction > 1 else None
        self.reduced_norm = nn.LayerNorm(width) if reduction > 1 else None

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        q = heads_of(self.q(x), self.heads)
        if self.reduce is not None:
            x = self.reduced_norm(self.reduce(tokens_to_grid(x, h, w)).flatten(2).transpose(1, 2))
        k, v = (heads_of(t, self.heads) for t in self.kv(x).chunk(2, -1))
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v)))


class MixFFN(nn.Module):
    """SegFormer's Mix-FFN: Linear, a depthwise 3x3 convolution on the grid (its only position signal), GELU,
    Linear."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        grid = self.depthwise(tokens_to_grid(self.fc1(x), h, w))
        return self.fc2(F.gelu(grid.flatten(2).transpose(1, 2)))


class MiTBlock(nn.Module):
    def __init__(self, width: int, heads: int, reduction: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention, self.ffn = EfficientSelfAttention(width, heads, reduction), MixFFN(width, 4 * width)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), h, w)
        return x + self.ffn(self.norm2(x), h, w)


class SegFormer(nn.Module):
    """SegFormer (Xie et al. 2021) with a MiT-B1-sized encoder (widths 64-128-320-512, two blocks a stage, 1-2-5-8
    heads, key reductions 8-4-2-1) and the all-MLP decoder: every stage projected to 256 channels, upsampled to
    1/4 resolution, concatenated and fused by a 1x1 convolution, classified, and upsampled to the image."""

    def __init__(self, classes: int, widths: tuple[int, ...], heads: tuple[int, ...] = (1, 2, 5, 8),
                 reductions: tuple[int, ...] = (8, 4, 2, 1), decoder: int = 256) -> None:
        super().__init__()
        cins, kernels, strides = (3, *widths[:-1]), (7, 3, 3, 3), (4, 2, 2, 2)
        self.embeds = nn.ModuleList(OverlapPatchEmbed(*args) for args in zip(cins, widths, kernels, strides))
        self.stages = nn.ModuleList(nn.ModuleList(MiTBlock(w, h, r) for _ in range(2))
                                    for w, h, r in zip(widths, heads, reductions))
        self.norms = nn.ModuleList(nn.LayerNorm(w) for w in widths)
        self.projections = nn.ModuleList(nn.Linear(w, decoder) for w in widths)
        self.fuse = nn.Sequential(nn.Conv2d(4 * decoder, decoder, 1, bias=False), nn.BatchNorm2d(decoder), nn.ReLU())
        self.classify = nn.Conv2d(decoder, classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x, features = images, []
        for embed, blocks, norm, projection in zip(self.embeds, self.stages, self.norms, self.projections):
            x, h, w = embed(x)
            for block in blocks:
                x = block(x, h, w)
            x = tokens_to_grid(norm(x), h, w)
            features.append(tokens_to_grid(projection(x.flatten(2).transpose(1, 2)), h, w))
        size = features[0].shape[-2:]
        decoded = [F.interpolate(f, size=size, mode="bilinear", align_corners=False) for f in features[::-1]]
        logits = self.classify(self.fuse(torch.cat(decoded, 1)))
        return F.interpolate(logits, size=images.shape[-2:], mode="bilinear", align_corners=False)


def scene_batches(count: int, batch: int, side: int, classes: int,
                  generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 'scenes' on the device: label maps of 16x16-pixel regions, images coloured by class under
    noise, normalised."""
    colours = torch.rand(classes, 3, generator=generator)
    batches = []
    for _ in range(count):
        labels = torch.randint(classes, (batch, side // 16, side // 16), generator=generator)
        labels = labels.repeat_interleave(16, 1).repeat_interleave(16, 2)
        images = colours[labels].permute(0, 3, 1, 2) + 0.2 * torch.randn(batch, 3, side, side, generator=generator)
        batches.append((((images - 0.5) / 0.3).to(dev()), labels.to(dev())))
    return batches


def healthy_segformer_bf16(fixes: Fixes) -> Step:
    """SegFormer-B1 semantic segmentation at 512x512 (150 classes as in ADE20K; 16 images a step, the logits
    upsampled to the labels' resolution for the cross-entropy). bf16 autocast, SDPA for the efficient
    self-attention, fused AdamW, the batches on the device, one loss `.item()` at the end."""
    classes, batch, side = 150, pick(16, 2), pick(512, 32)
    model = SegFormer(classes, tuple(pick(w, w // 8) for w in (64, 128, 320, 512)), decoder=pick(256, 16)).to(dev())
    opt = torch.optim.AdamW(model.parameters(), lr=6e-5, weight_decay=1e-2, fused=on_gpu())
    batches = scene_batches(pick(4, 1), batch, side, classes, torch.Generator().manual_seed(0))
    turn = itertools.count()

    def step() -> float:
        images, labels = batches[next(turn) % len(batches)]
        with autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


# --------------------------------------------------------------------------------------------- recompilation

class ResBlock2d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def vae_encoder(codes: int, hidden: int, downsamples: int) -> nn.Sequential:
    """DALL-E's dVAE encoder, smaller: residual blocks and max-pooling down to the grid, logits over the codes."""
    layers: list[nn.Module] = [nn.Conv2d(3, hidden, 7, padding=3)]
    for _ in range(downsamples):
        layers += [ResBlock2d(hidden), ResBlock2d(hidden), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Conv2d(hidden, codes, 1))


def vae_decoder(embedding: int, hidden: int, upsamples: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(embedding, hidden, 1)]
    for _ in range(upsamples):
        layers += [ResBlock2d(hidden), ResBlock2d(hidden), nn.Upsample(scale_factor=2.0, mode="nearest")]
    return nn.Sequential(*layers, nn.ReLU(), nn.Conv2d(hidden, 3, 1))


class GumbelQuantizer(nn.Module):
    """DALL-E's relaxation of the codes: a Gumbel-softmax over the codes at every grid cell, its soft one-hot
    mixing the codebook; and the KL of the encoder's distribution to the uniform prior."""

    def __init__(self, codes: int, embedding: int) -> None:
        super().__init__()
        self.codebook = nn.Parameter(torch.randn(codes, embedding) / math.sqrt(embedding))

    def forward(self, logits: torch.Tensor, temperature: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()  # the relaxation in fp32: Gumbel noise and a low temperature
        gumbel = -torch.empty_like(logits).exponential_().log()
        soft_one_hot = ((logits + gumbel) / temperature).softmax(1)
        z = torch.einsum("bkhw,kd->bdhw", soft_one_hot, self.codebook)
        log_q = logits.log_softmax(1)
        kl = (log_q.exp() * (log_q + math.log(logits.shape[1]))).sum(1).mean()
        return z, kl


def annealed_temperature(step: int, rate: float = 1e-4, floor: float = 1 / 16) -> float:
    """The temperature schedule: exp(-rate * step), down to a floor."""
    return max(floor, math.exp(-rate * step))


class AnnealedGumbelQuantizer(GumbelQuantizer):
    """The quantizer owning its schedule: forward(logits, step) computes the temperature from the step number."""

    def forward(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(logits, annealed_temperature(step))


def dvae_compiled_annealed_gumbel(fixes: Fixes) -> Step:
    """A DALL-E-style discrete VAE on 128x128 images (encoder and decoder of residual blocks at 128 channels,
    three 2x steps to a 16x16 grid, 8192 codes of 256 dimensions; 64 images a step; MSE plus a KL to the uniform
    prior; bf16 autocast, fused AdamW), resumed from a checkpoint. The Gumbel-softmax quantizer is compiled with
    torch.compile (default settings), its [64, 8192, 16, 16] relaxation the memory hot spot, and owns its
    temperature schedule: forward(logits, step) computes exp(-1e-4 * step) from the Python step number, so every
    step's new number fails the guards and the quantizer's forward and backward are compiled again (the recompile
    limit raised after the warning). The run resumes at a random step, so that no compile cache left by an earlier
    run has seen its numbers. Fix: the schedule computed outside the compiled module and handed in as a 0-d device
    tensor updated in place, one graph for every temperature."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 2048)
    side, batch, hidden = pick(128, 32), pick(64, 2), pick(128, 8)
    codes, embedding, downsamples = pick(8192, 64), pick(256, 16), 3
    encoder, decoder = vae_encoder(codes, hidden, downsamples).to(dev()), vae_decoder(embedding, hidden,
                                                                                      downsamples).to(dev())
    scheduled_outside = "recompilation" in fixes
    quantizer = (GumbelQuantizer if scheduled_outside else AnnealedGumbelQuantizer)(codes, embedding).to(dev())
    compiled = torch.compile(quantizer)
    opt = fused_adamw([*encoder.parameters(), *decoder.parameters(), *quantizer.parameters()])
    generator = torch.Generator().manual_seed(0)
    images = F.interpolate(torch.rand(pick(512, 8), 3, side // 8, side // 8, generator=generator), size=side,
                           mode="bilinear", align_corners=False).to(dev()) * 2 - 1
    temperature = torch.ones((), device=dev())
    steps = itertools.count(int(np.random.default_rng().integers(10_000, 40_000)))

    def step() -> float:
        done = next(steps)
        x = images[torch.randint(len(images), (batch,), device=dev())]
        with autocast():
            logits = encoder(x)
            if scheduled_outside:
                z, kl = compiled(logits, temperature.fill_(annealed_temperature(done)))
            else:
                z, kl = compiled(logits, done)
            reconstruction = decoder(z)
        loss = F.mse_loss(reconstruction.float(), x) + 1e-3 * kl
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


PROGRAMS = {
    "sasrec_rss_guard_checkpoints": ["gc_pauses", "checkpoint_in_step"],
    "protonet_unique_class_masks": ["host_syncs"],
    "sac_n_critic_loop": ["launch_bound"],
    "decision_transformer_batch_64": ["tiny_batch"],
    "hifigan_resample_on_load": ["data_loader"],
    "gmlp_fp32_gating_checkpointed": ["precision", "activation_checkpointing"],
    "set_transformer_host_sampling": ["host_work", "eager_attention"],
    "healthy_hyena_fftconv_bf16": [],
    "healthy_segformer_bf16": [],
    "dvae_compiled_annealed_gumbel": ["recompilation"],
}
WITH_STACK = {"sasrec_rss_guard_checkpoints", "set_transformer_host_sampling", "protonet_unique_class_masks"}
"""Programs profiled with Python stacks (and garbage collections)."""


if __name__ == "__main__":
    run_set_fixes(__doc__, {globals()[name]: causes for name, causes in PROGRAMS.items()}, WITH_STACK)
