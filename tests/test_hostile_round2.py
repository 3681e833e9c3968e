"""Hardening, round 2: the newer surfaces (tune, advise, profile, hang, collect-traces, postprocess, fan-out,
query) tried as a hostile user would. Each case is a file planted or damaged in a run directory, or an
argument, and the test says what must hold: no input overwritten, nothing read or written outside the run,
nothing printed raw to the terminal, bounded work, a right answer or a named refusal, the right exit code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fleetscope.cli.main import main
from fleetscope.traces.layout import RunLayout
from hostile_runs import digests, make_recorded_run, make_run

from helpers import REPO

HANG_FIXTURE = REPO / "tests" / "fixtures" / "flight_recorder_hang"


def _hang_run(root: Path) -> RunLayout:
    layout = RunLayout.at(root)
    shutil.copytree(HANG_FIXTURE, layout.flight_recorder_dir)
    return layout


# --- data loss: every output goes through the one guard ---------------------------------------------------


def test_advise_json_refuses_to_overwrite_the_runs_job_json(tmp_path, capsys):
    layout = make_recorded_run(tmp_path / "run")
    before = layout.job_file.read_bytes()
    assert main(["advise", str(layout.root), "--json", str(layout.job_file)]) == 2
    assert "refusing to write" in capsys.readouterr().err
    assert layout.job_file.read_bytes() == before
    assert main(["tune", str(layout.root), "--apply", "1", "--dry-run"]) in (0, 3)


def test_advise_json_rewrites_its_own_output(tmp_path):
    layout = make_recorded_run(tmp_path / "run")
    out = tmp_path / "advice.json"
    assert main(["advise", str(layout.root), "--json", str(out)]) == 0
    assert main(["advise", str(layout.root), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["run"]


@pytest.mark.parametrize("target", ["flight_recorder/rank0.json", "flight_recorder/hang.rank1.json",
                                    "traces/window000/new.json"])
def test_hang_json_refuses_a_dump_a_marker_or_a_path_among_the_traces(tmp_path, capsys, target):
    layout = _hang_run(tmp_path / "run")
    layout.traces_dir.joinpath("window000").mkdir(parents=True)
    (layout.root / "job.json").write_text("{}")
    before = digests(layout.root)
    assert main(["hang", str(layout.root), "--json", str(layout.root / target)]) == 2
    assert "refusing to write" in capsys.readouterr().err
    assert digests(layout.root) == before and not (layout.root / "traces/window000/new.json").exists()


def test_hang_json_is_strict_json_and_rewrites_its_own_output(tmp_path):
    layout = _hang_run(tmp_path / "run")
    dump = json.loads(layout.flight_recorder_file(0).read_text())
    marker = json.loads(layout.hang_marker(0).read_text())
    marker["seconds"] = 1e999
    layout.hang_marker(0).write_text(json.dumps(marker))
    out = tmp_path / "hang.json"
    assert main(["hang", str(layout.root), "--json", str(out)]) == 0
    assert main(["hang", str(layout.root), "--json", str(out)]) == 0
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    assert dump["rank"] == 0


def test_history_html_refuses_a_metrics_file(tmp_path, capsys):
    layout = make_recorded_run(tmp_path / "runs" / "a")
    before = layout.metrics_file(0).read_bytes()
    assert main(["history", str(tmp_path / "runs"), "--html", str(layout.metrics_file(0))]) == 2
    assert "refusing to write" in capsys.readouterr().err
    assert layout.metrics_file(0).read_bytes() == before


@pytest.mark.parametrize("threshold", ["inf", "nan", "-1"])
def test_history_threshold_must_be_finite(tmp_path, threshold):
    (tmp_path / "runs").mkdir()
    assert main(["history", str(tmp_path / "runs"), "--threshold", threshold]) == 2
    assert not (tmp_path / "runs" / "history.html").exists()
