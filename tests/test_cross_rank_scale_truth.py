"""Ground truth on N-rank sets made from one GPU trace: known clock offsets and a known late rank must be
recovered, and the offsets must not change the straggler findings."""

import json
import random
import zlib
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.synthetic import TraceSetSpec, crc32_combine, make_trace_set
from helpers.kineto import KinetoBuilder, gpu_rank

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "gpu"
OFFSET_US = 37_000.0
LATE_RANK = 3
LATE_US = 300.0


def _hand_built_nccl(directory: Path) -> Path:
    # all-reduce kernels of 800 us, from 100 to 900 in each 1000 us step
    return gpu_rank(0, nccl_start=100).write(directory / "source_nccl.json.gz")


def _hand_built_single_gpu(directory: Path) -> Path:
    builder = KinetoBuilder(rank=0, world_size=1)
    for step, s in enumerate((0.0, 3000.0, 6000.0)):
        builder.step(step, s, 3000).kernel("gemm", s + 100, 1500, launch_ts=s + 20)
    return builder.write(directory / "source_single.json.gz")


SOURCES = {"hand-built nccl": _hand_built_nccl, "hand-built single gpu": _hand_built_single_gpu}
SOURCES.update({f"fixture {p.name}": (lambda directory, p=p: p) for p in sorted(FIXTURE_DIR.glob("*.json.gz"))})


@pytest.fixture(params=sorted(SOURCES))
def source(request, tmp_path) -> Path:
    return SOURCES[request.param](tmp_path)


def _analyze_set(source: Path, out: Path, **spec) -> object:
    make_trace_set(source, out, TraceSetSpec(ranks=4, ranks_per_host=2, late_rank=LATE_RANK, late_us=LATE_US,
                                             inserted_allreduce_us=1000.0, **spec))
    return analyze(out, use_hta=False)


def test_offsets_and_the_late_rank_are_recovered(source, tmp_path):
    report = _analyze_set(source, tmp_path / "set", host_offsets_us={1: OFFSET_US})
    assert report.complete and report.analyzed_ranks == list(range(4))
    for window in report.windows:
        hosts = {h.host: h for h in window.clock.hosts}
        assert hosts["node0"].source == "reference host"
        assert hosts["node1"].source == "collectives" and hosts["node1"].ranks == [2, 3]
        assert hosts["node1"].offset_us == pytest.approx(OFFSET_US, abs=1000)   # the bound
        assert hosts["node1"].offset_us == pytest.approx(OFFSET_US, abs=1)      # what NCCL ends give
        stragglers = window.stragglers
        assert stragglers.waited_for_rank == LATE_RANK and stragglers.consistent
        assert stragglers.waited_for_median_us == pytest.approx(LATE_US, abs=1)
        assert stragglers.by_wait[0].last_pct == 100.0
    assert f"rank {LATE_RANK} is the straggler" in report.verdict


def test_clock_offsets_do_not_change_the_findings(source, tmp_path):
    skewed = _analyze_set(source, tmp_path / "skewed", host_offsets_us={1: OFFSET_US})
    plain = _analyze_set(source, tmp_path / "plain")
    for a, b in zip(skewed.windows, plain.windows):
        assert [(w.rank, w.times_last) for w in a.stragglers.by_wait] == [(w.rank, w.times_last) for w in b.stragglers.by_wait]
        for x, y in zip(a.stragglers.worst_instances, b.stragglers.worst_instances):
            assert (x.step, x.name, x.ordinal, x.last_rank) == (y.step, y.name, y.ordinal, y.last_rank)
            assert x.lateness_us == pytest.approx(y.lateness_us, abs=1)


def test_hta_straggler_view_runs_on_current_nccl_names(tmp_path):
    make_trace_set(_hand_built_nccl(tmp_path), tmp_path / "set", TraceSetSpec(ranks=4, late_rank=2, late_us=LATE_US))
    hta = analyze(tmp_path / "set").windows[0].hta
    assert "potential_stragglers" in hta.tables, hta.errors
    assert len(hta.tables["potential_stragglers"]) >= 1
    launches = {row["rank"]: row for row in hta.tables["cuda_launch_stats"]}
    assert sorted(launches) == [0, 1, 2, 3] and launches[0]["launches"] == 8


def test_one_gpu_rank_says_why_hta_straggler_view_is_absent(tmp_path):
    gpu_rank(0, world_size=1).write(tmp_path / "rank0.json.gz")
    hta = analyze(tmp_path).windows[0].hta
    assert hta.status == "ok"
    assert "two ranks" in hta.not_applicable["potential_stragglers"]


def test_hta_gets_a_chosen_subset_of_many_ranks(tmp_path):
    make_trace_set(_hand_built_nccl(tmp_path), tmp_path / "set", TraceSetSpec(ranks=6, late_rank=4, late_us=LATE_US))
    report = analyze(tmp_path / "set", hta_max_ranks=3)
    hta = report.windows[0].hta
    chosen = sorted(row["rank"] for row in hta.tables["temporal_breakdown"])
    window = report.windows[0]
    means = sorted((r.step_time.mean_ms, r.rank) for r in window.ranks)
    expected = {window.stragglers.slowest_rank, window.stragglers.waited_for_rank, means[0][1],
                means[len(means) // 2][1]}
    assert window.stragglers.waited_for_rank == 4 and 4 in chosen
    assert len(chosen) == 3 and set(chosen) <= expected   # slowest, waited for, fastest, median: first three
    assert "HTA ran on 3 of 6 ranks" in hta.reason


def test_hta_ranks_all_and_a_list(tmp_path):
    make_trace_set(_hand_built_nccl(tmp_path), tmp_path / "set", TraceSetSpec(ranks=6, late_rank=4, late_us=LATE_US))
    every = analyze(tmp_path / "set", hta_max_ranks=3, hta_ranks="all", use_cache=False).windows[0].hta
    assert sorted(row["rank"] for row in every.tables["temporal_breakdown"]) == list(range(6))
    listed = analyze(tmp_path / "set", hta_ranks=[1, 5], use_cache=False).windows[0].hta
    assert sorted(row["rank"] for row in listed.tables["temporal_breakdown"]) == [1, 5]


def test_each_file_of_a_set_is_one_gzip_member_holding_its_rank(tmp_path):
    """As every writer makes them: one member whose text is the rank's header then the shared events (two
    members made every reader join a copy of the whole text); its CRC-32 is combined from the two parts'."""
    paths = make_trace_set(_hand_built_nccl(tmp_path), tmp_path / "set", TraceSetSpec(ranks=3, late_rank=2, late_us=LATE_US))
    texts = []
    for rank, path in enumerate(paths):
        inflater = zlib.decompressobj(wbits=31)
        text = inflater.decompress(path.read_bytes())
        assert inflater.eof and inflater.unused_data == b""
        document = json.loads(text)
        assert document["distributedInfo"]["rank"] == rank
        texts.append(text)
    assert texts[0].split(b'"traceEvents"')[1] == texts[1].split(b'"traceEvents"')[1] != texts[2].split(
        b'"traceEvents"')[1]                                   # the late rank's events differ
    rng = random.Random(7)
    for _ in range(20):
        first, second = rng.randbytes(rng.randrange(0, 300)), rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second)) == zlib.crc32(first + second)
