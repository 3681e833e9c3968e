"""The merged trace of real H200 traces (tests/fixtures/gpu, see its README): kernels, memcpys and
memsets on GPU stream tracks, CUDA launch flows, and the gloo collectives of a 2-rank DDP run."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.check import CROSS_RANK_FLOW_BIT, check_trace

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
EAGER = FIXTURES / "h200-small-hf-eager-2steps.json.gz"
DDP_GLOO = FIXTURES / "h200-ddp-gloo-2rank"
FSDP = FIXTURES / "h200-fsdp-1rank"
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def input_slices(document: dict) -> Counter:
    base = document["baseTimeNanoseconds"]
    return Counter((e["name"], base + round(e["ts"] * 1000), base + round(e["ts"] * 1000) + max(0, round(e["dur"] * 1000)))
                   for e in document["traceEvents"] if e.get("ph") == "X")


def recorded_slices(check, process) -> Counter:
    return Counter((s.name, s.start_ns, s.end_ns) for s in check.slices
                   if check.process_of(s.track_uuid) == process
                   and check.tracks[s.track_uuid].name != "fleetscope analysis")


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> tuple[dict, object, object]:
    directory = tmp_path_factory.mktemp("eager")
    result = merge(EAGER, directory / "merged.perfetto-trace",
                   options=MergeOptions(chrome_json=directory / "merged.trace.json"))
    return load(EAGER), result, check_trace(result.output)


def test_every_gpu_event_is_a_slice_on_its_stream_track(eager):
    document, result, check = eager
    assert check.ok, check.problems[:5]
    (process,) = check.processes()
    assert recorded_slices(check, process) == input_slices(document)
    streams = {(e["args"]["device"], e["args"]["stream"]) for e in document["traceEvents"] if e.get("cat") in GPU_WORK}
    gpu_tracks = {check.tracks[s.track_uuid].name for s in check.slices if s.category in GPU_WORK}
    assert {name.split(" [")[0] for name in gpu_tracks} == {f"GPU {d} stream {s}" for d, s in streams}


def test_each_launched_gpu_event_has_an_arrow_from_its_cpu_launch(eager):
    document, _, check = eager
    events = document["traceEvents"]
    launched = {e["args"]["correlation"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    expected = sum(1 for e in events if e.get("cat") in GPU_WORK and e["args"].get("correlation") in launched)
    by_key = {(s.track_uuid, s.start_ns, s.name): s for s in check.slices}
    launch_arrows = [(by_key[a], by_key[b]) for flow_id, a, b in check.arrows
                     if by_key[b].category in GPU_WORK and not flow_id & CROSS_RANK_FLOW_BIT]
    assert len(launch_arrows) == expected > 1000
    assert all(cpu.category in ("cuda_runtime", "cuda_driver") and cpu.start_ns <= gpu.start_ns
               for cpu, gpu in launch_arrows)


def test_gpu_merge_is_small_next_to_its_chrome_json(eager):
    document, result, _ = eager
    assert result.output_bytes <= 0.3 * result.chrome_json_uncompressed_bytes
    assert result.chrome_json_uncompressed_bytes == result.chrome_json.stat().st_size
    merged_json = json.loads(result.chrome_json.read_bytes())
    assert sum(e.get("ph") == "X" and e.get("cat") in GPU_WORK for e in merged_json["traceEvents"]) == \
        sum(e.get("ph") == "X" and e.get("cat") in GPU_WORK for e in document["traceEvents"])


def test_ddp_gloo_run_joins_each_collective_across_both_ranks(tmp_path):
    result = merge(DDP_GLOO, tmp_path / "merged.perfetto-trace")
    check = check_trace(result.output)
    assert check.ok, check.problems[:5]
    assert [p.name for p in check.processes()] == ["rank 0 (vm)", "rank 1 (vm)"]
    for process, path in zip(check.processes(), sorted(DDP_GLOO.glob("traces/window000/*.json.gz"))):
        assert recorded_slices(check, process) == input_slices(load(path))
    cross = [(a, b) for flow_id, a, b in check.arrows if flow_id & CROSS_RANK_FLOW_BIT]
    gloo_spans = Counter(check.process_of(s.track_uuid).name for s in check.slices if s.name.startswith("gloo:"))
    assert len(cross) == min(gloo_spans.values()) > 0
    assert all(a[2] == b[2] and a[2].startswith("gloo:") for a, b in cross)


def test_fsdp_run_overlay_has_the_profiled_steps_on_the_gpu_basis(tmp_path):
    check = check_trace(merge(FSDP, tmp_path / "merged.perfetto-trace").output)
    steps = [s for s in check.slices if s.name.startswith("step ")]
    assert [s.name for s in steps] == ["step 4", "step 5"]
    assert all(s.annotations["idle_basis"] == "gpu" and 0 < s.annotations["idle_pct"] < 100 for s in steps)
    idle = [s for s in check.slices if s.name.startswith("idle: ")]
    assert idle and all(any(step.start_ns <= s.start_ns and s.end_ns <= step.end_ns for step in steps) for s in idle)
