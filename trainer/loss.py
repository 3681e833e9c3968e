"""Causal-LM loss without materializing the logits of the whole batch.

The LM head's logits ([tokens, vocab], 1 GB in bf16 for 16k tokens x 32k vocab, twice that in
fp32 for the softmax) dominate activation memory and memory traffic at the end of the step.
`FusedLinearCrossEntropy` processes the tokens in chunks: per chunk it computes the logits, the
loss and, right away, the gradients for the hidden states and the head weight; backward only
scales them. Peak extra memory is one chunk of logits; no matmul is recomputed.
"""

from __future__ import annotations

import functools

import torch

from .load_balance import RouterBalance

IGNORE_INDEX = -100


class FusedLinearCrossEntropy(torch.autograd.Function):
    """mean cross-entropy of (hidden_ND @ weight_VD.T) against labels_N, chunked over N."""

    @staticmethod
    def forward(ctx, hidden_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        inverse_count = 1.0 / (labels_N != IGNORE_INDEX).sum().clamp(min=1).float()
        loss_and_grad = _compiled_loss_and_grad() if hidden_ND.is_cuda else _loss_and_grad
        grad_hidden_ND = torch.empty_like(hidden_ND)
        grad_weight_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        for start in range(0, hidden_ND.shape[0], chunk_tokens):
            hidden_CD = hidden_ND[start:start + chunk_tokens]
            logits_CV = hidden_CD @ weight_VD.t()
            loss_sum, grad_logits_CV = loss_and_grad(logits_CV, labels_N[start:start + chunk_tokens], inverse_count)
            loss += loss_sum
            torch.matmul(grad_logits_CV, weight_VD, out=grad_hidden_ND[start:start + chunk_tokens])
            grad_weight_VD.add_(grad_logits_CV.t() @ hidden_CD)
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD.to(weight_VD.dtype))
        return loss * inverse_count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden_ND, grad_weight_VD = ctx.saved_tensors
        return grad_hidden_ND * grad_loss.to(grad_hidden_ND.dtype), grad_weight_VD * grad_loss.to(
            grad_weight_VD.dtype), None, None


def _loss_and_grad(logits_CV: torch.Tensor, labels_C: torch.Tensor,
                   inverse_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of CE over the chunk, d(mean CE)/d(logits) in the logits' dtype); fp32 inside.

    d CE / d logits = softmax - one_hot(label), zero at ignored positions. Written as one
    reduction and one elementwise pass so that, compiled, the logits are read twice in total.
    """
    grad_dtype = logits_CV.dtype
    logits_CV = logits_CV.float()
    valid_C = labels_C != IGNORE_INDEX
    labels_C = labels_C.clamp(min=0)
    logsumexp_C = torch.logsumexp(logits_CV, dim=-1)
    target_C = logits_CV.gather(1, labels_C.unsqueeze(1)).squeeze(1)
    loss_sum = ((logsumexp_C - target_C) * valid_C).sum()
    vocab_V = torch.arange(logits_CV.shape[1], device=logits_CV.device)
    one_hot_CV = vocab_V.unsqueeze(0) == labels_C.unsqueeze(1)
    grad_CV = torch.exp(logits_CV - logsumexp_C.unsqueeze(1)) - one_hot_CV.float()
    scale_C = valid_C.float() * inverse_count
    return loss_sum, (grad_CV * scale_C.unsqueeze(1)).to(grad_dtype)


@functools.cache
def _compiled_loss_and_grad():
    """The loss math compiled once per process (CUDA): fused passes instead of ~8 over fp32 logits."""
    return torch.compile(_loss_and_grad, dynamic=False)


def shift_labels(input_ids_BS: torch.Tensor) -> torch.Tensor:
    """Next-token labels: position t predicts token t+1; the last position is ignored."""
    labels_BS = torch.full_like(input_ids_BS, IGNORE_INDEX)
    labels_BS[:, :-1] = input_ids_BS[:, 1:]
    return labels_BS


def causal_lm_loss(hidden_BSD: torch.Tensor, head_weight_VD: torch.Tensor, input_ids_BS: torch.Tensor, *,
                   chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean next-token cross-entropy, same value as transformers' `ForCausalLMLoss`."""
    labels_N = shift_labels(input_ids_BS).reshape(-1)
    hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    if torch.is_autocast_enabled(hidden_ND.device.type):
        dtype = torch.get_autocast_dtype(hidden_ND.device.type)
        hidden_ND, head_weight_VD = hidden_ND.to(dtype), head_weight_VD.to(dtype)
    with torch.autocast(hidden_ND.device.type, enabled=False):
        return FusedLinearCrossEntropy.apply(hidden_ND, head_weight_VD, labels_N, chunk_tokens)


class CausalLMTrainingModule(torch.nn.Module):
    """The unit every parallel wrapper sees: token ids in, mean next-token loss out.

    With `fused_loss` the decoder's hidden states go straight into the chunked fused loss (the
    LM head's logits never exist for the whole batch); otherwise transformers computes its loss. With
    `balance` (model.router_aux_loss_coef > 0) the routers' load-balancing term is added to either.
    """

    def __init__(self, causal_lm: torch.nn.Module, *, fused_loss: bool, chunk_tokens: int,
                 balance: RouterBalance | None = None):
        super().__init__()
        self.causal_lm = causal_lm
        self.fused_loss = fused_loss
        self.chunk_tokens = chunk_tokens
        self.balance = balance

    @property
    def config(self):
        return self.causal_lm.config

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        loss = self._language_model_loss(input_ids_BS)
        return loss if self.balance is None else self.balance.added_to(loss)

    def _language_model_loss(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        if not self.fused_loss:
            # With the trainer's balancing loss on, transformers' own (output_router_logits) stays off: one owner.
            router_logits = {} if self.balance is None else {"output_router_logits": False}
            return self.causal_lm(input_ids=input_ids_BS, labels=input_ids_BS, use_cache=False, **router_logits).loss
        hidden_BSD = self.causal_lm.model(input_ids=input_ids_BS, use_cache=False).last_hidden_state
        return causal_lm_loss(hidden_BSD, self.causal_lm.lm_head.weight, input_ids_BS,
                              chunk_tokens=self.chunk_tokens)
