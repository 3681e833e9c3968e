"""Every bad-input case of the analysis: each is named in the report with its reason, the rest is analyzed,
and `complete` tells complete from partial."""

import gzip
import json
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.per_rank.events import build_table, decode_selectively, extract_events
from helpers.kineto import KinetoBuilder, gpu_rank

GPU_FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


def _good(rank, world_size=2):
    builder = KinetoBuilder(rank=rank, world_size=world_size, backend="gloo").step(1, 0, 1000)
    return builder.op("aten::mm", 10, 500).op("c10d::allreduce_", 600, 5).gloo(605, 100)


def _dir_with(tmp_path, name, data: bytes, *, world_size=2):
    _good(0, world_size).write(tmp_path / "rank0.json")
    (tmp_path / name).write_bytes(data)
    return analyze(tmp_path, use_hta=False)


def _only_problem(report):
    assert not report.complete
    assert report.analyzed_ranks == [0]
    assert len(report.problems) == 1
    return report.problems[0]


def test_truncated_gzip(tmp_path):
    packed = gzip.compress(json.dumps(_good(1).document()).encode())
    problem = _only_problem(_dir_with(tmp_path, "rank1.json.gz", packed[:-40]))
    assert problem.label == "rank1.json.gz" and "corrupt or truncated gzip" in problem.reason


def test_invalid_json(tmp_path):
    problem = _only_problem(_dir_with(tmp_path, "rank1.json", b'{"traceEvents": [{"ph": "X", "ts": }]}'))
    assert "invalid JSON" in problem.reason


def test_empty_file(tmp_path):
    assert _only_problem(_dir_with(tmp_path, "rank1.json", b"")).reason == "empty file"


def test_not_a_kineto_trace(tmp_path):
    problem = _only_problem(_dir_with(tmp_path, "rank1.json", b'{"hello": 1}'))
    assert "no traceEvents" in problem.reason


def test_a_json_file_beside_the_traces_that_names_no_trace_is_skipped_with_a_note(tmp_path):
    # a config or ground-truth file kept next to a program's traces is no damaged trace: the analysis stays
    # complete and says which files it skipped; one NAMED like a trace (a rank, "trace") stays a problem
    report = _dir_with(tmp_path, "config.json", b'{"lr": 0.001, "batch": 8}', world_size=1)
    assert report.complete and report.problems == [] and report.analyzed_ranks == [0]
    assert any("config.json" in note and "hold no trace" in note for note in report.notes)
    (tmp_path / "worker.pt.trace.json").write_bytes(b'{"hello": 1}')
    assert [p.label for p in analyze(tmp_path, use_hta=False).problems] == ["worker.pt.trace.json"]


def test_no_distributed_info_takes_rank_from_name_and_says_so(tmp_path):
    _good(0).write(tmp_path / "rank0.json")
    builder = _good(1)
    builder.rank = None
    builder.write(tmp_path / "trainer_rank1.json")
    report = analyze(tmp_path, use_hta=False)
    assert report.complete
    sources = {r.rank: r.rank_source for r in report.windows[0].ranks}
    assert sources == {0: "distributedInfo", 1: "file name"}


def test_duplicate_rank_is_named(tmp_path):
    _good(0).write(tmp_path / "rank0.json")
    _good(1).write(tmp_path / "rank1.json")
    _good(1).write(tmp_path / "rank1_copy.json")
    report = analyze(tmp_path, use_hta=False)
    assert not report.complete
    assert report.analyzed_ranks == [0, 1]
    assert [(p.label, p.rank) for p in report.problems] == [("rank1_copy.json", 1)]
    assert "duplicate rank 1" in report.problems[0].reason


def test_missing_ranks_are_listed(tmp_path):
    _good(0, world_size=4).write(tmp_path / "rank0.json")
    _good(2, world_size=4).write(tmp_path / "rank2.json")
    report = analyze(tmp_path, use_hta=False)
    assert not report.complete
    assert [m.rank for m in report.missing] == [1, 3]
    assert report.problems == []


def test_non_utf8_names_are_replaced_and_noted(tmp_path):
    text = json.dumps(_good(1).document()).replace("aten::mm", "aten::m@m")
    data = text.encode().replace(b"@", b"\xff")
    report = _dir_with(tmp_path, "rank1.json", data)
    assert report.complete
    assert [r.rank for r in report.ranks] == [0, 1]
    assert any("rank 1: invalid UTF-8" in n for n in report.windows[0].notes)
    rank1 = report.windows[0].ranks[1]
    assert rank1.utilization.compute_us == 500


def test_integers_beyond_int64(tmp_path):
    builder = _good(1)
    builder.events[1]["args"] = {"External id": 2**70, "correlation": 2**65}
    builder.complete("aten::huge", "cpu_op", 2**66, 10)     # a timestamp no clock can have
    report = _dir_with(tmp_path, "rank1.json", json.dumps(builder.document()).encode())
    assert report.complete
    rank1 = report.windows[0].ranks[1]
    assert rank1.dropped_events == {"time beyond int64 nanoseconds": 1}
    assert rank1.utilization.compute_us == 500
    assert any("rank 1: events left out (1 time beyond int64 nanoseconds)" in n for n in report.windows[0].notes)


def test_negative_durations_are_dropped_and_noted(tmp_path):
    builder = _good(1).op("aten::add", 800, -50)
    report = _dir_with(tmp_path, "rank1.json", json.dumps(builder.document()).encode())
    assert report.complete
    assert report.windows[0].ranks[1].dropped_events == {"negative duration": 1}
    assert any("1 negative duration" in n for n in report.windows[0].notes)


def test_different_step_windows_per_rank(tmp_path):
    _good(0).write(tmp_path / "rank0.json")
    late = KinetoBuilder(rank=1, backend="gloo").step(7, 0, 1000).op("aten::mm", 10, 500)
    late.op("c10d::allreduce_", 600, 5).gloo(605, 100).write(tmp_path / "rank1.json")
    report = analyze(tmp_path, use_hta=False)
    notes = report.windows[0].notes
    assert any("ranks recorded different steps (rank 0: 1, rank 1: 7)" in n for n in notes)
    assert report.windows[0].stragglers.matched_collectives == 0
    assert report.windows[0].stragglers.unmatched_collectives == 2


def test_fast_and_generic_decoders_build_the_same_table():
    document = gpu_rank(0).document()
    document["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": 17, "pid": "Spans", "tid": "x",
                                    "ts": 5.5, "dur": 1})
    collectives = [e for e in document["traceEvents"] if str(e["name"]).startswith("nccl")]
    collectives[0]["args"].update({"Process Group Name": "3", "Process Group Description": "mesh_tp"})
    collectives[1]["args"].update({"Process Group Name": ["odd"], "Process Group Description": {"x": 1}})
    metadata, fast_events = decode_selectively(json.dumps(document).encode())
    fast = build_table(fast_events)
    generic = extract_events(document)
    assert metadata["distributedInfo"] == document["distributedInfo"]
    assert fast.names == generic.names
    for column in ("name_id", "kind", "start_us", "dur_us", "thread", "device", "correlation", "group_id"):
        assert getattr(fast, column).tolist() == getattr(generic, column).tolist(), column
    assert fast.groups == generic.groups == ["mesh_tp pg 3"]
    assert sorted(fast.group_id.tolist()).count(0) == 1      # the odd group name is no group


@pytest.mark.parametrize("data", [b"[]", b'{"traceEvents": {}}', b'{"traceEvents": [1, "x"]}',
                                  b'{"traceEvents": [{"ph": "Q", "name": "ProfilerStep#1"}]}',
                                  b'{"traceEvents": [{"name": "no phase"}]}', b'{"traceEvents": [{"ph": 7}]}'])
def test_odd_shapes_go_to_the_generic_decoder(data):
    assert decode_selectively(data) is None


def _same_tables(fast, generic) -> None:
    assert fast.names == generic.names and fast.thread_names == generic.thread_names
    for column in ("name_id", "kind", "start_us", "dur_us", "thread", "device", "correlation"):
        assert getattr(fast, column).tolist() == getattr(generic, column).tolist(), column
    for column in ("group_id", "message_id", "external_id"):
        fast_column, generic_column = getattr(fast, column), getattr(generic, column)
        assert (fast_column is None) == (generic_column is None), column
        assert fast_column is None or fast_column.tolist() == generic_column.tolist(), column
    assert (fast.groups, fast.messages, fast.op_of_external, fast.dropped, fast.omitted_host_ops) == (
        generic.groups, generic.messages, generic.op_of_external, generic.dropped, generic.omitted_host_ops)


@pytest.mark.parametrize("fixture", ["h200-small-hf-eager-2steps.json.gz", "h200-small-moe", "h200-ddp-gloo-2rank"])
def test_the_fast_decoder_reads_real_traces_of_every_phase_as_the_generic_one(fixture):
    """Flow arrows, instants, metadata: each phase decodes to its own class on the fast path, holding only
    what the table reads of it; the table equals the generic decoder's."""
    path = GPU_FIXTURES / fixture
    path = path if path.is_file() else sorted(path.rglob("*.json.gz"))[0]
    data = gzip.decompress(path.read_bytes())
    document = json.loads(data)
    phases = {event.get("ph") for event in document["traceEvents"]}
    assert {"X", "M"} <= phases and len(phases) >= 3
    _, fast_events = decode_selectively(data)
    _same_tables(build_table(fast_events), extract_events(document))


def test_a_phase_outside_the_format_is_skipped_as_the_generic_decoder_skips_it():
    document = gpu_rank(0).document()
    document["traceEvents"].insert(3, {"ph": "Q", "name": "odd", "ts": 1.0})
    data = json.dumps(document).encode()
    assert decode_selectively(data) is None          # the generic decoder takes the file
    del document["traceEvents"][3]
    _, fast_events = decode_selectively(json.dumps(document).encode())
    _same_tables(build_table(fast_events), extract_events(json.loads(data)))



def test_strange_values_are_survived(tmp_path):
    builder = _good(1)
    builder.events += [
        {"ph": "X", "cat": ["cpu_op"], "name": {"a": 1}, "pid": [1], "tid": [2], "ts": 20, "dur": 1, "args": [1]},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": "stream x", "ts": 30, "dur": 2,
         "args": {"stream": "7", "device": None, "correlation": 1.5}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": None},
        "not an event",
    ]
    report = _dir_with(tmp_path, "rank1.json", json.dumps(builder.document()).encode())
    assert report.complete, report.problems
    rank1 = report.windows[0].ranks[1]
    assert rank1.dropped_events == {"not a JSON object": 1}
    assert rank1.utilization.basis == "gpu"


@pytest.mark.parametrize(("key", "value"), [("device", 2**40), ("External id", 2**70)])
def test_an_id_too_large_for_its_column_is_left_out_not_fatal(tmp_path, key, value):
    """One kernel naming a device beyond int32 or an External id beyond int64 had failed the whole rank (an
    OverflowError filling the column); the value is now read as absent, on both decoders."""
    document = gpu_rank(1).document()
    document["distributedInfo"]["backend"] = "gloo"  # rank 0 (_dir_with) is a gloo job's: one job
    kernel = next(e for e in document["traceEvents"] if e.get("cat") == "kernel")
    kernel["args"][key] = value
    report = _dir_with(tmp_path, "rank1.json", json.dumps(document).encode())
    assert report.complete, report.problems
    assert report.analyzed_ranks == [0, 1]
    _, fast_events = decode_selectively(json.dumps(document).encode())
    _same_tables(build_table(fast_events), extract_events(document))
