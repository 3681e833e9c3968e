"""Bandwidth of every collective instance, aggregated per (type, process group, message-size bucket).

For one collective instance (a column of the aligned arrival matrix, arrivals.py):
  - moving_us: data-movement time, the median over its members of (own end - the LAST member's arrival);
    no data moves before every member has arrived;
  - wait_us of a member: last arrival - own arrival; an instance's wait is the mean over its members;
  - algbw_gbps = bytes / moving time (GB/s, 1e9 bytes per second), bytes as comm_bytes.py counts them;
  - busbw_gbps = algbw x the nccl-tests factor for n members: all-reduce 2(n-1)/n; all-gather,
    reduce-scatter, all-to-all (n-1)/n; broadcast, reduce, send/recv 1.
A row sums its instances: algbw = total bytes / total moving time; wait_pct = wait / (wait + moving).
n is the `Group size` arg (the ranks whose traces hold the instance, where more or no arg). The row is
intra-node when all the ranks holding it are on one host, else inter-node, and is compared with that
link's peak bus bandwidth (PEAK_BUSBW_GBPS, or the `link_peak_gbps` override of analyze(), CLI
`--link-peak`).

All-to-all with bytes per peer (comm_bytes.py SplitBytes): an instance's bytes are the most any member
sent (the busiest sender sets the time; with uneven splits each member's `In msg nelems` differs). Bytes
per peer come from the trainer's records where they apply (metrics/rank<R>.moe.jsonl: every split whole,
for the token all-to-all of each MoE layer's dispatch and combine, the last one issued in the range, in
steps that ran the layer's forward once), else from the trace's split sizes; a list the profiler cut at
30 entries gives none ("split sizes truncated"), and the instance keeps the trace's own size.
A row is slow when its messages are at least SLOW_MIN_BYTES (smaller ones are bound by
latency, not by the link) and its busbw is below SLOW_PEAK_PCT of the peak.
Each timed instance is also kept (up to INSTANCES_KEPT, in instance order) with its own algbw, busbw and
share of its row's peak, for the merged trace's marks over each collective.

One rank's trace (users often profile only rank 0: STATUS_ONE_RANK): no last arrival is known, so an
instance's time is its whole duration, waiting for the others included, and its algbw/busbw are lower
bounds ("apparent"); a row's algbw/busbw is its best instance's (the least waiting: the estimate), its
moving_us the summed durations, wait_us 0 (not measurable); n is the `Group size` arg and the scope is
assumed intra-node up to RANKS_PER_NODE_ASSUMED members (one rank's trace names no peer host).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from fleetscope.traces.formats import MOE_COMBINE, MOE_DISPATCH, MoeRecord

from fleetscope.analysis.cross_rank.arrivals import ArrivalMatrix
from fleetscope.analysis.per_rank.collectives import SOURCE_NCCL, CollectiveKey
from fleetscope.analysis.per_rank.comm_bytes import (
    SPLIT_NOT_RECORDED,
    SPLIT_RECORDS,
    SPLIT_TRUNCATED,
    SplitBytes,
)
from fleetscope.analysis.per_rank.names import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    REDUCE_SCATTER,
)
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.traces.device_peaks import peer_link

INTRA_NODE, INTER_NODE = "intra-node", "inter-node"
PEAK_BUSBW_GBPS = {INTRA_NODE: 450.0, INTER_NODE: 50.0}
"""Peak bus bandwidth per direction, GB/s: intra-node NVLink 4 of H100/H200 SXM (18 links x 25 GB/s);
inter-node InfiniBand NDR 400 Gb/s = 50 GB/s per NIC, one NIC per GPU."""
PEAK_SOURCES = {INTRA_NODE: "NVLink 4 (H100/H200 SXM), 450 GB/s per direction",
                INTER_NODE: "InfiniBand NDR 400 Gb/s, 50 GB/s per NIC (one per GPU)"}
BUCKET_BASE = 4
"""Message sizes are bucketed in powers of 4 bytes (1 MiB, 4 MiB, 16 MiB, ...)."""
STATUS_OK, STATUS_NOT_RECORDED, STATUS_NO_MATRIX = "ok", "not recorded", "not matched"
STATUS_ONE_RANK = "one rank, lower bound"
ONE_RANK_REASON = ("one rank's trace: each instance's apparent bandwidth over its whole duration, waiting for the "
                   "other ranks included (a lower bound); per row the best instance is the estimate")
RANKS_PER_NODE_ASSUMED = 8
SLOW_PEAK_PCT = 50.0
SLOW_MIN_BYTES = 1 << 20
INSTANCES_KEPT = 5000


@dataclass(frozen=True, kw_only=True)
class BandwidthRow:
    collective: str
    """Collective type (names.py: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, ...)."""
    group: str | None
    """Process group label; None where the trace names none."""
    bucket_min_bytes: int
    bucket_max_bytes: int
    """Message sizes in [min, max): consecutive powers of 4."""
    size_bucket: str
    """The bucket in words ("64 MiB-256 MiB")."""
    members: int
    """Ranks taking part (largest over the row's instances): the `Group size` arg, or the ranks whose
    traces hold the instance when that is more (or the arg is missing). The bus factor uses it."""
    scope: str
    """INTRA_NODE or INTER_NODE, from the members' hosts."""
    instances: int
    total_bytes: float
    moving_us: float
    wait_us: float
    wait_pct: float
    algbw_gbps: float
    busbw_gbps: float
    peak_busbw_gbps: float
    peak_pct: float
    """busbw as a percentage of peak_busbw_gbps."""
    verdict: str
    split_status: dict[str, int] = field(default_factory=dict)
    """All-to-all: instances by where their bytes per peer come from (comm_bytes.py SPLIT_*); empty otherwise."""
    max_peer_bytes: float | None = None
    """All-to-all: the most bytes one member sent one peer in one instance (None: no bytes per peer)."""
    sender_max_over_mean: float | None = None
    """All-to-all: over the instances, the largest busiest-sender / mean-sender bytes (1: even)."""
    slow: bool = False
    """Messages of at least SLOW_MIN_BYTES moving below SLOW_PEAK_PCT of the link's peak."""


@dataclass(frozen=True, kw_only=True)
class InstanceBandwidth:
    """One timed collective instance (module docstring)."""

    step: int
    name: str
    ordinal: int
    """The instance key (collectives.py), as in stragglers' worst_instances."""
    row: int
    """Index of its row in Bandwidth.rows."""
    bytes: float
    members: int
    moving_us: float
    wait_us: float
    algbw_gbps: float
    busbw_gbps: float
    peak_pct: float
    """busbw as a percentage of its row's peak."""


@dataclass(frozen=True, kw_only=True)
class Bandwidth:
    status: str
    """STATUS_OK; STATUS_NOT_RECORDED (no message sizes in the traces); STATUS_ONE_RANK (one rank's trace:
    apparent bandwidth, lower bounds, module docstring); STATUS_NO_MATRIX (fewer than two ranks with
    collectives and no one rank's sizes to bound it)."""
    reason: str = ""
    rows: list[BandwidthRow] = field(default_factory=list)
    """Sorted by moving time, largest first."""
    peak_busbw_gbps: dict[str, float] = field(default_factory=dict)
    """The peaks used, by scope."""
    peak_source: str = ""
    """Where the peaks come from (the table, or the override)."""
    instances_with_bytes: int = 0
    instances_without_bytes: int = 0
    """Matched instances whose size no rank recorded, or whose movement time is not positive."""
    instances: list[InstanceBandwidth] = field(default_factory=list)
    """Up to INSTANCES_KEPT timed instances, in instance order."""


def bus_factor(collective: str, members: int) -> float:
    """nccl-tests' busbw / algbw for a collective of `members` ranks."""
    if members < 2:
        return 0.0
    if collective == ALL_REDUCE:
        return 2.0 * (members - 1) / members
    if collective in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return (members - 1) / members
    return 1.0


def size_bucket(size_bytes: float) -> tuple[int, int]:
    """[4^k, 4^(k+1)) holding `size_bytes` (sizes below 1 byte go to [0, 1))."""
    if size_bytes < 1:
        return 0, 1
    low = BUCKET_BASE ** int(math.floor(math.log(size_bytes, BUCKET_BASE)))
    while low > size_bytes:
        low //= BUCKET_BASE
    while low * BUCKET_BASE <= size_bytes:
        low *= BUCKET_BASE
    return low, low * BUCKET_BASE


def format_bytes(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def collective_bandwidth(results: list[RankResult], matrix: ArrivalMatrix | None,
                         link_peak_gbps: float | None = None, moe_records: list[MoeRecord] = ()) -> Bandwidth:
    """The window's bandwidth rows from the clock-aligned arrival `matrix`; `moe_records`: the trainer's
    MoE records, preferred for the bytes per peer of the MoE token all-to-alls."""
    peaks, peak_source = _peaks(link_peak_gbps, results)
    splits = _splits_by_key(results, list(moe_records))
    sizes = _with_split_sizes(_sizes_by_key(results), splits)
    if not sizes:
        return Bandwidth(status=STATUS_NOT_RECORDED, reason=_not_recorded_reason(results),
                         peak_busbw_gbps=peaks, peak_source=peak_source)
    holders = [r for r in results if r.collectives.sizes is not None and len(r.collectives)]
    if matrix is None and len(holders) == 1:
        rows, instances = _one_rank_rows(holders[0], sizes, peaks)
        if rows:
            return Bandwidth(status=STATUS_ONE_RANK, reason=ONE_RANK_REASON, rows=rows, peak_busbw_gbps=peaks,
                             peak_source=peak_source, instances_with_bytes=sum(r.instances for r in rows),
                             instances_without_bytes=len(holders[0].collectives) - len(instances), instances=instances)
    if matrix is None:
        return Bandwidth(status=STATUS_NO_MATRIX, peak_busbw_gbps=peaks, peak_source=peak_source,
                         reason="fewer than two ranks with collectives: wait and data movement cannot be told apart")
    rows, instances, skipped = _rows(matrix, sizes, peaks, splits)
    return Bandwidth(status=STATUS_OK, rows=rows, peak_busbw_gbps=peaks, peak_source=peak_source,
                     instances_with_bytes=sum(r.instances for r in rows), instances_without_bytes=skipped,
                     instances=instances)


def _peaks(override: float | None, results: list[RankResult]) -> tuple[dict[str, float], str]:
    """The links' peaks: given, else the intra-node link of the GPU the traces name (one kind for every rank
    that names one), else the assumed H100/H200 SXM node."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"link_peak_gbps must be > 0, got {override}")
        return {INTRA_NODE: override, INTER_NODE: override}, f"given: {override:g} GB/s for every link"
    links = {peer_link(r.device_name) for r in results if r.device_name}
    peaks, sources = dict(PEAK_BUSBW_GBPS), dict(PEAK_SOURCES)
    if len(links) == 1 and next(iter(links))[2] > 0:
        device, link, rate = next(iter(links))
        peaks[INTRA_NODE] = rate
        sources[INTRA_NODE] = f"{link} of the {device} the traces name, {rate:g} GB/s per direction"
    else:
        sources[INTRA_NODE] += (" (assumed: the traces name GPUs of different kinds)" if len(links) > 1 else
                                " (assumed: the traces name no GPU fleetscope knows)")
    return peaks, "; ".join(f"{scope}: {text}" for scope, text in sources.items())


def _sizes_by_key(results: list[RankResult]) -> dict[CollectiveKey, tuple[float, str, str | None, int]]:
    """Instance key -> (bytes, collective type, group, recorded group size or -1), from the first rank
    that recorded it."""
    found: dict[CollectiveKey, tuple[float, str, str | None, int]] = {}
    for result in results:
        sizes = result.collectives.sizes
        if sizes is None:
            continue
        for key, size, kind, group, members in zip(result.collectives.keys, sizes.bytes, sizes.collective,
                                                   sizes.group, sizes.group_size.tolist()):
            if key not in found and not np.isnan(size) and kind is not None:
                found[key] = (float(size), kind, group, int(members))
    return found


def _splits_by_key(results: list[RankResult], records: list[MoeRecord]) -> dict[CollectiveKey, dict[int, SplitBytes]]:
    """Instance key -> rank -> its bytes per peer: the trainer's records where they apply, else the trace's."""
    found: dict[CollectiveKey, dict[int, SplitBytes]] = defaultdict(dict)
    for result in results:
        sizes = result.collectives.sizes
        for key, split in zip(result.collectives.keys, sizes.splits if sizes is not None else []):
            if split is not None:
                found[key][result.rank] = split
    for (rank, key), split in _record_splits(results, records).items():
        found[key][rank] = split
    return dict(found)


def _record_splits(results: list[RankResult], records: list[MoeRecord]) -> dict[tuple[int, CollectiveKey], SplitBytes]:
    """(rank, key) -> bytes per ep peer from the records, for the last all-to-all each rank issued in each
    MoE layer's dispatch (sends its send_bytes) and combine (returns its recv_bytes), in the steps where
    the trace shows one forward of the layer per profiled step (records sum every forward of a step)."""
    by_step = {(r.rank, r.step, r.layer): r for r in records}
    found = {}
    for result in results:
        moe = result.moe
        if moe is None:
            continue
        once = {(layer.layer, kind) for layer in moe.layers for kind in (MOE_DISPATCH, MOE_COMBINE)
                if layer.calls.get(kind) == moe.steps}
        last: dict[tuple[int, int, str], CollectiveKey] = {}
        for call in moe.all_to_alls:                     # sorted by key: ordinals in issue order
            if (call.layer, call.kind) in once:
                last[(call.key[0], call.layer, call.kind)] = call.key
        for (step, layer, kind), key in last.items():
            record = by_step.get((result.rank, step, layer))
            if record is None:
                continue
            send, recv = (record.send_bytes, record.recv_bytes) if kind == MOE_DISPATCH else (
                record.recv_bytes, record.send_bytes)
            found[(result.rank, key)] = SplitBytes(status=SPLIT_RECORDS, send_bytes=tuple(map(float, send)),
                                                   recv_bytes=tuple(map(float, recv)))
    return found


def _with_split_sizes(sizes: dict[CollectiveKey, tuple[float, str, str | None, int]],
                      splits: dict[CollectiveKey, dict[int, SplitBytes]]) -> dict:
    """All-to-all instances sized by their busiest sender where bytes per peer are known (also instances
    whose trace records no message, e.g. gloo, when the trainer's records cover them)."""
    sized = dict(sizes)
    for key, by_rank in splits.items():
        sent = [sum(s.send_bytes) for s in by_rank.values() if s.known]
        if not sent:
            continue
        _, kind, group, members = sized.get(key, (0.0, ALL_TO_ALL, None, -1))
        if kind == ALL_TO_ALL:
            sized[key] = (float(max(sent)), kind, group, members)
    return sized


def _instance_split(by_rank: dict[int, SplitBytes] | None, present_ranks: list[int]) -> tuple[str, float | None, float | None]:
    """(status, largest bytes one member sent one peer, busiest over mean sender) of one all-to-all instance."""
    members = [by_rank.get(r) for r in present_ranks] if by_rank else []
    if not members or any(m is None or not m.known for m in members):
        truncated = any(m is not None and m.status == SPLIT_TRUNCATED for m in members)
        return (SPLIT_TRUNCATED if truncated else SPLIT_NOT_RECORDED), None, None
    statuses = {m.status for m in members}
    status = SPLIT_RECORDS if SPLIT_RECORDS in statuses else sorted(statuses)[0]
    sent = [sum(m.send_bytes) for m in members]
    mean = float(np.mean(sent))
    return status, max(max(m.send_bytes) for m in members), (max(sent) / mean if mean > 0 else None)


def _not_recorded_reason(results: list[RankResult]) -> str:
    sources = sorted({r.collectives.source for r in results if r.collectives.source})
    if not sources:
        return "no collectives in the traces"
    if SOURCE_NCCL not in sources:
        return (f"collectives come from {', '.join(sources)}: those record no message sizes "
                "(gloo CPU traces have no record_param_comms / NCCL kernel args; with record_shapes, all-to-alls "
                "are sized from the c10d::alltoall_base_ ops that issue them)")
    return "NCCL kernels carry no 'In msg nelems' / 'dtype' args (PyTorch older than 2.3?)"


def _rows(matrix: ArrivalMatrix, sizes: dict, peaks: dict[str, float],
          splits: dict[CollectiveKey, dict[int, SplitBytes]] | None = None,
          ) -> tuple[list[BandwidthRow], list[InstanceBandwidth], int]:
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
    scopes: dict[tuple, set[str]] = defaultdict(set)
    split_rows: dict[tuple, list] = defaultdict(lambda: [defaultdict(int), None, None])
    timed: list[tuple[CollectiveKey, tuple, float, float, float, int]] = []
    skipped = 0
    for column, key in enumerate(matrix.keys):
        instance = _instance(matrix, column)
        if key not in sizes or instance is None:
            skipped += 1
            continue
        size, kind, group, recorded_members = sizes[key]
        moving_us, wait_us, members, hosts = instance
        members = max(members, recorded_members)
        row_key = (kind, group, size_bucket(size))
        total = totals[row_key]
        total[0] += 1
        total[1] += size
        total[2] += moving_us
        total[3] += wait_us
        total[4] = max(total[4], members)
        scopes[row_key] |= hosts
        if kind == ALL_TO_ALL:
            present = [rank for rank, here in zip(matrix.ranks, matrix.present[:, column]) if here]
            status, peer_max, imbalance = _instance_split((splits or {}).get(key), present)
            counts = split_rows[row_key]
            counts[0][status] += 1
            counts[1] = max(v for v in (counts[1], peer_max) if v is not None) if peer_max is not None else counts[1]
            counts[2] = max(v for v in (counts[2], imbalance) if v is not None) if imbalance is not None else counts[2]
        timed.append((key, row_key, size, moving_us, wait_us, members))
    rows = sorted(((_row(key, total, scopes[key], peaks, split_rows.get(key)), key) for key, total in totals.items()),
                  key=lambda item: -item[0].moving_us)
    index = {key: position for position, (_, key) in enumerate(rows)}
    instances = [_instance_row(entry, index[entry[1]], rows[index[entry[1]]][0]) for entry in timed[:INSTANCES_KEPT]]
    return [row for row, _ in rows], instances, skipped


def _one_rank_rows(result: RankResult, sizes: dict, peaks: dict[str, float],
                   ) -> tuple[list[BandwidthRow], list[InstanceBandwidth]]:
    """STATUS_ONE_RANK: per instance its whole duration; per (type, group, bucket) the best instance."""
    calls = result.collectives
    by_row: dict[tuple, list[tuple]] = defaultdict(list)
    for key, start, end in zip(calls.keys, calls.start_us.tolist(), calls.end_us.tolist()):
        if key not in sizes or not end - start > 0:
            continue
        size, kind, group, members = sizes[key]
        by_row[(kind, group, size_bucket(size))].append((key, size, end - start, max(members, 1)))
    rows = []
    for (kind, group, (low, high)), entries in by_row.items():
        members = max(e[3] for e in entries)
        scope = INTRA_NODE if members <= RANKS_PER_NODE_ASSUMED else INTER_NODE
        best = max(e[1] / e[2] for e in entries) / 1e3
        busbw, peak = best * bus_factor(kind, members), peaks[scope]
        bucket = f"{format_bytes(low)}-{format_bytes(high)}"
        where = f"{group} ({scope}, assumed)" if group else f"the {scope} group (assumed)"
        verdict = (f"{kind.replace('_', '-')} of {bucket} on {where}: apparent busbw at least {busbw:.1f} GB/s "
                   f"({100 * busbw / peak:.0f}% of {peak:g} GB/s), the best of {len(entries)} instance(s) on one "
                   "rank's trace, waiting for the other ranks included: a lower bound")
        rows.append((BandwidthRow(
            collective=kind, group=group, bucket_min_bytes=low, bucket_max_bytes=high, size_bucket=bucket,
            members=members, scope=scope, instances=len(entries), total_bytes=sum(e[1] for e in entries),
            moving_us=sum(e[2] for e in entries), wait_us=0.0, wait_pct=0.0, algbw_gbps=best, busbw_gbps=busbw,
            peak_busbw_gbps=peak, peak_pct=100.0 * busbw / peak, verdict=verdict), entries))
    rows.sort(key=lambda item: -item[0].moving_us)
    instances = [InstanceBandwidth(step=key[0], name=key[1], ordinal=key[2], row=position, bytes=size,
                                   members=members, moving_us=dur, wait_us=0.0, algbw_gbps=size / dur / 1e3,
                                   busbw_gbps=size / dur / 1e3 * bus_factor(row.collective, members),
                                   peak_pct=100.0 * size / dur / 1e3 * bus_factor(row.collective, members)
                                   / row.peak_busbw_gbps)
                 for position, (row, entries) in enumerate(rows) for key, size, dur, members in entries]
    instances.sort(key=lambda i: (i.step, i.name, i.ordinal))
    return [row for row, _ in rows], instances[:INSTANCES_KEPT]


def _instance_row(entry: tuple, position: int, row: BandwidthRow) -> InstanceBandwidth:
    (step, name, ordinal), _, size, moving_us, wait_us, members = entry
    algbw = size / moving_us / 1e3
    busbw = algbw * bus_factor(row.collective, members)
    return InstanceBandwidth(step=step, name=name, ordinal=ordinal, row=position, bytes=size, members=members,
                             moving_us=moving_us, wait_us=wait_us, algbw_gbps=algbw, busbw_gbps=busbw,
                             peak_pct=100.0 * busbw / row.peak_busbw_gbps)


def _instance(matrix: ArrivalMatrix, column: int) -> tuple[float, float, int, set[str]] | None:
    """(moving_us, mean wait_us, members, member hosts) of one instance; None when it cannot be timed."""
    present = matrix.present[:, column]
    if present.sum() < 2:
        return None
    starts, ends = matrix.start_us[present, column], matrix.end_us[present, column]
    last_arrival = starts.max()
    moving_us = float(np.median(ends - last_arrival))
    if not moving_us > 0:
        return None
    hosts = {host for host, here in zip(matrix.hosts, present) if here}
    return moving_us, float(np.mean(last_arrival - starts)), int(present.sum()), hosts


def _row(key: tuple, total: list, hosts: set[str], peaks: dict[str, float], split: list | None = None) -> BandwidthRow:
    (kind, group, (low, high)), (instances, size, moving_us, wait_us, members) = key, total
    scope = INTRA_NODE if len(hosts) == 1 else INTER_NODE
    algbw = size / moving_us / 1e3
    busbw = algbw * bus_factor(kind, members)
    peak = peaks[scope]
    bucket = f"{format_bytes(low)}-{format_bytes(high)}"
    wait_pct = 100.0 * wait_us / (wait_us + moving_us)
    where = f"{group} ({scope})" if group else f"the {scope} group"
    verdict = (f"{kind.replace('_', '-')} of {bucket} on {where} runs at {100 * busbw / peak:.0f}% of bus peak "
               f"({busbw:.1f} of {peak:g} GB/s); {wait_pct:.0f}% of its time is waiting for the last rank")
    return BandwidthRow(collective=kind, group=group, bucket_min_bytes=low, bucket_max_bytes=high,
                        size_bucket=bucket, members=members, scope=scope, instances=instances,
                        total_bytes=size, moving_us=moving_us, wait_us=wait_us, wait_pct=wait_pct,
                        algbw_gbps=algbw, busbw_gbps=busbw, peak_busbw_gbps=peak,
                        peak_pct=100.0 * busbw / peak, verdict=verdict + _split_verdict(split),
                        split_status=dict(split[0]) if split else {}, max_peer_bytes=split[1] if split else None,
                        sender_max_over_mean=split[2] if split else None,
                        slow=low >= SLOW_MIN_BYTES and 100.0 * busbw / peak < SLOW_PEAK_PCT)


def _split_verdict(split: list | None) -> str:
    if not split:
        return ""
    if split[0].get(SPLIT_TRUNCATED):
        return f"; split sizes truncated in {split[0][SPLIT_TRUNCATED]} instance(s): no bytes per peer there"
    if split[2] is not None and split[2] > 1.0:
        return f"; the busiest sender moves {split[2]:.2f}x the mean"
    return ""
