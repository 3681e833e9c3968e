"""The merged trace of a real 2-rank torchrun job (gloo, CPU): traces recorded by torch.profiler.

One session-scoped job writes two profiling windows per rank, published into a run directory the
way ranks publish them (`traces.writer.publish_trace`), plus plain copies with names that carry no
rank (so the rank must come from `distributedInfo`).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.traces.gather import gather
from fleetscope.traces.layout import RunLayout
from test_merge import expected_slices, rebuilt_slices

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import os, shutil, socket, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function, schedule
    from fleetscope.traces.layout import RunLayout
    from fleetscope.traces.writer import publish_trace

    run_dir, plain_dir = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = []

    def publish(prof):
        local = Path(os.environ["TMPDIR"]) / f"r{rank}w{len(windows)}.pt.trace.json"
        prof.export_chrome_trace(str(local))
        publish_trace(local, RunLayout.at(run_dir), window=len(windows), rank=rank, host=socket.gethostname())
        shutil.copyfile(local, plain_dir / f"worker-{os.getpid()}-{len(windows)}.json")
        windows.append(local)

    sched = schedule(wait=1, warmup=1, active=2, repeat=2)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=publish,
                 profile_memory=True, with_stack=False) as prof:
        for step in range(9):
            with record_function("train_step"):
                with record_function("forward"):
                    loss = model(torch.randn(32, 64)).square().mean()
                with record_function("backward"):
                    loss.backward()
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
                optimizer.step()
                optimizer.zero_grad()
            prof.step()
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="session")
def gloo_run(tmp_path_factory) -> tuple[RunLayout, Path]:
    root = tmp_path_factory.mktemp("gloo_run")
    layout, plain = RunLayout.at(root / "run"), root / "plain"
    plain.mkdir()
    (root / "tmp").mkdir()
    script = root / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), str(layout.root), str(plain)]
    env = {**os.environ, "TMPDIR": str(root / "tmp"), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return layout, plain


def load(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def input_slices(paths: list[Path]) -> Counter:
    """(name, start_ns, end_ns) of the inputs' complete events: baseTimeNanoseconds + ts * 1000."""
    return sum((expected_slices(load(path)) for path in paths), Counter())


def test_run_directory_merge_keeps_every_event_of_both_windows(gloo_run):
    layout, _ = gloo_run
    manifest = gather(layout.root)
    assert len(manifest.traces) == 4 and not manifest.problems
    result = merge(layout.root)
    assert result.output == layout.merged_trace
    check = check_trace(result.output)
    assert check.ok, check.problems[:5]
    host = manifest.traces[0].host
    assert [p.name for p in check.processes()] == [f"rank 0 ({host})", f"rank 1 ({host})"]
    for rank in (0, 1):
        paths = [manifest.resolve(t) for t in manifest.traces if t.rank == rank]
        expected = input_slices(paths)
        assert result.slices_per_rank[rank] == sum(expected.values()) > 100
        assert rebuilt_slices(check, f"rank {rank} ({host})") == expected


def test_gloo_threads_and_collectives_are_on_named_tracks(gloo_run):
    layout, _ = gloo_run
    check = check_trace(merge(layout.root, layout.root / "tracks.perfetto-trace").output)
    track_names = Counter(check.tracks[s.track_uuid].name.split(" (")[-1] for s in check.slices
                          if s.name.startswith("gloo:"))
    assert track_names and all(name.startswith("pt_gloo_runloop") for name in track_names)
    main = {check.tracks[s.track_uuid].name for s in check.slices if s.name == "train_step"}
    assert len(main) == 2 and all("(python" in name for name in main)


def test_plain_directory_ranks_come_from_distributed_info(gloo_run):
    layout, plain = gloo_run
    result = merge(plain, plain / "merged.perfetto-trace")
    assert result.ranks == [0, 1]
    assert all(len(summary.files) == 2 for summary in result.per_rank)
    check = check_trace(result.output)
    assert check.ok
    for summary in result.per_rank:
        documents = [load(Path(p)) for p in summary.files]
        assert {d["distributedInfo"]["rank"] for d in documents} == {summary.rank}
        assert rebuilt_slices(check, summary.process_name) == input_slices([Path(p) for p in summary.files])


def test_merged_trace_is_much_smaller_than_the_json(gloo_run):
    _, plain = gloo_run
    result = merge(plain, plain / "size.perfetto-trace")
    json_bytes = sum(p.stat().st_size for p in plain.glob("*.json"))
    assert result.output_bytes < 0.3 * json_bytes


def test_each_gloo_collective_is_joined_across_the_two_ranks(gloo_run):
    layout, _ = gloo_run
    check = check_trace(merge(layout.root, layout.root / "flows.perfetto-trace").output)
    gloo_counts = Counter(check.process_of(s.track_uuid).name for s in check.slices if s.name.startswith("gloo:"))
    assert len(gloo_counts) == 2 and len(set(gloo_counts.values())) == 1
    cross = [(a, b) for flow_id, a, b in check.arrows if flow_id >> 63]
    assert len(cross) == next(iter(gloo_counts.values()))
    for (track_a, start_a, name_a), (track_b, start_b, name_b) in cross:
        assert name_a == name_b and name_a.startswith("gloo:")
        assert check.process_of(track_a).name != check.process_of(track_b).name
        assert start_a <= start_b
    assert not check.unpaired_flow_ids


def test_cpu_trace_overlay_has_every_profiled_step(gloo_run):
    layout, _ = gloo_run
    manifest = gather(layout.root)
    check = check_trace(merge(layout.root, layout.root / "overlay.perfetto-trace").output)
    for rank in (0, 1):
        steps = sorted(s for t in manifest.traces if t.rank == rank for s in t.steps)
        process = next(p for p in check.processes() if p.order == rank)
        drawn = [s for s in check.slices if s.name.startswith("step ") and check.process_of(s.track_uuid) == process]
        assert sorted(int(s.name.split()[1]) for s in drawn) == steps
        assert all(s.annotations["idle_basis"] == "cpu" and 0 <= s.annotations["idle_pct"] <= 100 for s in drawn)
