"""The MoE section of the terminal summary: findings first, then one table row per layer and rank."""

from __future__ import annotations

from fleetscope.analysis.cross_rank.moe import MoeLayerReport, MoeReport

MAX_LAYER_ROWS = 64
"""Beyond this many (layer, rank) rows the table stops; the JSON/HTML report holds all of them."""
_COLUMNS = ("layer", "rank", "recv tok", "router", "dispatch", "d2h", "experts", "gemm gpu", "combine",
            "a2a wait", "a2a xfer", "last %")


def moe_section(moe: MoeReport | None) -> str:
    """"MoE layers" with its findings and table, or "" without an MoE view."""
    if moe is None:
        return ""
    lines = [_summary(moe)]
    lines += [f"  {finding.sentence}" for finding in moe.findings]
    if moe.status == "ok" and not moe.findings:
        lines.append(f"  no expert received >= {moe.hot_expert_min_ratio:.1f}x the mean tokens in any layer")
    lines += [f"  {line}" for line in _layer_lines(moe.layers)]
    lines += [f"  {line}" for line in _table(moe.layers)]
    return "\n".join(lines)


def _summary(moe: MoeReport) -> str:
    head = f"MoE layers (ep {moe.ep}, {moe.num_experts} experts, {len(moe.layers)} layers)"
    if moe.status != "ok":
        head += f": {moe.status}: {moe.reason}"
    return head + "; times in ms per profiled step"


def _layer_lines(layers: list[MoeLayerReport]) -> list[str]:
    lines = []
    for layer in layers:
        if layer.hottest_expert is None:
            continue
        rank = f", rank max/mean {layer.rank_max_over_mean:.2f}" if layer.rank_max_over_mean is not None else ""
        lines.append(f"layer {layer.layer}: hottest expert {layer.hottest_expert} "
                     f"(expert max/mean {layer.expert_max_over_mean:.2f}{rank})")
    return lines


def _table(layers: list[MoeLayerReport]) -> list[str]:
    rows = [_COLUMNS]
    for layer in layers:
        for rank in layer.ranks:
            wait = _sum(rank.dispatch_wait_ms, rank.combine_wait_ms)
            transfer = _sum(rank.dispatch_transfer_ms, rank.combine_transfer_ms)
            rows.append((str(layer.layer), str(rank.rank), _num(rank.recv_tokens, 0), _num(rank.host_ms.get("router")),
                         _num(rank.host_ms.get("dispatch")), _num(rank.split_sizes_d2h_ms, 3),
                         _num(rank.host_ms.get("experts")), _num(rank.grouped_gemm_ms), _num(rank.host_ms.get("combine")),
                         _num(wait), _num(transfer), _num(rank.combine_last_pct, 0)))
    shown = rows[:MAX_LAYER_ROWS + 1]
    widths = [max(len(row[i]) for row in shown) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in shown]
    if len(rows) > len(shown):
        lines.append(f"... {len(rows) - len(shown)} more rows in the JSON/HTML report")
    return lines


def _sum(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
