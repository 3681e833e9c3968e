"""Pipeline parallel: the decoder stack split into stages, run by a `torch.distributed.pipelining` schedule.

Stages are built by hand from the whole (seeded, identical on every rank) causal LM: each stage keeps
the transformers base model with only its slice of decoder blocks, so the family's own forward still
builds the causal / sliding-window masks, position ids and rotary embeddings for the blocks it holds.
The first stage keeps the token embedding and takes token ids; later stages take the previous stage's
hidden states as `inputs_embeds`; the last stage keeps the final norm and the LM head and returns
logits, whose next-token cross-entropy is the schedule's loss function (mean per micro-batch; the
schedule divides gradients by the number of micro-batches, so a step's gradient is the batch mean).

Data parallelism composes over the `dp` ranks of each stage: `parallelize` wraps every stage module
(FSDP2, HSDP or DDP), and the schedule's stage runs the DDP / FSDP gradient sync on the last
micro-batch only. Tensor parallelism inside a stage is not supported (config refuses pp x tp).

Every stage forward / backward of a micro-batch is a `pp_forward` / `pp_backward` range holding a
`microbatch[<i>]` range (traces.formats), outside which the schedule's send / recv ops run.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)
from torch.profiler import record_function

from ..traces.formats import (INJECTED_SLOW_STAGE, INJECTED_STAGE_WORK, PP_BACKWARD, PP_FORWARD, microbatch_range,
                              p2p_marker, schedule_marker)
from .config import ConfigError, FaultConfig, TrainConfig
from .fast_moe import install_fast_experts
from .faults import install_layer_faults
from .flops import FlopModel, flop_model
from .loss import IGNORE_INDEX, shift_labels
from .models import build_model, decoder_layers
from .parallel import ParallelDims, parallelize

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Decoder blocks of each stage: contiguous, as even as possible, earlier stages take the remainder."""
    if num_layers < num_stages:
        raise ConfigError(f"parallel.pp: {num_stages} pipeline stages need at least as many decoder blocks; "
                          f"the model has {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        count = base + (stage < extra)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stage indices held by pipeline rank `pp_rank`: itself, plus `pp` apart when interleaved (round-robin)."""
    return [pp_rank + loop * pp for loop in range(stages_per_rank)]


class StageModule(torch.nn.Module):
    """One pipeline stage of a causal LM. `causal_lm` is the pruned transformers model (so decoder_layers,
    activation checkpointing and FSDP wrapping find its blocks); first stage: token ids in; last: logits out."""

    def __init__(self, causal_lm: torch.nn.Module, *, first: bool, last: bool):
        super().__init__()
        self.causal_lm = causal_lm
        self.first = first
        self.last = last

    @property
    def config(self):
        return self.causal_lm.config

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        base = self.causal_lm.model
        if self.first:
            hidden_BSD = base(input_ids=inputs, use_cache=False).last_hidden_state
        else:
            hidden_BSD = base(inputs_embeds=inputs, use_cache=False).last_hidden_state
        return self.causal_lm.lm_head(hidden_BSD) if self.last else hidden_BSD


def carve_stage(causal_lm: torch.nn.Module, layers: range, *, first: bool, last: bool) -> StageModule:
    """A copy of `causal_lm` holding only the blocks in `layers` (and the embedding / head by position).

    The copy's config says how many blocks it holds and their layer types, which is what the family's
    forward reads when it picks each block's mask."""
    stage_lm = copy.deepcopy(causal_lm)
    base = stage_lm.model
    config = copy.copy(stage_lm.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    base.config = config
    base.layers = torch.nn.ModuleList(base.layers[i] for i in layers)
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = torch.nn.Identity()
        stage_lm.lm_head = None
    return StageModule(stage_lm, first=first, last=last)


def next_token_loss(logits_BSV: torch.Tensor, input_ids_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (fp32), as transformers' causal-LM loss."""
    labels_N = shift_labels(input_ids_BS).reshape(-1)
    return torch.nn.functional.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), labels_N,
                                             ignore_index=IGNORE_INDEX)


class TracedStage(PipelineStage):
    """A PipelineStage whose compute per micro-batch is marked in the trace (and, for the
    faults.slow_stage drill, slowed; for faults.stage_work_ms, given work of its own in every forward and
    backward)."""

    def __init__(self, *args, slow_ms: float = 0.0, work_ms: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow_ms = slow_ms
        self.work_ms = work_ms

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        with record_function(PP_FORWARD), record_function(microbatch_range(fwd_chunk_id)):
            _sleep(INJECTED_STAGE_WORK, self.work_ms)
            _sleep(INJECTED_SLOW_STAGE, self.slow_ms)
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        with record_function(PP_BACKWARD), record_function(microbatch_range(bwd_chunk_id)):
            _sleep(INJECTED_STAGE_WORK, self.work_ms)
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    # The schedule issues the ops these return right away: a marker per op names its peer and micro-batch.
    def get_fwd_recv_ops(self, fwd_chunk_id):
        return _marked(super().get_fwd_recv_ops(fwd_chunk_id), "recv", "forward", fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id):
        return _marked(super().get_fwd_send_ops(fwd_chunk_id), "send", "forward", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return _marked(super().get_bwd_recv_ops(bwd_chunk_id), "recv", "backward", bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id):
        return _marked(super().get_bwd_send_ops(bwd_chunk_id), "send", "backward", bwd_chunk_id)


def _sleep(range_name: str, ms: float) -> None:
    """A host sleep of `ms` inside its own trace range (none when `ms` is 0)."""
    if ms > 0:
        with record_function(range_name):
            time.sleep(ms / 1e3)


def _marked(ops: list, kind: str, direction: str, microbatch: int) -> list:
    for op in ops:
        with record_function(p2p_marker(kind, direction, microbatch, op.peer)):
            pass
    return ops


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    stages: list[TracedStage]
    modules: torch.nn.ModuleList
    """The (data-parallel wrapped) stage modules: what the optimizer and gradient clipping see."""
    schedule: object
    group: dist.ProcessGroup
    """The pipeline process group (one rank per stage position)."""
    last_stage_rank: int
    """Global rank that holds the last stage (and so the loss)."""
    vocab_size: int
    flops: FlopModel
    schedule_name: str = "1f1b"
    """parallel.pp_schedule"""
    microbatches: int = 1
    """parallel.pp_microbatches"""
    _losses: list[torch.Tensor] = field(default_factory=list)
    _device: torch.device = torch.device("cpu")

    @property
    def first(self) -> bool:
        return self.stages[0].is_first

    @property
    def last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def schedule_step(self, input_ids: torch.Tensor) -> None:
        """Forward and backward of every micro-batch of `input_ids` (the first stage reads the tokens, the
        last the labels)."""
        self._losses: list[torch.Tensor] = []
        with record_function(schedule_marker(self.schedule_name, self.stages[0].num_stages,
                                             self.microbatches, [s.stage_index for s in self.stages])):
            pass
        kwargs = {"target": input_ids, "losses": self._losses} if self.last else {}
        args = (input_ids,) if self.first else ()
        self.schedule.step(*args, **kwargs)
        self._device = input_ids.device

    def agreed_loss(self) -> torch.Tensor:
        """The last step's mean micro-batch loss, broadcast from the last stage to every stage."""
        losses = self._losses
        loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros((), device=self._device)
        dist.broadcast(loss, src=self.last_stage_rank, group=self.group)
        return loss


def build_pipeline(config: TrainConfig, *, dims: ParallelDims, mesh: DeviceMesh, rank: int,
                   device: torch.device) -> Pipeline:
    """This rank's stages of the model, each parallelized over the data-parallel ranks, and the schedule."""
    parallel = config.parallel
    causal_lm = build_model(config.model, seed=config.seed).to(device)
    vocab_size, flops = causal_lm.config.vocab_size, flop_model(causal_lm)
    if config.performance.fast_experts:
        install_fast_experts(causal_lm)
    num_stages = dims.pp * parallel.stages_per_rank
    ranges = stage_layer_ranges(len(decoder_layers(causal_lm)), num_stages)
    group = mesh["pp"].get_group()
    stages, modules = [], []
    for index in rank_stages(dims.pp_rank(rank), dims.pp, parallel.stages_per_rank):
        module = carve_stage(causal_lm, ranges[index], first=index == 0, last=index == num_stages - 1)
        install_layer_faults(module, config.faults)
        module = parallelize(module, dims=dims, mesh=mesh, parallel=parallel, performance=config.performance,
                             device=device)
        modules.append(module)
        stages.append(TracedStage(module, index, num_stages, device, group=group,
                                  slow_ms=slow_stage_ms(config.faults, index),
                                  work_ms=config.faults.stage_work_ms))
    del causal_lm
    schedule_class = SCHEDULES[parallel.pp_schedule]
    stage_arg = stages if schedule_class is ScheduleInterleaved1F1B else stages[0]
    schedule = schedule_class(stage_arg, n_microbatches=parallel.pp_microbatches, loss_fn=next_token_loss)
    last_stage_rank = dist.get_global_rank(group, dims.pp - 1)
    return Pipeline(stages=stages, modules=torch.nn.ModuleList(modules), schedule=schedule, group=group,
                    last_stage_rank=last_stage_rank, vocab_size=vocab_size, flops=flops,
                    schedule_name=parallel.pp_schedule, microbatches=parallel.pp_microbatches)


def slow_stage_ms(faults: FaultConfig, stage_index: int) -> float:
    """ms of injected sleep per micro-batch forward of pipeline stage `stage_index`."""
    return faults.slow_stage_ms if faults.slow_stage == stage_index else 0.0


def global_grad_norm(local_norm: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole model's gradient norm from each stage's own: sqrt of the sum of squares over the stages."""
    squared = local_norm.detach().float() ** 2
    dist.all_reduce(squared, group=group)
    return squared.sqrt()
