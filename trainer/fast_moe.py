"""Routed experts as two grouped GEMMs over device-side offsets: no host sync, no graph break.

transformers' experts modules keep all expert weights in two 3-D parameters
(`gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]). Its grouped path falls back to a per-expert
host loop under torch.compile when the weights are not bf16 (fp32 master weights + autocast,
the usual training setup). This forward casts the weights itself, computes group offsets on
the device and never reads a tensor value on the host, so a compiled decoder block is one graph
and can be replayed as a CUDA graph. Parameters and state-dict keys are unchanged.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_native_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm")


def _grouped_mm(x_SD: torch.Tensor, w_EDK: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """Row block e of x (rows offs[e-1]..offs[e]) times w[e]. Compiled graphs lower only bf16
    grouped GEMMs; other dtypes there (fp32 CPU runs) take an expert loop of the same static shape."""
    if x_SD.dtype == torch.bfloat16 or not torch.compiler.is_compiling():
        return _native_grouped_mm(x_SD, w_EDK, offs=offs)
    group_S = torch.searchsorted(offs, torch.arange(x_SD.shape[0], device=x_SD.device, dtype=offs.dtype),
                                 right=True)
    out_SK = x_SD.new_zeros(x_SD.shape[0], w_EDK.shape[-1])
    for expert in range(w_EDK.shape[0]):
        out_SK = out_SK + (group_S == expert).unsqueeze(-1) * (x_SD @ w_EDK[expert])
    return out_SK


def supports_fast_experts(module: torch.nn.Module) -> bool:
    """Concatenated, non-transposed, gated, bias-free expert weights (all families but GPT-OSS)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3
        and isinstance(down, torch.nn.Parameter) and down.dim() == 3
        and getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True) and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_post_expert_norm", False) and hasattr(module, "act_fn")
    )


def supports_grouped_ffn(module: torch.nn.Module) -> bool:
    """Expert weights `expert_ffn` computes: the fast layout, or GPT-OSS's (transposed [E, D, 2I] / [E, I, D],
    interleaved gate/up, biases, its own clamped gate)."""
    return supports_fast_experts(module) or _is_transposed_biased(module)


def _is_transposed_biased(module: torch.nn.Module) -> bool:
    return (getattr(module, "is_transposed", False) and getattr(module, "has_bias", False)
            and hasattr(module, "_apply_gate") and isinstance(getattr(module, "gate_up_proj_bias", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj_bias", None), torch.Tensor))


@dataclass(frozen=True)
class RoutedTokens:
    """Token copies sorted by expert: which token each row is and how it is weighted back."""

    order_S: torch.Tensor
    """Position in the flattened [T * K] routing of each sorted row."""
    token_S: torch.Tensor
    """Token index of each sorted row."""
    counts_E: torch.Tensor
    """Rows per expert (int32, on the device)."""
    num_tokens: int


def permute_by_expert(hidden_TD: torch.Tensor, expert_TK: torch.Tensor, num_experts: int,
                      compute_dtype: torch.dtype) -> tuple[torch.Tensor, RoutedTokens]:
    """Each token once per chosen expert, rows grouped by expert id (stable: token order inside a group)."""
    num_tokens, top_k = expert_TK.shape
    expert_S = expert_TK.reshape(-1)
    order_S = torch.argsort(expert_S, stable=True)
    token_S = order_S // top_k
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=hidden_TD.device)
    counts_E.scatter_add_(0, expert_S.to(torch.int32), torch.ones_like(expert_S, dtype=torch.int32))
    return hidden_TD[token_S].to(compute_dtype), RoutedTokens(order_S, token_S, counts_E, num_tokens)


def expert_ffn(module: torch.nn.Module, x_SD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows grouped by (local) expert through their expert's MLP: two grouped GEMMs over device offsets."""
    compute_dtype = x_SD.dtype
    if _is_transposed_biased(module):
        group_S = _row_groups(offsets_E, x_SD.shape[0])
        gate_up_S2I = _grouped_mm(x_SD, module.gate_up_proj.to(compute_dtype), offs=offsets_E)
        gate_up_S2I = gate_up_S2I + module.gate_up_proj_bias.to(compute_dtype)[group_S]
        y_SD = _grouped_mm(module._apply_gate(gate_up_S2I), module.down_proj.to(compute_dtype), offs=offsets_E)
        return y_SD + module.down_proj_bias.to(compute_dtype)[group_S]
    gate_up_S2I = _grouped_mm(x_SD, module.gate_up_proj.to(compute_dtype).transpose(-2, -1), offs=offsets_E)
    gate_SI, up_SI = gate_up_S2I.chunk(2, dim=-1)
    return _grouped_mm(module.act_fn(gate_SI) * up_SI, module.down_proj.to(compute_dtype).transpose(-2, -1),
                       offs=offsets_E)


def _row_groups(offsets_E: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert index of each row of a grouped block (on the device)."""
    return torch.searchsorted(offsets_E, torch.arange(rows, device=offsets_E.device, dtype=offsets_E.dtype),
                              right=True)


def combine_weighted(y_SD: torch.Tensor, routed: RoutedTokens, weight_TK: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """Each token's expert outputs, weighted by its routing weights, summed back in fp32."""
    y_SD = y_SD * weight_TK.reshape(-1)[routed.order_S].unsqueeze(-1).to(y_SD.dtype)
    out_TD = torch.zeros(routed.num_tokens, y_SD.shape[-1], dtype=torch.float32, device=y_SD.device)
    out_TD.index_add_(0, routed.token_S, y_SD.float())
    return out_TD.to(out_dtype)


def grouped_experts_forward(self: torch.nn.Module, hidden_TD: torch.Tensor, expert_TK: torch.Tensor,
                            weight_TK: torch.Tensor) -> torch.Tensor:
    """Each token's top-k experts: sort token copies by expert, two grouped GEMMs, weighted sum back."""
    x_SD, routed = permute_by_expert(hidden_TD, expert_TK, self.gate_up_proj.shape[0], compute_dtype(hidden_TD))
    y_SD = expert_ffn(self, x_SD, torch.cumsum(routed.counts_E, dim=0, dtype=torch.int32))
    return combine_weighted(y_SD, routed, weight_TK, hidden_TD.dtype)


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    if hidden.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return hidden.dtype


def install_fast_experts(model: torch.nn.Module) -> int:
    """Swap the forward of every supported experts module; returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if supports_fast_experts(module):
            module.forward = types.MethodType(grouped_experts_forward, module)
            swapped += 1
    return swapped
