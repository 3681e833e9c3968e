"""analyze() on real traces: a 2-rank gloo DDP job under torchrun, with rank 1 late at a known collective."""

import gzip
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetscope.analysis import analyze, render_terminal
from fleetscope.analysis.cross_rank.clock_align import MIN_SAMPLES
from fleetscope.traces.clock import DEFAULT_ROUND_TRIPS, ClockOffset, read_clock_offsets
from fleetscope.traces.gather import gather
from fleetscope.traces.layout import RunLayout

pytestmark = pytest.mark.slow

LATE_RANK = 1
LATE_MS = 150
"""Rank 1's sleep before the explicit all-reduce: each instance's lateness is asserted within 0.6-2x of it, and
two ranks on a loaded 2-core machine move one step's lateness by 10-20 ms either way (40 ms left 16 ms of room
below); 12 steps cost 1.8 s."""
ACTIVE_STEPS = 3
WINDOWS = 2
SKEW_MS = 37

JOB = textwrap.dedent(f"""
    import os, sys, tempfile, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, record_function, schedule
    from fleetscope.traces.clock import measure_clock_offset, record_clock_offset, write_clock_offset
    from fleetscope.traces.layout import RunLayout
    from fleetscope.traces.writer import publish_trace

    layout = RunLayout.at(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record_clock_offset(layout)
    # the same measurement with rank 1's clock {SKEW_MS} ms ahead, kept aside for the skew test
    skew_ns = {SKEW_MS} * 1_000_000 if rank == 1 else 0
    skewed = measure_clock_offset(now_ns=lambda: time.time_ns() + skew_ns)
    write_clock_offset(skewed, layout.root.parent / "skewed_clock" / f"rank{{rank}}.json")
    through_store = measure_clock_offset(transport="store", now_ns=lambda: time.time_ns() + skew_ns)
    write_clock_offset(through_store, layout.root.parent / "skewed_clock_store" / f"rank{{rank}}.json")
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
            # less than LATE_MS when rank 0 itself runs late in that step (2 ranks share 2 cores)
            assert 0.6 * LATE_MS * 1000 <= instance.lateness_us <= 2.0 * LATE_MS * 1000
    assert f"rank {LATE_RANK} is the straggler" in report.verdict


def test_real_clock_offsets_are_measured(gloo_run):
    offsets, problems = read_clock_offsets(gloo_run)
    assert problems == [] and sorted(offsets) == [0, 1]
    assert offsets[0].offset_us == 0.0
    one = offsets[1]
    assert one.round_trips == DEFAULT_ROUND_TRIPS and 0 < one.uncertainty_us < 10_000
    # both ranks read the same host clock: the true offset is 0, inside the bound by construction
    assert abs(one.offset_us) <= one.uncertainty_us
    for transport_dir in ("skewed_clock", "skewed_clock_store"):
        skewed = ClockOffset.from_json(json.loads((gloo_run.root.parent / transport_dir / "rank1.json").read_text()))
        assert abs(skewed.offset_us - SKEW_MS * 1000) <= skewed.uncertainty_us < 10_000, transport_dir


def _skewed_copy(layout: RunLayout, destination: Path, *, with_clock_files: bool) -> RunLayout:
    """The run as if rank 1 ran on another host whose clock is SKEW_MS ahead."""
    shutil.copytree(layout.root, destination)
    copy = RunLayout.at(destination)
    shutil.rmtree(copy.report_dir, ignore_errors=True)
    for path in copy.traces_dir.rglob("rank1.*.json.gz"):
        document = json.loads(gzip.decompress(path.read_bytes()))
        document["host_name"] = "other-node"
        for event in document["traceEvents"]:
            if isinstance(event.get("ts"), (int, float)):
                event["ts"] += SKEW_MS * 1000
        path.write_bytes(gzip.compress(json.dumps(document).encode()))
    shutil.rmtree(copy.clock_dir)
    if with_clock_files:
        shutil.copytree(layout.root.parent / "skewed_clock", copy.clock_dir)
    gather(copy.root)
    return copy


def _lateness_by_instance(report):
    return {(w.window, i.step, i.name, i.ordinal): (i.last_rank, i.lateness_us)
            for w in report.windows for i in w.stragglers.worst_instances}


@pytest.mark.parametrize("with_clock_files", [True, False], ids=["measured", "from-collectives"])
def test_injected_clock_skew_is_recovered_and_the_report_unchanged(gloo_run, tmp_path, with_clock_files):
    original = analyze(gloo_run.root, write_default_outputs=False)
    skewed = analyze(_skewed_copy(gloo_run, tmp_path / "skewed", with_clock_files=with_clock_files).root,
                     write_default_outputs=False)
    # gloo span ends on two busy cores agree only to a few ms (measured here: errors of 1.4-2.5 ms); the
    # startup measurement is the precise source (NCCL kernel ends are: test_cross_rank_scale_truth.py)
    collectives_tolerance_us = 4000
    tolerances_us = []
    for window in skewed.windows:
        other = next(h for h in window.clock.hosts if h.host == "other-node")
        window_tolerance_us = collectives_tolerance_us
        assert other.collective_samples >= MIN_SAMPLES
        if not with_clock_files:
            assert other.source == "collectives" and other.measured_offset_us is None
        else:
            measured = ClockOffset.from_json(
                json.loads((gloo_run.root.parent / "skewed_clock" / "rank1.json").read_text()))
            # the file is read whichever source wins, and it holds the skew within its own bound
            assert other.measured_offset_us == pytest.approx(measured.offset_us)
            assert other.measured_uncertainty_us == pytest.approx(measured.uncertainty_us)
            assert abs(measured.offset_us - SKEW_MS * 1000) <= max(1000.0, measured.uncertainty_us)
            # the documented choice: the collectives win only when their spread is below the measured bound
            # (on two busy cores the best round trip, and so that bound, can grow to several ms)
            collectives_tighter = other.collective_spread_us < measured.uncertainty_us
            assert other.source == ("collectives" if collectives_tighter else "measured")
            if other.source == "measured":
                window_tolerance_us = max(1000.0, measured.uncertainty_us)
        assert other.offset_us == pytest.approx(SKEW_MS * 1000, abs=window_tolerance_us)
        tolerances_us.append(window_tolerance_us)
    tolerance_us = max(tolerances_us)
    before, after = _lateness_by_instance(original), _lateness_by_instance(skewed)
    assert before.keys() == after.keys()
    for key, (last_rank, lateness_us) in before.items():
        if lateness_us > 5 * tolerance_us:        # clear-cut instances keep their late rank and amount
            assert after[key][0] == last_rank
            assert after[key][1] == pytest.approx(lateness_us, abs=tolerance_us)
    assert [w.stragglers.waited_for_rank for w in skewed.windows] == [LATE_RANK] * WINDOWS
