"""Typed configuration of one training run: what every rank runs.

Torch-free on purpose: the launcher renders these into a command line (and `--dry-run` prints it)
without importing torch. Every field has a docstring; `__post_init__` validation names the bad
field. Any field can be set from the command line with `--set section.field=value`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from .families import BIAS_ROUTER_FAMILIES, EP_MODEL_TYPES, FAMILIES, PRESETS
from .triggers import parse_triggers

ParallelMode = Literal["ddp", "fsdp", "tp", "fsdp_tp"]
PARALLEL_MODES: tuple[str, ...] = typing.get_args(ParallelMode)
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]
Backend = Literal["auto", "nccl", "gloo"]
CompileMode = Literal["none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
ActivationCheckpointing = Literal["none", "full", "selective"]
DataSource = Literal["synthetic", "text", "tokens"]
Tokenizer = Literal["bytes", "bpe"]
TokenDtype = Literal["uint16", "uint32"]
SlowPhase = Literal["none", "forward", "backward", "optimizer_step"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
ReduceDtype = Literal["auto", "fp32", "bf16"]


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def require(condition: bool, field_name: str, message: str) -> None:
    """Raise a ConfigError naming `field_name` unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    family: str = "qwen3_moe"
    """Model family: mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, gpt_oss."""
    preset: str = "tiny"
    """Size preset of the family: tiny (CPU tests), small, medium (one GPU)."""
    path: str = ""
    """Local directory with a transformers config.json (and weights, if `load_weights`); overrides preset."""
    load_weights: bool = False
    """Load weights from `path` with from_pretrained instead of random initialisation."""
    router_aux_loss_coef: float = 0.0
    """Weight of the routers' load-balancing loss added to the training loss (trainer/load_balance.py:
    E * sum_e f_e * P_e per MoE layer, averaged over layers; 1.0 at balanced routing); 0: off (nothing is
    computed). Typical: 0.001-0.01. Not with parallel.pp > 1, nor with tensor parallelism without
    expert parallelism."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after every optimizer step, each router's
    `e_score_correction_bias` moves by +rate for experts under the layer's mean load over the step (all
    ranks) and -rate over it (trainer/load_balance.py); 0: off. DeepSeek-V3's: 0.001. Routers with that bias
    only (family deepseek_v3); same layouts as router_aux_loss_coef."""

    def __post_init__(self) -> None:
        require(self.family in FAMILIES, "model.family",
                 f"unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        require(self.preset in PRESETS, "model.preset", f"must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        require(not self.load_weights or bool(self.path), "model.load_weights", "needs model.path")
        require(math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0,
                "model.router_aux_loss_coef", f"must be a finite number >= 0, got {self.router_aux_loss_coef}")
        require(math.isfinite(self.router_bias_update_rate) and self.router_bias_update_rate >= 0,
                "model.router_bias_update_rate", f"must be a finite number >= 0, got {self.router_bias_update_rate}")
        require(not self.router_bias_update_rate or bool(self.path) or self.family in BIAS_ROUTER_FAMILIES,
                "model.router_bias_update_rate", f"the {self.family} router has no e_score_correction_bias to "
                f"update (families with one: {', '.join(BIAS_ROUTER_FAMILIES)}); use model.router_aux_loss_coef")



EP_MODES: tuple[str, ...] = ("ddp", "fsdp", "fsdp_tp")
"""Parallel modes that compose with expert parallelism (parallel.ep > 1); `tp` shards over every rank and
leaves no data-parallel ranks to spread the experts over."""

@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    mode: ParallelMode = "ddp"
    """ddp (replicate), fsdp (FSDP2 fully_shard per block), tp (tensor parallel), fsdp_tp (2-D)."""
    tp: int = 1
    """Tensor-parallel degree (tp and fsdp_tp); the data-parallel degree is world_size / tp."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (saves memory, re-gathers in backward)."""
    cpu_offload: bool = False
    """FSDP2: keep sharded parameters and optimizer state in host memory."""
    backend: Backend = "auto"
    """Process-group backend: nccl on CUDA and gloo on CPU (auto), or forced (gloo on CUDA tensors)."""
    ep: int = 1
    """Expert-parallel degree: routed experts are split into `ep` equal slices, one per rank of an `ep` mesh
    axis carved out of the data-parallel ranks; tokens travel to their experts by all-to-all. The
    world_size / (tp * ep) data-parallel replicas of each slice reduce its gradients (modes ddp, fsdp and
    fsdp_tp: with tp the routed experts stay whole and each TP rank dispatches its share of the tokens)."""
    dp_replicate: int = 1
    """HSDP (modes fsdp, fsdp_tp): replicas of the sharded model, e.g. one per node; FSDP2 shards inside a
    replica and all-reduces gradients across replicas. 1: plain FSDP."""
    dp_shard: int = 0
    """HSDP: ranks one replica shards over (e.g. the GPUs of a node); 0: the rest of the data-parallel degree,
    world_size / (pp * tp * dp_replicate)."""
    reshard_every: int = 1
    """FSDP2 with reshard_after_forward: free the gathered parameters of every Nth block only (the others stay
    gathered from forward to backward: less traffic, more memory). 1: every block."""
    reshard_to: int = 0
    """FSDP2 reshard_after_forward as an int: after forward, keep the parameters of a resharding block sharded
    over this many ranks (a divisor of the shard degree, e.g. the GPUs of a node) instead of all; 0: all."""
    forward_prefetch: int = 0
    """FSDP2: blocks whose all-gather is issued ahead in forward (set_modules_to_forward_prefetch); 0: FSDP's
    default of one implicit prefetch."""
    backward_prefetch: int = 0
    """FSDP2: blocks whose all-gather is issued ahead in backward (set_modules_to_backward_prefetch); 0: default."""
    reduce_dtype: ReduceDtype = "auto"
    """FSDP2 gradient reduce-scatter dtype (MixedPrecisionPolicy.reduce_dtype): auto (fp32 under bf16 on CUDA,
    else the parameters' dtype), fp32 or bf16."""
    pp: int = 1
    """Pipeline-parallel stages (one per rank of a pp group); the decoder blocks are split evenly."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b, or interleaved_1f1b (two stages per
    rank, round-robin)."""
    pp_microbatches: int = 4
    """Micro-batches per step that the pipeline schedule splits each rank's batch into."""

    def __post_init__(self) -> None:
        self._check_hybrid()
        require(self.mode in PARALLEL_MODES, "parallel.mode", f"must be one of {PARALLEL_MODES}, got {self.mode!r}")
        require(self.tp >= 1, "parallel.tp", f"must be >= 1, got {self.tp}")
        require(self.mode in ("tp", "fsdp_tp") or self.tp == 1, "parallel.tp",
                 f"is {self.tp} but parallel.mode {self.mode!r} has no tensor parallelism")
        require(self.bucket_cap_mb > 0, "parallel.bucket_cap_mb", "must be > 0")
        require(self.backend in typing.get_args(Backend), "parallel.backend", f"unknown backend {self.backend!r}")
        require(self.ep >= 1, "parallel.ep", f"must be >= 1, got {self.ep}")
        require(self.ep == 1 or self.mode in EP_MODES, "parallel.ep",
                f"is {self.ep} but parallel.mode {self.mode!r} is not one of {EP_MODES}: mode 'tp' shards over every "
                "rank, which leaves no data-parallel ranks to spread the experts over (use fsdp_tp)")


    def _check_hybrid(self) -> None:
        fsdp = self.mode in ("fsdp", "fsdp_tp")
        require(self.dp_replicate >= 1, "parallel.dp_replicate", f"must be >= 1, got {self.dp_replicate}")
        require(self.dp_shard >= 0, "parallel.dp_shard", f"must be >= 0, got {self.dp_shard}")
        require(fsdp or (self.dp_replicate == 1 and self.dp_shard == 0), "parallel.dp_replicate",
                f"HSDP shards with FSDP2; parallel.mode {self.mode!r} does not")
        require(self.reshard_every >= 1, "parallel.reshard_every", f"must be >= 1, got {self.reshard_every}")
        require(self.reshard_to >= 0, "parallel.reshard_to", f"must be >= 0, got {self.reshard_to}")
        for name in ("forward_prefetch", "backward_prefetch"):
            require(getattr(self, name) >= 0, f"parallel.{name}", f"must be >= 0, got {getattr(self, name)}")
        require(self.reduce_dtype in typing.get_args(ReduceDtype), "parallel.reduce_dtype",
                f"must be one of {typing.get_args(ReduceDtype)}, got {self.reduce_dtype!r}")
        require(self.pp >= 1, "parallel.pp", f"must be >= 1, got {self.pp}")
        require(self.pp_schedule in typing.get_args(PipelineSchedule), "parallel.pp_schedule",
                f"must be one of {typing.get_args(PipelineSchedule)}, got {self.pp_schedule!r}")
        require(self.pp_microbatches >= 1, "parallel.pp_microbatches", f"must be >= 1, got {self.pp_microbatches}")
        require(self.pp == 1 or self.tp == 1, "parallel.pp",
                "pipeline x tensor parallel is not supported; use pp with ddp or fsdp over the data-parallel ranks")
        require(self.pp == 1 or self.pp_schedule == "gpipe" or self.pp_microbatches >= self.pp,
                "parallel.pp_microbatches", f"{self.pp_schedule} needs at least pp={self.pp} micro-batches")

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank holds (2 for the interleaved schedule)."""
        return 2 if self.pp > 1 and self.pp_schedule == "interleaved_1f1b" else 1


def check_degrees(config: ParallelConfig, world_size: int) -> None:
    """Parallel degrees against the world size (launcher and trainer both call this, before any
    process group exists)."""
    if world_size % config.tp:
        raise ConfigError(f"parallel.tp: {config.tp} does not divide the world size {world_size}")
    if world_size % (config.tp * config.pp):
        raise ConfigError(f"parallel.pp: pp={config.pp} x tp={config.tp} does not divide the world size {world_size}")
    dp = world_size // (config.tp * config.pp)
    if dp % config.dp_replicate:
        raise ConfigError(f"parallel.dp_replicate: {config.dp_replicate} does not divide the data-parallel "
                          f"degree {dp} (world {world_size} / pp {config.pp} / tp {config.tp})")
    shard = config.dp_shard or dp // config.dp_replicate
    if config.reshard_to and (shard % config.reshard_to or config.reshard_to == 1):
        raise ConfigError(f"parallel.reshard_to: {config.reshard_to} must be > 1 and divide the shard degree {shard}")
    if config.dp_shard and config.dp_replicate * config.dp_shard != dp:
        raise ConfigError(f"parallel.dp_shard: dp_replicate {config.dp_replicate} x dp_shard {config.dp_shard} "
                          f"must equal the data-parallel degree {dp}")
    if config.mode == "tp" and config.tp != world_size:
        raise ConfigError(f"parallel.tp: mode 'tp' shards over all {world_size} ranks, so tp must be "
                          f"{world_size} (got {config.tp}); use fsdp_tp for data x tensor parallel")
    if (world_size // config.tp) % config.ep:
        raise ConfigError(f"parallel.ep: {config.ep} does not divide the {world_size // config.tp} data-parallel "
                          f"ranks (world size {world_size}, tp {config.tp})")


FAULT_RANK_FIELDS = ("crash_rank", "straggle_rank", "signal_rank", "data_delay_rank", "slow_phase_rank", "hang_rank")
"""FaultConfig fields that name a rank (-1: none)."""


def check_fault_ranks(faults: "FaultConfig", world_size: int) -> None:
    """A fault aimed at a rank the job does not have would silently do nothing: refuse it before start."""
    for name in FAULT_RANK_FIELDS:
        rank = getattr(faults, name)
        if rank >= world_size:
            raise ConfigError(f"faults.{name}: rank {rank} is not in the job (world size {world_size}, ranks "
                              f"0..{world_size - 1})")


def check_expert_degree(config: ParallelConfig, *, num_experts: int, model_type: str, name: str) -> None:
    """Expert parallelism against the model: whole experts per rank, an MoE block the trainer can split."""
    if config.ep == 1:
        return
    if model_type not in EP_MODEL_TYPES:
        raise ConfigError(f"parallel.ep: {name} (model_type {model_type!r}) has no expert-parallel support; "
                          f"supported model types: {', '.join(EP_MODEL_TYPES)}")
    if num_experts % config.ep:
        raise ConfigError(f"parallel.ep: {config.ep} does not divide the {num_experts} routed experts of {name}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfilerSchedule:
    """torch.profiler schedule, in training steps. Each cycle: wait, warmup, active; `repeat` cycles."""

    enabled: bool = True
    """Profile at all."""
    skip_first: int = 0
    """Steps to skip before the first cycle."""
    wait: int = 1
    """Steps without profiling at the start of each cycle."""
    warmup: int = 1
    """Steps profiled but discarded (the profiler's own start-up cost lands here)."""
    active: int = 2
    """Steps recorded into the trace of each window."""
    repeat: int = 1
    """Number of cycles (windows); 0 means until training ends."""
    record_shapes: bool = False
    """Record operator input shapes."""
    with_stack: bool = False
    """Record Python stacks (large traces)."""
    profile_memory: bool = False
    """Record allocations."""
    on_demand: bool = True
    """Honour `fleetscope profile` requests (rank 0 looks for them at step boundaries)."""
    request_poll_steps: int = 10
    """Rank 0 looks for new requests every this many steps ..."""
    request_poll_seconds: float = 5.0
    """... or when this many seconds passed since it last looked, whichever comes first."""
    trigger: str = ""
    """Anomaly triggers that record a window on every rank, e.g. `step_time>2x,rank_step_time>1.5x`
    (trainer/triggers.py); empty: none."""
    trigger_history: int = 20
    """Steps in the rolling median that relative step_time / data_time triggers compare against."""
    trigger_every: int = 10
    """rank_step_time: compare the ranks' step times every this many steps."""
    trigger_warmup: int = 1
    """Warmup steps of a triggered window."""
    trigger_active: int = 2
    """Recorded steps of a triggered window."""
    max_triggered_windows: int = 2
    """At most this many triggered windows per run attempt (a sick job cannot fill the disk)."""
    trigger_cooldown: int = 50
    """Steps after a triggered window ends before a trigger may fire again."""
    cupti_teardown: bool = True
    """Unsubscribe CUPTI after each window (`TEARDOWN_CUPTI=1` on every rank, traces/cupti.py): steps after a
    window then cost what unprofiled steps cost. Applied on CUDA >= 12.6 with windows at least one step apart
    (wait >= 1 or a single window); a TEARDOWN_CUPTI the user sets wins."""

    def __post_init__(self) -> None:
        for name in ("skip_first", "wait", "warmup", "repeat", "trigger_warmup", "max_triggered_windows",
                     "trigger_cooldown"):
            require(getattr(self, name) >= 0, f"profiler.{name}", f"must be >= 0, got {getattr(self, name)}")
        require(self.active >= 1, "profiler.active", f"must be >= 1, got {self.active}")
        for name in ("request_poll_steps", "trigger_history", "trigger_every", "trigger_active"):
            require(getattr(self, name) >= 1, f"profiler.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(self.request_poll_seconds > 0, "profiler.request_poll_seconds", "must be > 0")
        try:
            parse_triggers(self.trigger)
        except ValueError as error:
            raise ConfigError(f"profiler.trigger: {error}") from None

    @property
    def cycle_steps(self) -> int:
        return self.wait + self.warmup + self.active

    @property
    def windows_apart(self) -> bool:
        """Planned windows leave at least one step between them (a profiler never starts right after one stopped)."""
        return self.wait >= 1 or self.repeat == 1


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    source: DataSource = "synthetic"
    """synthetic random tokens, a local UTF-8 `text` file, or a `tokens` file (flat uint16/uint32 array)."""
    path: str = ""
    """File for the text and tokens sources."""
    tokenizer: Tokenizer = "bytes"
    """text source: UTF-8 bytes as ids 3..258 (offline, fixed), or a byte-level BPE trained on the file
    itself to the model's vocabulary size (offline, deterministic)."""
    token_dtype: TokenDtype = "uint16"
    """tokens source: element type of the flat token-id file (memory-mapped)."""
    batch_size: int = 4
    """Sequences per data-parallel rank per step."""
    seq_len: int = 128
    """Tokens per sequence."""
    num_workers: int = 0
    """DataLoader worker processes."""
    pin_memory: bool = True
    """Page-locked host batches (CUDA only) for asynchronous copies."""
    persistent_workers: bool = False
    """Keep DataLoader workers alive between epochs."""
    prefetch_factor: int = 2
    """Batches prefetched per worker (with num_workers > 0)."""
    drop_last: bool = True
    """Drop the last incomplete batch."""

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "data.batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.seq_len >= 2, "data.seq_len", f"must be >= 2, got {self.seq_len}")
        require(self.num_workers >= 0, "data.num_workers", "must be >= 0")
        require(self.prefetch_factor >= 1, "data.prefetch_factor", "must be >= 1")
        require(self.source == "synthetic" or bool(self.path), "data.path", f"is required for source {self.source!r}")
        require(self.source in typing.get_args(DataSource), "data.source", f"unknown source {self.source!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    fused: bool = True
    """Fused AdamW kernel (CUDA; ignored on CPU)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
    accumulation_steps: int = 1
    """Micro-batches (of data.batch_size sequences each) accumulated per optimizer step; gradients are
    synchronized on the last one only, and each micro-batch's loss is scaled by 1 / accumulation_steps."""

    def __post_init__(self) -> None:
        require(self.accumulation_steps >= 1, "optim.accumulation_steps",
                f"must be >= 1, got {self.accumulation_steps}")
        require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class PerformanceConfig:
    device: Device = "auto"
    """cuda when available, else cpu."""
    precision: Precision = "bf16"
    """bf16 autocast on CUDA; fp32 always on CPU (bf16 CPU matmuls are slow and change numerics)."""
    tf32: bool = True
    """torch.set_float32_matmul_precision('high') on CUDA."""
    compile: CompileMode = "none"
    """torch.compile mode, applied per decoder block (regional compilation)."""
    compile_backend: str = "inductor"
    """torch.compile backend: inductor (generates kernels), or e.g. eager / aot_eager (Dynamo capture only:
    graphs, breaks and recompiles are the same, compile time is far shorter; what fast CPU tests use)."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute activations in backward: every block (full) or every other block (selective)."""
    alloc_conf: str = ""
    """PYTORCH_ALLOC_CONF for every rank, e.g. expandable_segments:True."""
    fast_experts: bool = True
    """Routed experts as grouped GEMMs over device-side offsets (no host sync; compiles as one graph)."""
    fused_loss: bool = True
    """Chunked LM-head + cross-entropy that never materializes the whole batch's logits."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the fused loss."""

    def __post_init__(self) -> None:
        require(self.device in typing.get_args(Device), "performance.device", f"unknown device {self.device!r}")
        require(self.precision in typing.get_args(Precision), "performance.precision",
                 f"must be fp32 or bf16, got {self.precision!r}")
        require(self.compile in typing.get_args(CompileMode), "performance.compile",
                 f"must be one of {typing.get_args(CompileMode)}, got {self.compile!r}")
        require(self.activation_checkpointing in typing.get_args(ActivationCheckpointing),
                 "performance.activation_checkpointing", f"unknown value {self.activation_checkpointing!r}")
        require(self.loss_chunk_tokens >= 1, "performance.loss_chunk_tokens", "must be >= 1")
        require(bool(self.compile_backend), "performance.compile_backend", "must not be empty")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 0
    """Save a distributed checkpoint every N steps (0: never periodically)."""
    at_exit: bool = False
    """Save when training ends or is preempted."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory when one exists."""

    def __post_init__(self) -> None:
        require(self.every >= 0, "checkpoint.every", f"must be >= 0, got {self.every}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ObservabilityConfig:
    """What each rank records besides traces and step metrics."""

    clock_round_trips: int = 16
    """Round trips to rank 0 when measuring this rank's clock offset at startup (0: skip)."""
    mllog: bool = False
    """Also print MLPerf-style `:::MLLOG` lines (every rank) with the per-step time breakdown."""
    memory_snapshot_step: int = -1
    """CUDA: record allocator history and dump a snapshot after this step (-1: never)."""
    memory_snapshot_on_oom: bool = False
    """CUDA: record allocator history and dump a snapshot when a step runs out of memory."""
    memory_history_entries: int = 100_000
    """Allocation events kept in the history ring buffer."""
    step_timeline: bool = True
    """Append one 32-byte record a step to metrics/rank<R>.timeline (traces/timeline.py), the whole-run section's
    input. Off only to measure what it costs (bench/timeline_gpu_overhead.py): the report then has no whole run."""
    moe_records: bool = True
    """Count, on the device, the tokens routed to each expert and the all-to-all split matrix of every MoE
    layer every step; written to metrics/rank<R>.moe.jsonl at each profiler window's end, every
    `moe_flush_steps` steps and at the end of the run."""
    moe_flush_steps: int = 100
    """Steps kept on the device before the MoE records are copied to the host and written (bounds memory)."""
    flight_recorder_entries: int = 2000
    """PyTorch Flight Recorder ring buffer per rank (TORCH_FR_BUFFER_SIZE, gloo and NCCL; set
    before the process group starts unless already in the environment); 0: off."""
    hang_timeout_s: float = 600.0
    """A rank that completes no step for this long dumps its Flight Recorder, asks every rank to dump, and
    stops the job (trainer/hang.py); 0: no hang detector."""
    hang_grace_s: float = 15.0
    """After a hang is detected, how long a rank waits for the other ranks' dumps before it exits."""

    def __post_init__(self) -> None:
        require(self.clock_round_trips >= 0, "observability.clock_round_trips", "must be >= 0")
        require(self.flight_recorder_entries >= 0, "observability.flight_recorder_entries", "must be >= 0")
        require(self.hang_timeout_s >= 0, "observability.hang_timeout_s", "must be >= 0")
        require(self.hang_grace_s >= 0, "observability.hang_grace_s", "must be >= 0")
        require(self.memory_snapshot_step >= -1, "observability.memory_snapshot_step", "must be >= -1")
        require(self.memory_history_entries >= 1, "observability.memory_history_entries", "must be >= 1")
        require(self.moe_flush_steps >= 1, "observability.moe_flush_steps", f"must be >= 1, got {self.moe_flush_steps}")

    @property
    def records_memory(self) -> bool:
        return self.memory_snapshot_step >= 0 or self.memory_snapshot_on_oom


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultConfig:
    """Deliberate faults, to rehearse what a slow or broken job looks like in the report."""

    crash_rank: int = -1
    """Rank that raises an error at `crash_step`; -1: none."""
    crash_step: int = 0
    """Step at which `crash_rank` fails."""
    straggle_rank: int = -1
    """Rank that sleeps `straggle_ms` at the start of every step's forward phase (its first micro-batch's, inside
    the forward span and range, never the data span); -1: none."""
    straggle_ms: float = 0.0
    """Delay of the straggling rank, per step."""
    signal_rank: int = -1
    """Rank that sends itself SIGUSR1 (a scheduler's preemption notice) at `signal_step`; -1: none."""
    signal_step: int = 0
    """Step at which `signal_rank` is signalled."""
    data_delay_rank: int = -1
    """Rank whose data loading sleeps `data_delay_ms` per batch, inside the DataLoader's fetch (so the step's
    data_ms and the trace's DataLoader span show it); -1: none."""
    data_delay_ms: float = 0.0
    """Delay per batch of `data_delay_rank`'s data loading."""
    sync_per_layer: bool = False
    """Force one host sync per decoder layer in forward: `.item()` of a scalar computed from the layer's output
    (one real `aten::_local_scalar_dense` per layer per forward), on every rank."""
    leak_mb_per_step: float = 0.0
    """Keep this many MiB of new tensors alive per step on the device in use, on every rank (0: off)."""
    graph_break: bool = False
    """Force a graph break inside every compiled decoder block (needs performance.compile)."""
    slow_phase: SlowPhase = "none"
    """Phase whose record_function range gets an extra `slow_phase_ms` of host sleep: forward, backward or
    optimizer_step (none: off)."""
    slow_phase_ms: float = 0.0
    """Delay added inside `slow_phase`, per step."""
    slow_phase_rank: int = -1
    """Rank that gets the slow phase; -1: every rank."""
    hot_expert: int = -1
    """Routed expert (global id) whose router logit gets `hot_expert_bias` added in every MoE layer on every
    rank, so that it draws far more tokens than the others; -1: none."""
    hot_expert_bias: float = 4.0
    """Logit added to `hot_expert` (natural-log units: +4 multiplies its softmax odds by e^4, about 55)."""
    expert_skew: float = 0.0
    """Zipf-like load skew: expert e's router logit gets -expert_skew * ln(e + 1) added, so softmax router
    probabilities scale like (e + 1)^-expert_skew before top-k; 0: off."""
    slow_from_step: int = -1
    """The straggle fault (straggle_rank, straggle_ms) starts at this step; -1: from the first step."""
    slow_until_step: int = -1
    """The straggle fault stops before this step (the rank recovers: steps slow_from_step..slow_until_step - 1
    are slow); -1: to the end. A slowdown with a known start and end is ground truth for change points."""
    hang_rank: int = -1
    """Rank that blocks forever before its step's collectives at `hang_step` (a hang to detect); -1: none."""
    hang_step: int = 0
    """Step at which `hang_rank` blocks."""
    slow_stage: int = -1
    """Pipeline stage (parallel.pp > 1) whose every micro-batch forward sleeps `slow_stage_ms`; -1: none."""
    slow_stage_ms: float = 0.0
    """Delay per micro-batch forward of `slow_stage`."""
    stage_work_ms: float = 0.0
    """Sleep in every micro-batch forward and every micro-batch backward of every pipeline stage (parallel.pp > 1),
    standing in for the device work a GPU stage runs while its host waits (0: off). On CPU the stages' own compute
    shares the cores, and a sleeping stage (slow_stage) hands its core to the others, which then run faster than
    in the job without it; a stage's work large beside its CPU compute keeps each stage's time its own, as on
    GPUs: ground truth for the pipeline what-if."""

    def __post_init__(self) -> None:
        require(self.crash_step >= 0, "faults.crash_step", "must be >= 0")
        require(self.straggle_ms >= 0, "faults.straggle_ms", "must be >= 0")
        require(self.signal_step >= 0, "faults.signal_step", "must be >= 0")
        require(self.data_delay_ms >= 0, "faults.data_delay_ms", f"must be >= 0, got {self.data_delay_ms}")
        require(self.data_delay_rank >= -1, "faults.data_delay_rank", f"must be >= -1, got {self.data_delay_rank}")
        require(self.leak_mb_per_step >= 0, "faults.leak_mb_per_step", f"must be >= 0, got {self.leak_mb_per_step}")
        require(self.slow_phase in typing.get_args(SlowPhase), "faults.slow_phase",
                 f"must be one of {typing.get_args(SlowPhase)}, got {self.slow_phase!r}")
        require(self.slow_phase_ms >= 0, "faults.slow_phase_ms", f"must be >= 0, got {self.slow_phase_ms}")
        require(self.slow_phase_rank >= -1, "faults.slow_phase_rank", f"must be >= -1, got {self.slow_phase_rank}")
        require(self.slow_from_step >= -1, "faults.slow_from_step", f"must be >= -1, got {self.slow_from_step}")
        require(self.slow_until_step == -1 or self.slow_until_step > max(self.slow_from_step, 0),
                "faults.slow_until_step",
                f"must be -1 (to the end) or > faults.slow_from_step ({self.slow_from_step}) and > 0, "
                f"got {self.slow_until_step}")
        require(self.hang_step >= 0, "faults.hang_step", f"must be >= 0, got {self.hang_step}")
        require(self.slow_stage >= -1, "faults.slow_stage", f"must be >= -1, got {self.slow_stage}")
        require(self.slow_stage_ms >= 0, "faults.slow_stage_ms", f"must be >= 0, got {self.slow_stage_ms}")
        require(math.isfinite(self.stage_work_ms) and self.stage_work_ms >= 0, "faults.stage_work_ms",
                f"must be finite and >= 0, got {self.stage_work_ms}")
        require(self.slow_phase == "none" or self.slow_phase_ms > 0, "faults.slow_phase_ms",
                 f"must be > 0 when faults.slow_phase is {self.slow_phase!r}")
        require(self.hot_expert >= -1, "faults.hot_expert", f"must be >= -1, got {self.hot_expert}")
        require(self.hot_expert_bias > 0, "faults.hot_expert_bias", f"must be > 0, got {self.hot_expert_bias}")
        require(self.expert_skew >= 0, "faults.expert_skew", f"must be >= 0, got {self.expert_skew}")

    @property
    def biases_router(self) -> bool:
        """Whether a fault adds to the router logits (hot_expert or expert_skew)."""
        return self.hot_expert >= 0 or self.expert_skew > 0

    def data_delay_for(self, rank: int) -> float:
        """ms of injected data-loading delay per batch on `rank`."""
        return self.data_delay_ms if rank == self.data_delay_rank else 0.0

    def straggles(self, rank: int, step: int) -> bool:
        """Whether the straggle fault delays `rank` at `step`."""
        return (rank == self.straggle_rank and self.straggle_ms > 0 and step >= self.slow_from_step
                and (self.slow_until_step == -1 or step < self.slow_until_step))

    def slow_phase_delay(self, phase: str, rank: int) -> float:
        """ms of injected delay inside `phase` on `rank`."""
        hit = self.slow_phase == phase and self.slow_phase_rank in (-1, rank)
        return self.slow_phase_ms if hit else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    run_dir: str
    """Run directory on shared storage (traces, metrics, clock, checkpoints go there)."""
    steps: int = 10
    """Training steps (in total, counting steps done before a resume)."""
    seed: int = 0
    """Seed for weights and synthetic data (same on every rank, so step-0 losses compare)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    profiler: ProfilerSchedule = field(default_factory=ProfilerSchedule)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        require(bool(self.run_dir), "run_dir", "must not be empty")
        require(not (self.observability.records_memory and self.performance.device == "cpu"),
                 "observability.memory_snapshot_step", "memory snapshots record the CUDA allocator; device is cpu")
        cuda_graphs = self.performance.compile in ("reduce-overhead", "max-autotune")
        require(not (cuda_graphs and self.parallel.mode in ("fsdp", "fsdp_tp")), "performance.compile",
                 f"{self.performance.compile!r} records CUDA graphs, which need fixed parameter addresses; "
                 "FSDP re-gathers parameters every step: use max-autotune-no-cudagraphs or default")
        require(not (cuda_graphs and self.parallel.ep > 1), "performance.compile",
                 f"{self.performance.compile!r} records CUDA graphs; expert parallelism copies the all-to-all split "
                 "sizes to the host every MoE layer, which no graph can replay: use default or "
                 "max-autotune-no-cudagraphs")
        require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        require(not (self.faults.graph_break and self.performance.compile == "none"), "faults.graph_break",
                 "breaks a compiled region; performance.compile is none")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        require(not (self.faults.biases_router and self.parallel.tp > 1 and self.parallel.ep == 1),
                "faults.hot_expert",
                "the router faults (hot_expert, expert_skew) need the trainer's MoE layers, which tensor-parallel "
                "runs without expert parallelism (parallel.tp > 1, parallel.ep = 1) keep as transformers built them")
        require(self.parallel.ep == 1 or not (self.checkpoint.every or self.checkpoint.at_exit), "checkpoint.every",
                "checkpoints of expert-parallel runs are not supported: every rank holds different experts under "
                "the same parameter names (set parallel.ep=1, or checkpoint.every=0 and checkpoint.at_exit=false)")
        require(self.parallel.ep == 1 or not (self.parallel.pp > 1 or self.parallel.dp_replicate > 1), "parallel.ep",
                "expert parallelism composes with DDP, FSDP2 and FSDP2 x TP without pipeline or HSDP axes only "
                "(parallel.pp=1, parallel.dp_replicate=1)")
        self._check_load_balance()
        self._check_pipeline()

    def _check_load_balance(self) -> None:
        """The balancing loss and the bias update need the trainer's MoE layers (trainer/expert_parallel.py)
        on every router."""
        for name in ("router_aux_loss_coef", "router_bias_update_rate"):
            if getattr(self.model, name) == 0:
                continue
            require(self.parallel.pp == 1, f"model.{name}",
                    "load balancing is not supported with pipeline parallelism (parallel.pp > 1): the pipeline "
                    "stages run the routers as transformers built them")
            require(not (self.parallel.tp > 1 and self.parallel.ep == 1), f"model.{name}",
                    "load balancing needs the trainer's MoE layers, which tensor-parallel runs without "
                    "expert parallelism (parallel.tp > 1, parallel.ep = 1) keep as transformers built them")

    def _check_pipeline(self) -> None:
        parallel = self.parallel
        stages = parallel.pp * parallel.stages_per_rank
        require(self.faults.slow_stage < stages, "faults.slow_stage",
                f"{self.faults.slow_stage} is not a pipeline stage (there are {stages})")
        if parallel.pp == 1:
            require(self.faults.stage_work_ms == 0, "faults.stage_work_ms",
                    "is per pipeline micro-batch: it needs parallel.pp > 1")
            return
        require(not (self.checkpoint.every or self.checkpoint.at_exit), "checkpoint.every",
                "checkpoints of pipeline stages are not supported (parallel.pp > 1)")
        require(self.optim.accumulation_steps == 1, "optim.accumulation_steps",
                "the pipeline schedule accumulates over parallel.pp_microbatches already; keep it 1 with pp > 1")
        require(self.data.batch_size % parallel.pp_microbatches == 0, "parallel.pp_microbatches",
                f"{parallel.pp_microbatches} does not divide data.batch_size {self.data.batch_size}")
        require(self.performance.compile == "none", "performance.compile", "is not supported with parallel.pp > 1")


# --- `section.field=value` overrides -------------------------------------------------------


def apply_overrides(config: Any, assignments: list[str]) -> Any:
    """Return `config` with `a.b=value` assignments applied (values parsed by field type).

    All assignments are applied together, so their order never matters for validation
    (`parallel.tp=2` and `parallel.mode=tp` in either order); a later one wins on the same key.
    """
    updates: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key = key.strip()
        require(bool(sep) and bool(key), assignment, "expected section.field=value")
        path = key.split(".")
        hint = _field_type(type(config), path, key)
        _nested_set(updates, path, parse_value(text.strip(), hint, key))
    return _replace_nested(config, updates)


def _field_type(cls: type, path: list[str], key: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if path[0] not in names:
        close = difflib.get_close_matches(path[0], names, n=1)
        parents = key.split(".")[:-len(path)]
        hint = f"did you mean {'.'.join([*parents, close[0], *path[1:]])}? " if close else ""
        raise ConfigError(f"{key}: unknown setting; {hint}known here: {', '.join(sorted(names))} "
                          "(`fleetscope config` lists every field)")
    hint = hints[path[0]]
    is_section = dataclasses.is_dataclass(hint)
    if len(path) == 1:
        require(not is_section, key, "is a section; set one of its fields")
        return hint
    require(is_section, key, f"{path[0]} is not a section")
    return _field_type(hint, path[1:], key)


def _nested_set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def _replace_nested(config: Any, updates: dict[str, Any]) -> Any:
    changes = {
        name: _replace_nested(getattr(config, name), value) if isinstance(value, dict) else value
        for name, value in updates.items()
    }
    return dataclasses.replace(config, **changes)


def overrides_from_defaults(config: Any, *, skip: frozenset[str] = frozenset(), prefix: str = "") -> list[str]:
    """The `a.b=value` assignments that turn a default config into `config` (round-trips with apply)."""
    assignments = []
    for spec in dataclasses.fields(config):
        name = f"{prefix}{spec.name}"
        value = getattr(config, spec.name)
        if name in skip:
            continue
        if dataclasses.is_dataclass(value):
            assignments += overrides_from_defaults(value, skip=skip, prefix=f"{name}.")
        elif spec.default is dataclasses.MISSING or value != spec.default:
            assignments.append(f"{name}={format_value(value)}")
    return assignments


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_value(text: str, hint: Any, key: str) -> Any:
    """Parse `text` as the annotated type (bool, int, float, str, Literal, optional)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        require(text in choices, key, f"must be one of {choices}, got {text!r}")
        return text
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() in ("none", "null", ""):
            return None
        return parse_value(text, options[0], key)
    if hint is bool:
        lowered = text.lower()
        require(lowered in ("true", "false", "1", "0", "yes", "no"), key, f"expected true/false, got {text!r}")
        return lowered in ("true", "1", "yes")
    if hint in (int, float):
        try:
            value = hint(text)
        except ValueError:
            raise ConfigError(f"{key}: expected {hint.__name__}, got {text[:40]!r}") from None
        require(hint is int or math.isfinite(value), key, f"expected a finite number, got {text[:40]!r}")
        return value
    return text


# --- command line of `python -m fleetscope.trainer` (and of `fleetscope launch`) -----------

TRAIN_SHORTCUTS: dict[str, tuple[str, str]] = {
    "model": ("model.family", "mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, gpt_oss"),
    "preset": ("model.preset", "tiny, small, medium"),
    "parallel": ("parallel.mode", "ddp, fsdp, tp, fsdp_tp"),
    "tp": ("parallel.tp", "tensor-parallel degree"),
    "batch_size": ("data.batch_size", "sequences per data-parallel rank"),
    "seq_len": ("data.seq_len", "tokens per sequence"),
    "device": ("performance.device", "auto, cpu, cuda"),
    "compile": ("performance.compile", "none, default, reduce-overhead, max-autotune, ..."),
}


def add_train_arguments(parser: Any) -> None:
    """The training flags: a few shortcuts, --profile, and --set for any field."""
    defaults = TrainConfig(run_dir="-")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help=f"how many training steps to run (a count; default: {defaults.steps})")
    for flag, (key, choices) in TRAIN_SHORTCUTS.items():
        default = format_value(config_value(defaults, key))
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, default=None,
                            help=f"{choices} ({key}; default: {default})")
    parser.add_argument("--profile", default=None, metavar="wait=1,warmup=1,active=2,repeat=1",
                        help="profiler schedule fields, comma separated; 'off' disables profiling (default: "
                             f"wait={defaults.profiler.wait},warmup={defaults.profiler.warmup},"
                             f"active={defaults.profiler.active},repeat={defaults.profiler.repeat})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="any config field, e.g. --set performance.compile=default (repeatable; "
                             "`fleetscope config` lists them all; default: none)")


def config_value(config: Any, key: str) -> Any:
    """The value of a dotted field, e.g. `parallel.tp`."""
    for name in key.split("."):
        config = getattr(config, name)
    return config


def train_assignments(args: Any) -> list[str]:
    """Assignments from parsed training flags: shortcuts, then --profile, then --set in order."""
    assignments = [f"steps={args.steps}"] if args.steps is not None else []
    assignments += [f"{key}={getattr(args, flag)}" for flag, (key, _) in TRAIN_SHORTCUTS.items()
                    if getattr(args, flag) is not None]
    assignments += profile_assignments(args.profile) if args.profile else []
    return assignments + list(args.overrides)


def build_arg_parser() -> "argparse.ArgumentParser":
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fleetscope.trainer",
        description="One rank of a fleetscope training run (started by torchrun or srun).",
    )
    parser.add_argument("--run-dir", required=True, help="run directory on shared storage")
    add_train_arguments(parser)
    return parser


def profile_assignments(text: str) -> list[str]:
    """`wait=1,active=3` -> profiler.* assignments; `off` disables profiling."""
    if text.strip().lower() in ("off", "none", "false"):
        return ["profiler.enabled=false"]
    return [f"profiler.{part.strip()}" for part in text.split(",") if part.strip()]


def parse_train_args(argv: list[str]) -> TrainConfig:
    args = build_arg_parser().parse_args(argv)
    return apply_overrides(TrainConfig(run_dir=args.run_dir), train_assignments(args))


def train_argv(config: TrainConfig) -> list[str]:
    """The trainer arguments that reproduce `config` exactly (what launchers put on the command line)."""
    argv = ["--run-dir", config.run_dir, "--steps", str(config.steps)]
    for assignment in overrides_from_defaults(config, skip=frozenset({"run_dir", "steps"})):
        argv += ["--set", assignment]
    return argv
