"""The training loop of one rank: model, parallelism, optimizer, data, profiling, metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import signal
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..traces.formats import INJECTED_DELAY
from ..traces.layout import RunLayout
from ..traces.timeline import TimelineWriter
from .config import ConfigError, TrainConfig
from .data import build_loader, data_plan
from .expert_parallel import expert_parameter_names, install_moe_layers, moe_blocks
from .flops import FlopModel, flop_model, peak_tflops
from .load_balance import RouterBalance, RouterBiasUpdate
from .loss import CausalLMTrainingModule
from .comm_timing import (Clock, DdpCommTimer, ReduceScatterTimer, StepBuckets, TimedSpan,
                          install_reduce_scatter_stamps)
from .compile_record import CompileWatch
from .accumulation import gradient_sync, micro_step, take_micro_batches
from .capture import CaptureController
from .faults import MemoryLeak, injected_hang, install_layer_faults, slow_phase
from .hang import HangWatchdog
from .moe_stats import MoeStats
from .metrics import MemorySample, MetricsWriter, PhaseTimer, StepMemory, StepMetrics, StepPhaseMarks
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .models import build_model
from .observability import MemorySnapshots, mllog_line
from .preemption import LEVEL_NONE, LEVEL_NOTICE, StopReason, StopRequests
from .parallel import parallelize
from .pipeline_parallel import Pipeline, build_pipeline, global_grad_norm
from .profiling import PublishedTrace, Window, WindowedProfiler, plan_windows
from .runtime import Runtime

log = logging.getLogger("fleetscope.trainer")


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    vocab_size: int
    flops: FlopModel
    comm_timer: DdpCommTimer | None = None
    """Times DDP's gradient all-reduces (None: not DDP)."""
    leak: MemoryLeak | None = None
    """The faults.leak_mb_per_step fault (None: off)."""
    moe: MoeStats | None = None
    """Per-step MoE routing records (None: off or no MoE layer)."""
    expert_params: list[torch.nn.Parameter] = dataclasses.field(default_factory=list)
    """Expert-parallel experts' parameters: each rank holds a different slice (grad norm sums over ep)."""
    ep_group: object = None
    """The expert-parallel process group (None: no expert parallelism)."""
    pipeline: Pipeline | None = None
    """This rank's pipeline stages and schedule (None: parallel.pp is 1)."""
    router_bias: RouterBiasUpdate | None = None
    """The routers' bias update after every optimizer step (None: model.router_bias_update_rate is 0)."""
    reduce_scatters: ReduceScatterTimer | None = None
    """FSDP2's gradient reduce-scatters, timed (None: not FSDP2)."""
    step: int = 0


def build_state(config: TrainConfig, runtime: Runtime) -> TrainState:
    if runtime.dims.pp > 1:
        return build_pipeline_state(config, runtime)
    sharded = runtime.dims.tp > 1
    causal_lm = build_model(config.model, seed=config.seed).to(runtime.device)
    vocab_size = causal_lm.config.vocab_size
    flops = flop_model(causal_lm)
    # The fast paths work on whole (unsharded by tp) expert and LM-head weights; expert parallelism keeps the
    # routed experts whole under tp too.
    balance = RouterBalance(config.model.router_aux_loss_coef) if config.model.router_aux_loss_coef > 0 else None
    moe, router_bias = (None, None) if sharded and runtime.dims.ep == 1 else install_moe(causal_lm, config, runtime,
                                                                                         balance)
    model = CausalLMTrainingModule(causal_lm, fused_loss=config.performance.fused_loss and not sharded,
                                   chunk_tokens=config.performance.loss_chunk_tokens, balance=balance)
    install_layer_faults(model, config.faults)  # before compiling: the hooks must run inside the blocks
    model = parallelize(model, dims=runtime.dims, mesh=runtime.mesh, parallel=config.parallel,
                        performance=config.performance, device=runtime.device)
    comm_timer = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        comm_timer = DdpCommTimer(runtime.use_cuda)
        comm_timer.install(model, runtime.mesh["dp"].get_group())
    reduce_scatters = stamp_reduce_scatters(model, runtime)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay,
        fused=config.optim.fused and runtime.use_cuda,
    )
    leak = MemoryLeak(config.faults.leak_mb_per_step, runtime.device) if config.faults.leak_mb_per_step else None
    expert_names = set(expert_parameter_names(model))
    expert_params = [p for name, p in model.named_parameters() if name in expert_names]
    ep_group = runtime.mesh["ep"].get_group() if runtime.dims.ep > 1 else None
    return TrainState(model=model, optimizer=optimizer, vocab_size=vocab_size, flops=flops, comm_timer=comm_timer,
                      leak=leak, moe=moe, expert_params=expert_params, ep_group=ep_group, router_bias=router_bias,
                      reduce_scatters=reduce_scatters)


def stamp_reduce_scatters(model: torch.nn.Module, runtime: Runtime) -> ReduceScatterTimer | None:
    """Time FSDP2's gradient reduce-scatters (None: no FSDP2 module in `model`)."""
    if runtime.dims.mode not in ("fsdp", "fsdp_tp"):
        return None
    timer = ReduceScatterTimer(runtime.use_cuda)
    return timer if install_reduce_scatter_stamps(model, timer) else None


def install_moe(causal_lm: torch.nn.Module, config: TrainConfig, runtime: Runtime,
                balance: RouterBalance | None = None) -> tuple[MoeStats | None, RouterBiasUpdate | None]:
    """Ranges, routing records, router faults and the load-balancing terms on every MoE layer (grouped GEMMs
    where enabled); the record keeper (None when records are off or the model has no MoE layer) and the
    router-bias update (None: model.router_bias_update_rate is 0)."""
    blocks = moe_blocks(causal_lm)
    for name, value in (("router_aux_loss_coef", config.model.router_aux_loss_coef),
                        ("router_bias_update_rate", config.model.router_bias_update_rate)):
        if value and not blocks:
            raise ConfigError(f"model.{name}: {type(causal_lm).__name__} has no MoE block with a router the "
                              "trainer can balance")
    stats = None
    if config.observability.moe_records and blocks:
        dims = runtime.dims
        num_experts = int(blocks[0][1].experts.gate_up_proj.shape[0])
        stats = MoeStats(layers=[index for index, _ in blocks], num_experts=num_experts,
                         ep=dims.ep, ep_rank=dims.ep_rank(runtime.rank), ep_ranks=dims.ep_group_ranks(runtime.rank),
                         rank=runtime.rank,
                         path=RunLayout.at(config.run_dir).moe_file(runtime.rank),
                         flush_steps=config.observability.moe_flush_steps, device=runtime.device)
    _, router_bias = install_moe_layers(causal_lm, faults=config.faults, stats=stats,
                                        grouped=config.performance.fast_experts, device=runtime.device,
                                        expert_parallel=runtime.dims.ep > 1, balance=balance,
                                        bias_rate=config.model.router_bias_update_rate)
    return stats, router_bias


def build_pipeline_state(config: TrainConfig, runtime: Runtime) -> TrainState:
    pipeline = build_pipeline(config, dims=runtime.dims, mesh=runtime.mesh, rank=runtime.rank, device=runtime.device)
    optimizer = torch.optim.AdamW(pipeline.modules.parameters(), lr=config.optim.lr,
                                  weight_decay=config.optim.weight_decay, fused=config.optim.fused and runtime.use_cuda)
    leak = MemoryLeak(config.faults.leak_mb_per_step, runtime.device) if config.faults.leak_mb_per_step else None
    return TrainState(model=pipeline.modules, optimizer=optimizer, vocab_size=pipeline.vocab_size,
                      flops=pipeline.flops, leak=leak, pipeline=pipeline,
                      reduce_scatters=stamp_reduce_scatters(pipeline.modules, runtime))


def autocast_context(config: TrainConfig, runtime: Runtime) -> contextlib.AbstractContextManager:
    if runtime.use_cuda and config.performance.precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def phase(name: str, runtime: Runtime) -> Iterator[None]:
    """A named range in the trace (record_function) and, on CUDA, in NVTX."""
    with torch.profiler.record_function(name):
        if runtime.use_cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if runtime.use_cuda:
                torch.cuda.nvtx.range_pop()


def train_step(state: TrainState, batches: Iterator[torch.Tensor], config: TrainConfig, runtime: Runtime,
               timer: PhaseTimer) -> torch.Tensor:
    """One optimizer step over optim.accumulation_steps micro-batches; returns the mean loss (a tensor:
    reading it is the caller's sync point)."""
    timer.mark("data")
    count = config.optim.accumulation_steps
    micro_batches = [ids.to(runtime.device, non_blocking=True) for ids in take_micro_batches(batches, count)]
    inject_faults(state.step, config, runtime)
    if state.leak is not None:
        state.leak.step()
    with phase("train_step", runtime):
        if state.pipeline is not None:
            loss = pipeline_step(state.pipeline, micro_batches[0], config, runtime, timer, step=state.step)
        else:
            losses = []
            for index, input_ids in enumerate(micro_batches):
                with micro_step(index, count), gradient_sync(state.model, enabled=index == count - 1):
                    losses.append(forward_backward(state, input_ids, config, runtime, timer, scale=1.0 / count,
                                                   first=index == 0))
            loss = losses[0] if count == 1 else torch.stack(losses).mean()
        timer.mark("optimizer")
        with phase("optimizer_step", runtime):
            slow_phase("optimizer_step", config.faults, runtime.rank)
            if config.optim.grad_clip:
                clip_grad_norm(list(state.model.parameters()), config.optim.grad_clip,
                               expert_params=state.expert_params, ep_group=state.ep_group,
                               stage_group=state.pipeline.group if state.pipeline is not None else None)
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            if state.router_bias is not None:
                state.router_bias.update()
        timer.mark("end")
    return loss.detach()


def forward_backward(state: TrainState, input_ids: torch.Tensor, config: TrainConfig, runtime: Runtime,
                     timer: PhaseTimer, *, scale: float, first: bool = True) -> torch.Tensor:
    """Forward and backward of one micro-batch, its loss scaled by `scale` for the gradient; the unscaled loss.
    `first`: the step's first micro-batch (the straggle fault delays that one)."""
    timer.mark("forward")
    with phase("forward", runtime), autocast_context(config, runtime):
        if first:
            straggle(state.step, config.faults, runtime)
        slow_phase("forward", config.faults, runtime.rank)
        loss = state.model(input_ids)
    timer.mark("backward")
    with phase("backward", runtime):
        slow_phase("backward", config.faults, runtime.rank)
        (loss * scale if scale != 1.0 else loss).backward()
    return loss.detach()


def pipeline_step(pipeline: Pipeline, input_ids: torch.Tensor, config: TrainConfig, runtime: Runtime,
                  timer: PhaseTimer, *, step: int) -> torch.Tensor:
    """The pipeline schedule over this rank's batch: forward_ms holds the whole schedule (its forwards and
    backwards interleave), backward_ms the loss broadcast from the last stage."""
    timer.mark("forward")
    with phase("forward", runtime), autocast_context(config, runtime):
        straggle(step, config.faults, runtime)
        slow_phase("forward", config.faults, runtime.rank)
        pipeline.schedule_step(input_ids)
    timer.mark("backward")
    return pipeline.agreed_loss()


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, *,
                   expert_params: list[torch.nn.Parameter] = (), ep_group=None,
                   stage_group: "torch.distributed.ProcessGroup | None" = None) -> torch.Tensor:
    """Clip the global gradient norm without a host sync; any mix of plain and DTensor gradients.

    Gradients are normed in foreach groups: plain tensors, and DTensors per device mesh (FSDP x TP
    mixes 1-D and 2-D meshes); a DTensor norm is the whole tensor's after `full_tensor`. Expert-parallel
    experts' squared norms are summed over the ep group (each rank holds other experts), pipeline stages'
    over the stage group. Then every gradient is scaled by one device scalar.
    """
    experts = {id(p) for p in expert_params}
    shared = _grad_groups([p for p in parameters if id(p) not in experts])
    sharded = _grad_groups([p for p in parameters if id(p) in experts])
    if not shared and not expert_params and stage_group is None:
        return torch.zeros(())
    total_sq = _squared_norm(shared)
    if expert_params:  # every ep rank joins the all-reduce, with or without expert gradients
        expert_sq = _squared_norm(sharded)
        if expert_sq is None:
            expert_sq = torch.zeros((), device=expert_params[0].device)
        dist.all_reduce(expert_sq, group=ep_group)
        total_sq = expert_sq if total_sq is None else total_sq + expert_sq.to(total_sq.device)
    total = total_sq.sqrt() if total_sq is not None else torch.zeros(())
    if stage_group is not None:  # pipeline stages: the norm of the whole model's gradient
        total = global_grad_norm(total, stage_group)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in (*shared.values(), *sharded.values()):
        torch._foreach_mul_(group, scale.to(group[0].device))
    return total


def _grad_groups(parameters: list[torch.nn.Parameter]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            key = parameter.grad.device_mesh if isinstance(parameter.grad, DTensor) else None
            groups.setdefault(key, []).append(parameter.grad)
    return groups


def _squared_norm(groups: dict[object, list[torch.Tensor]]) -> torch.Tensor | None:
    if not groups:
        return None
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm
             for group in groups.values() for norm in torch._foreach_norm(group)]
    return torch.stack([n.float() for n in norms]).square().sum()


class InjectedFault(RuntimeError):
    """Raised by the crash drill (faults.crash_rank / crash_step)."""


def inject_faults(step: int, config: TrainConfig, runtime: Runtime) -> None:
    faults = config.faults
    if runtime.rank == faults.crash_rank and step == faults.crash_step:
        raise InjectedFault(f"injected crash on rank {runtime.rank} at step {step} (faults.crash_rank)")
    if runtime.rank == faults.signal_rank and step == faults.signal_step:
        os.kill(os.getpid(), signal.SIGUSR1)
    if runtime.rank == faults.hang_rank and step == faults.hang_step:
        injected_hang(runtime.rank, step)


def straggle(step: int, faults, runtime: Runtime) -> None:
    """The straggle fault (faults.straggle_*): a host-side delay inside the forward phase of the step's first
    micro-batch, so it lands in the part of the step it names (a slow rank's compute), never in its data span."""
    if faults.straggles(runtime.rank, step):
        with torch.profiler.record_function(INJECTED_DELAY):
            time.sleep(faults.straggle_ms / 1e3)


def step_metrics(step: int, loss: torch.Tensor, spans: dict[str, float], config: TrainConfig,
                 runtime: Runtime, state: TrainState, profiled: bool) -> StepMetrics:
    step_ms = sum(spans.values())
    tokens = config.data.batch_size * config.data.seq_len * config.optim.accumulation_steps / runtime.dims.pp
    peak = peak_tflops(runtime.device)
    achieved_tflops = state.flops.per_token(config.data.seq_len) * tokens / (step_ms / 1e3) / 1e12 if step_ms else 0.0
    return StepMetrics(
        step=step, rank=runtime.rank, loss=float(loss), step_time_ms=step_ms, data_ms=spans["data"],
        forward_ms=spans["forward"], backward_ms=spans["backward"], optimizer_ms=spans["optimizer"],
        tokens_per_s=tokens / (step_ms / 1e3) if step_ms > 0 else 0.0,
        profiled=profiled, tflops=achieved_tflops,
        mfu_pct=100.0 * achieved_tflops / peak if peak else None,
    )


@dataclass(frozen=True)
class PendingStep:
    """A launched step whose loss, timings and stop flag are read after the next step is launched."""

    step: int
    loss: torch.Tensor
    timing: StepPhaseMarks
    profiled: bool
    stop_flag: torch.Tensor | None
    memory: MemorySample = MemorySample()
    buckets: StepBuckets | None = None
    """The step's gradient collectives, timed: DDP's buckets or FSDP2's reduce-scatters (None: neither)."""
    first_collective: object | None = None
    """When the step's first gradient collective was issued, a point of the step timing's clock (DDP: the first
    bucket's all-reduce; FSDP2: the first reduce-scatter); None: no gradient collective noted."""
    agreement: TimedSpan | None = None
    """The stop-flag all-reduce after the step (None: none issued)."""
    compiled_frames: int | None = None
    leaked_mb: float | None = None

    def evidence(self) -> dict[str, object]:
        """The StepMetrics fields read from this step's memory, communication and compile bookkeeping."""
        comm = self.buckets.estimate() if self.buckets is not None else None
        return dict(
            max_memory_allocated_mb=self.memory.peak_allocated_mb, max_memory_reserved_mb=self.memory.peak_reserved_mb,
            alloc_retries=self.memory.alloc_retries, ooms=self.memory.ooms,
            comm_ms=comm.comm_ms if comm else None, comm_exposed_ms=comm.comm_exposed_ms if comm else None,
            comm_buckets=comm.buckets if comm else None, comm_mb=comm.total_mb if comm else None,
            comm_last_bucket_mb=comm.last_bucket_mb if comm else None,
            stop_agreement_ms=self.agreement.ms() if self.agreement is not None else None,
            compiled_frames=self.compiled_frames, fault_leaked_mb=self.leaked_mb,
        )

    def timeline_parts(self, metrics: StepMetrics) -> dict[str, float]:
        """The step's first_collective_ms and exposed_comm_ms for the timeline (NaN: not noted in this mode),
        each within [0, step time] (a point a little past the step's last mark is the step's end)."""
        first = self.timing.ms_since_start(self.first_collective) if self.first_collective is not None else math.nan
        exposed = metrics.comm_exposed_ms if metrics.comm_exposed_ms is not None else math.nan
        return {name: min(max(value, 0.0), metrics.step_time_ms) if not math.isnan(value) else value
                for name, value in (("first_collective_ms", first), ("exposed_comm_ms", exposed))}


class JobHung(Exception):
    """This rank failed while the job was being stopped for a hang (a peer's hang detector gave up)."""


class Preempted(Exception):
    """Every rank stopped at the same step on a scheduler's request, after saving a checkpoint."""

    def __init__(self, reason: StopReason):
        needs = "; the job must be requeued to resume" if reason.requeue_needed else ""
        super().__init__(f"stopped on {reason.signal_name} after {reason.steps_done} steps; checkpoint saved{needs}")
        self.reason = reason


class TrainingRun:
    """One rank's run: resume, the step loop, metrics, profiling windows, checkpoints, stop requests."""

    def __init__(self, config: TrainConfig, runtime: Runtime):
        self.config, self.runtime = config, runtime
        self.layout = RunLayout.at(config.run_dir)
        self.state = build_state(config, runtime)
        self._resume()
        windows = plan_windows(config.profiler, config.steps)
        self.profiled_steps = {s for w in windows for s in range(w.warmup_start, w.end)}
        self.profiler = WindowedProfiler(windows=windows, config=config.profiler, layout=self.layout,
                                         rank=runtime.rank, attempt=runtime.attempt,
                                         use_cuda=runtime.use_cuda, on_published=self._on_published)
        self.writer = MetricsWriter(self.layout.metrics_file(runtime.rank))
        self.timeline = (TimelineWriter(self.layout.timeline_file(runtime.rank), runtime.rank)
                         if config.observability.step_timeline else None)
        self.first_step = self.state.step
        """This process's first step (resumed runs start past 0): its timeline record is flagged first."""
        self.timer = PhaseTimer(runtime.use_cuda)
        self.stops = StopRequests(runtime.device)
        self.memory = MemorySnapshots(config.observability, self.layout, runtime.rank, runtime.use_cuda)
        self.step_memory = StepMemory(runtime.device)
        self.compile_watch = None
        if config.performance.compile != "none":
            self.compile_watch = CompileWatch(layout=self.layout, rank=runtime.rank, mode=config.performance.compile,
                                              backend=config.performance.compile_backend, use_cuda=runtime.use_cuda)
        self.clock = Clock(runtime.use_cuda)
        self._window_ended = False
        self.history: list[StepMetrics] = []
        self.capture = CaptureController(config=config, layout=self.layout, rank=runtime.rank,
                                         world_size=runtime.world_size, planned=windows, open_window=self._open_window)
        self.watchdog = HangWatchdog(config.observability, self.layout, runtime.rank, runtime.world_size).start()

    def _resume(self) -> None:
        found = latest_checkpoint(self.layout) if self.config.checkpoint.resume else None
        if found:
            self.state.step = load_checkpoint(found[1], model=self.state.model, optimizer=self.state.optimizer)

    def _batches(self) -> Iterator[torch.Tensor]:
        micro = self.config.optim.accumulation_steps  # the loader counts micro-batches
        plan = data_plan(self.config.data, vocab_size=self.state.vocab_size, seed=self.config.seed,
                              steps=self.config.steps * micro, dp_rank=self.runtime.dp_rank, dp_size=self.runtime.dims.dp)
        return iter(build_loader(self.config.data, plan=plan, start_step=self.state.step * micro,
                                 use_cuda=self.runtime.use_cuda,
                                 delay_ms=self.config.faults.data_delay_for(self.runtime.rank)))

    def run(self) -> list[StepMetrics]:
        batches = self._batches()
        pending = None
        try:
            for step in range(self.state.step, self.config.steps):
                self.step_memory.start_step()
                with self.profiler.step_context(step):
                    loss = self._step(batches)
                    if self.state.moe is not None:
                        self.state.moe.end_step(step)
                self.memory.after_step(step)
                self.watchdog.progress(step + 1)
                self.state.step = step + 1
                launched = self._launched(step, loss)
                # The previous step's GPU work is done or nearly so: reading it costs no stall.
                if pending is not None and (level := self._finish(pending)):
                    self._finish(launched)
                    self._stop_for_scheduler(level)
                self._maybe_save_periodic()
                pending = launched
            if pending is not None and (level := self._finish(pending)):
                self._stop_for_scheduler(level)
            self._maybe_save_at_exit()
        except BaseException as error:
            hung = isinstance(error, Exception) and not isinstance(error, Preempted) and self.watchdog.job_hung()
            self.watchdog.dump("stop_signal" if isinstance(error, Preempted) else "hang" if hung else "error")
            self.capture.close(self.state.step, None if isinstance(error, Preempted) else error)
            if hung:
                raise JobHung(f"stopped at step {self.state.step}: the job hung ({error})") from error
            raise
        else:
            self.capture.close(self.state.step, None)
        finally:
            self.watchdog.stop()
            self.profiler.close()
            self.writer.close()
            if self.timeline is not None:
                self.timeline.close()
            if self.state.moe is not None:
                self.state.moe.close()
            self.stops.restore()
            if self.compile_watch is not None:
                self.compile_watch.write(final=True)
        return self.history

    def _launched(self, step: int, loss: torch.Tensor) -> PendingStep:
        """The step just launched, with its bookkeeping taken now (host-side only: no device sync)."""
        timing, memory = self.timer.finish(), self.step_memory.finish_step()
        compiled = self.compile_watch.after_step(step) if self.compile_watch is not None else None
        if self.compile_watch is not None and self._window_ended:
            self.compile_watch.write(final=False)
        self._window_ended = False
        buckets = self.state.comm_timer.finish_step() if self.state.comm_timer is not None else None
        if self.state.reduce_scatters is not None:
            buckets = self.state.reduce_scatters.finish_step()
        first_collective = buckets.first_ready() if buckets is not None else None
        leaked = self.state.leak.kept_mb if self.state.leak is not None else None
        start = self.clock.now()
        flag = self._stop_flag(step)
        agreement = TimedSpan(self.clock, start, self.clock.now()) if flag is not None else None
        return PendingStep(step, loss, timing, step in self.profiled_steps, flag, memory=memory, buckets=buckets,
                           first_collective=first_collective, agreement=agreement, compiled_frames=compiled,
                           leaked_mb=leaked)

    def _step(self, batches: Iterator[torch.Tensor]) -> torch.Tensor:
        try:
            return train_step(self.state, batches, self.config, self.runtime, self.timer)
        except torch.OutOfMemoryError:
            self.memory.on_out_of_memory()
            raise

    def _stop_flag(self, step: int) -> torch.Tensor | None:
        """The stop-level agreement after `step`, carrying the capture votes (trainer/capture.py)."""
        if self.runtime.world_size > 1 or self.stops.requested_by or self.capture.active:
            return self.stops.agreed_flag(self.capture.votes(step))
        return None

    def _open_window(self, window: Window) -> None:
        """An unplanned window this rank records (trainer/capture.py agreed it with every rank)."""
        self.profiler.add_window(window)
        self.profiled_steps.update(range(window.warmup_start, window.end))

    def _finish(self, pending: PendingStep) -> float:
        """Record a step's metrics; the agreed stop level after it (preemption.py; 0: go on)."""
        metrics = dataclasses.replace(
            step_metrics(pending.step, pending.loss, pending.timing.durations_ms(), self.config, self.runtime,
                         self.state, pending.profiled), **pending.evidence())
        self.writer.write(metrics)
        if self.timeline is not None:
            self.timeline.append(step=pending.step, start_us=pending.timing.start_us, step_ms=metrics.step_time_ms,
                                 data_ms=metrics.data_ms, profiled=pending.profiled,
                                 first=pending.step == self.first_step, **pending.timeline_parts(metrics))
        self.capture.observe(metrics)
        self.history.append(metrics)
        _log_step(metrics, self.runtime)
        if self.config.observability.mllog:
            print_whole_line(mllog_line(metrics))
        if pending.stop_flag is None:
            return LEVEL_NONE
        level, *votes = pending.stop_flag.tolist()
        self.capture.agreed(pending.step, votes)
        return level

    def _on_published(self, trace: PublishedTrace) -> None:
        _log_published(trace)
        # The window's last step is not yet in the compile watch: the record is written once it is.
        self._window_ended = True
        if self.state.moe is not None:
            self.state.moe.flush()

    def _stop_for_scheduler(self, level: float) -> None:
        self._save(self.state.step)
        raise Preempted(StopReason(steps_done=self.state.step,
                                   signal_name=self.stops.requested_by or "another rank's signal",
                                   requeue_needed=level >= LEVEL_NOTICE))

    def _maybe_save_periodic(self) -> None:
        every = self.config.checkpoint.every
        if every and self.state.step % every == 0 and self.state.step < self.config.steps:
            self._save(self.state.step)

    def _maybe_save_at_exit(self) -> None:
        if self.config.checkpoint.at_exit or self.config.checkpoint.every:
            self._save(self.state.step)

    def _save(self, steps_done: int) -> None:
        save_checkpoint(self.layout, steps_done=steps_done, model=self.state.model, optimizer=self.state.optimizer)


def train(config: TrainConfig, runtime: Runtime) -> list[StepMetrics]:
    return TrainingRun(config, runtime).run()


def _log_step(metrics: StepMetrics, runtime: Runtime) -> None:
    if runtime.rank == 0:
        log.info("step %d loss %.4f step %.1f ms (fwd %.1f bwd %.1f opt %.1f) %.0f tok/s",
                 metrics.step, metrics.loss, metrics.step_time_ms, metrics.forward_ms, metrics.backward_ms,
                 metrics.optimizer_ms, metrics.tokens_per_s)


def _log_published(trace: PublishedTrace) -> None:
    log.info("trace of window %d (steps %d-%d) published: %s (%.2f s)", trace.window.index,
             trace.window.active_start, trace.window.end - 1, trace.path, trace.export_seconds)


def print_whole_line(text: str) -> None:
    """One line to stdout in one write: every rank shares the launcher's stdout, and a line split across
    writes (a full buffer) would interleave with another rank's line (lines < PIPE_BUF write atomically)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())
