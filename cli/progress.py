"""Progress of long CLI work (gather, parse, HTA, merge) on stderr, never on stdout.

On a terminal: a tqdm bar (tqdm comes with HTA; a one-line counter without it). Not on a terminal (logs,
CI, pipes): one plain status line at most every STATUS_EVERY_S seconds, and one when the work is done, so a
log shows the job is alive without a line per item. stdout stays clean for what the command prints.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

STATUS_EVERY_S = 10.0

Progress = Callable[[int, int], None]
"""progress(done, total); total 0 when it is not known beforehand."""


def progress_callback(label: str, unit: str = "traces", *, stream: TextIO | None = None,
                      every_s: float = STATUS_EVERY_S, clock: Callable[[], float] = time.monotonic) -> Progress:
    """A `progress(done, total)` callback for `label`, shaped for where stderr goes."""
    stream = stream or sys.stderr
    if _is_tty(stream):
        return _bar(label, unit, stream)
    return _status_lines(label, unit, stream, every_s, clock)


def counting(progress: Progress) -> Callable[[object], None]:
    """A per-item callback (e.g. merge's, called with each rank's summary) counting into `progress`."""
    done = [0]

    def one(_item: object) -> None:
        done[0] += 1
        progress(done[0], 0)

    return one


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _bar(label: str, unit: str, stream: TextIO) -> Progress:
    try:
        from tqdm import tqdm
    except ImportError:
        return _counter(label, unit, stream)
    state: dict[str, object] = {}

    def show(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None or (bar.total or 0) != total:
            bar = state["bar"] = tqdm(total=total or None, desc=label, file=stream, leave=True,
                                      unit=unit.removesuffix("s"), dynamic_ncols=True)
        bar.update(done - bar.n)
        if total and done >= total:
            bar.close()
            state.pop("bar")

    return show


def _counter(label: str, unit: str, stream: TextIO) -> Progress:
    def show(done: int, total: int) -> None:
        count = f"{done}/{total}" if total else str(done)
        print(f"\r{label}: {count} {unit}", end="\n" if total and done >= total else "", file=stream, flush=True)

    return show


def _status_lines(label: str, unit: str, stream: TextIO, every_s: float, clock: Callable[[], float]) -> Progress:
    started = clock()
    last = [started]

    def show(done: int, total: int) -> None:
        now = clock()
        finished = bool(total) and done >= total
        if not finished and now - last[0] < every_s:
            return
        last[0] = now
        count = f"{done}/{total}" if total else str(done)
        print(f"{label}: {count} {unit} ({'done' if finished else 'running'}, {now - started:.0f} s)", file=stream,
              flush=True)

    return show
