"""Fuzz tier: seeded, bounded property runs of analyze, merge and compare over mutated inputs.

Every suite starts from real inputs (the recorded H200 run in tests/fixtures, and small traces built by
the test helpers), damages one file the way a hostile user or a broken file system would (byte flips,
truncation, inserted deep nesting or absurd numbers, values of the wrong type, the file replaced by a
symlink, a FIFO or a directory), runs the commands in-process, and checks the contract of SECURITY.md:
  - no uncaught exception; exit code 0 (complete), 3 (partial), 1 (nothing analyzed) with that meaning;
  - every problem names its file; the untouched ranks are still analyzed;
  - no input byte changes (sha256 of every input file before and after);
  - the report is JSON without NaN (what `--json` writes).
The commands that read what a job left behind are fuzzed the same way: `tune --dry-run` over a damaged
job.json (exit 0 or 2, nothing created), the fan-out's task records (a damaged one is a task that did not
complete), MoE records (`analyze` and `advise`), and the all-to-all message args of a trace.
Runs are derandomized (the same examples every run, no example database written). Inputs that once
broke the contract live in tests/fuzz_corpus/ and are replayed by test_corpus_case.
"""

from __future__ import annotations

import atexit
import copy
import functools
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from fleetscope.analysis import analyze
from fleetscope.analysis.compare import compare
from fleetscope.analysis.per_rank.cache import ENTRY_SUFFIX
from fleetscope.cli.main import main
from fleetscope.traces.formats import read_metric_records
from fleetscope.traces.layout import RunLayout
from hostile_runs import (
    alltoall_rank,
    digests,
    good_rank,
    make_recorded_run,
    make_run,
    make_trace_dir,
    moe_line,
    write_moe_records,
)

pytestmark = pytest.mark.fuzz

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
REAL_RUN = FIXTURES / "h200-ddp-gloo-2rank"
CORPUS = Path(__file__).parent / "fuzz_corpus"
EXIT_OK, EXIT_FAILED, EXIT_PARTIAL = 0, 1, 3


def fuzz_settings(examples: int):
    # no shrinking phase: a failure is reported as found, and the run time stays bounded
    return settings(derandomize=True, max_examples=examples, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


# --- mutations ---------------------------------------------------------------------------------------

HOSTILE_SNIPPETS = [
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b"18446744073709551616", b"-9223372036854775809",
    b"[" * 5000, b'{"a":' * 3000, b"\xff\xfe\xfd", b"\x00", b'"', b"null", b"true", b"{}", b"[]",
    b'"world_size": 1000000000', b'"rank": 99999999999', b'"../../etc/passwd"', b'"/etc/passwd"',
]
HOSTILE_VALUES = [
    None, True, False, -1, 0, 2**64, -(2**63) - 1, 10**9, 1e308, -1e308, math.nan, math.inf, -math.inf,
    "", "x" * 50, "../../outside", "/etc/passwd", [], {}, [[[]]], {"a": {"b": {}}}, "rank1", 1.5,
]
_byte_op = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.sampled_from(HOSTILE_SNIPPETS)),
)
byte_mutations = st.lists(_byte_op, min_size=1, max_size=4)
value_mutations = st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=1, max_size=5),
                                     st.one_of(st.sampled_from(HOSTILE_VALUES), st.just("<delete>"))),
                           min_size=1, max_size=4)


def mutate_bytes(data: bytes, operations) -> bytes:
    data = bytearray(data)
    for operation in operations:
        at = int(operation[1] * max(len(data) - 1, 0))
        if operation[0] == "flip" and data:
            data[at] ^= operation[2]
        elif operation[0] == "truncate":
            del data[at:]
        elif operation[0] == "insert":
            data[at:at] = operation[2]
    return bytes(data)


def mutate_values(document, operations):
    """Replace (or delete) the value at a path chosen by index at each level of the document."""
    for path, value in operations:
        document = _replace_at(document, path, value)
    return document


def _replace_at(node, path: list[int], value):
    if not path or not isinstance(node, (dict, list)) or not node:
        return node if value == "<delete>" else copy.deepcopy(value)  # never share one list between places
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    key = keys[path[0] % len(keys)]
    if len(path) == 1 and value == "<delete>":
        del node[key]
    else:
        node[key] = _replace_at(node[key], path[1:], value)
    return node


def dumps(document) -> bytes:
    return json.dumps(document, allow_nan=True).encode()


def write_mutated(path: Path, data: bytes) -> None:
    """Write `data` where `path` is, keeping the file's compression (so the damage reaches the JSON)."""
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)


def plant(path: Path, kind: str, outside: Path) -> None:
    """Replace `path` by something that is not a trace file."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path)
    else:
        path.symlink_to(outside)


# --- the contract -----------------------------------------------------------------------------------


@contextmanager
def workspace():
    with tempfile.TemporaryDirectory(prefix="fleetscope-fuzz-") as directory:
        yield Path(directory)


def analyze_in_process(root: Path, out: Path, *, valid_labels: set[str]) -> int:
    """`fleetscope analyze` in-process (rendering and writing included), and the contract checks."""
    before = digests(root)
    rc = main(["analyze", str(root), "--json", str(out / "report.json"), "--html", str(out / "report.html"),
               "--no-hta"])
    assert digests(root) == before, "an input file changed"
    assert rc in (EXIT_OK, EXIT_FAILED, EXIT_PARTIAL)
    if rc == EXIT_FAILED and not (out / "report.json").exists():
        assert not valid_labels, "the analysis failed although some traces were intact"
        return rc
    data = json.loads((out / "report.json").read_text())   # written with allow_nan=False
    analyzed = {r["label"] for w in data["windows"] for r in w["ranks"]}
    problems = {p["label"]: p["reason"] for p in data["problems"]}
    assert all(label and reason for label, reason in problems.items()), "a problem does not name its file"
    for label in valid_labels:
        assert label in analyzed or "duplicate" in problems.get(label, ""), f"intact {label} was not analyzed"
    assert (rc == EXIT_OK) == data["complete"] and (rc == EXIT_FAILED) == (not data["ranks"])
    return rc


def merge_in_process(root: Path, out: Path, *, in_workers: bool = False) -> None:
    """`fleetscope merge` in-process; intact traces are always there, so the merge must produce a trace
    (exit 0 or 3: a failure of the whole merge over one bad file is exactly what must not happen).
    One worker unless `in_workers`: a pool of worker processes per example was most of the fuzz tier's time
    (0.6 s an example of 0.7), and the real trace's examples still take the default pool."""
    before = digests(root)
    workers = [] if in_workers else ["--workers", "1"]
    rc = main(["merge", str(root), "-o", str(out / "merged.perfetto-trace"), *workers])
    assert rc in (EXIT_OK, EXIT_PARTIAL), f"merge exit code {rc}"
    assert digests(root) == before, "an input file changed"


def _trace_dir(root: Path, ranks: int = 3) -> Path:
    return make_trace_dir(root, world_size=ranks)


# --- suites ---------------------------------------------------------------------------------------


@fuzz_settings(120)
@given(operations=byte_mutations)
def test_byte_damage_to_one_trace_is_that_traces_problem(operations):
    with workspace() as tmp:
        root = _trace_dir(tmp / "traces")
        victim = root / "rank2.json"
        write_mutated(victim, mutate_bytes(victim.read_bytes(), operations))
        analyze_in_process(root, tmp, valid_labels={"rank0.json", "rank1.json"})
        merge_in_process(root, tmp)


@fuzz_settings(120)
@given(operations=value_mutations)
def test_wrong_types_and_absurd_values_in_one_trace(operations):
    with workspace() as tmp:
        root = _trace_dir(tmp / "traces")
        document = mutate_values(good_rank(2, world_size=3).document(), operations)
        write_mutated(root / "rank2.json", dumps(document))
        analyze_in_process(root, tmp, valid_labels={"rank0.json", "rank1.json"})
        merge_in_process(root, tmp)


@fuzz_settings(12)
@given(operations=st.one_of(byte_mutations, value_mutations), gzip_kept=st.booleans())
def test_damage_to_a_real_h200_trace(operations, gzip_kept):
    with workspace() as tmp:
        run = tmp / "run"
        shutil.copytree(REAL_RUN, run)
        victim = RunLayout.at(run).window_dir(0) / "rank1.vm.pt.trace.json.gz"
        data = gzip.decompress(victim.read_bytes())
        if isinstance(operations[0][0], str):
            data = mutate_bytes(data, operations)
        else:
            data = dumps(mutate_values(json.loads(data), operations))
        victim.write_bytes(gzip.compress(data, compresslevel=1) if gzip_kept else data)
        analyze_in_process(run, tmp, valid_labels={"traces/window000/rank0.vm.pt.trace.json.gz"})
        merge_in_process(run, tmp, in_workers=True)


@fuzz_settings(40)
@given(kind=st.sampled_from(["fifo", "directory", "loop", "outside"]), rank=st.integers(0, 2),
       run_dir=st.booleans())
def test_a_trace_replaced_by_a_fifo_directory_or_symlink(kind, rank, run_dir):
    with workspace() as tmp:
        outside = good_rank(rank, world_size=3).write(tmp / "elsewhere" / "rank.json")
        if run_dir:
            layout = make_run(tmp / "run", 3)
            root, victim = layout.root, layout.trace_file(0, rank, "node0")
            labels = {layout.relative(layout.trace_file(0, r, "node0")) for r in range(3) if r != rank}
        else:
            root = _trace_dir(tmp / "traces")
            victim, labels = root / f"rank{rank}.json", {f"rank{r}.json" for r in range(3) if r != rank}
        plant(victim, kind, outside)
        rc = analyze_in_process(root, tmp, valid_labels=labels)
        assert rc == EXIT_PARTIAL
        merge_in_process(root, tmp)


@fuzz_settings(100)
@given(operations=st.one_of(byte_mutations, value_mutations))
def test_a_damaged_manifest(operations):
    with workspace() as tmp:
        layout = make_run(tmp / "run", 3)
        text = layout.manifest_file.read_bytes()
        if isinstance(operations[0][0], str):
            layout.manifest_file.write_bytes(mutate_bytes(text, operations))
        else:
            layout.manifest_file.write_bytes(dumps(mutate_values(json.loads(text), operations)))
        try:
            json.loads(layout.manifest_file.read_bytes())
            parses = True
        except (ValueError, RecursionError):
            parses = False
        labels = set() if parses else {layout.relative(layout.trace_file(0, r, "node0")) for r in range(3)}
        analyze_in_process(layout.root, tmp, valid_labels=labels)


@fuzz_settings(60)
@given(operations=st.one_of(byte_mutations, value_mutations))
def test_a_damaged_clock_file(operations):
    from fleetscope.traces.clock import ClockOffset, write_clock_offset

    with workspace() as tmp:
        layout = make_run(tmp / "run", 3)
        for rank in range(3):
            write_clock_offset(ClockOffset(rank=rank, offset_us=10.0 * rank, uncertainty_us=1.0,
                                           best_round_trip_us=2.0, round_trips=4, host="node0", measured_at_ns=1),
                               layout.clock_file(rank))
        victim = layout.clock_file(1)
        if isinstance(operations[0][0], str):
            victim.write_bytes(mutate_bytes(victim.read_bytes(), operations))
        else:
            victim.write_bytes(dumps(mutate_values(json.loads(victim.read_text()), operations)))
        labels = {layout.relative(layout.trace_file(0, r, "node0")) for r in range(3)}
        assert analyze_in_process(layout.root, tmp, valid_labels=labels) == EXIT_OK


def _metrics(layout: RunLayout, rank: int, tokens_per_s: float) -> Path:
    path = layout.metrics_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "rank": rank, "step_time_ms": 100.0, "tokens_per_s": tokens_per_s})
             for s in range(6)]
    path.write_text("\n".join(lines) + "\n")
    return path


@functools.lru_cache(maxsize=None)
def _compare_template(real: bool) -> Path:
    """base/ and new/ run directories with step metrics and a report.json (so compare reads the report
    instead of analyzing with HTA), built once per session and copied for each example."""
    root = Path(tempfile.mkdtemp(prefix="fleetscope-fuzz-compare-"))
    atexit.register(shutil.rmtree, root, True)
    for name in ("base", "new"):
        if real:
            shutil.copytree(REAL_RUN, root / name)
            layout = RunLayout.at(root / name)
        else:
            layout = make_run(root / name, 2)
            for rank in range(2):
                _metrics(layout, rank, 1000.0)
        analyze(layout.root, use_hta=False, html_out=None)
    return root


@fuzz_settings(80)
@given(operations=st.one_of(byte_mutations, value_mutations), real=st.booleans())
def test_damaged_metrics_never_make_a_false_regression(operations, real):
    with workspace() as tmp:
        shutil.copytree(_compare_template(real), tmp / "sides")
        base, new = RunLayout.at(tmp / "sides" / "base"), RunLayout.at(tmp / "sides" / "new")
        victim = new.metrics_file(1)
        lines = victim.read_bytes()
        if isinstance(operations[0][0], str):
            victim.write_bytes(mutate_bytes(lines, operations))
        else:
            first, _, rest = lines.partition(b"\n")
            victim.write_bytes(dumps(mutate_values(json.loads(first), operations)) + b"\n" + rest)
        before = digests(tmp)
        result = compare(base.root, new.root)
        assert digests(tmp) == before
        read = read_metric_records(victim)
        if read.bad_line_count:
            assert any("metrics/rank1.jsonl" in n and "bad line" in n for n in result.notes)
        if not read.records:
            assert not result.regressions, "a rank left out on one side made a regression"


@fuzz_settings(60)
@given(operations=byte_mutations)
def test_a_damaged_cache_entry_is_a_miss_and_the_report_is_unchanged(operations, tmp_path_factory):
    with workspace() as tmp:
        root = _trace_dir(tmp / "traces")
        cache = tmp / "cache"
        expected = analyze(root, use_hta=False, cache_dir=cache).to_json()
        for entry in sorted(cache.glob(f"*{ENTRY_SUFFIX}")):
            entry.write_bytes(mutate_bytes(entry.read_bytes(), operations))
        report = analyze(root, use_hta=False, cache_dir=cache).to_json()
        for data in (expected, report):
            data.pop("notes"), data.pop("created_at")
        assert report == expected


@fuzz_settings(6)
@given(operations=byte_mutations, target=st.sampled_from(["trace", "manifest"]))
def test_the_cli_exit_code_of_a_damaged_run(operations, target):
    with workspace() as tmp:
        layout = make_run(tmp / "run", 3)
        victim = layout.manifest_file if target == "manifest" else layout.trace_file(0, 2, "node0")
        victim.write_bytes(mutate_bytes(victim.read_bytes(), operations))
        before = digests(layout.root)
        done = subprocess.run([sys.executable, "-m", "fleetscope.cli.main", "analyze", str(layout.root), "--no-hta"],
                              capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode in (EXIT_OK, EXIT_PARTIAL) and digests(layout.root) == before
        assert (done.returncode == EXIT_OK) == json.loads(layout.report_json.read_text())["complete"]


# --- what a job left behind: job.json (tune), task records (fan-out), MoE records, all-to-all args --------


def _damaged(data: bytes, operations) -> bytes:
    if isinstance(operations[0][0], str):
        return mutate_bytes(data, operations)
    return dumps(mutate_values(json.loads(data), operations))


def tune_dry_run(layout: RunLayout) -> int:
    """`fleetscope tune RUN --apply 1 --dry-run` in-process, and its contract: exit 0 (planned) or 2 (refused:
    job.json unreadable or not a spec this version relaunches); no input changed; nothing created beside the run."""
    before, around = digests(layout.root), sorted(os.listdir(layout.root.parent))
    rc = main(["tune", str(layout.root), "--apply", "1", "--dry-run"])
    assert rc in (EXIT_OK, 2), rc
    assert digests(layout.root) == before and sorted(os.listdir(layout.root.parent)) == around
    return rc


@fuzz_settings(80)
@given(operations=st.one_of(byte_mutations, value_mutations))
def test_a_damaged_job_record_is_refused_or_planned_never_a_crash(operations):
    with workspace() as tmp:
        layout = make_recorded_run(tmp / "run")
        layout.job_file.write_bytes(_damaged(layout.job_file.read_bytes(), operations))
        tune_dry_run(layout)


def _task_record(tmp: Path) -> tuple[RunLayout, Path]:
    from fleetscope.traces.fanout import ParseCounts, TaskRecord, ShardTraceProblem, write_task_record

    layout = make_run(tmp / "run", 3, gathered=False)
    counts = ParseCounts(traces=2, parsed=1, failed=[ShardTraceProblem(label="rank9.json", reason="not JSON")])
    record = TaskRecord(array_job_id="77", task=0, tasks=2, node="n0", ranks=[0, 1], counts=counts,
                        cache_dir=str(tmp / "cache"), seconds=1.5)
    return layout, write_task_record(layout, record)


@fuzz_settings(150)
@given(operations=st.one_of(byte_mutations, value_mutations))
def test_a_damaged_task_record_is_a_task_that_did_not_complete(operations):
    from fleetscope.cli.fanout_commands import incomplete_tasks
    from fleetscope.launcher.fanout import shard_blocks
    from fleetscope.traces.fanout import read_task_record

    with workspace() as tmp:
        layout, path = _task_record(tmp)
        original = path.read_bytes()
        path.write_bytes(_damaged(original, operations))
        record, why = read_task_record(layout, "77", 0)
        assert (record is None) == bool(why)
        if record is not None:   # what was read back is what a task writes
            assert all(type(k) is int or isinstance(k, str) for k in record.ranks)
            assert all(isinstance(p.label, str) and isinstance(p.reason, str) for p in record.counts.failed)
        tasks = incomplete_tasks(layout, "77", shard_blocks([0, 1, 2], 2))
        assert 1 in [t.task for t in tasks] and all(t.reason for t in tasks)


@fuzz_settings(50)
@given(operations=st.one_of(byte_mutations, value_mutations))
def test_damaged_moe_records_are_skipped_and_named(operations):
    with workspace() as tmp:
        layout = make_run(tmp / "run", 2)
        write_moe_records(layout, extra={1: [_damaged(moe_line(1, 9).encode(), operations).decode("latin-1")]})
        labels = {layout.relative(layout.trace_file(0, r, "node0")) for r in range(2)}
        assert analyze_in_process(layout.root, tmp, valid_labels=labels) == EXIT_OK
        data = json.loads((tmp / "report.json").read_text())
        assert data["moe"]["status"] == "ok"
        assert main(["advise", str(layout.root)]) == EXIT_OK


_A2A_ARGS = ["Collective name", "In msg nelems", "Out msg nelems", "dtype", "Group size", "In split size",
             "Out split size", "Process Group Name", "Process Group Description"]
_A2A_VALUES = [*HOSTILE_VALUES, 2**40, 2**62, 10**9, "[]", "[-1, 3]", "[1, ...]", "[" * 100, [[1]], ["a"],
               [10**30, 1], "[" + ", ".join(["1"] * 5000) + "]"]


@fuzz_settings(60)
@given(changes=st.lists(st.dictionaries(st.sampled_from(_A2A_ARGS), st.sampled_from(_A2A_VALUES), max_size=4),
                        min_size=1, max_size=4))
def test_hostile_all_to_all_args_lose_no_rank(changes):
    """Message args only size a collective: whatever they hold, both ranks are analyzed."""
    with workspace() as tmp:
        root = tmp / "traces"
        root.mkdir()
        for rank in (0, 1):
            alltoall_rank(rank, changes).write(root / f"rank{rank}.json")
        assert analyze_in_process(root, tmp, valid_labels={"rank0.json", "rank1.json"}) == EXIT_OK


@functools.lru_cache(maxsize=None)
def _advised_template() -> Path:
    """A run with traces, MoE records and its report.json, built once per session and copied per example."""
    root = Path(tempfile.mkdtemp(prefix="fleetscope-fuzz-advise-"))
    atexit.register(shutil.rmtree, root, True)
    layout = make_run(root / "run", 2)
    write_moe_records(layout)
    analyze(layout.root, use_hta=False)
    return layout.root


@fuzz_settings(120)
@given(operations=value_mutations)
@example(operations=[([11], None)])          # "ranks": null was an advise traceback
@example(operations=[([12, 0], None)])       # a window that is null, too
def test_advise_over_a_damaged_report_json_names_the_file(operations, capsys):
    with workspace() as tmp:
        run = tmp / "run"
        shutil.copytree(_advised_template(), run)
        layout = RunLayout.at(run)
        layout.report_json.write_bytes(dumps(mutate_values(json.loads(layout.report_json.read_text()), operations)))
        before = digests(run)
        capsys.readouterr()
        rc = main(["advise", str(run)])
        assert rc in (EXIT_OK, EXIT_FAILED) and digests(run) == before
        if rc == EXIT_FAILED:
            assert f"{layout.report_json}: cannot read report" in capsys.readouterr().err


# --- the corpus: inputs that once broke the contract -------------------------------------------------


def _corpus_cases() -> list[Path]:
    return sorted(p for p in CORPUS.iterdir() if p.is_file() and not p.name.startswith((".", "README")))


@pytest.mark.parametrize("case", _corpus_cases(), ids=lambda p: p.name)
def test_corpus_case(case, tmp_path):
    """The file's name says where it goes: trace-* (rank 2 of three traces, analyzed and merged),
    manifest-*, clock-* (rank 1's clock file), metrics-* (rank 1's metrics of the new side of a compare),
    moe-* (lines appended to rank 1's MoE records), job-* (job.json of a run `tune` relaunches: refused),
    task-* (task 0's record of a parse fan-out: a task that did not complete)."""
    kind = case.name.split("-", 1)[0]
    layout = make_run(tmp_path / "run", 3)
    labels = {layout.relative(layout.trace_file(0, r, "node0")) for r in range(3)}
    if kind == "trace":
        root = _trace_dir(tmp_path / "traces")
        shutil.copyfile(case, root / "rank2.json")
        analyze_in_process(root, tmp_path, valid_labels={"rank0.json", "rank1.json"})
        merge_in_process(root, tmp_path)
    elif kind == "manifest":
        shutil.copyfile(case, layout.manifest_file)
        analyze_in_process(layout.root, tmp_path, valid_labels=set())
    elif kind == "clock":
        layout.clock_dir.mkdir()
        shutil.copyfile(case, layout.clock_file(1))
        assert analyze_in_process(layout.root, tmp_path, valid_labels=labels) == EXIT_OK
    elif kind == "metrics":
        base = make_run(tmp_path / "base", 2)
        for rank in range(2):
            _metrics(base, rank, 1000.0)
            _metrics(layout, rank, 1000.0)
        shutil.copyfile(case, layout.metrics_file(1))
        assert not compare(base.root, layout.root, allow_different_jobs=True).regressions   # 2 ranks vs 3
    elif kind == "moe":
        write_moe_records(layout, ranks=(0, 1, 2))
        with layout.moe_file(1).open("ab") as handle:
            handle.write(case.read_bytes())
        assert analyze_in_process(layout.root, tmp_path, valid_labels=labels) == EXIT_OK
        assert main(["advise", str(layout.root)]) == EXIT_OK
    elif kind == "job":
        recorded = make_recorded_run(tmp_path / "recorded")
        shutil.copyfile(case, recorded.job_file)
        assert tune_dry_run(recorded) == 2
    elif kind == "task":
        from fleetscope.cli.fanout_commands import incomplete_tasks
        from fleetscope.launcher.fanout import shard_blocks
        from fleetscope.traces.layout import fanout_task_record

        path = fanout_task_record(layout, "77", 0)
        path.parent.mkdir(parents=True)
        shutil.copyfile(case, path)
        assert "unreadable record" in incomplete_tasks(layout, "77", shard_blocks([0, 1, 2], 2))[0].reason
    else:
        pytest.fail(f"{case.name}: corpus files are named trace-*, manifest-*, clock-*, metrics-*, moe-*, job-* "
                    "or task-*")
