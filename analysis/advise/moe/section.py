"""What the MoE rules read of the report's MoE section: a layer, a rank's expert compute, the hot ranks' extra."""

from __future__ import annotations

import numpy as np
from fleetscope.analysis.cross_rank.moe import MoeFinding, MoeLayerReport, MoeRankLayer, MoeReport

MOE_RULES_SOURCE = "the report's MoE section"


def layer_report(moe: MoeReport, index: int) -> MoeLayerReport | None:
    return next((layer for layer in moe.layers if layer.layer == index), None)


def expert_ms(rank: MoeRankLayer) -> float | None:
    """One rank's expert compute in one layer, ms per step: the GPU `moe/experts` range, else its GEMMs,
    else the host range (CPU traces)."""
    if "experts" in rank.gpu_ms:
        return rank.gpu_ms["experts"]
    if rank.grouped_gemm_ms is not None:
        return rank.grouped_gemm_ms
    return rank.host_ms.get("experts")


def holder_extra_ms(moe: MoeReport, finding: MoeFinding) -> float | None:
    """How much longer the hot expert's ranks compute their experts than the median other rank, in the
    finding's layer (ms per step): what the others wait for at the combine. None: no range times."""
    layer = layer_report(moe, finding.layer)
    if layer is None or not finding.ranks:
        return None
    times = {r.rank: expert_ms(r) for r in layer.ranks}
    holders = [times[r] for r in finding.ranks if times.get(r) is not None]
    others = [v for r, v in times.items() if r not in finding.ranks and v is not None]
    if not holders or not others:
        return None
    return max(max(holders) - float(np.median(others)), 0.0)


def ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
