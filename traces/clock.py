"""Clock offset of each rank to rank 0, measured at startup over the process group.

Kineto timestamps follow the host's wall clock (CLOCK_REALTIME), and hosts' wall clocks disagree by up to
milliseconds even under NTP. Right after `init_process_group`, every rank calls `record_clock_offset`:

    rank r                                   rank 0
    t0 = now(); send(ping)  ------------->   recv(ping); t1 = now()
    recv(pong); t2 = now()  <-------------   send(pong = t1)

offset = (t0 + t2) / 2 - t1 estimates (rank r's clock - rank 0's clock), exactly when the two legs take
equal time and within +/- (t2 - t0) / 2 in any case. Of several round trips the one with the shortest
round trip is kept: its bound is the tightest. Rank 0 serves one peer at a time (a `go` message starts each
peer, so no round trip includes waiting for another peer).

Two transports carry the messages; the bound above holds for either, whatever path a message takes:
  - "group": point-to-point sends of one-element tensors over the process group (the default for gloo:
    direct TCP between the pair; on NCCL, device tensors read after a synchronization);
  - "store": keys in the rendezvous store (the default otherwise: NCCL would build a communicator for
    every (0, r) pair, which at a thousand ranks costs more than the whole measurement).
Store keys are left in place (two small keys per round trip, under `fleetscope/clock/`).

Each rank writes `clock/rank<R>.json` (RunLayout.clock_file) atomically. Convert a timestamp of rank r to
rank 0's clock with `t_rank0 = t_r - offset_us`.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .layout import RunLayout
from .safe_read import read_metadata
from .validate import clock_offset_problem, rank_problem
from .writer import write_bytes_atomically
from .jsontext import strict_dumps

CLOCK_FILE_VERSION = 1
DEFAULT_ROUND_TRIPS = 16
CLOCK_NAME = "time.time_ns (CLOCK_REALTIME), the clock Kineto timestamps follow"


@dataclass(frozen=True, kw_only=True)
class RoundTrip:
    """One ping-pong, nanoseconds: t0 and t2 on this rank's clock, t1 on the reference rank's."""

    sent_ns: int
    reference_ns: int
    received_ns: int

    @property
    def round_trip_ns(self) -> int:
        return self.received_ns - self.sent_ns

    @property
    def offset_ns(self) -> float:
        return (self.sent_ns + self.received_ns) / 2 - self.reference_ns


@dataclass(frozen=True, kw_only=True)
class ClockOffset:
    """This rank's clock minus the reference rank's clock."""

    rank: int
    reference_rank: int = 0
    offset_us: float
    """t_reference = t_local - offset_us."""
    uncertainty_us: float
    """The true offset lies within offset_us +/- uncertainty_us (half the best round trip)."""
    best_round_trip_us: float
    round_trips: int
    host: str
    measured_at_ns: int
    """This rank's wall clock when the measurement ended."""
    clock: str = CLOCK_NAME
    version: int = CLOCK_FILE_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ClockOffset":
        if not isinstance(data, dict):
            raise ValueError(f"top level is {type(data).__name__}, expected an object")
        if data.get("version") != CLOCK_FILE_VERSION:
            raise ValueError(f"clock file version {data.get('version')!r} is not supported")
        return cls(**data)


def best_estimate(samples: list[RoundTrip], *, rank: int, host: str, measured_at_ns: int) -> ClockOffset:
    """The offset from the round trip with the shortest round-trip time."""
    if not samples:
        raise ValueError("no round trips to estimate a clock offset from")
    valid = [s for s in samples if s.round_trip_ns >= 0]
    if not valid:
        raise ValueError("every round trip went backwards in time: the local clock jumped during measurement")
    best = min(valid, key=lambda s: s.round_trip_ns)
    return ClockOffset(
        rank=rank, offset_us=best.offset_ns / 1000.0, uncertainty_us=best.round_trip_ns / 2000.0,
        best_round_trip_us=best.round_trip_ns / 1000.0, round_trips=len(samples), host=host,
        measured_at_ns=measured_at_ns,
    )


TRANSPORTS = ("auto", "group", "store")


def measure_clock_offset(*, group=None, round_trips: int = DEFAULT_ROUND_TRIPS, transport: str = "auto",
                         device=None, now_ns: Callable[[], int] = time.time_ns) -> ClockOffset:
    """Measure this rank's clock offset to the group's rank 0. Collective: every rank of `group` calls it.

    `transport`: "group", "store", or "auto" (group for gloo, store otherwise; see the module docstring).
    `device`: where "group" messages live; default cuda (current device) for NCCL, else cpu.
    `now_ns`: the clock to measure (tests inject a skewed one).
    """
    import torch.distributed as dist

    if round_trips < 1:
        raise ValueError(f"round_trips must be >= 1, got {round_trips}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "auto":
        transport = "group" if dist.get_backend(group) == "gloo" else "store"
    channel = _Channel(group, device) if transport == "group" else _StoreChannel(group)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    host = socket.gethostname()
    if me == 0:
        for peer in range(1, size):
            channel.serve(peer, round_trips, now_ns)
        return ClockOffset(rank=channel.global_rank(0), offset_us=0.0, uncertainty_us=0.0, best_round_trip_us=0.0,
                           round_trips=0, host=host, measured_at_ns=now_ns())
    samples = channel.ping(round_trips, now_ns)
    return best_estimate(samples, rank=channel.global_rank(me), host=host, measured_at_ns=now_ns())


def record_clock_offset(layout: RunLayout, *, group=None, round_trips: int = DEFAULT_ROUND_TRIPS,
                        transport: str = "auto", device=None,
                        now_ns: Callable[[], int] = time.time_ns) -> ClockOffset:
    """Measure (collectively) and write this rank's `clock/rank<R>.json`; what the trainer calls on every
    rank right after `init_process_group`."""
    offset = measure_clock_offset(group=group, round_trips=round_trips, transport=transport, device=device,
                                  now_ns=now_ns)
    write_clock_offset(offset, layout.clock_file(offset.rank))
    return offset


def write_clock_offset(offset: ClockOffset, path: Path) -> Path:
    write_bytes_atomically((strict_dumps(offset.to_json(), indent=1) + "\n").encode(), path)
    return path


def read_clock_offsets(layout: RunLayout) -> tuple[dict[int, ClockOffset], list[str]]:
    """Every rank's clock file: (rank -> offset, problems as 'file: reason'). A file is read by the safe
    reader and its values judged by validate.py: an absurd offset is named and not used."""
    offsets, problems = {}, []
    if not layout.clock_dir.is_dir():
        return offsets, problems
    for path in sorted(layout.clock_dir.glob("rank*.json")):
        try:
            offset = ClockOffset.from_json(json.loads(read_metadata(path, within=layout.root)))
            why = _offset_problem(offset, path)
        except (ValueError, TypeError, AttributeError, RecursionError) as error:
            why = f"unreadable clock file ({str(getattr(error, 'reason', error))[:200]})"
        if why:
            problems.append(f"{layout.relative(path)}: {why}")
        else:
            offsets[offset.rank] = offset
    return offsets, problems


def _offset_problem(offset: ClockOffset, path: Path) -> str | None:
    why = rank_problem(offset.rank) or clock_offset_problem(offset.offset_us, offset.uncertainty_us)
    if why is None and path.name != f"rank{offset.rank}.json":
        why = f"says rank {offset.rank}, its name another rank: not used"
    return why


class _Channel:
    """One-element int64 messages between a rank and the group's rank 0."""

    def __init__(self, group, device) -> None:
        import torch
        import torch.distributed as dist

        self._dist, self._torch, self._group = dist, torch, group
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._device = torch.device(device)
        self._buffer = torch.zeros(1, dtype=torch.int64, device=self._device)

    def global_rank(self, group_rank: int) -> int:
        if self._group is None:
            return group_rank
        return self._dist.get_global_rank(self._group, group_rank)

    def _send(self, value: int, peer: int) -> None:
        self._buffer.fill_(value)
        self._dist.send(self._buffer, dst=self.global_rank(peer), group=self._group)

    def _recv(self, peer: int) -> int:
        self._dist.recv(self._buffer, src=self.global_rank(peer), group=self._group)
        return int(self._buffer.item())  # .item() waits for the device

    def serve(self, peer: int, round_trips: int, now_ns: Callable[[], int]) -> None:
        self._send(1, peer)  # go
        for _ in range(round_trips):
            self._recv(peer)
            self._send(now_ns(), peer)

    def ping(self, round_trips: int, now_ns: Callable[[], int]) -> list[RoundTrip]:
        self._recv(0)  # wait for our turn
        samples = []
        for _ in range(round_trips):
            sent = now_ns()
            self._send(sent, 0)
            reference = self._recv(0)
            samples.append(RoundTrip(sent_ns=sent, reference_ns=reference, received_ns=now_ns()))
        return samples


class _StoreChannel:
    """The same exchange through the rendezvous store (see the module docstring)."""

    _PREFIX = "fleetscope/clock"

    def __init__(self, group) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self._dist, self._group = dist, group
        self._store = distributed_c10d._get_default_store()
        self._ranks = [dist.get_global_rank(group, r) if group is not None else r
                       for r in range(dist.get_world_size(group))]

    def global_rank(self, group_rank: int) -> int:
        return self._ranks[group_rank]

    def _key(self, peer: int, *parts: object) -> str:
        return "/".join([self._PREFIX, str(self.global_rank(0)), str(self.global_rank(peer)), *map(str, parts)])

    def serve(self, peer: int, round_trips: int, now_ns: Callable[[], int]) -> None:
        self._store.set(self._key(peer, "go"), b"1")
        for trip in range(round_trips):
            self._store.get(self._key(peer, trip, "ping"))
            self._store.set(self._key(peer, trip, "pong"), str(now_ns()).encode())

    def ping(self, round_trips: int, now_ns: Callable[[], int]) -> list[RoundTrip]:
        me = self._dist.get_rank(self._group)
        self._store.get(self._key(me, "go"))
        samples = []
        for trip in range(round_trips):
            sent = now_ns()
            self._store.set(self._key(me, trip, "ping"), b"1")
            reference = int(self._store.get(self._key(me, trip, "pong")))
            samples.append(RoundTrip(sent_ns=sent, reference_ns=reference, received_ns=now_ns()))
        return samples
