"""Seeded, bounded fuzz of the newer surfaces: Flight Recorder dumps and hang markers (`hang`), on-demand
requests (`profile`'s reader), output paths (every command's output guard), fan-out records (`status`),
collect-traces globs over hostile trees, metrics lines (compare, gate and advice read them) and report.json
read back (`advise`). The contract: no traceback, an exit code the CLI documents, no input modified, nothing
printed raw, bounded work."""

from __future__ import annotations

import json
import re
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


# --- fan-out records (status) --------------------------------------------------------------------------

TASK_FIELDS = ["array_job_id", "task", "tasks", "node", "ranks", "counts", "cache_dir", "seconds"]
REDUCE_FIELDS = ["array_job_id", "tasks", "incomplete", "counts", "outputs", "errors", "seconds", "complete"]
COUNT_FIELDS = ["traces", "hits", "parsed", "failed"]


@contextmanager
def fanout_run():
    from fleetscope.traces.fanout import IncompleteTask, ParseCounts, ReduceRecord, TaskRecord, \
        write_reduce_record, write_task_record

    with tempfile.TemporaryDirectory() as tmp:
        layout = RunLayout.at(Path(tmp) / "run")
        layout.root.mkdir()
        layout.job_file.write_text(json.dumps({"scheduler": "local", "status": "succeeded"}))
        for task in (0, 1):
            write_task_record(layout, TaskRecord(array_job_id="77", task=task, tasks=3, node="n", ranks=[task],
                                                 counts=ParseCounts(traces=1, hits=1), cache_dir="/c", seconds=1.0))
        write_reduce_record(layout, ReduceRecord(
            array_job_id="77", tasks=3, counts=ParseCounts(traces=3, hits=2, parsed=1),
            incomplete=[IncompleteTask(task=2, ranks=[2], log_path="l", reason="no record")], outputs={},
            errors=[], seconds={"analyze": 1.0}, complete=True))
        yield layout


@fuzz_settings(40)
@given(operations=st.lists(st.tuples(st.sampled_from(["task0", "task1", "reduce", "counts"]),
                                     st.sampled_from(TASK_FIELDS + REDUCE_FIELDS + COUNT_FIELDS),
                                     st.sampled_from(range(len(HOSTILE_VALUES)))), min_size=1, max_size=4))
def test_damaged_fanout_records(operations, capsys):
    from fleetscope.traces.layout import fanout_reduce_record, fanout_task_record

    with fanout_run() as layout:
        for where, name, value in operations:
            path = (fanout_reduce_record(layout, "77") if where == "reduce"
                    else fanout_task_record(layout, "77", 1 if where == "task1" else 0))
            document = json.loads(path.read_text())
            if where == "counts":
                document["counts"][name] = HOSTILE_VALUES[value]
            else:
                document[name] = HOSTILE_VALUES[value]
            path.write_text(json.dumps(document))
        before = digests(layout.root)
        code = main(["status", str(layout.root)])
        captured = capsys.readouterr()
        assert code in (0, 1, 3), captured.err
        assert "\x1b" not in captured.out + captured.err and "Traceback" not in captured.err
        assert len(captured.out) < 100_000
        assert digests(layout.root) == before
        done = [line for line in captured.out.splitlines() if "task(s) done" in line]
        for line in done:       # the counts status prints add up
            counts = re.search(r"\((\d+) trace\(s\): (\d+) parsed, (-?\d+) already cached, (\d+) unreadable\)", line)
            assert counts, line
            traces, *parts = (int(n) for n in counts.groups())
            assert traces == sum(parts) and min(parts) >= 0, line


# --- collect-traces: globs over a tree of links, other runs' traces and FIFOs ------------------------------

GLOB_PARTS = ["**", "*", "*.json", "*.json.gz", "rank*", "up", "loop", "other-run", "traces", "window000", "fifo*",
              "..", "."]


@fuzz_settings(30)
@given(parts=st.lists(st.sampled_from(GLOB_PARTS), min_size=1, max_size=5))
def test_collect_traces_globs_over_hostile_trees(parts, capsys):
    import os

    from hostile_runs import make_run
    from helpers.kineto import KinetoBuilder

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        KinetoBuilder(rank=0, world_size=1).write(work / "prog" / "rank0_trace.json.gz")
        (work / "prog" / "up").symlink_to("..")
        (work / "prog" / "loop").symlink_to("loop")
        os.mkfifo(work / "prog" / "fifo.json")
        other = make_run(work / "other-run")
        (other.root / "job.json").write_text("{}")
        run = Path(tmp) / "run"
        run.mkdir()
        before = digests(work)
        code = main(["collect-traces", str(run), str(work) + "/" + "/".join(parts)])
        captured = capsys.readouterr()
        assert code in (0, 1, 2, 3), captured.err
        assert "Traceback" not in captured.err
        assert digests(work) == before
        collected = list(RunLayout.at(run).traces_dir.rglob("*")) if RunLayout.at(run).traces_dir.exists() else []
        assert len([p for p in collected if p.is_file()]) <= 1      # only the program's own trace, once


# --- metrics lines: what the reader accepts is a plausible step record ------------------------------------

METRIC_FIELDS = ["step", "rank", "step_time_ms", "data_ms", "tokens_per_s", "max_memory_allocated_mb", "mfu_pct",
                 "alloc_retries", "loss"]


@fuzz_settings(60)
@given(changes=st.dictionaries(st.sampled_from(METRIC_FIELDS), st.sampled_from(range(len(HOSTILE_VALUES))),
                               min_size=1, max_size=4))
def test_forged_metrics_lines(changes):
    import math

    from fleetscope.traces.formats import read_metric_records

    record = {"step": 3, "rank": 0, "loss": 1.0, "step_time_ms": 100.0, "data_ms": 3.0, "tokens_per_s": 200.0}
    record.update({name: HOSTILE_VALUES[value] for name, value in changes.items()})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank0.jsonl"
        path.write_text(json.dumps(record) + "\n")
        for kept in read_metric_records(path).records:
            assert type(kept.step) is int and kept.step >= 0
            assert kept.rank is None or (type(kept.rank) is int and kept.rank >= 0)
            for name in ("step_time_ms", "data_ms", "tokens_per_s", "max_memory_allocated_mb", "mfu_pct"):
                value = getattr(kept, name)
                assert value is None or (type(value) in (int, float) and 0 <= value < 1e13 and math.isfinite(value))


# --- report.json read back: advise on a damaged report ------------------------------------------------------


@pytest.fixture(scope="module")
def analyzed_run(tmp_path_factory):
    from hostile_runs import make_recorded_run, make_run

    root = tmp_path_factory.mktemp("report") / "run"
    make_recorded_run(root)
    layout = make_run(root)
    assert main(["analyze", str(layout.root)]) in (0, 3)
    return layout


def _paths(value, prefix=()):
    """Every (path, value) inside a JSON document, depth first, at most 400."""
    found = [(prefix, value)]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            found += _paths(item, (*prefix, index))
    return found[:400]


def _at(document, path):
    """The value at `path`, or None where an earlier damage put something else on the way (a scalar where a
    container was): nothing left to damage there."""
    holder = document
    for key in path:
        try:
            holder = holder[key]
        except (KeyError, IndexError, TypeError):
            return None
    return holder


@fuzz_settings(40)
@given(choices=st.lists(st.tuples(st.integers(0, 399), st.sampled_from(range(len(HOSTILE_VALUES)))),
                        min_size=1, max_size=3))
def test_advise_on_a_damaged_report(analyzed_run, choices, capsys):
    report_file = analyzed_run.report_dir / "report.json"
    original = report_file.read_text()
    document = json.loads(original)
    try:
        paths = [p for p, _ in _paths(document) if p]
        for index, value in choices:
            *parent, last = paths[index % len(paths)]
            holder = _at(document, parent)
            if isinstance(holder, dict) or (isinstance(holder, list) and isinstance(last, int) and last < len(holder)):
                holder[last] = HOSTILE_VALUES[value]
        report_file.write_text(json.dumps(document))
        code = main(["advise", str(analyzed_run.root)])
        captured = capsys.readouterr()
        assert code in (0, 1, 2, 3), captured.err
        assert "Traceback" not in captured.err and "\x1b" not in captured.out
    finally:
        report_file.write_text(original)
