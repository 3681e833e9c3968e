"""The MoE view across ranks: routing records joined with every rank's MoE range times and the arrivals at
each layer's dispatch and combine all-to-alls, down to "which expert is hot, where it lives, what it costs".

Sources: `metrics/rank<R>.moe.jsonl` (traces/formats.py MoeRecord: tokens per expert and per ep peer, every
recorded step) and the per-rank MoE times (per_rank/moe.py: profiled steps only).

Definitions (per MoE layer; "per step" = summed, then divided by the steps counted):
  - tokens_per_expert: token copies routed to each global expert, summed over ranks, mean per recorded step;
    expert_max_over_mean: the hottest expert's over the mean of all experts;
  - tokens_per_rank: token copies each rank's experts received (recv_tokens summed), mean per step;
    rank_max_over_mean: the most loaded rank's over the mean of its ep group's ranks, worst group;
  - split_tokens / split_bytes: [src global rank][dst global rank], what src sent dst in dispatch (combine
    returns as much), mean per step; zero between ranks of different ep groups;
  - where an expert lives: experts are split into ep contiguous slices, ep rank k holding experts
    [k * E/ep, (k + 1) * E/ep) (trainer/expert_parallel.py `_keep_slice`); its global ranks are
    `ep_ranks[k]` of every ep group;
  - wait / transfer at an all-to-all instance, per member of the ep group: wait = last member's start -
    own start, transfer = own end - last member's start (times after clock alignment, us);
  - a finding (hot expert) when expert_max_over_mean >= HOT_EXPERT_MIN_RATIO; with ep > 1 it names the
    ranks holding the expert, how often one of them arrived last at the layer's combine all-to-all
    (holder_last_pct: of the combine instances of all ep groups), and cost_ms_per_step: over the combine
    instances where a holder arrived last, the mean over the group's other members of their wait for it,
    summed and divided by the profiled steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.inputs.records import MoeFile
from fleetscope.traces.formats import MOE_COMBINE, MOE_DISPATCH, MOE_SPLIT_SIZES_D2H, MoeRecord
from fleetscope.traces.layout import RunLayout

from fleetscope.analysis.cross_rank.arrivals import ArrivalMatrix
from fleetscope.analysis.per_rank.rank import RankResult

HOT_EXPERT_MIN_RATIO = 1.5
"""An expert that receives at least this many times the mean expert's tokens in a layer is a finding.
Unbiased: the tiny preset's router under ep=4 (4 ranks, all steps summed) gives 1.07-1.10, a single step
at most 1.36; with faults.hot_expert (+4 logit) 2.0 of a possible 2.0 (top-2 of 4), and 8.0 in the H200
fixture (top-2 of 16) (tests/test_cross_rank_moe.py)."""
STATUS_OK, STATUS_NOT_RECORDED = "ok", "not recorded"


@dataclass(frozen=True, kw_only=True)
class MoeRankLayer:
    """One rank in one MoE layer, per profiled step (ms), from its trace and its records."""

    rank: int
    host_ms: dict[str, float] = field(default_factory=dict)
    """kind (router, dispatch, experts, combine, split_sizes_d2h) -> host range ms per step."""
    gpu_ms: dict[str, float] = field(default_factory=dict)
    """kind -> GPU range ms per step (empty on CPU traces)."""
    grouped_gemm_ms: float | None = None
    """GEMM kernels inside moe/experts, GPU ms per step (None: no GPU ranges)."""
    split_sizes_d2h_ms: float | None = None
    """The split-size copy before the token all-to-all, host ms per step (the trace's moe/split_sizes_d2h
    ranges; None without expert parallelism)."""
    split_sizes_d2h_record_ms: float | None = None
    """The same from the records (every recorded step, not only profiled ones), mean ms per step."""
    dispatch_wait_ms: float | None = None
    dispatch_transfer_ms: float | None = None
    combine_wait_ms: float | None = None
    combine_transfer_ms: float | None = None
    """Wait / transfer at the layer's forward all-to-alls, ms per step (None: no matched instance)."""
    combine_last_pct: float | None = None
    """Of the layer's combine instances of its ep group, how often this rank started last."""
    combine_cost_ms: float | None = None
    """Over the combine instances this rank started last at, the others' mean wait for it, ms per step."""
    recv_tokens: float | None = None
    """Token copies this rank's experts received per step (records)."""


@dataclass(frozen=True, kw_only=True)
class MoeLayerReport:
    layer: int
    record_steps: int
    """Steps with records of this layer (every rank's counted)."""
    tokens_per_expert: list[float]
    expert_max_over_mean: float | None
    hottest_expert: int | None
    tokens_per_rank: dict[int, float]
    rank_max_over_mean: float | None
    split_tokens: list[list[float]]
    split_bytes: list[list[float]]
    split_ranks: list[int]
    """Global ranks labelling the split matrices' rows and columns."""
    ranks: list[MoeRankLayer] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class MoeFinding:
    layer: int
    expert: int
    tokens_vs_mean: float
    """The expert's tokens over the mean expert's (x)."""
    ep_rank: int | None
    """ep rank holding the expert (None: ep = 1, every rank holds every expert)."""
    ranks: list[int]
    """Global ranks holding it (empty with ep = 1)."""
    holder_last_pct: float | None
    cost_ms_per_step: float | None
    sentence: str


@dataclass(frozen=True, kw_only=True)
class MoeReport:
    status: str
    reason: str = ""
    ep: int = 1
    num_experts: int = 0
    hot_expert_min_ratio: float = HOT_EXPERT_MIN_RATIO
    layers: list[MoeLayerReport] = field(default_factory=list)
    findings: list[MoeFinding] = field(default_factory=list)
    ep_groups: list[list[int]] = field(default_factory=list)
    """Global ranks of each expert-parallel group, by ep rank (records; empty with ep = 1 or no records)."""


MOE_IMBALANCE = "moe_imbalance"
"""The cause hint (stragglers.find_stragglers `cause_hints`) for a rank holding a hot expert."""


def moe_imbalance_hints(records: list[MoeRecord]) -> dict[int, str]:
    """rank -> why it may be late: the hottest expert it holds (routing records only, no traces)."""
    report = moe_report(records, [])
    hints: dict[int, str] = {}
    for finding in sorted(report.findings if report else [], key=lambda f: -f.tokens_vs_mean):
        for rank in finding.ranks:
            hints.setdefault(rank, f"{MOE_IMBALANCE} (expert {finding.expert}, which it holds, received "
                                   f"{finding.tokens_vs_mean:.1f}x the mean tokens in layer {finding.layer})")
    return hints


def uneven_routing_hints(records: list[MoeRecord]) -> dict[int, str]:
    """rank -> "uneven routing: expert E (layer L) on rank R" for each rank holding a hot expert (routing
    records only; hottest first, one clause per expert with the layers it is hot in)."""
    report = moe_report(records, [])
    layers: dict[tuple[int, int], list[int]] = defaultdict(list)
    ratio: dict[tuple[int, int], float] = defaultdict(float)
    for finding in report.findings if report else []:
        for rank in finding.ranks:
            layers[(rank, finding.expert)].append(finding.layer)
            ratio[(rank, finding.expert)] = max(ratio[(rank, finding.expert)], finding.tokens_vs_mean)
    clauses: dict[int, list[str]] = defaultdict(list)
    for (rank, expert) in sorted(layers, key=lambda k: -ratio[k]):
        found = sorted(layers[(rank, expert)])
        where = f"layer {found[0]}" if len(found) == 1 else f"layers {', '.join(map(str, found))}"
        clauses[rank].append(f"expert {expert} ({where}) on rank {rank}")
    return {rank: "uneven routing: " + ", ".join(parts) for rank, parts in clauses.items()}


def moe_records_noted(layout: RunLayout | None, files: dict[int, MoeFile],
                      ranks: list[int]) -> tuple[list[MoeRecord], list[str]]:
    """(every rank's well-formed MoE records, a note per file with lines or records left out), of the files
    inputs/records.py read. The records of one job agree on the ep degree and the expert count: those that
    disagree with the first rank's (another job's file, a damaged one) are left out and named."""
    if layout is None:
        return [], []
    found, notes = [], []
    for rank in sorted(set(files).intersection(ranks)):
        path, read = files[rank].path, files[rank].read
        if read is None:
            notes.append(f"{layout.relative(path)}: {files[rank].problem}")
            continue
        if read.bad_line_count:
            notes.append(f"{layout.relative(path)}: {read.bad_line_count} bad line(s) skipped ({read.first_problem})")
        reference = found[0] if found else (read.records[0] if read.records else None)
        kept = [r for r in read.records if _record_shape(r) == _record_shape(reference)]
        if len(kept) < len(read.records):
            notes.append(f"{layout.relative(path)}: {len(read.records) - len(kept)} record(s) left out: their ep "
                         "degree or expert count differs from the run's other records")
        found += kept
    return found, notes


def _record_shape(record: MoeRecord) -> tuple[int, int]:
    return record.ep, len(record.tokens_per_expert)


# --- per window: arrivals at the attributed all-to-alls ---------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MoeWindow:
    """What one window's traces say per (layer, rank): range times and all-to-all waits, summed (us)."""

    steps: dict[int, int]
    """rank -> profiled steps."""
    host_us: dict[tuple[int, int], dict[str, float]]
    """(layer, rank) -> kind -> us."""
    gpu_us: dict[tuple[int, int], dict[str, float]]
    gemm_us: dict[tuple[int, int], float]
    wait_us: dict[tuple[int, int, str], float]
    """(layer, rank, kind) -> us; also transfer_us."""
    transfer_us: dict[tuple[int, int, str], float]
    combine_instances: dict[tuple[int, int], int]
    """(layer, rank) -> combine instances it took part in; combine_last the ones it started last at."""
    combine_last: dict[tuple[int, int], int]
    combine_cost_us: dict[tuple[int, int], float]
    """(layer, rank) -> over the combines it started last at, the others' mean wait for it, summed."""


def moe_window(results: list[RankResult], matrix: ArrivalMatrix | None, records: list[MoeRecord]) -> MoeWindow | None:
    """The window's MoE times; None when no trace holds MoE ranges."""
    with_moe = [r for r in results if r.moe is not None]
    if not with_moe:
        return None
    window = MoeWindow(steps={r.rank: r.moe.steps for r in with_moe}, host_us={}, gpu_us={}, gemm_us={},
                       wait_us=defaultdict(float), transfer_us=defaultdict(float),
                       combine_instances=defaultdict(int), combine_last=defaultdict(int),
                       combine_cost_us=defaultdict(float))
    for result in with_moe:
        for layer in result.moe.layers:
            window.host_us[(layer.layer, result.rank)] = dict(layer.host_us)
            window.gpu_us[(layer.layer, result.rank)] = dict(layer.gpu_us)
            if layer.grouped_gemm_us is not None:
                window.gemm_us[(layer.layer, result.rank)] = layer.grouped_gemm_us
    if matrix is not None:
        _add_arrivals(window, with_moe, matrix, _ep_groups(records, matrix.ranks))
    return window


def _ep_groups(records: list[MoeRecord], ranks: list[int]) -> list[list[int]]:
    groups = sorted({tuple(r.ep_ranks) for r in records if r.ep > 1})
    return [list(g) for g in groups] if groups else [sorted(ranks)]


def _add_arrivals(window: MoeWindow, results: list[RankResult], matrix: ArrivalMatrix,
                  groups: list[list[int]]) -> None:
    tag = {a.key: (a.layer, a.kind) for r in results for a in r.moe.all_to_alls}
    row_of = {rank: row for row, rank in enumerate(matrix.ranks)}
    for column, key in enumerate(matrix.keys):
        if key not in tag:
            continue
        layer, kind = tag[key]
        for group in groups:
            rows = [row_of[r] for r in group if r in row_of and not np.isnan(matrix.start_us[row_of[r], column])]
            if len(rows) >= 2:
                _add_instance(window, matrix, column, rows, layer, kind)


def _add_instance(window: MoeWindow, matrix: ArrivalMatrix, column: int, rows: list[int], layer: int,
                  kind: str) -> None:
    starts, ends = matrix.start_us[rows, column], matrix.end_us[rows, column]
    last_row = int(np.argmax(starts))
    last = starts[last_row]
    for slot, row in enumerate(rows):
        rank = matrix.ranks[row]
        window.wait_us[(layer, rank, kind)] += float(last - starts[slot])
        window.transfer_us[(layer, rank, kind)] += float(max(ends[slot] - last, 0.0))
        if kind == MOE_COMBINE:
            window.combine_instances[(layer, rank)] += 1
    if kind == MOE_COMBINE:
        late = matrix.ranks[rows[last_row]]
        window.combine_last[(layer, late)] += 1
        others = np.delete(starts, last_row)
        window.combine_cost_us[(layer, late)] += float(np.mean(last - others))


# --- the report section --------------------------------------------------------------------------------


def moe_report(records: list[MoeRecord], windows: list[MoeWindow | None]) -> MoeReport | None:
    """The MoE section; None for a run without MoE ranges or records."""
    windows = [w for w in windows if w is not None]
    if not records and not windows:
        return None
    if not records:
        return MoeReport(status=STATUS_NOT_RECORDED, reason="no metrics/rank<R>.moe.jsonl records: routing "
                         "(tokens per expert, splits) unknown; range times only",
                         layers=[_layer_report(layer, [], windows) for layer in _window_layers(windows)])
    ep, experts = max(r.ep for r in records), len(records[0].tokens_per_expert)
    by_layer: dict[int, list[MoeRecord]] = defaultdict(list)
    for record in records:
        by_layer[record.layer].append(record)
    layers = [_layer_report(layer, by_layer[layer], windows) for layer in sorted(set(by_layer) | _window_layers(windows))]
    findings = [f for f in (_finding(layer, ep, experts, by_layer[layer.layer]) for layer in layers) if f]
    groups = [list(g) for g in sorted({tuple(r.ep_ranks) for r in records if r.ep > 1})]
    return MoeReport(status=STATUS_OK, ep=ep, num_experts=experts, layers=layers, findings=findings,
                     ep_groups=groups)


def _window_layers(windows: list[MoeWindow]) -> set[int]:
    return {layer for w in windows for (layer, _) in w.host_us}


def _layer_report(layer: int, records: list[MoeRecord], windows: list[MoeWindow]) -> MoeLayerReport:
    steps = len({r.step for r in records}) or 1
    experts = np.sum([r.tokens_per_expert for r in records], axis=0) / steps if records else np.zeros(0)
    recv: dict[int, float] = defaultdict(float)
    for record in records:
        recv[record.rank] += sum(record.recv_tokens) / steps
    ranks = sorted(recv)
    split_tokens, split_bytes = _split_matrices(records, ranks, steps)
    d2h = _record_d2h_ms(records)
    return MoeLayerReport(
        layer=layer, record_steps=steps, tokens_per_expert=[float(v) for v in experts],
        expert_max_over_mean=_max_over_mean(experts), hottest_expert=int(np.argmax(experts)) if experts.size else None,
        tokens_per_rank=dict(recv), rank_max_over_mean=_rank_imbalance(records, recv),
        split_tokens=split_tokens, split_bytes=split_bytes, split_ranks=ranks,
        ranks=_rank_layers(layer, windows, recv, d2h))


def _max_over_mean(values) -> float | None:
    values = np.asarray(values, dtype=float)
    return float(values.max() / values.mean()) if values.size and values.mean() > 0 else None


def _rank_imbalance(records: list[MoeRecord], recv: dict[int, float]) -> float | None:
    groups = {tuple(r.ep_ranks) for r in records if r.ep > 1}
    ratios = [_max_over_mean([recv[r] for r in group if r in recv]) for group in groups]
    ratios = [r for r in ratios if r is not None]
    return max(ratios) if ratios else None


def _split_matrices(records: list[MoeRecord], ranks: list[int], steps: int) -> tuple[list[list[float]], list[list[float]]]:
    index = {rank: slot for slot, rank in enumerate(ranks)}
    tokens, nbytes = np.zeros((len(ranks), len(ranks))), np.zeros((len(ranks), len(ranks)))
    for record in records:
        for peer, (count, size) in enumerate(zip(record.send_tokens, record.send_bytes)):
            destination = record.ep_ranks[peer] if record.ep > 1 else record.rank
            if destination in index:
                tokens[index[record.rank], index[destination]] += count / steps
                nbytes[index[record.rank], index[destination]] += size / steps
    return tokens.tolist(), nbytes.tolist()


def _record_d2h_ms(records: list[MoeRecord]) -> dict[int, float]:
    per_rank: dict[int, list[float]] = defaultdict(list)
    for record in records:
        if record.split_sizes_d2h_ms is not None:
            per_rank[record.rank].append(record.split_sizes_d2h_ms)
    return {rank: float(np.mean(values)) for rank, values in per_rank.items()}


def _rank_layers(layer: int, windows: list[MoeWindow], recv: dict[int, float],
                 d2h: dict[int, float]) -> list[MoeRankLayer]:
    ranks = sorted({rank for w in windows for (of_layer, rank) in w.host_us if of_layer == layer} | set(recv))
    return [_rank_layer(layer, rank, windows, recv.get(rank), d2h.get(rank)) for rank in ranks]


def _rank_layer(layer: int, rank: int, windows: list[MoeWindow], recv: float | None,
                d2h_record: float | None) -> MoeRankLayer:
    mine = [w for w in windows if (layer, rank) in w.host_us]
    steps = sum(w.steps[rank] for w in mine)
    if not steps:
        return MoeRankLayer(rank=rank, recv_tokens=recv, split_sizes_d2h_record_ms=d2h_record)

    def per_step(values) -> float | None:
        values = [v for v in values if v is not None]
        return sum(values) / steps / 1000.0 if values else None

    def kinds(attribute: str) -> dict[str, float]:
        summed: dict[str, float] = defaultdict(float)
        for w in mine:
            for kind, us in getattr(w, attribute)[(layer, rank)].items():
                summed[kind] += us
        return {kind: us / steps / 1000.0 for kind, us in summed.items()}

    def arrivals(attribute: str, kind: str) -> float | None:
        return per_step([getattr(w, attribute).get((layer, rank, kind)) for w in mine])

    host = kinds("host_us")
    combines = sum(w.combine_instances.get((layer, rank), 0) for w in mine)
    last = sum(w.combine_last.get((layer, rank), 0) for w in mine)
    return MoeRankLayer(
        rank=rank, host_ms=host, gpu_ms=kinds("gpu_us"), grouped_gemm_ms=per_step([w.gemm_us.get((layer, rank)) for w in mine]),
        split_sizes_d2h_ms=host.get(MOE_SPLIT_SIZES_D2H), split_sizes_d2h_record_ms=d2h_record,
        dispatch_wait_ms=arrivals("wait_us", MOE_DISPATCH), dispatch_transfer_ms=arrivals("transfer_us", MOE_DISPATCH),
        combine_wait_ms=arrivals("wait_us", MOE_COMBINE), combine_transfer_ms=arrivals("transfer_us", MOE_COMBINE),
        combine_last_pct=100.0 * last / combines if combines else None,
        combine_cost_ms=per_step([w.combine_cost_us.get((layer, rank)) for w in mine]) if combines else None,
        recv_tokens=recv)


def _finding(layer: MoeLayerReport, ep: int, experts: int, records: list[MoeRecord]) -> MoeFinding | None:
    ratio, expert = layer.expert_max_over_mean, layer.hottest_expert
    if ratio is None or expert is None or ratio < HOT_EXPERT_MIN_RATIO:
        return None
    head = f"expert {expert} received {ratio:.1f}x the mean tokens in layer {layer.layer}"
    if ep <= 1:
        return MoeFinding(layer=layer.layer, expert=expert, tokens_vs_mean=ratio, ep_rank=None, ranks=[],
                          holder_last_pct=None, cost_ms_per_step=None,
                          sentence=f"{head} (no expert parallelism: every rank runs it; load imbalance only)")
    ep_rank = expert // (experts // ep)
    holders = sorted({r.ep_ranks[ep_rank] for r in records if r.ep == ep})
    return _holder_finding(layer, expert, ratio, ep_rank, holders, head)


def _holder_finding(layer: MoeLayerReport, expert: int, ratio: float, ep_rank: int, holders: list[int],
                    head: str) -> MoeFinding:
    by_rank = {r.rank: r for r in layer.ranks}
    rows = [by_rank[h] for h in holders if h in by_rank and by_rank[h].combine_last_pct is not None]
    where = f"it lives on rank{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}"
    if not rows:
        return MoeFinding(layer=layer.layer, expert=expert, tokens_vs_mean=ratio, ep_rank=ep_rank, ranks=holders,
                          holder_last_pct=None, cost_ms_per_step=None,
                          sentence=f"{head}; {where} (no matched combine all-to-all: cost unknown)")
    last_pct = float(np.mean([r.combine_last_pct for r in rows]))
    cost = sum(r.combine_cost_ms for r in rows if r.combine_cost_ms is not None)
    ranks_word = "it" if len(holders) == 1 else "one of them"
    return MoeFinding(layer=layer.layer, expert=expert, tokens_vs_mean=ratio, ep_rank=ep_rank, ranks=holders,
                      holder_last_pct=last_pct, cost_ms_per_step=cost,
                      sentence=(f"{head}; {where}; {ranks_word} arrived last at layer {layer.layer}'s combine "
                                f"all-to-all {last_pct:.0f}% of the time, costing the others {cost:.2f} ms per step"))
