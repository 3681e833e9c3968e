"""The MoE section of the HTML report: findings, tokens per expert, the split matrix of each layer as a
heatmap (src rank x dst rank), and a table of phase times and all-to-all waits per layer and rank."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.cross_rank.moe import MoeLayerReport, MoeReport
from fleetscope.analysis.render import svg
from fleetscope.analysis.render.html_table import table

MAX_HEATMAP_LAYERS = 8
"""Split-matrix heatmaps drawn for the first layers only; the JSON holds every layer's matrix."""
_PHASES = ("router", "dispatch", "split_sizes_d2h", "experts", "combine")


def moe_section(moe: MoeReport | None) -> str:
    if moe is None:
        return ""
    status = "" if moe.status == "ok" else f"<p>{escape(moe.status)}: {escape(moe.reason)}</p>"
    findings = "".join(f"<li>{escape(f.sentence)}</li>" for f in moe.findings)
    findings = (f"<ul>{findings}</ul>" if findings else
                f"<p>No expert received &ge; {moe.hot_expert_min_ratio:.1f}x the mean tokens in any layer.</p>"
                if moe.status == "ok" else "")
    parts = [f"<h2>MoE layers</h2><p>ep {moe.ep}, {moe.num_experts} experts, {len(moe.layers)} layers; "
             "times in ms per profiled step.</p>", status, findings, _expert_heatmap(moe)]
    parts += [_split_heatmap(layer) for layer in moe.layers[:MAX_HEATMAP_LAYERS]]
    parts.append(_rank_table(moe.layers))
    return "<section class=\"moe\">" + "".join(parts) + "</section>"


def _expert_heatmap(moe: MoeReport) -> str:
    rows = [layer for layer in moe.layers if layer.tokens_per_expert]
    if not rows:
        return ""
    experts = [f"e{e}" for e in range(len(rows[0].tokens_per_expert))]
    chart = svg.heatmap([f"layer {layer.layer}" for layer in rows], experts,
                        [list(layer.tokens_per_expert) for layer in rows], unit="tokens/step")
    return f"<h3>Tokens per expert (all ranks, per step)</h3>{chart}"


def _split_heatmap(layer: MoeLayerReport) -> str:
    if len(layer.split_ranks) < 2:
        return ""
    labels = [f"rank {r}" for r in layer.split_ranks]
    chart = svg.heatmap([f"from {label}" for label in labels], [f"to {r}" for r in layer.split_ranks],
                        layer.split_tokens, unit="tokens/step")
    return f"<h3>Layer {layer.layer}: dispatch split matrix (src rank x dst rank)</h3>{chart}"


def _rank_table(layers: list[MoeLayerReport]) -> str:
    header = ["layer", "rank", "recv tokens", *[f"{p} ms" for p in _PHASES], "grouped GEMM ms",
              "dispatch wait", "dispatch xfer", "combine wait", "combine xfer", "combine last %", "combine cost ms"]
    rows = []
    for layer in layers:
        for rank in layer.ranks:
            rows.append([str(layer.layer), str(rank.rank), _f(rank.recv_tokens, 0),
                         *[_f(rank.host_ms.get(p), 3) for p in _PHASES], _f(rank.grouped_gemm_ms, 3),
                         _f(rank.dispatch_wait_ms, 3), _f(rank.dispatch_transfer_ms, 3), _f(rank.combine_wait_ms, 3),
                         _f(rank.combine_transfer_ms, 3), _f(rank.combine_last_pct, 0), _f(rank.combine_cost_ms, 3)])
    if not rows:
        return ""
    return "<h3>Per layer and rank</h3>" + table(header, rows, labels=2)


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
