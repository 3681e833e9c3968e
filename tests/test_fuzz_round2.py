"""Seeded, bounded fuzz of the newer surfaces: Flight Recorder dumps and hang markers (`hang`), on-demand
requests (`profile`'s reader), and output paths (every command's output guard). The contract: no traceback,
an exit code the CLI documents, no input modified, nothing printed raw."""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fleetscope.cli.main import main
from fleetscope.traces.capture import RequestError, read_request, request_numbers
from fleetscope.traces.layout import RunLayout
from hostile_runs import digests

from helpers import REPO

pytestmark = pytest.mark.fuzz
HANG_FIXTURE = REPO / "tests" / "fixtures" / "flight_recorder_hang"
HOSTILE_VALUES = [None, True, -1, 0, 2**63, 10**12, 1e999, -1e999, 1.5, "", "[1e999]", "\x1b[2J\x1b]0;t\x07",
                  "x" * 5000, [], [1, "a"], {}, {"a": [None]}, [[[[]]]]]
DUMP_FIELDS = ["rank", "step", "reason", "pg_config", "pg_status", "entries", "python_stack", "version"]
ENTRY_FIELDS = ["collective_seq_id", "profiling_name", "process_group", "input_sizes", "input_dtypes",
                "state", "frames", "is_p2p"]
MARKER_FIELDS = ["rank", "step", "seconds", "at"]


def fuzz_settings(examples: int):
    return settings(derandomize=True, max_examples=examples, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@contextmanager
def hang_run():
    with tempfile.TemporaryDirectory() as tmp:
        layout = RunLayout.at(Path(tmp) / "run")
        shutil.copytree(HANG_FIXTURE, layout.flight_recorder_dir)
        yield layout


damage = st.lists(st.tuples(st.sampled_from(["dump", "entry", "marker"]), st.integers(0, 1),
                            st.sampled_from(DUMP_FIELDS + ENTRY_FIELDS + MARKER_FIELDS),
                            st.sampled_from(range(len(HOSTILE_VALUES)))), min_size=1, max_size=4)


@fuzz_settings(40)
@given(operations=damage)
def test_damaged_dumps_and_markers(operations, capsys):
    with hang_run() as layout:
        for where, rank, name, value in operations:
            path = layout.hang_marker(rank) if where == "marker" else layout.flight_recorder_file(rank)
            document = json.loads(path.read_text())
            if where == "entry" and document.get("entries"):
                document["entries"][0][name] = HOSTILE_VALUES[value]
            elif where != "entry":
                document[name] = HOSTILE_VALUES[value]
            path.write_text(json.dumps(document))
        before = digests(layout.root)
        out = layout.root.parent / "hang.json"
        code = main(["hang", str(layout.root), "--json", str(out)])
        captured = capsys.readouterr()
        assert code in (0, 1), captured.err
        assert "\x1b" not in captured.out and "Traceback" not in captured.err
        assert len(captured.out) < 1_000_000
        assert digests(layout.root) == before
        if code == 0:
            json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(name))


@fuzz_settings(40)
@given(number=st.one_of(st.integers(1, 40), st.integers(2**24 - 2, 2**24 + 2), st.integers(10**8, 10**9 - 1)),
       value=st.sampled_from(range(len(HOSTILE_VALUES))), name=st.sampled_from(["steps", "warmup", "ranks",
                                                                                 "requested_by", "requested_at"]))
def test_planted_requests(number, value, name):
    with tempfile.TemporaryDirectory() as tmp:
        layout = RunLayout.at(Path(tmp))
        layout.requests_dir.mkdir()
        layout.request_file(number).write_text(json.dumps({"steps": 1, name: HOSTILE_VALUES[value]}))
        numbers = request_numbers(layout)
        assert all(0 < n <= 2**24 for n in numbers)
        for found in numbers:
            try:
                request = read_request(layout, found, world_size=2)
            except RequestError:
                continue
            assert 1 <= request.steps <= 1000 and (request.ranks is None or max(request.ranks) < 2)


@fuzz_settings(30)
@given(target=st.sampled_from(["flight_recorder/rank0.json", "flight_recorder/hang.rank0.json", "job.json",
                               "metrics/rank0.jsonl", "traces/window000/x.json", "traces/new.json",
                               "flight_recorder", "link.json"]),
       command=st.sampled_from(["hang", "advise", "history"]))
def test_output_paths_over_run_files(target, command, capsys):
    with hang_run() as layout:
        (layout.root / "job.json").write_text("{}")
        layout.metrics_dir.mkdir()
        layout.metrics_file(0).write_text("")
        layout.window_dir(0).mkdir(parents=True)
        (layout.root / "link.json").symlink_to(layout.root / "job.json")
        before = digests(layout.root)
        flag = "--html" if command == "history" else "--json"
        code = main([command, str(layout.root), flag, str(layout.root / target)])
        capsys.readouterr()
        assert code == 2
        assert digests(layout.root) == before
