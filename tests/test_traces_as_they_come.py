"""Trace shapes from the field, each built from the real format: windows of one worker without a rank, a Chrome
trace of another tool, communication kernels of runtimes other than NCCL, JSON files kept beside the traces."""

import json
import shutil
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.per_rank.names import is_known_comm_kernel, kernel_category, looks_like_comm_kernel
from helpers.kineto import KinetoBuilder


def _worker_window(directory, index: int, *, pid: int, host: str = "node7", start_us: float = 0.0) -> None:
    """One `tensorboard_trace_handler` file of a process that never set up distributed: no distributedInfo, the
    worker name `<host>_<pid>` and a timestamp in the file name, the process's pid on every event."""
    builder = KinetoBuilder(rank=None, world_size=None)
    builder.step(index, start_us, 1000.0).op("aten::mm", start_us + 10, 500)
    document = builder.document()
    document.pop("distributedInfo", None)
    document["host_name"] = host
    for event in document["traceEvents"]:
        event["pid"] = pid
    (directory / f"{host}_{pid}.{1700000000 + index}.pt.trace.json").write_text(json.dumps(document))


def test_windows_of_one_worker_are_windows_of_one_rank(tmp_path):
    for index in range(3):
        _worker_window(tmp_path, index, pid=4242, start_us=index * 10_000.0)
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, use_cache=False)
    assert report.analyzed_ranks == [0]
    assert [(w.window, [r.rank for r in w.ranks]) for w in report.windows] == [(0, [0]), (1, [0]), (2, [0])]
    assert any("3 traces of one process (host node7, pid 4242) are windows of one rank" in n for n in report.notes)


def test_two_workers_at_the_same_time_stay_two_ranks(tmp_path):
    _worker_window(tmp_path, 0, pid=4242)
    _worker_window(tmp_path, 1, pid=4243)                      # another process, same host, same time
    _worker_window(tmp_path, 2, pid=4242, host="node8")       # another host, same pid
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, use_cache=False)
    assert report.analyzed_ranks == [0, 1, 2]


def test_a_chrome_trace_of_another_tool_is_said_to_be_one(tmp_path):
    KinetoBuilder(rank=0, world_size=1).step(1, 0.0, 1000.0).op("aten::mm", 10, 500).write(tmp_path / "rank0.json")
    other = {"traceEvents": [{"ph": "X", "name": "kernel_a", "cat": "instrumented", "ts": 0.0, "dur": 5.0,
                              "pid": 1, "tid": 1},
                             {"ph": "X", "name": "kernel_b", "cat": "instrumented", "ts": 6.0, "dur": 5.0,
                              "pid": 1, "tid": 1}]}
    (tmp_path / "kernels.trace.json").write_text(json.dumps(other))
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, use_cache=False)
    assert not report.complete and report.analyzed_ranks == [0]
    assert [p.label for p in report.problems] == ["kernels.trace.json"]
    assert "no torch.profiler events" in report.problems[0].reason


@pytest.mark.parametrize("name", [
    "void deep_ep::internode::dispatch<true, 8, 768>(int4*, float*)",      # DeepEP's namespaces
    "void internode::combine<8, 768>(int4*)",
    "void c10d::symmetric_memory::one_shot_all_reduce_kernel<float, 8>(float*)",
    "nvshmemi_transfer_rma_nbi_kernel",
    "void vllm::cross_device_reduce_1stage<__half, 8>(vllm::RankData*)",
    "userbuffers_fp16_sum_inplace_gpu_rr_rs",
])
def test_known_communication_kernels_beyond_nccl_count_as_communication(name):
    assert is_known_comm_kernel(name) and kernel_category(name) == "communication"
    assert not looks_like_comm_kernel(name)


@pytest.mark.parametrize("name", ["ampere_bf16_s16816gemm_bf16_128x128", "void at::native::index_elementwise_kernel",
                                  "void at::native::reduce_kernel<512, 1>", "triton_poi_fused_add_0"])
def test_compute_kernels_are_not_communication(name):
    assert not is_known_comm_kernel(name) and not looks_like_comm_kernel(name)


def test_all_to_alls_of_torch_2_1_are_collectives_by_their_launching_stack(tmp_path):
    # PyTorch 2.0-2.2 shape (TorchRec DLRM traces): NCCL runs the all-to-all as SendRecv kernels, launched inside
    # `nccl:all_to_all` > `c10d::alltoall_base_` > `record_param_comms`, and no arg names the collective; rank 1
    # starts each all-to-all 400 us after rank 0, which waits for it inside the kernel
    from fleetscope.analysis.per_rank.p2p import point_to_point_kinds
    from fleetscope.analysis.per_rank.events import extract_events

    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=2)
        late = 400.0 * rank
        for step in (0, 1):
            base = step * 5000.0
            builder.step(step, base, 5000.0).op("aten::mm", base + 10, 900)
            builder.kernel("sm90_xmma_gemm_bf16", base + 20, 1000.0, launch_ts=base + 15)
            builder.annotation("nccl:all_to_all", base + 1000 + late, 60)
            builder.op("c10d::alltoall_base_", base + 1005 + late, 50)
            builder.op("record_param_comms", base + 1010 + late, 40)
            builder.kernel("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", base + 1100 + late, 1500.0 - late,
                           launch_ts=base + 1020 + late, stream=20)
        builder.write(tmp_path / f"rank{rank}.pt.trace.json")
    events = extract_events(json.loads((tmp_path / "rank1.pt.trace.json").read_text()))
    assert point_to_point_kinds(events) == {}                # no send or receive among them
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, use_cache=False)
    assert report.windows[0].ranks[0].collective_count == 2
    assert "rank 1" in report.verdict and "straggler" in report.verdict


def test_cuda_work_launched_but_not_recorded_is_said_first_not_read_as_a_cpu_job(tmp_path):
    # 8 A100s in deviceProperties and launch calls, but no kernel events (CUPTI off, failed or capped)
    builder = KinetoBuilder(rank=0, world_size=1).step(0, 0.0, 1000.0).op("aten::mm", 10, 500)
    for index in range(20):
        builder.complete("cudaLaunchKernel", "cuda_runtime", 20 + index * 10, 4.0,
                         args={"correlation": 100 + index, "External id": 100 + index})
    document = builder.document()
    document["deviceProperties"] = [{"id": device, "name": "NVIDIA A100-SXM4-80GB"} for device in range(8)]
    (tmp_path / "rank0.json").write_text(json.dumps(document))
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, use_cache=False)
    assert not report.complete
    assert report.verdict.startswith("CUDA work was launched but not recorded on rank 0")
    assert "partial: GPU activity not recorded" in report.verdict


def test_a_huge_name_in_a_trace_is_bounded_in_every_output(tmp_path):
    # a 2 MB kernel name (a 20 MB frame name in a 96 KB trace made advise print 40 MB): every output stays small
    from fleetscope.analysis.advise import advise
    from fleetscope.analysis.per_rank.events import MAX_NAME_CHARS
    from fleetscope.analysis.render.terminal import render_terminal

    builder = KinetoBuilder(rank=0, world_size=1).step(0, 0.0, 1000.0)
    builder.kernel("void huge_kernel<" + "T" * 2_000_000 + ">", 20.0, 600.0, launch_ts=15.0)
    builder.write(tmp_path / "rank0.json")
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, use_cache=False)
    assert len(report.to_json() if isinstance(report.to_json(), str) else json.dumps(report.to_json())) < 200_000
    assert len(render_terminal(report)) < 200_000
    assert all(len(k.name) <= MAX_NAME_CHARS + 40 for w in report.windows for k in w.top_kernels)
    assert len(repr(advise(tmp_path))) < 200_000
    from fleetscope.analysis.merge.run import merge

    merge(tmp_path, tmp_path / "merged.pftrace", use_cache=False)
    assert sum(path.stat().st_size for path in tmp_path.glob("merged*.pftrace")) < 200_000


def test_an_event_before_the_clocks_zero_is_left_out_of_the_merge_not_the_whole_trace(tmp_path):
    # one event at ts -5 us with baseTimeNanoseconds 0 (or pushed there by a clock offset) lost the whole merged
    # trace ("Value out of range"): it is left out and counted, the rest is written
    from fleetscope.analysis.merge.run import merge

    builder = KinetoBuilder(rank=0, world_size=1).step(0, 0.0, 1000.0).op("aten::mm", 10, 500)
    builder.kernel("sm90_xmma_gemm_bf16", 20.0, 600.0, launch_ts=15.0)
    document = builder.document()
    document["baseTimeNanoseconds"] = 0
    document["traceEvents"] += [{"ph": "X", "name": "early", "cat": "cpu_op", "ts": -5.0, "dur": 1.0, "pid": 1, "tid": 1},
                                {"ph": "i", "name": "early", "cat": "x", "ts": -5.0, "pid": 1, "tid": 1, "s": "t"}]
    (tmp_path / "rank0.json").write_text(json.dumps(document))
    result = merge(tmp_path, tmp_path / "merged.pftrace", use_cache=False)
    assert (tmp_path / "merged.pftrace").stat().st_size > 0 and not result.problems
    assert any("2 events: event before the trace clock's zero" in note.reason for note in result.notes)


def test_a_lone_surrogate_in_a_name_loses_nothing(tmp_path):
    # JSON may escape a lone surrogate ("\ud800"), which UTF-8 cannot encode: the cache entry, the report and the
    # merged trace once failed on it and lost the whole rank
    from fleetscope.analysis.merge.run import merge

    builder = KinetoBuilder(rank=0, world_size=1).step(0, 0.0, 1000.0).op("aten::mm", 10, 500)
    builder.kernel("sgemm_MARK", 20.0, 600.0, launch_ts=15.0)
    (tmp_path / "rank0.json").write_text(json.dumps(builder.document()).replace("sgemm_MARK", "sgemm_\\ud800"))
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, cache_dir=tmp_path / "cache")
    assert report.complete and report.analyzed_ranks == [0]
    assert any("\\ud800" in k.name for k in report.windows[0].top_kernels)
    assert merge(tmp_path, tmp_path / "merged.pftrace", use_cache=False).problems == []


def test_a_trace_of_another_job_in_the_folder_is_named_not_analyzed_with_this_one(tmp_path):
    """Rank 1's file was recorded two years before ranks 0, 2 and 3 (another job's, left in the folder), and a
    fifth file names another backend: neither is a rank of this job, each is named with why."""
    day_ns = 86_400 * 10**9
    for rank in range(4):
        builder = KinetoBuilder(rank=rank, world_size=4)
        if rank == 1:
            builder.base_time_ns -= 730 * day_ns
        builder.step(1, 0.0, 1000.0).op("aten::mm", 10, 500).write(tmp_path / f"rank{rank}.json")
    other = KinetoBuilder(rank=2, world_size=4)
    other.backend = "gloo" if other.backend != "gloo" else "nccl"
    other.step(1, 0.0, 1000.0).op("aten::mm", 10, 500).write(tmp_path / "other_rank2.json")
    report = analyze(tmp_path, use_hta=False, write_default_outputs=False, use_cache=False)
    assert report.analyzed_ranks == [0, 2, 3]
    reasons = {p.label.rsplit("/", 1)[-1]: p.reason for p in report.problems}
    assert "recorded 730 days from the other traces" in reasons["rank1.json"]
    assert "backend" in reasons["other_rank2.json"]
    assert not report.complete


def _fuse_like_tracelens(documents: list[dict]) -> dict:
    """Ranks fused as TraceLens's TraceFuse writes them: args.rank on every event, pid and correlation offset by
    the rank, the originals kept as `<field>_raw`."""
    fused = []
    for rank, document in enumerate(documents):
        for event in json.loads(json.dumps(document["traceEvents"])):
            args = event.setdefault("args", {})
            args["rank"] = rank
            if isinstance(event.get("pid"), int):
                args["pid_raw"], event["pid"] = event["pid"], event["pid"] + rank * 10**8
            if "correlation" in args:
                args["correlation_raw"], args["correlation"] = args["correlation"], args["correlation"] + rank * 10**7
            fused.append(event)
    return {"traceEvents": fused}


def test_a_file_of_fused_ranks_is_refused_and_split_back_into_its_ranks(tmp_path, capsys):
    """Four ranks fused into one file are not one rank (their steps and GPUs would be pooled): the analysis says
    so with the command, `fleetscope split` writes one trace per rank with the offsets undone, and those
    analyze as the four ranks they were."""
    from fleetscope.cli.main import main
    from helpers.kineto import gpu_rank

    originals = tmp_path / "originals"
    documents = []
    for rank in range(4):
        builder = gpu_rank(rank, world_size=4, nccl_start=600 - 100 * rank)
        builder.write(originals / f"rank{rank}.json")
        documents.append(builder.document())
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "merged_trace.json").write_text(json.dumps(_fuse_like_tracelens(documents)))
    refused = analyze(fused, use_hta=False, write_default_outputs=False, use_cache=False)
    assert refused.analyzed_ranks == [] and not refused.complete
    reason = refused.problems[0].reason
    assert "holds 4 ranks fused into one file (ranks 0-3)" in reason and "fleetscope split" in reason
    split = tmp_path / "split"
    assert main(["split", str(fused / "merged_trace.json"), "-o", str(split)]) == 0
    assert sorted(p.name for p in split.iterdir()) == [f"rank{r}.pt.trace.json.gz" for r in range(4)]
    again = analyze(split, use_hta=False, write_default_outputs=False, use_cache=False)
    before = analyze(originals, use_hta=False, write_default_outputs=False, use_cache=False)
    assert again.analyzed_ranks == [0, 1, 2, 3]
    assert [(r.step_time, r.busy_pct, r.comm_pct) for r in again.ranks] == [(r.step_time, r.busy_pct, r.comm_pct)
                                                                      for r in before.ranks]
    assert again.step_time.median_ms == before.step_time.median_ms
    assert main(["split", str(fused / "merged_trace.json"), "-o", str(split)]) == 2  # never over existing files


def test_ranks_fused_by_process_name_are_found_too(tmp_path):
    from fleetscope.traces.fused import fused_ranks, split_fused

    events = []
    for rank in range(2):
        pid = 1000 + rank * 10**8
        events += [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"RANK {rank} - CPU"}},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": 1, "ts": 10.0, "dur": 5.0}]
    assert fused_ranks({"traceEvents": events}) == {1000: 0, 1000 + 10**8: 1}
    parts = split_fused({"traceEvents": events})
    assert sorted(parts) == [0, 1] and all(len(p["traceEvents"]) == 2 for p in parts.values())
    # the file states no world size: the ranks it holds are not the job's (it need not hold them all)
    assert parts[1]["distributedInfo"] == {"rank": 1}
    stated = split_fused({"distributedInfo": {"backend": "nccl", "world_size": 8}, "traceEvents": events})
    assert stated[1]["distributedInfo"] == {"backend": "nccl", "rank": 1, "world_size": 8}
    assert fused_ranks({"traceEvents": events[:2]}) == {}


TRACEFUSE = Path(__file__).parent / "fixtures" / "tracefuse"
TWO_OF_128 = Path(__file__).parent / "fixtures" / "public" / "hta" / "two_of_128_ranks"


def test_a_file_tracelens_fused_is_refused_and_splits_into_the_ranks_it_was_made_of(tmp_path):
    """TraceLens's own TraceFuse output of two real ranks (fixtures/tracefuse/README.md): refused as one rank,
    and its split analyzes to exactly what the two original files give (steps, step times, busy, the straggler);
    the world size, which the fused file does not state, is left unknown rather than taken as 2."""
    from fleetscope.cli.main import main
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(TRACEFUSE / "two_of_128_ranks_fused.json.gz", fused)
    refused = analyze(fused, use_hta=False, write_default_outputs=False, use_cache=False)
    assert refused.analyzed_ranks == []
    assert "holds 2 ranks fused into one file (ranks 0-1)" in refused.problems[0].reason
    split = tmp_path / "split"
    assert main(["split", str(fused / "two_of_128_ranks_fused.json.gz"), "-o", str(split)]) == 0
    original = analyze(TWO_OF_128, use_hta=False, write_default_outputs=False, use_cache=False).to_json()
    again = analyze(split, use_hta=False, write_default_outputs=False, use_cache=False).to_json()
    assert again["world_size"] is None and original["world_size"] == 128

    def per_rank(report):
        return {row["rank"]: ([(s["step"], s["step_time_ms"]) for s in row["steps"]], row["utilization"]["busy_pct"])
                for row in report["windows"][0]["ranks"]}
    assert per_rank(again) == per_rank(original)
    assert again["verdict"].split(";")[0] == original["verdict"].split(";")[0]
