"""MoE layers: named ranges, routing records and router faults on every MoE block, and expert parallelism.

Every supported family's MoE block routes first (`gate` or `router` -> top-k expert ids and weights) and
then calls `experts(hidden_TD, expert_TK, weight_TK)` with all experts' weights stacked on dim 0 of 3-D
parameters. `install_moe_layers` swaps the experts' forward for one in named phases (dispatch, experts,
combine) and wraps the router; `apply_expert_parallel` (called by `parallelize`) then keeps only this
rank's slice of the experts and makes dispatch and combine all-to-alls over the `ep` mesh axis:

    dispatch: sort token copies by global expert -> all-to-all of per-expert counts (even, ep x local
              experts) -> split sizes to the host (the one sync: all_to_all_single takes host lists) ->
              all-to-all of the rows over uneven splits
    experts:  received rows regrouped by local expert -> two grouped GEMMs over device-side offsets
    combine:  rows back to source order -> all-to-all back -> weighted sum into each token

Expert gradients: each rank's expert weights see the token copies of its whole ep group, so their
gradient is scaled by 1/ep in backward; the expert-data-parallel replicas (edp) then average it (FSDP2 on
the `edp` axis, or gradient hooks beside DDP), which together is the mean over all data-parallel ranks,
as for every other parameter. Shared experts are ordinary modules: replicated (or FSDP-sharded) like the
attention.

With tensor parallelism (mode fsdp_tp) the routed experts stay whole and out of the TP plan: every rank of
a TP group holds the same expert slice, and the group's ranks see the same (replicated) tokens. Rather than
dispatch them tp times, each TP rank dispatches its 1/tp share of the tokens (`split_for_tp`: forward
slices, backward all-gathers the share's gradients into the replicated gradient) and the combined outputs
are all-gathered over the TP group (`gather_from_tp`: backward keeps this rank's share of the replicated
gradient). The experts of one TP group then saw different tokens: their gradients are scaled by tp/ep and
FSDP2 averages them over the 2-D (edp, tp) mesh, which is again the mean over all data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..traces.formats import (MOE_COMBINE, MOE_DISPATCH, MOE_EXPERTS, MOE_ROUTER, MOE_SPLIT_SIZES_D2H,
                              moe_range)
from .config import ConfigError, FaultConfig
from .fast_moe import (RoutedTokens, combine_weighted, compute_dtype, expert_ffn, permute_by_expert,
                       supports_fast_experts, supports_grouped_ffn)
from .faults import router_logit_bias
from .load_balance import RouterBalance, RouterBiasUpdate, count_routed, router_term
from .models import decoder_layers
from .moe_stats import LayerCounter, MoeStats

MOE_LAYER_ATTRIBUTE = "_fleetscope_moe_layer"
"""Attribute of an experts module holding its MoeLayer (a plain Python object, not module state)."""
MOE_ROUTER_ATTRIBUTE = "_fleetscope_moe_router_of"
"""The same, on the layer's router."""


@dataclass(frozen=True)
class ExpertShard:
    """This rank's slice of one layer's experts and the group that holds the other slices."""

    group: dist.ProcessGroup
    ep: int
    ep_rank: int
    num_experts: int
    """Global expert count."""
    tp_group: dist.ProcessGroup | None = None
    """The tensor-parallel group whose ranks share this slice and split its tokens (None: no TP)."""
    tp: int = 1
    tp_rank: int = 0

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    @property
    def grad_scale(self) -> float:
        """Factor on the local experts' gradients that makes the replicas' average the data-parallel mean:
        1/ep for the ep group's token copies, x tp because each TP rank saw only its share of the tokens
        and the TP ranks' gradients are averaged, not summed."""
        return self.tp / self.ep


@dataclass
class MoeLayer:
    """One decoder layer's MoE block as the trainer runs it."""

    index: int
    num_experts: int
    grouped: bool
    """Experts run as grouped GEMMs in named phases (else: transformers' own experts forward, one range)."""
    counter: LayerCounter | None
    use_nvtx: bool = False
    logit_bias_E: torch.Tensor | None = None
    """What the router faults add to the router's logits (None: off)."""
    shard: ExpertShard | None = None
    """Set by apply_expert_parallel (None: every expert local)."""
    balance: RouterBalance | None = None
    """Where the router's load-balancing term goes (None: model.router_aux_loss_coef is 0, nothing computed)."""
    sigmoid_scores: bool = False
    """The router scores experts with a sigmoid (DeepSeek-V3: it has e_score_correction_bias), not a softmax."""
    bias_loads_E: torch.Tensor | None = None
    """This layer's row of the router-bias update's loads (None: model.router_bias_update_rate is 0)."""


@contextlib.contextmanager
def moe_phase(kind: str, layer: MoeLayer, use_nvtx: bool) -> Iterator[None]:
    """`moe/<kind>[layer L]` as a record_function range and, on CUDA, an NVTX range; nothing inside compiled
    code: every decoder block shares one code object, so a per-layer name there would make Dynamo
    specialize on the layer index and recompile the block once per layer (past its cache limit)."""
    if torch.compiler.is_compiling():
        yield
        return
    name = moe_range(kind, layer.index)
    with torch.profiler.record_function(name):
        if use_nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if use_nvtx:
                torch.cuda.nvtx.range_pop()


def moe_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, MoE block) of every decoder layer whose block has a router and experts with stacked weights."""
    found = []
    for index, layer in enumerate(decoder_layers(model)):
        for module in layer.modules():
            stacked = isinstance(getattr(getattr(module, "experts", None), "gate_up_proj", None), torch.Tensor)
            if stacked and _router_of(module) is not None:
                found.append((index, module))
                break
    return found


def _router_of(block: torch.nn.Module) -> torch.nn.Module | None:
    for name in ("gate", "router"):
        router = getattr(block, name, None)
        if isinstance(router, torch.nn.Module) and isinstance(getattr(router, "weight", None), torch.Tensor):
            return router
    return None


def _num_experts(experts: torch.nn.Module) -> int:
    return int(experts.gate_up_proj.shape[0])


# --- installing the instrumented forwards ----------------------------------------------------------


def install_moe_layers(model: torch.nn.Module, *, faults: FaultConfig, stats: MoeStats | None, grouped: bool,
                       device: torch.device, expert_parallel: bool,
                       balance: RouterBalance | None = None,
                       bias_rate: float = 0.0) -> tuple[list[MoeLayer], RouterBiasUpdate | None]:
    """Ranges, records and router faults on every MoE block; grouped GEMMs where `grouped` allows it (and
    always under expert parallelism, which needs them); each router's load-balancing term into `balance`
    when given; with `bias_rate`, the loads of DeepSeek-V3-style routers for their bias update. Returns the
    installed layers and the bias update (None: no rate)."""
    layers, use_cuda = [], device.type == "cuda"
    for index, block in moe_blocks(model):
        experts = block.experts
        if expert_parallel and not supports_grouped_ffn(experts):
            raise ConfigError(f"parallel.ep: the experts of layer {index} ({type(experts).__name__}) do not have "
                              "stacked [E, ...] weights the trainer can split")
        use_grouped = expert_parallel or (grouped and supports_fast_experts(experts))
        counter = stats.counter(index) if stats is not None else None
        router = _router_of(block)
        layer = MoeLayer(index=index, num_experts=_num_experts(experts), grouped=use_grouped, counter=counter,
                         use_nvtx=use_cuda, balance=balance,
                         sigmoid_scores=isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor))
        bias_E = router_logit_bias(faults, layer.num_experts)
        layer.logit_bias_E = bias_E.to(device) if bias_E is not None else None
        # Bound methods of shared functions, state on the modules (not per-layer closures): compiled blocks
        # share one code object and then guard on the same functions in every layer, compiling once.
        setattr(router, MOE_ROUTER_ATTRIBUTE, layer)
        router.forward = types.MethodType(routed_forward, router)
        setattr(experts, MOE_LAYER_ATTRIBUTE, layer)
        experts.forward = types.MethodType(grouped_moe_forward if use_grouped else native_moe_forward, experts)
        layers.append(layer)
    return layers, _bias_update(layers, model, bias_rate, device)


def _bias_update(layers: list[MoeLayer], model: torch.nn.Module, rate: float,
                 device: torch.device) -> RouterBiasUpdate | None:
    """The router-bias update over every installed layer, each layer's load row attached (None: rate 0)."""
    if rate == 0 or not layers:
        return None
    routers = {layer.index: _router_of(block) for index, block in moe_blocks(model) for layer in layers
               if layer.index == index}
    missing = [index for index, router in routers.items()
               if not isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor)]
    if missing:
        raise ConfigError(f"model.router_bias_update_rate: the routers of layers {missing} have no "
                          "e_score_correction_bias to update (DeepSeek-V3-style routers only)")
    update = RouterBiasUpdate(rate, {index: router.e_score_correction_bias for index, router in routers.items()},
                              layers[0].num_experts, device)
    for layer in layers:
        layer.bias_loads_E = update.loads_of(layer.index)
    return update


def routed_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """The router's own forward (its class's) in a `moe/router` range, under the router faults' logit bias;
    its load-balancing term recorded when the loss is on. Every supported router returns (logits, weights,
    chosen experts)."""
    layer: MoeLayer = getattr(self, MOE_ROUTER_ATTRIBUTE)
    with moe_phase(MOE_ROUTER, layer, layer.use_nvtx):
        if layer.logit_bias_E is None:
            routed = type(self).forward(self, hidden_states, *args, **kwargs)
        else:
            with LogitBias(layer.logit_bias_E):
                routed = type(self).forward(self, hidden_states, *args, **kwargs)
        if layer.balance is not None:
            logits, _, expert_index = routed
            layer.balance.record(layer.index, router_term(logits, expert_index, layer.num_experts,
                                                          sigmoid_scores=layer.sigmoid_scores))
        if layer.bias_loads_E is not None:
            count_routed(layer.bias_loads_E, routed[2])
        return routed


class LogitBias(torch.overrides.TorchFunctionMode):
    """Adds a bias over experts to the router's logits: the output of the one `F.linear` a router runs
    (every supported family's router computes its logits with exactly one)."""

    def __init__(self, bias_E: torch.Tensor):
        super().__init__()
        self.bias_E = bias_E

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            out = out + self.bias_E.to(out.dtype)
        return out


def native_moe_forward(self: torch.nn.Module, hidden_TD: torch.Tensor, expert_TK: torch.Tensor,
                       weight_TK: torch.Tensor) -> torch.Tensor:
    """transformers' own experts forward in one `moe/experts` range, plus the routing counts."""
    layer: MoeLayer = getattr(self, MOE_LAYER_ATTRIBUTE)
    if layer.counter is not None:
        counts_E = _expert_counts(expert_TK, layer.num_experts)
        layer.counter.add(counts_E, counts_E.sum().reshape(1), _row_bytes(hidden_TD, hidden_TD.dtype))
    with moe_phase(MOE_EXPERTS, layer, layer.use_nvtx):
        return type(self).forward(self, hidden_TD, expert_TK, weight_TK)


def _expert_counts(expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    expert_S = expert_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_S.device)
    return counts_E.scatter_add_(0, expert_S.long(), torch.ones_like(expert_S, dtype=torch.int64))


def _row_bytes(hidden_TD: torch.Tensor, dtype: torch.dtype) -> int:
    return hidden_TD.shape[-1] * torch.empty((), dtype=dtype).element_size()


def grouped_moe_forward(self: torch.nn.Module, hidden_TD: torch.Tensor, expert_TK: torch.Tensor,
                        weight_TK: torch.Tensor) -> torch.Tensor:
    """Dispatch, experts and combine as named phases; across the ep group when the layer is sharded, on this
    TP rank's share of the tokens under tensor parallelism."""
    layer: MoeLayer = getattr(self, MOE_LAYER_ATTRIBUTE)
    use_cuda = layer.use_nvtx
    dtype = compute_dtype(hidden_TD)
    num_tokens = hidden_TD.shape[0]
    split_over_tp = layer.shard is not None and layer.shard.tp > 1
    with moe_phase(MOE_DISPATCH, layer, use_cuda):
        if split_over_tp:
            hidden_TD, expert_TK, weight_TK = split_for_tp((hidden_TD, expert_TK, weight_TK), layer.shard)
        x_SD, routed = permute_by_expert(hidden_TD, expert_TK, layer.num_experts, dtype)
        if layer.shard is None:
            if layer.counter is not None:
                layer.counter.add(routed.counts_E, routed.counts_E.sum().reshape(1), _row_bytes(hidden_TD, dtype))
            offsets_E = torch.cumsum(routed.counts_E, dim=0, dtype=torch.int32)
        else:
            exchange = dispatch_tokens(x_SD, routed, layer)
    with moe_phase(MOE_EXPERTS, layer, use_cuda):
        if layer.shard is None:
            y_SD = expert_ffn(self, x_SD, offsets_E)
        else:
            y_SD = local_experts(self, exchange, layer.shard)
    with moe_phase(MOE_COMBINE, layer, use_cuda):
        if layer.shard is not None:
            y_SD = return_tokens(y_SD, exchange, layer.shard)
        out_TD = combine_weighted(y_SD, routed, weight_TK, hidden_TD.dtype)
        if split_over_tp:
            out_TD = gather_from_tp(out_TD, layer.shard, num_tokens)
        return out_TD


# --- tokens split over the tensor-parallel group -----------------------------------------------------


def tp_share(num_tokens: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """(start, rows) of a TP rank's share of `num_tokens` replicated tokens: contiguous, the first
    num_tokens % tp ranks one row more (torch.tensor_split's rule)."""
    base, extra = divmod(num_tokens, tp)
    start = tp_rank * base + min(tp_rank, extra)
    return start, base + (tp_rank < extra)


def split_for_tp(tensors: tuple[torch.Tensor, ...], shard: ExpertShard) -> tuple[torch.Tensor, ...]:
    """This TP rank's share of the rows of each (replicated) tensor; integer tensors are sliced plainly."""
    start, rows = tp_share(tensors[0].shape[0], shard.tp, shard.tp_rank)
    return tuple(_SplitForTp.apply(t, start, rows, shard) if t.is_floating_point() else t[start:start + rows]
                 for t in tensors)


def gather_from_tp(share_TD: torch.Tensor, shard: ExpertShard, num_tokens: int) -> torch.Tensor:
    """Every TP rank's share of the rows, in order: the replicated [num_tokens, ...] tensor."""
    return _GatherFromTp.apply(share_TD, shard, num_tokens)


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch 2.13 renamed all_gather_into_tensor (which now warns on every call)."""


def _all_gather_shares(share: torch.Tensor, shard: ExpertShard, num_tokens: int) -> torch.Tensor:
    """All-gather of uneven row shares: each padded to the largest share, gathered, padding dropped."""
    widest = tp_share(num_tokens, shard.tp, 0)[1]
    padded = share.new_zeros(widest, *share.shape[1:])
    padded[:share.shape[0]] = share
    gathered = share.new_empty(shard.tp * widest, *share.shape[1:])
    _all_gather_single(gathered, padded.contiguous(), group=shard.tp_group)
    pieces = [gathered[rank * widest:rank * widest + tp_share(num_tokens, shard.tp, rank)[1]]
              for rank in range(shard.tp)]
    return torch.cat(pieces)


class _SplitForTp(torch.autograd.Function):
    """Forward: this rank's rows of a replicated tensor. Backward: the TP ranks' share gradients gathered,
    which is the replicated tensor's whole gradient on every rank (each share fed only its own rank)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, start: int, rows: int, shard: ExpertShard) -> torch.Tensor:
        ctx.shard, ctx.num_tokens = shard, full.shape[0]
        return full[start:start + rows]

    @staticmethod
    def backward(ctx, grad_share: torch.Tensor):
        return _all_gather_shares(grad_share.contiguous(), ctx.shard, ctx.num_tokens), None, None, None


class _GatherFromTp(torch.autograd.Function):
    """Forward: the shares all-gathered into the replicated tensor. Backward: this rank's rows of the
    replicated gradient (every TP rank holds the same whole gradient, so no reduction)."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, shard: ExpertShard, num_tokens: int) -> torch.Tensor:
        ctx.start, ctx.rows = tp_share(num_tokens, shard.tp, shard.tp_rank)
        return _all_gather_shares(share, shard, num_tokens)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        return grad_full[ctx.start:ctx.start + ctx.rows].contiguous(), None, None


# --- expert parallelism ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One dispatch's all-to-all: split sizes (host) and what arrived, by source rank then local expert."""

    send_splits: list[int]
    recv_splits: list[int]
    recv_counts_PL: torch.Tensor
    """Rows received from each ep peer for each local expert (device)."""
    x_RD: torch.Tensor
    """Received rows, grouped by source rank, then by local expert."""


def dispatch_tokens(x_SD: torch.Tensor, routed: RoutedTokens, layer: MoeLayer) -> Exchange:
    """Count exchange (even all-to-all of per-expert counts), split sizes to the host, rows to their experts."""
    shard = layer.shard
    counts_PL = routed.counts_E.to(torch.int64).view(shard.ep, shard.local_experts)
    recv_counts_PL = torch.empty_like(counts_PL)
    dist.all_to_all_single(recv_counts_PL, counts_PL, group=shard.group)
    if layer.counter is not None:
        layer.counter.add(counts_PL.reshape(-1), recv_counts_PL.sum(dim=1), _row_bytes(x_SD, x_SD.dtype))
    with moe_phase(MOE_SPLIT_SIZES_D2H, layer, x_SD.is_cuda):
        timed = layer.counter is not None and not torch.compiler.is_compiling()
        start = time.perf_counter() if timed else 0.0
        splits_2P = torch.stack([counts_PL.sum(dim=1), recv_counts_PL.sum(dim=1)]).cpu()
        if timed:
            layer.counter.add_sync_ms((time.perf_counter() - start) * 1e3)
    send_splits, recv_splits = splits_2P.tolist()
    x_RD = _all_to_all(x_SD, recv_splits, send_splits, shard.group)
    return Exchange(send_splits, recv_splits, recv_counts_PL, x_RD)


def _all_to_all(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """Uneven all_to_all_single whose backward is the reverse all-to-all."""
    from torch.distributed.nn.functional import all_to_all_single

    out_RD = x_SD.new_empty(sum(out_splits), x_SD.shape[-1])
    return all_to_all_single(out_RD, x_SD.contiguous(), out_splits, in_splits, group=group)


def local_experts(experts: torch.nn.Module, exchange: Exchange, shard: ExpertShard) -> torch.Tensor:
    """Received rows regrouped by local expert, through the grouped GEMMs, back in arrival order."""
    rows = exchange.x_RD.shape[0]
    device = exchange.x_RD.device
    expert_of_chunk = torch.arange(shard.local_experts, device=device).repeat(shard.ep)
    local_R = torch.repeat_interleave(expert_of_chunk, exchange.recv_counts_PL.reshape(-1), output_size=rows)
    order_R = torch.argsort(local_R, stable=True)
    offsets_L = torch.cumsum(exchange.recv_counts_PL.sum(dim=0), dim=0, dtype=torch.int32)
    scaled = _GradScaledExperts(experts, shard.grad_scale)
    y_RD = expert_ffn(scaled, exchange.x_RD[order_R], offsets_L)
    return y_RD[torch.argsort(order_R)]


def return_tokens(y_RD: torch.Tensor, exchange: Exchange, shard: ExpertShard) -> torch.Tensor:
    """Expert outputs back to the ranks that sent the rows, in their sorted order."""
    return _all_to_all(y_RD, exchange.send_splits, exchange.recv_splits, shard.group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _GradScaledExperts:
    """The experts module's weights as seen by `expert_ffn`, with gradients scaled by `scale`."""

    def __init__(self, experts: torch.nn.Module, scale: float):
        self._experts, self._scale = experts, scale

    def __getattr__(self, name: str):
        value = getattr(self._experts, name)
        if isinstance(value, torch.nn.Parameter):
            return _ScaleGrad.apply(value, self._scale)
        return value


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: DeviceMesh,
                          tp_mesh: DeviceMesh | None = None) -> list[torch.nn.Module]:
    """Keep this rank's slice of every installed MoE layer's experts (the TP group, when given, splits the
    tokens it dispatches); returns the sharded experts modules."""
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    tp_options = {}
    if tp_mesh is not None and tp_mesh.size() > 1:
        tp_options = dict(tp_group=tp_mesh.get_group(), tp=tp_mesh.size(), tp_rank=tp_mesh.get_local_rank())
    sharded = []
    for module in model.modules():
        layer = getattr(module, MOE_LAYER_ATTRIBUTE, None)
        if layer is None:
            continue
        if not layer.grouped:
            raise ConfigError(f"parallel.ep: layer {layer.index}'s experts were not installed for expert parallelism")
        layer.shard = ExpertShard(group=ep_mesh.get_group(), ep=ep, ep_rank=ep_rank, num_experts=layer.num_experts,
                                  **tp_options)
        _keep_slice(module, layer.shard)
        sharded.append(module)
    return sharded


def _keep_slice(experts: torch.nn.Module, shard: ExpertShard) -> None:
    """Replace every [E, ...] parameter by this rank's rows (contiguous expert ids per rank)."""
    start = shard.ep_rank * shard.local_experts
    for name, parameter in list(experts.named_parameters(recurse=False)):
        if parameter.shape[0] == shard.num_experts:
            piece = parameter.detach()[start:start + shard.local_experts].clone()
            setattr(experts, name, torch.nn.Parameter(piece, requires_grad=parameter.requires_grad))


def expert_parameter_names(model: torch.nn.Module) -> list[str]:
    """Fully qualified names of the sharded experts' parameters (what DDP must leave alone)."""
    names = []
    for module_name, module in model.named_modules():
        layer = getattr(module, MOE_LAYER_ATTRIBUTE, None)
        if layer is not None and layer.shard is not None:
            names += [f"{module_name}.{name}" if module_name else name
                      for name, _ in module.named_parameters(recurse=False)]
    return names


def average_over_replicas(parameters: list[torch.nn.Parameter], edp_group: dist.ProcessGroup, edp: int) -> None:
    """Beside DDP: average each expert gradient over the expert-data-parallel replicas once it is accumulated."""

    def hook(parameter: torch.nn.Parameter) -> None:
        dist.all_reduce(parameter.grad, group=edp_group)
        parameter.grad.div_(edp)

    for parameter in parameters:
        parameter.register_post_accumulate_grad_hook(hook)
