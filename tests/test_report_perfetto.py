"""The report's 'Open in Perfetto' buttons: the links they carry, and the page in a real headless Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fleetscope.analysis import analyze, render_html
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.render.open_in_perfetto import step_range, window_range
from test_merge import gpu_rank_events, kineto_document, write_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
requires_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium)")


@pytest.fixture
def linked_report(tmp_path: Path) -> tuple[Path, dict]:
    """A report.html next to its merged trace, rendered with the merge's step ranges."""
    for rank in (0, 1):
        write_trace(tmp_path / "t" / f"rank{rank}.json",
                    kineto_document(rank, gpu_rank_events(shift_us=30.0 * rank), host=f"n{rank}"))
    report = analyze(tmp_path / "t", use_hta=False)
    merged = merge(tmp_path / "t", tmp_path / "report" / "merged.perfetto-trace", report=report)
    page = tmp_path / "report" / "report.html"
    page.write_text(render_html(report, trace_ranges=merged.step_ranges_ns()))
    return page, merged.step_ranges_ns()


def links(page_html: str) -> list[dict]:
    return [json.loads(html.unescape(m)) for m in re.findall(r'data-perfetto-link="([^"]*)"', page_html)]


def test_each_straggler_window_and_instance_links_to_its_time_range(linked_report):
    page, ranges = linked_report
    start, end = ranges[(0, 3)]
    found = links(page.read_text())
    assert found[0]["title"] == "window -" and len(found) == 2
    assert re.fullmatch(r"step 3 nccl:AllReduce #0: rank [01] late", found[1]["title"])
    assert all(link["file"] == "merged.perfetto-trace" for link in found)
    assert all((int(link["start_ns"]), int(link["end_ns"])) == (start, end) for link in found)


def test_ranges_fall_back_from_step_to_window_to_none():
    ranges = {(0, 3): (10, 20), (0, 4): (20, 35), (1, 3): (50, 60)}
    assert window_range(ranges, None) == (10, 35) and window_range(ranges, 1) == (50, 60)
    assert step_range(ranges, None, 4) == (20, 35) and step_range(ranges, None, -1) == (10, 35)
    assert step_range(None, 0, 3) is None and window_range({}, 2) is None


def test_a_page_without_ranges_still_opens_the_trace(tmp_path):
    for rank in (0, 1):
        write_trace(tmp_path / f"rank{rank}.json", kineto_document(rank, gpu_rank_events(shift_us=30.0 * rank)))
    found = links(render_html(analyze(tmp_path, use_hta=False)))
    assert found and all("start_ns" not in link for link in found)


def dump_dom(page: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--enable-logging=stderr", "--v=0",
               *extra, "--dump-dom", page.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@requires_chromium
def test_the_page_runs_its_script_without_errors_and_prepares_each_message(linked_report):
    page, ranges = linked_report
    start, end = ranges[(0, 3)]
    completed = dump_dom(page)
    assert "Uncaught" not in completed.stderr, completed.stderr[-2000:]
    dom = completed.stdout
    assert 'data-perfetto-ready="2"' in dom, dom[-2000:]
    messages = [html.unescape(m).split("\n") for m in re.findall(r'data-perfetto-message="([^"]*)"', dom)]
    assert len(messages) == 2
    for opened, scrolled in (map(json.loads, pair) for pair in messages):
        assert opened == {"perfetto": {"buffer": "ArrayBuffer(0 bytes)", "title": opened["perfetto"]["title"],
                                       "fileName": "merged.perfetto-trace", "keepApiOpen": True}}
        assert scrolled == {"perfetto": {"timeStart": str(start), "timeEnd": str(end), "viewPercentage": 0.9}}
