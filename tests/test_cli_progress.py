"""cli/progress.py: a status line at most every 10 s off a terminal, and one at the end; stdout untouched."""

from __future__ import annotations

import io

from fleetscope.cli.progress import counting, progress_callback


def test_status_lines_are_periodic_off_a_terminal(capsys):
    now = [0.0]
    stream = io.StringIO()
    show = progress_callback("parse", stream=stream, every_s=10.0, clock=lambda: now[0])
    for done in range(1, 6):
        now[0] = done * 4.0
        show(done, 5)
    lines = stream.getvalue().splitlines()
    assert lines == ["parse: 3/5 traces (running, 12 s)", "parse: 5/5 traces (done, 20 s)"]
    assert capsys.readouterr().out == ""


def test_a_count_without_a_total_reports_every_ten_seconds():
    now = [0.0]
    stream = io.StringIO()
    one = counting(progress_callback("merge", "ranks", stream=stream, every_s=10.0, clock=lambda: now[0]))
    for second in (3.0, 11.0, 15.0):
        now[0] = second
        one(object())
    assert stream.getvalue().splitlines() == ["merge: 2 ranks (running, 11 s)"]
