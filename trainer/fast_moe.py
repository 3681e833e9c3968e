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


def grouped_experts_forward(self: torch.nn.Module, hidden_TD: torch.Tensor, expert_TK: torch.Tensor,
                            weight_TK: torch.Tensor) -> torch.Tensor:
    """Each token's top-k experts: sort token copies by expert, two grouped GEMMs, weighted sum back."""
    num_tokens, top_k = expert_TK.shape
    num_experts = self.gate_up_proj.shape[0]
    compute_dtype = _compute_dtype(hidden_TD)
    expert_S = expert_TK.reshape(-1)
    order_S = torch.argsort(expert_S, stable=True)
    token_S = order_S // top_k
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=hidden_TD.device)
    counts_E.scatter_add_(0, expert_S.to(torch.int32), torch.ones_like(expert_S, dtype=torch.int32))
    offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    x_SD = hidden_TD[token_S].to(compute_dtype)
    gate_up_S2I = _grouped_mm(x_SD, self.gate_up_proj.to(compute_dtype).transpose(-2, -1), offs=offsets_E)
    gate_SI, up_SI = gate_up_S2I.chunk(2, dim=-1)
    y_SD = _grouped_mm(self.act_fn(gate_SI) * up_SI, self.down_proj.to(compute_dtype).transpose(-2, -1),
                       offs=offsets_E)
    y_SD = y_SD * weight_TK.reshape(-1)[order_S].unsqueeze(-1).to(y_SD.dtype)
    out_TD = torch.zeros(num_tokens, y_SD.shape[-1], dtype=torch.float32, device=hidden_TD.device)
    out_TD.index_add_(0, token_S, y_SD.float())
    return out_TD.to(hidden_TD.dtype)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
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
