"""What-if by simulation against a published analyzer: fleetscope's S, S_t, S_w, M_W and M_S on the three
traces of the OSDI'25 straggler artifact (tests/fixtures/straggler_analysis, see SOURCE.md) beside the
artifact's own expected results, and the op-timeline importer's refusals."""

from __future__ import annotations

import builtins
import gzip
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from fleetscope.analysis.whatif.metrics import WhatIfConfig, what_if
from fleetscope.analysis.whatif.model import ModelError
from fleetscope.analysis.whatif.pipeline_model import model_timeline
from fleetscope.traces.op_timeline import OP_TYPES, OpTimelineError, read_op_timeline

ARTIFACT = Path(__file__).parent / "fixtures" / "straggler_analysis"
TRACES = ("AR", "ST", "SE")


@cache
def analyzed(name: str):
    modeled = model_timeline(read_op_timeline(ARTIFACT / f"trace-{name}.csv.gz"))
    return modeled, what_if(modeled)


def expected(kind: str, name: str) -> dict:
    return json.loads((ARTIFACT / f"{kind}-{name}.json").read_text())


def artifact_culprit_worker(result: dict) -> tuple[int, int]:
    """(DP rank, stage) the artifact's heatmap highlights most: the larger min(S of its DP rank, S of its stage)."""
    by_dp = {int(k.split(",")[0]): v for k, v in result["blocking_decompose_by_dp_rank"].items()}
    by_stage = {int(k.split(",")[0]): v for k, v in result["blocking_decompose_by_stage"].items()}
    return max(((dp, stage) for dp in by_dp for stage in by_stage),
               key=lambda worker: min(by_dp[worker[0]], by_stage[worker[1]]))


@pytest.mark.parametrize("name", TRACES)
def test_the_steps_and_the_replay_are_the_artifacts(name):
    """The trace's steps are those the artifact analyzed, and replaying the recorded op times through the
    dependency model gives the artifact's replayed step time (its `step_t_nodelay`)."""
    modeled, result = analyzed(name)
    reference = expected("result", name)
    assert sorted(int(step) for step in reference["step_t_base"]) == modeled.model.steps.tolist()
    assert result.measured_step_s == pytest.approx(np.mean(list(reference["step_t_base"].values())), rel=1e-3)
    assert result.replayed_step_s == pytest.approx(np.mean(list(reference["step_t_nodelay"].values())), rel=0.01)
    assert result.replayed_step_s <= result.measured_step_s


@pytest.mark.parametrize("name", TRACES)
def test_slowdown_is_within_5_percent_of_the_artifacts(name):
    _, result = analyzed(name)
    reference = expected("result", name)
    assert result.slowdown == pytest.approx(reference["blocking_slowdown"], rel=0.05)
    assert result.ideal_step_s == pytest.approx(np.mean(list(reference["step_t_noblk"].values())), rel=0.05)


@pytest.mark.parametrize("name", TRACES)
def test_the_culprits_are_the_artifacts(name):
    """Same slowest op type, DP rank, stage and worker; each S_t, S_dp and S_stage within 5%."""
    modeled, result = analyzed(name)
    reference = expected("result", name)
    for ours, theirs in ((result.slowdown_by_op_type, reference["blocking_decompose_by_optype"]),
                         (result.slowdown_by_dp_rank, reference["blocking_decompose_by_dp_rank"]),
                         (result.slowdown_by_stage, reference["blocking_decompose_by_stage"])):
        theirs = {str(key).split(",")[0]: value for key, value in theirs.items()}
        assert str(next(iter(ours))) == max(theirs, key=theirs.get)
        assert {str(key) for key in ours} == set(theirs)
        for key, value in ours.items():
            assert value == pytest.approx(theirs[str(key)], rel=0.05), key
    worst = result.slowdown_by_worker[0]
    assert (worst.dp_rank, worst.stage) == artifact_culprit_worker(reference)
    assert worst.rank == modeled.worker_rank[worst.stage, list(modeled.dp_ranks).index(worst.dp_rank)]


@pytest.mark.parametrize("name", TRACES)
def test_worker_and_stage_shares_are_within_10_points_of_the_artifacts(name):
    _, result = analyzed(name)
    assert result.worker_share_explained == pytest.approx(expected("mw", name)["Mw"], abs=0.10)
    assert result.stage_share_explained == pytest.approx(expected("ms", name)["Ms"], abs=0.10)


def test_the_readmes_highlights_hold():
    """AR: one slow worker explains it all (M_W ~100%); ST: the long last stage (M_S ~120%); SE: sequence
    imbalance, with the last stage second (M_S ~68%, M_W small)."""
    ar, st, se = (analyzed(name)[1] for name in TRACES)
    assert ar.worker_share_explained > 0.9 and len(ar.workers_explaining) == 1
    assert ar.slowdown_by_worker[0].slowdown > 1.5 > ar.slowdown_by_worker[1].slowdown
    assert st.stage_share_explained > 1.0 and st.worker_share_explained < 0.2
    assert 0.5 < se.stage_share_explained < 0.9 and se.worker_share_explained < 0.2


def test_the_chrome_json_timeline_gives_the_tables_answer():
    """The artifact's JSON timeline of ST (comm ops drawn from their last peer's arrival, absolute times)
    reads to the same ops and the same what-if as its table."""
    from_json = read_op_timeline(ARTIFACT / "timeline-ST.json.gz")
    from_table = read_op_timeline(ARTIFACT / "trace-ST.csv.gz")
    assert len(from_json) == len(from_table)
    key = lambda t: np.lexsort((t.seq_id, t.op_type, t.step, t.rank))  # noqa: E731
    a, b = from_json.select(key(from_json)), from_table.select(key(from_table))
    for field in ("rank", "dp_rank", "stage", "step", "op_type", "seq_id", "micro_batch", "model_chunk"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    compute = np.isin(a.type_names(), ["forward-compute", "backward-compute"])
    assert np.allclose(a.duration_s[compute], b.duration_s[compute], atol=1e-6)
    json_result = what_if(model_timeline(from_json))
    table_result = analyzed("ST")[1]
    assert json_result.slowdown == pytest.approx(table_result.slowdown, rel=1e-4)
    assert json_result.stage_share_explained == pytest.approx(table_result.stage_share_explained, abs=1e-3)


def test_a_median_ideal_is_a_choice_of_the_config():
    """The paper's ideal takes the mean of computation times; a median ideal ignores AR's one slow worker
    entirely, so the slowdown grows."""
    modeled, result = analyzed("AR")
    by_median = what_if(modeled, WhatIfConfig(computation_statistic="median"))
    assert by_median.ideal_step_s < result.ideal_step_s and by_median.slowdown > result.slowdown
    with pytest.raises(ValueError, match="computation_statistic"):
        WhatIfConfig(computation_statistic="p90")


CSV_HEADER = "dp_rank,stage,rank,step,optype,start_ts,duration,seq_id,mc,mb_id,gmc\n"


def write_csv(path: Path, rows: list[str], header: str = CSV_HEADER) -> Path:
    path.write_text(header + "".join(row + "\n" for row in rows))
    return path


@pytest.mark.parametrize("header, rows, says", [
    ("dp_rank,stage,rank,step,optype,start_ts,seq_id,mc,mb_id\n", ["0,0,0,1,optimizer,0.1,0,-1,-1"],
     "missing column(s) duration"),
    (CSV_HEADER, ["0,0,0,one,optimizer,0.1,0.2,0,-1,-1,-1"], "step of row 0 is 'one', not an integer"),
    (CSV_HEADER, ["0,0,0,1,attention,0.1,0.2,0,-1,-1,-1"], "optype 'attention' is not an op type"),
    (CSV_HEADER, ["0,0,0,1,optimizer,0.1,-0.2,0,-1,-1,-1"], "duration of op 0 is negative"),
    (CSV_HEADER, ["0,0,0,1,optimizer,nan,0.2,0,-1,-1,-1"], "start_ts of row 0"),
    (CSV_HEADER, [], "no ops"),
])
def test_a_bad_table_is_refused_naming_the_file_and_the_field(tmp_path, header, rows, says):
    path = write_csv(tmp_path / "ops.csv", rows, header)
    with pytest.raises(OpTimelineError, match="ops.csv") as refused:
        read_op_timeline(path)
    assert says in str(refused.value)


@pytest.mark.parametrize("document, says", [
    (b"{not json", "not JSON"),
    (b'{"traceEvents": 3}', "no list of events"),
    (b'[{"ph": "X", "name": "optimizer", "pid": 0, "tid": 0, "ts": 1, "dur": 2, "args": {"step": 1, "seq_id": 0}}]',
     "no thread_name metadata"),
    (b'[{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "PP rank 0, TP rank 0, compute"}},'
     b'{"ph": "X", "name": "optimizer", "pid": 0, "tid": 0, "ts": "soon", "dur": 2, "args": {"step": 1, "seq_id": 0}}]',
     "op event 0: ts is 'soon'"),
    (b'[{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "PP rank 0, TP rank 0, compute"}},'
     b'{"ph": "X", "name": "optimizer", "pid": 0, "tid": 9, "ts": 1, "dur": 2, "args": {"step": 1, "seq_id": 0}}]',
     "tid 9 has no thread_name"),
])
def test_a_bad_json_timeline_is_refused_naming_the_file_and_the_field(tmp_path, document, says):
    path = tmp_path / "timeline.json.gz"
    path.write_bytes(gzip.compress(document))
    with pytest.raises(OpTimelineError, match="timeline.json.gz") as refused:
        read_op_timeline(path)
    assert says in str(refused.value)


def test_parquet_without_pyarrow_says_what_to_do(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name == "pyarrow":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "trace.parquet").write_bytes(b"PAR1")
    with pytest.raises(OpTimelineError, match=r"trace.parquet: reading parquet needs pyarrow"):
        read_op_timeline(tmp_path / "trace.parquet")


def test_an_unknown_suffix_is_refused(tmp_path):
    (tmp_path / "ops.txt").write_text("x")
    with pytest.raises(OpTimelineError, match="not an op timeline"):
        read_op_timeline(tmp_path / "ops.txt")


def test_a_step_missing_an_op_is_refused_naming_it(tmp_path):
    table = read_op_timeline(ARTIFACT / "trace-ST.csv.gz")
    dropped = np.flatnonzero((table.step == 25) & (table.dp_rank == 1) & (table.stage == 2)
                             & (table.op_type == OP_TYPES.index("backward-compute")) & (table.seq_id == 3))
    keep = np.ones(len(table), dtype=bool)
    keep[dropped] = False
    with pytest.raises(ModelError, match=r"step 25, DP rank 1, stage 2: backward-compute #3 is missing"):
        model_timeline(table.select(keep))


def test_the_whatif_command_prints_the_figures_and_names_the_source(tmp_path, capsys):
    from fleetscope.cli.main import main

    out = tmp_path / "whatif.json"
    assert main(["whatif", str(ARTIFACT / "trace-AR.csv.gz"), "--top", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "trace-AR.csv.gz" in printed and "S            1.973" in printed
    assert "rank 0 (DP 0, stage 0) 1.979" in printed and "M_W          100.2%" in printed
    written = json.loads(out.read_text())
    assert written["slowdown"] == pytest.approx(1.973, abs=1e-3) and written["workers_explaining"] == [0]


def test_the_whatif_command_refuses_a_bad_file_without_a_traceback(tmp_path, capsys):
    from fleetscope.cli.exit_codes import EXIT_FAILED
    from fleetscope.cli.main import main

    path = write_csv(tmp_path / "ops.csv", ["0,0,0,1,attention,0.1,0.2,0,-1,-1,-1"])
    assert main(["whatif", str(path)]) == EXIT_FAILED
    error = capsys.readouterr().err
    assert error.startswith("fleetscope whatif: ") and "ops.csv" in error and "Traceback" not in error


def test_a_json_collective_that_ended_before_its_last_peer_arrived_keeps_its_end_and_takes_no_time(tmp_path):
    """The artifact's writer draws a collective from its last member's arrival, so a send finished before its
    receive was posted has a negative dur (the SE timeline has such ops)."""
    document = (b'[{"ph": "M", "name": "thread_name", "pid": 0, "tid": 1,'
                b' "args": {"name": "PP rank 0, TP rank 0, pp"}},'
                b'{"ph": "X", "name": "forward-send", "pid": 0, "tid": 1, "ts": 100.0, "dur": -4.0,'
                b' "args": {"step": 1, "seq_id": 0, "mb_id": -1, "model_chunk": -1}}]')
    path = tmp_path / "timeline.json"
    path.write_bytes(document)
    timeline = read_op_timeline(path)
    assert timeline.start_s.tolist() == [96e-6] and timeline.duration_s.tolist() == [0.0]


def test_the_ideal_timeline_is_the_artifacts_and_reads_back_as_its_own_ideal(tmp_path, capsys):
    """`--ideal-timeline` writes the replayed ideal as the artifact's JSON: op for op the artifact's own ideal
    timeline of ST, and read back it is a job without stragglers (S = 1, measured = ideal)."""
    from fleetscope.analysis.whatif.metrics import measured_step_times
    from fleetscope.cli.main import main

    out = tmp_path / "ideal-ST.json.gz"
    assert main(["whatif", str(ARTIFACT / "trace-ST.csv.gz"), "--ideal-timeline", str(out)]) == 0
    ours = model_timeline(read_op_timeline(out))
    theirs = model_timeline(read_op_timeline(ARTIFACT / "ideal-timeline-ST.json.gz"))
    assert np.array_equal(ours.model.node_type, theirs.model.node_type)
    assert np.allclose(ours.start_s, theirs.start_s, atol=1e-6) and np.allclose(ours.end_s, theirs.end_s, atol=1e-6)
    again = what_if(ours)
    assert again.slowdown == pytest.approx(1.0, abs=1e-9)
    assert measured_step_times(ours) == pytest.approx(analyzed("ST")[1].ideal_step_s, rel=1e-6)
