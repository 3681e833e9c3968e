"""Model FLOPs per token (only the experts a token is routed to count) and MFU.

    flops_per_token = 6 * N_active + 6 * L * S * d_attn
      N_active  non-embedding parameters a token touches: all dense parameters plus top_k / E of
                the routed experts' parameters (the LM head counts; the input embedding does not)
      L, S      decoder layers and sequence length
      d_attn    query heads x head dim; 6 * S * d_attn is QK^T and AV, forward + backward (2 + 4),
                halved for the causal mask
MFU = achieved model FLOP/s over the accelerator's dense bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetscope.traces.device_peaks import BF16, peak_tflops



@dataclass(frozen=True, kw_only=True, slots=True)
class FlopModel:
    active_params: int
    total_params: int
    num_layers: int
    attention_dim: int

    def per_token(self, seq_len: int) -> float:
        return 6.0 * self.active_params + 6.0 * self.num_layers * seq_len * self.attention_dim


def flop_model(causal_lm: torch.nn.Module) -> FlopModel:
    config = causal_lm.config
    experts_total, experts_active = 0, 0.0
    top_k = getattr(config, "num_experts_per_tok", 1)
    for module in causal_lm.modules():
        expert_params = [p for name, p in module.named_parameters(recurse=False) if p.dim() == 3]
        if expert_params:
            count = sum(p.numel() for p in expert_params)
            experts_total += count
            experts_active += count * top_k / expert_params[0].shape[0]
    embedding = causal_lm.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in causal_lm.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return FlopModel(
        active_params=int(total - embedding - experts_total + experts_active),
        total_params=total,
        num_layers=config.num_hidden_layers,
        attention_dim=config.num_attention_heads * head_dim,
    )


def peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak of a CUDA device, or None when unknown (MFU is then not reported)."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device))[1].get(BF16)
