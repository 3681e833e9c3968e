"""analyze() on real traces: a 2-rank gloo DDP job under torchrun, with rank 1 late at a known collective."""

import subprocess
import sys
import textwrap

import pytest

from fleetscope.analysis import analyze, render_terminal
from fleetscope.traces.gather import gather
from fleetscope.traces.layout import RunLayout

LATE_RANK = 1
LATE_MS = 40
ACTIVE_STEPS = 3
WINDOWS = 2

JOB = textwrap.dedent(f"""
    import os, sys, tempfile, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, record_function, schedule
    from fleetscope.traces.layout import RunLayout
    from fleetscope.traces.writer import publish_trace

    layout = RunLayout.at(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(32, 128)
    windows = iter(range(100))

    def publish(prof):
        local = Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(local))
        publish_trace(local, layout, window=next(windows), rank=rank, host="localhost")

    with profile(activities=[ProfilerActivity.CPU],
                 schedule=schedule(wait=1, warmup=1, active={ACTIVE_STEPS}, repeat={WINDOWS}),
                 on_trace_ready=publish) as prof:
        for step in range(2 + {WINDOWS} * 5):
            with record_function("train_step"):
                with record_function("forward"):
                    loss = model(batch).pow(2).mean()
                with record_function("backward"):
                    loss.backward()
                with record_function("optimizer_step"):
                    optimizer.step()
                    optimizer.zero_grad()
            if rank == {LATE_RANK}:
                time.sleep({LATE_MS} / 1000)
            dist.all_reduce(torch.ones(256))
            prof.step()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gloo")
    script = root / "job.py"
    script.write_text(JOB)
    run_dir = root / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), str(run_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    gather(run_dir)
    return RunLayout.at(run_dir)


@pytest.mark.slow
def test_real_gloo_run_is_analyzed_completely(gloo_run):
    report = analyze(gloo_run.root)
    assert report.complete, render_terminal(report)
    assert report.analyzed_ranks == [0, 1]
    assert [w.window for w in report.windows] == list(range(WINDOWS))
    for window in report.windows:
        for rank in window.ranks:
            assert rank.step_source == "ProfilerStep"
            assert len(rank.steps) == ACTIVE_STEPS
            assert set(rank.steps[0].phases_ms) == {"train_step", "forward", "backward", "optimizer_step"}
            u = rank.utilization
            assert u.basis == "cpu"
            assert u.comm_us > 0 and u.compute_us > 0
            assert u.busy_us + u.idle_us == pytest.approx(u.span_us)
            assert 0 <= u.overlap_us <= u.comm_us
        assert window.hta.status == "skipped"
    assert gloo_run.report_json.is_file() and gloo_run.report_html.is_file()


@pytest.mark.slow
def test_real_gloo_run_finds_the_late_rank(gloo_run):
    report = analyze(gloo_run.root, write_default_outputs=False)
    for window in report.windows:
        stragglers = window.stragglers
        assert stragglers.collective_source == "gloo spans"
        # DDP's gradient all-reduce and the explicit one, every step, on both ranks
        assert stragglers.matched_collectives == 2 * ACTIVE_STEPS
        assert stragglers.unmatched_collectives == 0
        assert stragglers.waited_for_rank == LATE_RANK, stragglers.verdict
        assert stragglers.by_wait[0].times_last >= ACTIVE_STEPS
        # the explicit all-reduce (the 2nd collective of each step) is where rank 1 shows up LATE_MS late
        explicit = [i for i in stragglers.worst_instances if i.ordinal == 1]
        assert len(explicit) == ACTIVE_STEPS
        for instance in explicit:
            assert instance.last_rank == LATE_RANK
            assert 0.9 * LATE_MS * 1000 <= instance.lateness_us <= 2.0 * LATE_MS * 1000
    assert f"the others wait for rank {LATE_RANK}" in report.verdict
