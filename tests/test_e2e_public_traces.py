"""Real Kineto traces from other public projects' test data (tests/fixtures/public, SOURCES.md says where
each comes from): AMD/ROCm, CPU-only, nanosecond timestamps, missing rank information, the 2021 format.

Every folder goes through the real commands a user runs (`analyze --check`, `merge --verify`, `advise`):
none may end in a traceback, each exits with the documented code the folder calls for, and each report
says what the trace itself shows (its ranks, its steps read straight from the JSON, its device). Every
trace stock HTA loads must come out analyzed: its ranks found, on the GPU or the CPU basis, HTA's views
run where there are GPU kernels.
"""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from fleetscope.analysis.per_rank.events import extract_events
from fleetscope.analysis.per_rank.names import is_host_sync_call, kernel_category
from fleetscope.analysis.per_rank.steps import find_steps
from fleetscope.cli.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE
from helpers import REPO, fleetscope, trace_processor

PUBLIC = REPO / "tests" / "fixtures" / "public"
DOCUMENTED_EXITS = {EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL}
TRACEBACK = "Traceback (most recent call last)"
COMMAND_TIMEOUT_S = 180

# --- what the traces themselves show (read with json, not with fleetscope) -------------------------------

def trace_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz")))


def events_of(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def host_steps(events: list[dict]) -> list[dict]:
    """The host's `ProfilerStep#N` ranges (their GPU twins, category gpu_user_annotation, left out)."""
    return [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
            and e.get("cat") in ("user_annotation", "cpu_op", "Operator")]


def runtime_calls_in(events: list[dict], step: dict, names: set[str]) -> int:
    start, end = step["ts"], step["ts"] + step["dur"]
    return sum(1 for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in names
               and start <= e["ts"] < end)


HIP_LAUNCHES = {"hipLaunchKernel", "hipExtModuleLaunchKernel", "hipModuleLaunchKernel"}
SYNCS = {"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "hipDeviceSynchronize"}


# --- what each report must say ------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Expected:
    """What the commands must make of one fixture folder."""

    ranks: tuple[int, ...]
    """The ranks the report analyzes."""
    basis: str
    """Every rank's basis: "gpu" (device activity in the trace) or "cpu" (none)."""
    rank_source: str
    """Where each rank number came from: "distributedInfo", "file name" or "file order"."""
    world_size: int | None = None
    exit: int = EXIT_OK
    """analyze's and merge's exit code: EXIT_PARTIAL where the trace names more ranks than the folder holds."""
    missing: int = 0
    hta_loads: bool = True
    """Stock HTA 0.5 loads the folder (test_stock_hta_loads_exactly_the_folders_marked_so checks it)."""
    facts: tuple[Callable[[dict, dict, dict[str, list[dict]]], None], ...] = field(default=())
    """Checks of (report, advice, each trace file's name -> its events) particular to the folder."""


def window_rank(report: dict, rank: int) -> dict:
    return next(r for r in report["windows"][0]["ranks"] if r["rank"] == rank)


def kernel_categories(report: dict) -> dict[str, str]:
    """Top kernel name -> category, over the report's windows."""
    return {k["name"]: k["category"] for w in report["windows"] for k in w["top_kernels"]}


def hta_status(report: dict) -> dict:
    return report["windows"][0]["hta"]


def steps_match_the_trace(report, advice, traces):
    """Each rank's steps are the host ProfilerStep ranges of its trace: same numbers, same durations."""
    for rank_row in report["windows"][0]["ranks"]:
        events = traces[rank_row["label"]]
        truth = {int(s["name"].split("#")[1]): s["dur"] / 1000.0 for s in host_steps(events)}
        got = {s["step"]: s["host_ms"] for s in rank_row["steps"]}
        assert got.keys() == truth.keys(), (rank_row["label"], sorted(got), sorted(truth))
        for step, ms in truth.items():
            # 1 ns: float64 timestamps of ~4e12 us keep ~0.5 ns, so an end minus a start may differ by that
            assert got[step] == pytest.approx(ms, rel=1e-9, abs=1e-6), (rank_row["label"], step)
        for row in rank_row["steps"]:   # the step time is the host's range unless the GPU's span bounds it
            expected = row["gpu_ms"] if row["bound"] == "gpu" else row["host_ms"]
            assert row["step_time_ms"] == expected and (row["bound"] == "host" or row["gpu_ms"] > row["host_ms"])


def gpu_bound_steps_read_the_gpu(report, advice, traces):
    """A V100 job 98% busy: the host runs ahead of the CUDA queue at the window's start (its first ProfilerStep
    ranges last 35 and 72 ms), then waits for it (96 ms each); the steps are the GPU's ~96 ms throughout."""
    (rank_row,) = report["windows"][0]["ranks"]
    steps = rank_row["steps"]
    assert [s["bound"] for s in steps[:2]] == ["gpu", "gpu"] and steps[0]["host_ms"] < 40.0
    times = [s["step_time_ms"] for s in steps]
    assert max(times) / min(times) < 1.03, times


def rocm_gpu_bound_steps_read_the_kernels(report, advice, traces):
    """An MI300X rank 99% busy: the host's ProfilerStep ranges (15.9-16.8 ms) end before the kernels they launch
    do, and ROCm's own `ProfilerStep#N` GPU ranges last 16-18 us (a marker, not the step); each step is the span
    of the kernels launched in it (~19 ms), bound by the GPU."""
    (rank_row,) = report["windows"][0]["ranks"]
    (events,) = traces.values()
    marks = [e["dur"] / 1000.0 for e in events
             if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("ProfilerStep#")]
    assert len(marks) == 3 and max(marks) < 0.1
    for step in rank_row["steps"]:
        assert step["bound"] == "gpu" and step["step_time_ms"] == step["gpu_ms"] > step["host_ms"] * 1.1, step
    assert rank_row["steps"][0]["gpu_span_source"] == "the kernels launched in the host's step"


def link_peak_of_the_named_gpu(report, advice, traces):
    """The collectives' peak is the link of the GPU the trace names (MI300X: Infinity Fabric), not an NVLink."""
    bandwidth = report["windows"][0]["bandwidth"]
    assert bandwidth["peak_busbw_gbps"]["intra-node"] == 448.0
    assert "Infinity Fabric" in bandwidth["peak_source"] and "MI300X" in bandwidth["peak_source"]


def no_steps(report, advice, traces):
    """No step ranges: the whole capture is one step (0), from the first event to the last, and the report
    says so."""
    assert not any(host_steps(events) for events in traces.values())
    for row in report["windows"][0]["ranks"]:
        events = [e for e in traces[row["label"]] if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
        first = min(e["ts"] for e in events)
        last = max(e["ts"] + (e.get("dur") or 0) for e in events)
        (step,) = row["steps"]
        assert row["step_source"] == "whole capture" and step["step"] == 0
        assert step["host_ms"] == pytest.approx((last - first) / 1000.0, rel=1e-6, abs=1e-3)
    assert any("the whole capture" in note for note in report["windows"][0]["notes"])


def hta_views_ran(report, advice, traces):
    assert hta_status(report)["status"] in ("ok", "partial"), hta_status(report)


def hta_skipped_as_cpu_only(report, advice, traces):
    assert hta_status(report)["status"] == "skipped" and "CPU-only" in hta_status(report)["reason"]


def numbered_in_file_order(report, advice, traces):
    assert any("name no rank (no rank in distributedInfo" in note for note in report["notes"]), report["notes"]


def tensile_gemms_are_gemms(report, advice, traces):
    tensile = [name for name in kernel_categories(report) if name.startswith("Cijk_")]
    assert tensile and {kernel_categories(report)[n] for n in tensile} == {"gemm"}


def hip_launches_counted(report, advice, traces):
    (events,) = traces.values()
    rank = window_rank(report, report["ranks"][0]["rank"])
    for step, stalls in zip(host_steps(events), rank["host_stalls"]["steps"]):
        assert stalls["launch_count"] == runtime_calls_in(events, step, HIP_LAUNCHES)
    assert rank["host_stalls"]["steps"][0]["launch_count"] == 14


def syncs_counted(expected_per_step: int):
    def check(report, advice, traces):
        (events,) = traces.values()
        rank = window_rank(report, report["ranks"][0]["rank"])
        for step, stalls in zip(host_steps(events), rank["host_stalls"]["steps"]):
            assert stalls["sync_count"] == runtime_calls_in(events, step, SYNCS) == expected_per_step
    check.__name__ = f"syncs_counted_{expected_per_step}"
    return check


def world_of_missing_ranks(report, advice, traces):
    """The ranks the trace's world size names but the folder lacks are listed (at most 64) and make the
    analysis partial; the ranks present are analyzed all the same."""
    analyzed = {r["rank"] for r in report["ranks"]}
    listed = {m["rank"] for m in report["missing"]}
    assert not report["complete"]
    assert len(listed) == min(64, report["missing_total"]) and not listed & analyzed


def only_host_ops(report, advice, traces):
    """A trace with host events only (no device activity) is on the CPU basis, its step still timed."""
    (events,) = traces.values()
    assert {e.get("cat") for e in events if e.get("ph") == "X"} <= {"cpu_op", "user_annotation"}


def comm_kernel_only(report, advice, traces):
    row = window_rank(report, 70)
    assert row["gpu_time"] is None or set(row["gpu_time"]["by_category_us"]) <= {"communication"}
    # the one NCCL kernel is all the GPU did; the capture (the step) also holds the host op that launched it
    (events,) = traces.values()
    kernel = sum(e["dur"] for e in events if e.get("cat") == "kernel")
    capture = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    assert report["ranks"][0]["comm_pct"] == pytest.approx(100.0 * kernel / capture)


def triton_kernel_found(report, advice, traces):
    (events,) = traces.values()
    (kernel,) = [e["name"] for e in events if e.get("cat") == "kernel"]
    assert kernel_categories(report) == {kernel: "elementwise"}  # triton_poi_fused_add_cos_sin_0


def miopen_convolutions_are_gemms(report, advice, traces):
    igemm = [name for name in kernel_categories(report) if name.startswith("igemm_")]
    assert igemm and {kernel_categories(report)[n] for n in igemm} == {"gemm"}


def inductor_kernels_categorized(report, advice, traces):
    categories = kernel_categories(report)
    assert {categories[n] for n in categories if n.startswith("triton_poi_")} == {"elementwise"}
    assert {categories[n] for n in categories if n.startswith("triton_red_")} == {"reduction"}


def hta_views_computed_where_stock_hta_cannot_load(report, advice, traces):
    # stock HTA 0.5's loader raises on these traces under pandas 3 (a value over an int8 or int16 column's range
    # in its own dtype narrowing); the native views do not narrow and compute every table
    status = hta_status(report)
    assert status["status"] == "ok", status


def one_kernel(report, advice, traces):
    (events,) = traces.values()
    assert sum(1 for e in events if e.get("cat") == "kernel") == 1
    assert len(kernel_categories(report)) == 1


def data_loader_advice(report, advice, traces):
    assert "data_workers" in {finding["rule"] for finding in advice["findings"]}


CASES: dict[str, Expected] = {
    "hta/amd_mi250": Expected(ranks=(0,), basis="gpu", rank_source="file order", facts=(
        steps_match_the_trace, tensile_gemms_are_gemms, hip_launches_counted, hta_views_ran)),
    "hta/cpu_only": Expected(ranks=(34,), basis="cpu", rank_source="distributedInfo", world_size=300,
                             exit=EXIT_PARTIAL, missing=299, facts=(
        steps_match_the_trace, hta_skipped_as_cpu_only, world_of_missing_ranks)),
    "hta/ns_resolution": Expected(ranks=(0,), basis="gpu", rank_source="distributedInfo", world_size=1, facts=(
        gpu_bound_steps_read_the_gpu, steps_match_the_trace, hta_views_ran)),
    "hta/two_of_128_ranks": Expected(ranks=(0, 1), basis="gpu", rank_source="distributedInfo", world_size=128,
                                     exit=EXIT_PARTIAL, missing=126, facts=(
        steps_match_the_trace, hta_views_ran, world_of_missing_ranks)),
    "hta/distributed_info_unavailable": Expected(ranks=(0,), basis="cpu", rank_source="file order", facts=(
        steps_match_the_trace, only_host_ops, numbered_in_file_order, hta_skipped_as_cpu_only)),
    "hta/rank_unavailable": Expected(ranks=(0,), basis="cpu", rank_source="file order", facts=(
        steps_match_the_trace, only_host_ops, numbered_in_file_order, hta_skipped_as_cpu_only)),
    "hta/legacy_categories": Expected(ranks=(1,), basis="gpu", rank_source="distributedInfo", facts=(
        hta_views_ran,)),
    "hta/cuda_event_sync": Expected(ranks=(0,), basis="gpu", rank_source="distributedInfo", facts=(
        steps_match_the_trace, syncs_counted(3), hta_views_ran)),
    "hta/alexnet_no_steps": Expected(ranks=(0,), basis="gpu", rank_source="distributedInfo", facts=(
        no_steps, hta_views_ran)),
    "hta/large_integer": Expected(ranks=(70,), basis="gpu", rank_source="file name", facts=(
        no_steps, comm_kernel_only, hta_views_ran)),
    "hta/triton_example": Expected(ranks=(0,), basis="gpu", rank_source="file order", facts=(
        steps_match_the_trace, triton_kernel_found, hta_views_ran)),
    "hta/trace_compare_base": Expected(ranks=(1,), basis="gpu", rank_source="distributedInfo", facts=(
        steps_match_the_trace, hta_views_ran)),
    "hta/critical_path_overlay": Expected(ranks=(0,), basis="gpu", rank_source="distributedInfo", facts=(
        no_steps, hta_views_ran)),
    "tracelens/mi210_gpu_only": Expected(ranks=(0,), basis="gpu", rank_source="file order", facts=(
        no_steps, miopen_convolutions_are_gemms, hta_views_ran)),
    "tracelens/mi300x_bert_small": Expected(ranks=(0,), basis="gpu", rank_source="file order", facts=(
        steps_match_the_trace, tensile_gemms_are_gemms, syncs_counted(1), hta_views_ran)),
    "tracelens/h100_bert_small": Expected(ranks=(0,), basis="gpu", rank_source="file order", facts=(
        steps_match_the_trace, syncs_counted(2), hta_views_ran)),
    "tracelens/mi300x_torch_compile": Expected(ranks=(0,), basis="gpu", rank_source="file order",
                                               hta_loads=False, facts=(
        no_steps, tensile_gemms_are_gemms, inductor_kernels_categorized,
        hta_views_computed_where_stock_hta_cannot_load)),
    "tracelens/mi300x_resnet_gpu_bound": Expected(ranks=(0,), basis="gpu", rank_source="distributedInfo",
                                                  world_size=8, exit=EXIT_PARTIAL, missing=7, hta_loads=False, facts=(
        steps_match_the_trace, rocm_gpu_bound_steps_read_the_kernels, link_peak_of_the_named_gpu,
        hta_views_computed_where_stock_hta_cannot_load)),
    "kineto/event_sync_before_fix": Expected(ranks=(0,), basis="gpu", rank_source="file order", facts=(
        no_steps, one_kernel)),
    "kineto/resnet50_2021": Expected(ranks=(0,), basis="gpu", rank_source="file order", facts=(
        steps_match_the_trace, hta_views_ran, data_loader_advice)),
}

KNOWN_GAPS: dict[str, str] = {}
"""Folders whose report is wrong today, with the cause: their report test is xfail(strict) until fixed."""


def report_cases():
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name]))
            if name in KNOWN_GAPS else name for name in CASES]


# --- running the commands once per folder ------------------------------------------------------------

@dataclass
class Outcome:
    analyze: object
    merge: object
    advise: object
    report: dict
    advice: dict
    listing_before: list[str]
    listing_after: list[str]

    def commands(self):
        return {"analyze": self.analyze, "merge": self.merge, "advise": self.advise}


_OUTCOMES: dict[str, Outcome] = {}


@pytest.fixture(scope="module")
def work_root(tmp_path_factory):
    return tmp_path_factory.mktemp("public-traces")


def outcome(name: str, root: Path) -> Outcome:
    """analyze --check, merge --verify and advise on a copy of the folder, run once per module."""
    if name not in _OUTCOMES:
        work = root / name.replace("/", "__")
        traces = work / "traces"
        shutil.copytree(PUBLIC / name, traces)
        before = sorted(p.name for p in traces.iterdir())
        analyze = fleetscope("analyze", str(traces), "--check", "--json", str(work / "report.json"),
                             timeout=COMMAND_TIMEOUT_S)
        merge_args = ["merge", str(traces), "--verify", "-o", str(work / "merged.perfetto-trace")]
        binary = trace_processor()
        if binary is not None:  # without one, --verify still reads the output back
            merge_args += ["--trace-processor", str(binary)]
        merge = fleetscope(*merge_args, timeout=COMMAND_TIMEOUT_S)
        advise = fleetscope("advise", str(traces), "--json", str(work / "advice.json"), timeout=COMMAND_TIMEOUT_S)
        read = lambda p: json.loads(p.read_text()) if p.is_file() else {}  # noqa: E731
        _OUTCOMES[name] = Outcome(analyze, merge, advise, read(work / "report.json"), read(work / "advice.json"),
                                  before, sorted(p.name for p in traces.iterdir()))
    return _OUTCOMES[name]


# --- the tests ----------------------------------------------------------------------------------------

def test_every_public_folder_has_its_expectations_and_its_source():
    folders = {str(p.parent.relative_to(PUBLIC)) for p in PUBLIC.rglob("*") if p.name.endswith((".json", ".json.gz"))}
    assert folders == set(CASES)
    sources = (PUBLIC / "SOURCES.md").read_text()
    for name in CASES:
        assert sources.count(f"| `{name}/` |") == 2, f"{name}: one row in each table of SOURCES.md"
    for project in {name.split("/")[0] for name in CASES}:
        assert (PUBLIC / project / "LICENSE").is_file(), project


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_commands_end_with_a_documented_code_and_no_traceback(name, work_root):
    result, expected = outcome(name, work_root), CASES[name]
    for command, process in result.commands().items():
        assert TRACEBACK not in process.stdout + process.stderr, f"{command}: {process.stderr[-3000:]}"
        assert process.returncode in DOCUMENTED_EXITS, f"{command}: {process.returncode}: {process.stderr[-2000:]}"
    assert result.analyze.returncode == expected.exit, result.analyze.stdout[-2000:]
    assert "check: every invariant holds" in result.analyze.stdout
    assert result.merge.returncode == expected.exit, result.merge.stderr[-2000:]
    assert "verified: read back" in result.merge.stdout
    assert result.advise.returncode == EXIT_OK, result.advise.stderr[-2000:]
    assert result.listing_after == result.listing_before, "the commands wrote beside the traces"


@pytest.mark.slow
@pytest.mark.parametrize("name", report_cases())
def test_the_report_reads_what_the_trace_shows(name, work_root):
    result, expected = outcome(name, work_root), CASES[name]
    report = result.report
    assert [r["rank"] for r in report["ranks"]] == list(expected.ranks)
    assert report["world_size"] == expected.world_size
    assert report["missing_total"] == expected.missing
    for row in report["windows"][0]["ranks"]:
        assert row["rank_source"] == expected.rank_source, row["label"]
        assert row["utilization"] is not None and row["utilization"]["basis"] == expected.basis, row["label"]
    traces = {path.name: events_of(path) for path in trace_files(PUBLIC / name)}
    for fact in expected.facts:
        fact(report, result.advice, traces)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_stock_hta_loads_exactly_the_folders_marked_so(name, tmp_path):
    """Stock HTA's own loader over the folder: it loads those marked hta_loads (the ones whose report
    test demands an analyzed rank), and fails on the others."""
    from hta.trace_analysis import TraceAnalysis
    shutil.copytree(PUBLIC / name, tmp_path / "traces")
    try:
        loaded = sorted(TraceAnalysis(trace_dir=str(tmp_path / "traces")).t.traces)
    except Exception:  # noqa: BLE001  (whatever HTA raises: it did not load)
        loaded = None
    assert (loaded is not None) == CASES[name].hta_loads
    if loaded is not None and CASES[name].rank_source == "distributedInfo":
        assert loaded == sorted(CASES[name].ranks)  # HTA numbers the others 0 (no file-name rule)


# --- the fixes these traces called for, as unit checks ------------------------------------------------

@pytest.mark.parametrize("name, category", [
    ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_AFC1", "gemm"),  # Tensile (MI250)
    ("Cijk_Alik_Bljk_B_BS_BH_Bias_HA_S_SAV_UserArgs_MT16x16x128_MI16x16x1_SN_LDSB0", "gemm"),  # hipBLASLt
    ("igemm_fwd_gtcx2_nhwc_bf16_bx0_ex1_bt32x256x32_wt16x64x4", "gemm"),  # MIOpen implicit-GEMM convolution
    ("triton_red_fused__unsafe_view_add_mean_mul_pow_rsqrt_1", "reduction"),  # Inductor reduction
    ("triton_per_fused_native_layer_norm_0", "reduction"),  # Inductor persistent reduction
    ("triton_poi_fused__unsafe_view_mul_silu_2", "elementwise"),
    ("triton_permute_kernel", "other"),  # a user's Triton kernel: no Inductor prefix, no hint
])
def test_rocm_and_inductor_kernel_names_get_their_category(name, category):
    assert kernel_category(name) == category


@pytest.mark.parametrize("name", ["hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize"])
def test_hip_syncs_block_the_host_as_cuda_ones_do(name):
    assert is_host_sync_call(name)
    assert not is_host_sync_call("hipStreamWaitEvent")  # queues a wait on the device; the host goes on


def test_a_step_lasts_its_own_duration_on_nanosecond_epoch_timestamps():
    """hta/ns_resolution's ProfilerStep#101 as written (3 decimals): its end minus its start in float64
    is 35.11575 ms (epoch microseconds keep 0.25 us), its own duration 35.115869 ms."""
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#101", "pid": 1102, "tid": 1102,
            "ts": 1712195495502094.565, "dur": 35115.869}
    (timing,), source = find_steps(extract_events({"traceEvents": [step]}))
    assert source == "ProfilerStep"
    assert timing.step_time_ms == pytest.approx(35.115869, rel=0, abs=1e-9)
    assert (step["ts"] + step["dur"] - step["ts"]) / 1000 != pytest.approx(35.115869, rel=0, abs=1e-6)


def test_a_2021_traces_kernels_are_drawn_on_their_gpu_stream_with_their_launch_arrows(work_root):
    """2021-era Kineto names its categories `Kernel`, `Memcpy`, `Runtime`: the merge reads the parse's one category
    table, so the 8,772 kernels are on a GPU stream track and each GPU activity has its launch arrow (none was)."""
    from fleetscope.analysis.merge.perfetto.check import check_trace

    outcome("kineto/resnet50_2021", work_root)
    merged = check_trace(work_root / "kineto__resnet50_2021" / "merged.perfetto-trace")
    kernels = [s for s in merged.slices if s.category == "Kernel"]
    tracks = {merged.tracks[s.track_uuid].name for s in kernels}
    assert len(kernels) == 8772 and tracks == {"GPU 0 stream 7"}
    assert len(merged.arrows) >= 8772 + 312 + 12
