"""Why a job hung, from the ranks' Flight Recorder dumps (traces/flight_recorder.py).

Per process group: the last collective each rank entered (its highest collective_seq_id) and completed
(the recorder's pg_status, given as a collective_seq_id; NCCL also marks entries `completed`), the collective
the most advanced ranks wait in, the ranks that never entered it, and collectives whose type, sizes or dtypes
differ across ranks at the same sequence number. Joined with who detected the hang, each waiting rank's recorded
stack, each late rank's main-thread stack at dump time, the last profiled window and the tail of the ranks' logs.

PyTorch's own analyzer (torch.distributed.flight_recorder.components.builder.build_collectives) runs on
the same entries as a cross-check and its mismatch verdicts are listed; we go beyond it where it does not
fit: it needs every rank's pg_config with ranks (gloo's recorder leaves them empty, so the trainer records
them from c10d), it reads pickles (we read JSON, never unpickling a run directory), and it does not name
the late rank of a hang or say what that rank was doing instead.
"""

from __future__ import annotations

import ast
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from fleetscope.analysis.inputs.records import RunRecords
from fleetscope.traces.flight_recorder import Dumps
from fleetscope.traces.validate import MAX_LISTED_RANKS, MAX_WORLD_SIZE

LOG_TAIL_LINES = 3
FRAMES_SHOWN = 6
TORCH_PATH = "/site-packages/torch/"
MAX_RANKS_TEXT = 1 << 16
"""A pg_config `ranks` string longer than this is not parsed (a job's own lists are far shorter)."""


@dataclass(frozen=True, kw_only=True)
class Call:
    """One collective as one rank recorded it."""

    seq: int
    name: str
    input_sizes: list = field(default_factory=list)
    input_dtypes: list = field(default_factory=list)
    state: str = ""
    frames: list[str] = field(default_factory=list)
    """`function (file:line)`, innermost first."""

    @property
    def signature(self) -> str:
        return f"{self.name} sizes={self.input_sizes} dtypes={self.input_dtypes}"


@dataclass(frozen=True, kw_only=True)
class RankInGroup:
    rank: int
    last_entered: Call | None
    last_completed_seq: int | None
    """From the recorder's pg_status (None: not recorded)."""


@dataclass(frozen=True, kw_only=True)
class GroupHang:
    group: str
    desc: str
    ranks: list[int]
    members: list[RankInGroup]
    waiting_in: Call | None
    """The collective the most advanced ranks entered last (None: every rank is at the same one)."""
    waiting_ranks: list[int]
    late_ranks: list[int]
    """Members that never entered `waiting_in`."""
    mismatches: list[str]


@dataclass(frozen=True, kw_only=True)
class HangReport:
    dumped_ranks: list[int]
    missing_dumps: list[int]
    detected_by: list[dict[str, Any]]
    """{rank, step, seconds, at}: ranks whose watchdog saw no progress."""
    dump_reasons: dict[int, str]
    groups: list[GroupHang]
    late_ranks: list[int]
    verdict: str
    late_rank_stacks: dict[int, list[str]] = field(default_factory=dict)
    """Main-thread stack of each late rank when it dumped, innermost first."""
    last_steps: dict[int, int] = field(default_factory=dict)
    """Last step each rank wrote metrics for."""
    last_window: str = ""
    log_tails: dict[int, list[str]] = field(default_factory=dict)
    pytorch_analysis: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def analyze_hang(records: RunRecords, world_size: int | None = None) -> HangReport | None:
    """The hang report of a run directory (its records, inputs/records.py); None when it holds no Flight
    Recorder dump."""
    dumps = records.dumps
    if not dumps.by_rank:
        return None
    world = min(world_size or max([*dumps.by_rank, *(m.rank for m in dumps.markers)]) + 1, MAX_WORLD_SIZE)
    groups = [_group_hang(name, desc, ranks, dumps) for name, desc, ranks in _groups(dumps)]
    late = sorted({r for g in groups for r in g.late_ranks})
    missing, missing_total = _missing_dumps(world, dumps)
    problems = list(dumps.problems)
    if missing_total > len(missing):
        problems.append(f"{missing_total} of {world} ranks have no dump; the first {len(missing)} are listed")
    report = HangReport(
        dumped_ranks=sorted(dumps.by_rank), missing_dumps=missing,
        detected_by=[asdict(m) for m in dumps.markers],
        dump_reasons={r: str(d.get("reason", "")) for r, d in sorted(dumps.by_rank.items())},
        groups=groups, late_ranks=late, verdict=_verdict(groups, dumps),
        late_rank_stacks={r: _frames(dumps.by_rank[r].get("python_stack", []), innermost_last=True)
                          for r in late if r in dumps.by_rank},
        last_steps=_last_steps(records, world), last_window=_last_window(records),
        log_tails={r: _log_tail(records, r) for r in late or sorted(dumps.by_rank)},
        pytorch_analysis=pytorch_cross_check(dumps), problems=problems + list(records.hang.window_problems),
    )
    return report


def _missing_dumps(world: int, dumps: Dumps) -> tuple[list[int], int]:
    """The first MAX_LISTED_RANKS ranks below `world` without a dump, and how many there are in all."""
    listed = []
    for rank in range(world):
        if rank not in dumps.by_rank:
            listed.append(rank)
            if len(listed) == MAX_LISTED_RANKS:
                break
    return listed, world - sum(1 for r in dumps.by_rank if r < world)


def _groups(dumps: Dumps) -> list[tuple[str, str, list[int]]]:
    """(name, desc, member ranks) of every process group seen in the dumps' entries."""
    configs: dict[str, dict] = {}
    for dump in dumps.by_rank.values():
        for name, config in dump.get("pg_config", {}).items():
            if isinstance(config, dict):
                configs.setdefault(str(name), config)
    seen: dict[str, str] = {}
    for dump in dumps.by_rank.values():
        for entry in dump["entries"]:
            name, desc = _group_of(entry)
            seen.setdefault(name, desc)
    groups = []
    for name, desc in sorted(seen.items()):
        ranks = _ranks(configs.get(name, {}).get("ranks")) or sorted(dumps.by_rank)
        groups.append((name, desc, ranks))
    return groups


def _group_of(entry: dict) -> tuple[str, str]:
    group = entry.get("process_group") or ["?", ""]
    if not isinstance(group, (list, tuple)) or not group:
        group = [str(group), ""]
    return str(group[0]), str(group[1]) if len(group) > 1 else ""


def _ranks(text: Any) -> list[int]:
    try:
        value = ast.literal_eval(text[:MAX_RANKS_TEXT]) if isinstance(text, str) else text
        if not isinstance(value, (list, tuple)) or len(value) > MAX_WORLD_SIZE:
            return []
        if not all(type(r) is int and 0 <= r < MAX_WORLD_SIZE for r in value):
            return []  # "[1e999]", floats, negative or absurd ranks: a damaged config, not members
        return sorted(set(value))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return []


def _group_hang(name: str, desc: str, ranks: list[int], dumps: Dumps) -> GroupHang:
    calls = {r: _calls(dumps.by_rank[r], name) for r in ranks if r in dumps.by_rank}
    members = [RankInGroup(rank=r, last_entered=calls[r][-1] if calls[r] else None,
                           last_completed_seq=_completed(dumps.by_rank[r], name, calls[r])) for r in calls]
    furthest = max((m.last_entered.seq for m in members if m.last_entered), default=None)
    waiting_in, waiting, late = None, [], []
    if furthest is not None:
        waiting = [m.rank for m in members if m.last_entered and m.last_entered.seq == furthest]
        late = [r for r in ranks if r not in waiting]
        if late:
            waiting_in = next(m.last_entered for m in members if m.rank == waiting[0])
        else:
            waiting = []
    return GroupHang(group=name, desc=desc, ranks=ranks, members=members, waiting_in=waiting_in,
                     waiting_ranks=waiting, late_ranks=late, mismatches=_mismatches(calls))


def _calls(dump: dict, group: str) -> list[Call]:
    calls = [Call(seq=e["collective_seq_id"], name=e["profiling_name"], input_sizes=_listed(e.get("input_sizes")),
                  input_dtypes=_listed(e.get("input_dtypes")), state=str(e.get("state", "")),
                  frames=_frames(e.get("frames") or []))
             for e in dump["entries"] if _group_of(e)[0] == group and not e.get("is_p2p")]
    return sorted(calls, key=lambda c: c.seq)


def _listed(value: Any) -> list:
    return value if isinstance(value, list) else []


def _completed(dump: dict, group: str, calls: list[Call]) -> int | None:
    """The last collective the rank completed in `group`, as a collective sequence number (#N, like `Call.seq`)."""
    pg_status = dump.get("pg_status", {})
    status = pg_status.get(group) if isinstance(pg_status, dict) else None
    if isinstance(status, dict) and type(status.get("last_completed_collective")) is int:
        return _as_collective_seq(status, [e for e in dump["entries"] if _group_of(e)[0] == group])
    done = [c.seq for c in calls if c.state == "completed"]
    return max(done) if done else None


def _as_collective_seq(status: dict, entries: list[dict]) -> int | None:
    """pg_status's last completed operation as a collective sequence number. The recorder's pg_status counts in
    one of two numberings: NCCL its collectives (the entries' collective_seq_id), gloo every operation of the group
    (their op_id: #16 was op 49 in a gloo run, so 'completed 48' read as '#48' after '#16' entered). The numbering
    is the one in which last_enqueued_collective is the group's last entry; in op ids the answer is the last
    collective at or before that op. None where neither matches or the op is no longer in the recorder's buffer."""
    completed, enqueued = status["last_completed_collective"], status.get("last_enqueued_collective")
    if not entries:
        return completed
    last = max(enumerate(entries), key=lambda i_e: (i_e[1].get("record_id") if type(i_e[1].get("record_id")) is int
                                                    else -1, i_e[0]))[1]
    if not last.get("is_p2p") and last["collective_seq_id"] == enqueued:
        return completed
    if type(last.get("op_id")) is not int or last["op_id"] != enqueued:
        return None
    done = [e["collective_seq_id"] for e in entries
            if not e.get("is_p2p") and type(e.get("op_id")) is int and e["op_id"] <= completed]
    return max(done) if done else None


def _frames(frames: list, *, innermost_last: bool = False) -> list[str]:
    """`function (file:line)`, innermost first: the innermost frame, then frames outside torch itself."""
    frames = [f for f in frames if isinstance(f, dict)] if isinstance(frames, list) else []
    frames = frames[::-1] if innermost_last else frames
    kept = frames[:1] + [f for f in frames[1:] if TORCH_PATH not in str(f.get("filename", ""))]
    return [f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})" for f in kept[:FRAMES_SHOWN]]


def _mismatches(calls: dict[int, list[Call]]) -> list[str]:
    """Sequence numbers at which ranks recorded different collectives (type, sizes or dtypes)."""
    by_seq: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, rank_calls in calls.items():
        for call in rank_calls:
            by_seq[call.seq][call.signature].append(rank)
    return [f"#{seq}: " + "; ".join(f"ranks {ranks}: {sig}" for sig, ranks in variants.items())
            for seq, variants in sorted(by_seq.items()) if len(variants) > 1]


def _furthest_behind(group: GroupHang) -> str:
    """Among the late ranks, the ones that entered the fewest collectives: the others wait for them, directly or
    through ranks stuck in an earlier collective behind them (said only when the late ranks differ)."""
    late = [m for m in group.members if m.rank in group.late_ranks]
    entered = {m.rank: m.last_entered.seq if m.last_entered else -1 for m in late}
    if len(set(entered.values())) < 2:
        return ""
    lowest = min(entered.values())
    behind = sorted(r for r, seq in entered.items() if seq == lowest)
    last = next(m.last_entered for m in late if m.rank == behind[0])
    what = f"last entered #{last.seq} {last.name}" if last else "entered none"
    return (f"; furthest behind: rank(s) {behind} ({what}): the others wait for it, directly or through the "
            f"ranks stuck in an earlier collective")


def _verdict(groups: list[GroupHang], dumps: Dumps) -> str:
    stuck = [g for g in groups if g.late_ranks and g.waiting_in]
    parts = []
    for group in stuck:
        call = group.waiting_in
        parts.append(f"in process group {group.group} ({group.desc or 'no description'}), rank(s) "
                     f"{group.waiting_ranks} wait in collective #{call.seq} {call.name} (sizes {call.input_sizes}) "
                     f"that rank(s) {group.late_ranks} never entered" + _furthest_behind(group))
    for group in groups:
        if group.mismatches:
            parts.append(f"process group {group.group}: {len(group.mismatches)} mismatched collective(s), "
                         f"first {group.mismatches[0]}")
    if not parts:
        return (f"every dumped rank ({sorted(dumps.by_rank)}) entered the same collectives: no rank is behind "
                "in any process group (a hang inside one collective, or no hang)")
    return "; ".join(parts)


def _last_steps(records: RunRecords, world: int) -> dict[int, int]:
    steps = {}
    for metrics in records.step_metrics:
        if metrics.rank >= world or metrics.read is None:  # refused by the safe reader: no last step known
            continue
        if metrics.read.records:
            steps[metrics.rank] = max(r.step for r in metrics.read.records)
    return steps


def _last_window(records: RunRecords) -> str:
    windows = records.hang.windows
    if not windows:
        return ""
    last = windows[-1]
    steps = _window_steps(records, last.index)
    return f"{last.name}{f' (steps {steps})' if steps else ''}: {last.files} trace(s)"


def _window_steps(records: RunRecords, index: int) -> str:
    manifest = records.manifest
    if manifest is None:
        return ""
    try:
        steps = sorted({s for t in manifest.traces if t.window == index for s in t.steps})
        return f"{steps[0]}-{steps[-1]}" if steps else ""
    except (ValueError, AttributeError, TypeError):
        return ""


def _log_tail(records: RunRecords, rank: int) -> list[str]:
    """The last lines of the run's logs that the trainer wrote for `rank` (`... rank<R> LEVEL ...`)."""
    marker = f" rank{rank} "
    lines = []
    for text in records.hang.log_tails:
        lines += [line.strip() for line in text.splitlines() if marker in line]
    return lines[-LOG_TAIL_LINES:]


def pytorch_cross_check(dumps: Dumps) -> list[str]:
    """PyTorch's Flight Recorder matcher over the same entries: its mismatch verdicts, or why it could not run."""
    try:
        from torch.distributed.flight_recorder.components.builder import build_collectives, build_groups_memberships
        from torch.distributed.flight_recorder.components.utils import align_trace_from_beginning
    except ImportError as error:
        return [f"PyTorch's Flight Recorder analysis is not available: {error}"]
    entries = {r: [{**e, "process_group": _group_of(e)} for e in d["entries"]]
               for r, d in dumps.by_rank.items()}
    configs = {r: d.get("pg_config", {}) for r, d in dumps.by_rank.items()}
    version = str(next(iter(dumps.by_rank.values())).get("version", ""))
    logging.getLogger("Flight Recorder").setLevel(logging.CRITICAL)
    try:
        _, groups, _, memberships, guids = build_groups_memberships(configs)
        _, collectives, _ = build_collectives(align_trace_from_beginning(entries), groups, memberships, guids, version)
    except Exception as error:  # its input checks raise anything from KeyError to ValueError
        return [f"PyTorch's Flight Recorder analysis could not run on these dumps: {type(error).__name__}: {error}"]
    failed = [c for c in collectives if not c.pass_check]
    lines = [f"PyTorch's matcher: {len(collectives)} collective(s) matched across ranks, {len(failed)} failed a check"]
    for collective in failed[:5]:
        lines.append(f"  #{collective.collective_seq_id} {collective.collective_name}: "
                     f"{collective.type_of_mismatch or 'mismatch'}; missing ranks {sorted(collective.missing_ranks or [])}")
    return lines
