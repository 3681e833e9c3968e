"""Trace files that hold several ranks fused into one, and splitting them back into one document per rank.

Tools that fuse the ranks of a job into one Chrome trace for viewing (e.g. TraceLens's TraceFuse) keep each
event's rank in `args.rank`, offset the pids (and the ids that link events: `id`, `correlation`, `External id`)
by the rank so that ranks do not collide, and keep the original of each offset field as `<field>_raw` in its
args; others name each rank's processes ("RANK 3 - CPU", "rank 3 GPU") and offset the pids alone. Read as one
rank, such a file pools four GPUs' steps, busy time and collectives into one rank's: the analysis refuses it
with what to do, and `fleetscope split` writes one ordinary trace per rank, the offsets undone.
"""

from __future__ import annotations

import re
from typing import Any

RANK_ARG = "rank"
RAW_SUFFIX = "_raw"
OFFSET_FIELDS = ("pid", "tid", "id")
"""Event fields a fuser may offset by rank (the original kept in args as `<field>_raw`)."""
OFFSET_ARGS = ("correlation", "External id", "external id")
"""Args a fuser may offset by rank (the original kept in args as `<arg>_raw`)."""
PROCESS_RANK = re.compile(r"\brank[\s_#:-]*(\d{1,7})\b", re.IGNORECASE)
"""A process name that names its rank ("RANK 3 - CPU", "rank_3 GPU")."""
MIN_RANK_MENTIONS = 8
"""`"rank"` keys in a file before it is parsed to be checked: an ordinary trace names its rank once
(distributedInfo); a fused one on every event."""


def may_be_fused(data: bytes) -> bool:
    """A cheap look at a trace's JSON bytes: whether it could hold several ranks (then fused_ranks decides)."""
    return data.count(b'"rank"') >= MIN_RANK_MENTIONS or _names_a_rank(data[:1 << 20]) \
        and data.count(b"process_name") > 1


def _names_a_rank(head: bytes) -> bool:
    """Whether PROCESS_RANK matches in `head`'s text. An ASCII head is matched only where "ran" starts, in any
    case (the pattern's r, a and n have no case forms beyond ASCII): the same answer as searching the whole
    megabyte case-insensitively, which cost more than the trace's inflate."""
    if not head.isascii():
        return PROCESS_RANK.search(head.decode("utf-8", "replace")) is not None
    text, lowered = head.decode("ascii"), head.lower()
    start = lowered.find(b"ran")
    while start >= 0:
        if PROCESS_RANK.match(text, start) is not None:
            return True
        start = lowered.find(b"ran", start + 1)
    return False


def fused_ranks(document: dict[str, Any]) -> dict[int, int | None]:
    """{rank: None} by args.rank, or {pid: rank} by process names, where the document holds two ranks or more;
    {} for an ordinary trace."""
    events = document.get("traceEvents")
    if not isinstance(events, list):
        return {}
    by_arg = {_arg_rank(event) for event in events} - {None}
    if len(by_arg) >= 2:
        return {rank: None for rank in sorted(by_arg)}
    by_pid = _process_ranks(events)
    return by_pid if len(set(by_pid.values())) >= 2 else {}


def split_fused(document: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """One Kineto document per rank of a fused one, each event with its offset fields restored and its rank
    arg removed; events that carry no rank (the fuser's own metadata) go to every rank. {} when not fused."""
    found = fused_ranks(document)
    if not found:
        return {}
    events = document["traceEvents"]
    by_pid = {pid: rank for pid, rank in found.items() if rank is not None}
    parts: dict[int, list] = {rank: [] for rank in (set(by_pid.values()) or set(found))}
    for event in events:
        if not isinstance(event, dict):
            continue
        rank = _arg_rank(event) if not by_pid else by_pid.get(_hashable(event.get("pid")))
        targets = [rank] if rank in parts else list(parts)
        for target in targets:
            parts[target].append(_restored(event))
    header = {key: value for key, value in document.items() if key != "traceEvents"}
    return {rank: {**header, "distributedInfo": _distributed_info(header.get("distributedInfo"), rank),
                   "traceEvents": part}
            for rank, part in sorted(parts.items())}


def _arg_rank(event: Any) -> int | None:
    args = event.get("args") if isinstance(event, dict) else None
    rank = args.get(RANK_ARG) if isinstance(args, dict) else None
    return rank if type(rank) is int and 0 <= rank < 1 << 24 else None


def _process_ranks(events: list) -> dict[Any, int]:
    """pid -> rank from `process_name` metadata that names a rank."""
    found = {}
    for event in events:
        if isinstance(event, dict) and event.get("ph") == "M" and event.get("name") == "process_name":
            args = event.get("args")
            name = args.get("name") if isinstance(args, dict) else None
            match = PROCESS_RANK.search(name) if isinstance(name, str) else None
            if match:
                found[_hashable(event.get("pid"))] = int(match.group(1))
    return found


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (int, str, float)) or value is None else repr(value)


def _restored(event: dict) -> dict:
    """A copy of the event with each `<field>_raw` put back in its field and the rank arg removed."""
    args = event.get("args")
    if not isinstance(args, dict):
        return dict(event)
    args = dict(args)
    restored = {key: value for key, value in event.items() if key != "args"}
    for name in OFFSET_FIELDS:
        if name + RAW_SUFFIX in args:
            restored[name] = args.pop(name + RAW_SUFFIX)
    for name in OFFSET_ARGS:
        if name + RAW_SUFFIX in args:
            args[name] = args.pop(name + RAW_SUFFIX)
    args.pop(RANK_ARG, None)
    restored["args"] = args
    return restored


def _distributed_info(info: Any, rank: int) -> dict[str, Any]:
    """The file's own `distributedInfo` with this rank; its world size only where the file states one that holds
    the rank. A fused file need not hold every rank of its job (TraceFuse writes no metadata at all), so the
    number of ranks it holds is no world size: claiming one would call a partial set complete."""
    base = dict(info) if isinstance(info, dict) else {}
    size = base.pop("world_size", None)
    return {**base, "rank": rank, **({"world_size": size} if type(size) is int and size > rank else {})}
