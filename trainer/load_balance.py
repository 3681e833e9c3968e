"""Router load balancing: the load-balancing loss (Switch Transformer, GShard, Mixtral) and DeepSeek-V3's
auxiliary-loss-free bias update, the one owner of both formulas.

Per MoE layer, over the tokens this rank routes in one micro-batch:

    aux = E * sum_e f_e * P_e
    f_e = (token copies routed to expert e) / (tokens * top_k)     (the routing decision: no gradient)
    P_e = mean over tokens of the router's probability of expert e (differentiable: the router learns)

Balanced routing gives 1 for any top_k (f and P both 1/E); all tokens on one expert with all its
probability gives E. The trainer adds `model.router_aux_loss_coef` x the mean of the layers' terms to
each micro-batch's loss. (Megatron-LM's normalisation; transformers' `load_balancing_loss_func` omits the
1/top_k, giving top_k at balance, and concatenates the layers before the product instead of averaging
per-layer terms.)

Which tokens f_e counts: the ones this rank routes, the same with and without expert parallelism (a
rank routes its own micro-batch before dispatch, whatever the ep degree), so the loss and its gradient
do not depend on `parallel.ep`; the data-parallel gradient average then averages the ranks' terms, as for
the language-model loss (Megatron-LM's default micro-batch-level loss; its global-batch variant needs an
all-reduce of the counts in every layer's forward). Under tensor parallelism with expert parallelism the
router runs on the TP group's replicated tokens, so every TP rank computes the same term.

P_e for sigmoid-scored routers (DeepSeek-V3, whose router has `e_score_correction_bias`): the scores
normalised to sum to 1 per token, as in DeepSeek-V3's complementary sequence-wise balance loss.
"""

from __future__ import annotations

import torch


def load_balancing_loss(probs_TE: torch.Tensor, expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e for one layer (fp32 scalar): f from the chosen experts, P from the probabilities."""
    tokens, top_k = expert_TK.shape
    expert_S = expert_TK.reshape(-1).long()
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=expert_S.device)
    counts_E.scatter_add_(0, expert_S, torch.ones_like(expert_S, dtype=torch.float32))
    fraction_E = counts_E / max(tokens * top_k, 1)
    mean_prob_E = probs_TE.float().mean(dim=0)
    return num_experts * (fraction_E * mean_prob_E).sum()


def router_probabilities(router_logits_TE: torch.Tensor, *, sigmoid_scores: bool) -> torch.Tensor:
    """Each token's probability over the experts (fp32): softmax of the logits, or normalised sigmoid scores."""
    logits_TE = router_logits_TE.float()
    if not sigmoid_scores:
        return torch.softmax(logits_TE, dim=-1)
    scores_TE = logits_TE.sigmoid()
    return scores_TE / scores_TE.sum(dim=-1, keepdim=True)


def router_term(router_logits: torch.Tensor, expert_index: torch.Tensor, num_experts: int, *,
                sigmoid_scores: bool) -> torch.Tensor:
    """One layer's term from what its router returned (logits [..., E], chosen experts [..., K])."""
    probs_TE = router_probabilities(router_logits.reshape(-1, num_experts), sigmoid_scores=sigmoid_scores)
    return load_balancing_loss(probs_TE, expert_index.reshape(probs_TE.shape[0], -1), num_experts)


class RouterBalance:
    """Collects every MoE layer's term during a forward; `take` averages them for the loss and starts over.

    Terms are keyed by layer, so a layer that runs twice in one forward (never in these models) counts once;
    forwards that the backward pass runs again for activation checkpointing are not recorded (their terms
    would leak into the next micro-batch)."""

    def __init__(self, coef: float):
        self.coef = coef
        self._terms: dict[int, torch.Tensor] = {}

    def record(self, layer: int, term: torch.Tensor) -> None:
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        self._terms[layer] = term

    def take(self) -> torch.Tensor | None:
        """The mean of the recorded layers' terms (None: no MoE layer ran), and an empty record."""
        if not self._terms:
            return None
        terms = [self._terms[layer] for layer in sorted(self._terms)]
        self._terms = {}
        return torch.stack(terms).mean()

    def added_to(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` + coef x this forward's mean term (the loss itself when no MoE layer ran)."""
        term = self.take()
        if term is None:
            return loss
        return loss + self.coef * term.to(loss.device)


# --- auxiliary-loss-free balancing (DeepSeek-V3) ---------------------------------------------------


def bias_step(loads_LE: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's update of each layer's expert bias: +rate for experts under the layer's mean load, -rate
    over it, 0 at it (loads: token copies per expert, any scale)."""
    mean_L1 = loads_LE.mean(dim=1, keepdim=True)
    return rate * torch.sign(mean_L1 - loads_LE)


class RouterBiasUpdate:
    """`model.router_bias_update_rate`: after every optimizer step, each router's `e_score_correction_bias`
    (added to the sigmoid scores before top-k, not to the weights) moves by `bias_step` of the step's loads.

    Loads are the token copies each layer's router chose during the step's forwards (all micro-batches),
    counted on the device and summed over every rank of the job by one all-reduce per step (no host sync):
    every rank then makes the same update, so the replicated bias stays equal everywhere (TP ranks count the
    same replicated tokens, which scales every expert's load alike and leaves the sign unchanged)."""

    def __init__(self, rate: float, biases: dict[int, torch.Tensor], num_experts: int, device: torch.device):
        self.rate = rate
        self._biases = biases
        self._loads_LE = torch.zeros(len(biases), num_experts, dtype=torch.float32, device=device)
        self._rows = {layer: row for row, layer in enumerate(sorted(biases))}

    def loads_of(self, layer: int) -> torch.Tensor:
        """The accumulator row of one layer (a view: routers add into it in place)."""
        return self._loads_LE[self._rows[layer]]

    def update(self, group: "torch.distributed.ProcessGroup | None" = None) -> None:
        """The step's bias update, then zeroed loads; call after the optimizer step on every rank."""
        if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(self._loads_LE, group=group)
        step_LE = bias_step(self._loads_LE, self.rate)
        with torch.no_grad():
            for layer, row in self._rows.items():
                self._biases[layer].add_(step_LE[row].to(self._biases[layer].dtype))
        self._loads_LE.zero_()


def count_routed(loads_E: torch.Tensor, expert_index: torch.Tensor) -> None:
    """Add one forward's chosen experts to a layer's loads; not the forwards that activation checkpointing
    runs again in backward (each step counts every real forward once)."""
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        return
    expert_S = expert_index.reshape(-1).long()
    loads_E.scatter_add_(0, expert_S, torch.ones_like(expert_S, dtype=loads_E.dtype))
