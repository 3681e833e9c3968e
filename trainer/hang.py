"""Flight Recorder in every rank, and a hang detector that dumps it into the run directory.

`enable_flight_recorder` sets PyTorch's ring-buffer size before the process group starts
(TORCH_FR_BUFFER_SIZE, for gloo and NCCL alike; TORCH_NCCL_TRACE_BUFFER_SIZE is its deprecated name), plus
NCCL's own dump on a collective timeout into flight_recorder/nccl_trace_rank_<R> (a pickle, which fleetscope
does not read). Values already in the environment win.

`HangWatchdog` is a daemon thread per rank. The loop reports each completed step; when none completes for
`observability.hang_timeout_s`, the rank writes a hang marker, asks every rank to dump (a flag file every
watchdog looks for once a second), dumps its own buffer, waits up to `hang_grace_s` for the other ranks'
dumps and ends the process with EXIT_HUNG, which makes torchrun / srun stop the rest of the job. A rank whose
collective fails because a hung peer left ends with EXIT_HUNG as well (`job_hung`, entry.run_rank). A rank
blocked inside a collective still runs this thread: the collective's wait releases the GIL.
The dumps are also written when a rank fails (a collective timeout raises) and as soon as a stop signal
(SIGTERM, SIGUSR1/2: preemption, requeue, time limit) arrives, even in a rank blocked in a collective: the
watchdog reads the signal numbers from the wakeup pipe of `signal.set_wakeup_fd`.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from ..traces.capture import now_iso_ms
from ..traces.exit_status import EXIT_HUNG
from ..traces.flight_recorder import HangMarker, write_dump, write_hang_marker
from ..traces.layout import RunLayout
from .config import ObservabilityConfig
from .preemption import STOP_SIGNALS

log = logging.getLogger("fleetscope.trainer")

FR_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""The recorder's size; the second is its deprecated NCCL-era name (either one set by the user wins)."""
POLL_S = 1.0


def enable_flight_recorder(config: ObservabilityConfig, layout: RunLayout) -> None:
    """Call before the process group exists: the recorder reads its size when the group is created."""
    if not config.flight_recorder_entries:
        return
    if not any(name in os.environ for name in FR_VARIABLES):
        os.environ[FR_VARIABLES[0]] = str(config.flight_recorder_entries)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    layout.flight_recorder_dir.mkdir(parents=True, exist_ok=True)
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ:
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(layout.flight_recorder_dir / "nccl_trace_rank_"))


def flight_recorder_document(rank: int, reason: str, step: int) -> dict | None:
    """This process's Flight Recorder buffer as a JSON-able dict (None: the recorder is off or unavailable)."""
    try:
        raw = torch._C._distributed_c10d._dump_fr_trace()
    except (AttributeError, RuntimeError) as error:
        log.warning("no Flight Recorder dump: %s", error)
        return None
    dump = pickle.loads(raw)  # this process's own buffer, produced just now
    return {"rank": rank, "reason": reason, "at": now_iso_ms(), "step": step, "version": str(dump.get("version", "")),
            "pg_config": process_groups() or dump.get("pg_config", {}), "pg_config_recorded": dump.get("pg_config", {}),
            "pg_status": dump.get("pg_status", {}), "entries": [_json_entry(e) for e in dump.get("entries", [])],
            "python_stack": main_thread_stack()}


def process_groups() -> dict[str, dict[str, str]]:
    """Every process group of this rank as the Flight Recorder's pg_config has it ({name: {name, desc, ranks}}),
    taken from c10d: on gloo the recorder's own pg_config can lack the ranks."""
    from torch.distributed.distributed_c10d import _world

    groups = {}
    for group, name in list(_world.pg_names.items()):
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):
            continue
        groups[name] = {"name": name, "desc": getattr(group, "group_desc", ""), "ranks": str(ranks)}
    return groups


def main_thread_stack() -> list[dict[str, object]]:
    """Where this rank's main thread is now (innermost last): what it was doing instead of the collective."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return [{"name": f.name, "filename": f.filename, "line": f.lineno} for f in traceback.extract_stack(frame)] if frame else []


def _json_entry(entry: dict) -> dict:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in entry.items()}


def dump_flight_recorder(layout: RunLayout, rank: int, reason: str, step: int) -> bool:
    document = flight_recorder_document(rank, reason, step)
    if document is None:
        return False
    path = write_dump(layout, rank, document)
    log.warning("Flight Recorder of rank %d (%s, %d entries) dumped to %s", rank, reason,
                len(document["entries"]), path)
    return True


STOP_SIGNAL_NUMBERS = frozenset(int(sig) for sig in STOP_SIGNALS)


def _signal_pipe() -> tuple[int, int] | None:
    """A pipe that receives the number of every signal with a Python handler (signal.set_wakeup_fd); None off
    the main thread, or when something else already owns the wakeup fd."""
    if threading.current_thread() is not threading.main_thread():
        return None
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)  # someone else's: leave it to them
        os.close(read_fd)
        os.close(write_fd)
        return None
    return read_fd, write_fd


class HangWatchdog:
    """Detects a rank that stops making progress; see the module docstring. `progress(steps_done)` each step."""

    def __init__(self, config: ObservabilityConfig, layout: RunLayout, rank: int, world_size: int):
        self._timeout, self._grace = config.hang_timeout_s, config.hang_grace_s
        self._recorder = bool(config.flight_recorder_entries)
        self._layout, self._rank, self._world = layout, rank, world_size
        self._last = time.monotonic()
        self._started_at = time.time()
        self._steps_done = 0
        self._armed = False
        self._dumped = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None

    def start(self) -> "HangWatchdog":
        if self._timeout > 0:
            self._wakeup = _signal_pipe()
            self._thread = threading.Thread(target=self._watch, name="fleetscope-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def progress(self, steps_done: int) -> None:
        """One more step is done (the first call arms the detector: start-up and step 0 may be slow)."""
        self._steps_done, self._last, self._armed = steps_done, time.monotonic(), True

    def stop(self) -> None:
        self._stop.set()
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            self._wakeup = None  # the thread closes the pipe when it sees the stop

    def dump(self, reason: str) -> None:
        """Dump this rank's buffer once (later calls do nothing)."""
        if self._recorder and not self._dumped:
            self._dumped = True
            dump_flight_recorder(self._layout, self._rank, reason, self._steps_done)

    def _watch(self) -> None:
        pipe = self._wakeup
        try:
            while not self._stop.is_set():
                if self._wait_for_signal(pipe, min(POLL_S, self._timeout / 4)):
                    self.dump("stop_signal")
                self._check()
        finally:
            for fd in pipe or ():
                os.close(fd)

    def _wait_for_signal(self, pipe: tuple[int, int] | None, timeout: float) -> bool:
        """Sleep up to `timeout`; True when a stop signal arrived meanwhile. The C-level handler writes the
        signal number to the wakeup pipe at once, even while the main thread is blocked in a collective and
        the Python handler (preemption.StopRequests) cannot run yet."""
        if pipe is None:
            self._stop.wait(timeout)
            return False
        readable, _, _ = select.select([pipe[0]], [], [], timeout)
        if not readable:
            return False
        try:
            received = os.read(pipe[0], 64)
        except BlockingIOError:
            return False
        return any(number in received for number in STOP_SIGNAL_NUMBERS)

    def _check(self) -> None:
        if self._stop.is_set():
            return
        stalled = time.monotonic() - self._last
        if self._armed and stalled > self._timeout:
            self._on_hang(stalled)
        elif not self._dumped and self._fresh(self._layout.dump_request_flag):
            self.dump("dump_requested")

    def _on_hang(self, stalled: float) -> None:
        log.error("rank %d: no step finished for %.0f s, so it stopped in step %d: dumping the Flight Recorder and "
                  "stopping the job", self._rank, stalled, self._steps_done)
        write_hang_marker(self._layout, HangMarker(rank=self._rank, step=self._steps_done, seconds=round(stalled, 1),
                                                   at=now_iso_ms()))
        self._layout.dump_request_flag.touch()
        self.dump("hang")
        deadline = time.monotonic() + self._grace
        while time.monotonic() < deadline and not self._all_dumped():
            time.sleep(0.2)
        logging.shutdown()
        os._exit(EXIT_HUNG)

    def job_hung(self) -> bool:
        """A rank of this attempt gave up on a hang: a collective failing now is that rank leaving the job, and
        this rank ends as hung too (so the exit status does not depend on who noticed first)."""
        return self._timeout > 0 and any(self._fresh(self._layout.hang_marker(r)) for r in range(self._world))

    def _all_dumped(self) -> bool:
        return all(self._fresh(self._layout.flight_recorder_file(r)) for r in range(self._world))

    def _fresh(self, path) -> bool:
        """Written by this attempt of the job (an earlier attempt's files do not count)."""
        try:
            return path.stat().st_mtime >= self._started_at - 5.0
        except OSError:
            return False
