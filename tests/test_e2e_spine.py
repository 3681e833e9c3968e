"""The spine, end to end: `fleetscope launch` of a real 2-rank torchrun job (gloo) per parallel mode,
checked through the files a user opens: traces, manifest, report, merged Perfetto trace."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import fleetscope
from fleetscope.analysis.merge.critical_path_overlays import PATH_TRACK_NAME
from fleetscope.analysis.merge.ideal_overlays import IDEAL_PROCESS_NAME
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

pytestmark = pytest.mark.slow

WINDOWS = 2
OVERLAY_TRACK = "fleetscope analysis"
ANALYSIS_TRACKS = (OVERLAY_TRACK, PATH_TRACK_NAME)
"""Tracks the merge draws from the analysis, not copied from the traces (the ideal replay is a process of its own,
IDEAL_PROCESS_NAME: no rank's count holds it)."""


@pytest.fixture(scope="module", params=["ddp", "fsdp", "tp"])
def run(request, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp(request.param) / "run"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--parallel", request.param,
                           *(["--tp", "2"] if request.param == "tp" else []), "--device", "cpu",
                           "--steps", "8", "--profile", "wait=1,warmup=1,active=2,repeat=2", timeout=900)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "ui.perfetto.dev" in completed.stdout
    return run_dir


def trace_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "traces").rglob("*.pt.trace.json.gz"))


def test_every_rank_wrote_a_trace_per_window(run):
    names = [f"{p.parent.name}/{p.name.split('.')[0]}" for p in trace_files(run)]
    assert names == [f"window{w:03d}/rank{r}" for w in range(WINDOWS) for r in range(2)]


def test_manifest_lists_every_trace_with_its_sha256(run):
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and not manifest["missing"] and not manifest["problems"]
    for record in manifest["traces"]:
        data = (run / record["path"]).read_bytes()
        assert record["bytes"] == len(data)
        assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert sorted((t["window"], t["rank"]) for t in manifest["traces"]) == [(w, r) for w in range(2) for r in range(2)]
    assert [t["steps"] for t in manifest["traces"] if t["window"] == 1] == [[6, 7], [6, 7]]


def test_report_covers_both_ranks(run):
    report = json.loads((run / "report" / "report.json").read_text())
    assert report["complete"] is True
    ranks = sorted(r["rank"] for r in report["ranks"])
    assert ranks == [0, 1]
    html = (run / "report" / "report.html").read_text()
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org", "")
    assert "Open in Perfetto" in html and "start_ns" in html   # rendered again with the merge's step ranges


def test_step_metrics_have_one_line_per_step_and_rank(run):
    for rank in range(2):
        rows = [json.loads(line) for line in (run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(8))
        assert all(row["step_time_ms"] > 0 and row["tokens_per_s"] > 0 for row in rows)


def complete_events_per_rank(run: Path) -> Counter:
    counts: Counter = Counter()
    for path in trace_files(run):
        document = json.loads(gzip.decompress(path.read_bytes()))
        counts[document["distributedInfo"]["rank"]] += sum(1 for e in document["traceEvents"] if e.get("ph") == "X")
    return counts


def merged_slices_per_process(path: Path) -> tuple[dict[int, str], Counter]:
    """Process names and slice counts per process, read with the protobuf classes alone."""
    trace = pb.Trace()
    trace.ParseFromString(path.read_bytes())
    names, track_pid, track_name, parent = {}, {}, {}, {}
    for packet in trace.packet:
        if packet.HasField("track_descriptor"):
            track = packet.track_descriptor
            track_name[track.uuid] = track.name
            if track.HasField("process"):
                names[track.process.pid] = track.process.process_name
                track_pid[track.uuid] = track.process.pid
            elif track.HasField("thread"):
                track_pid[track.uuid] = track.thread.pid
            elif track.parent_uuid:
                parent[track.uuid] = track.parent_uuid
    for uuid, parent_uuid in parent.items():
        track_pid[uuid] = track_pid[parent_uuid]
    slices: Counter = Counter()
    for packet in trace.packet:
        event = packet.track_event
        if packet.HasField("track_event") and event.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            if not track_name.get(event.track_uuid, "").startswith(ANALYSIS_TRACKS):
                slices[track_pid[event.track_uuid]] += 1
    return names, slices


def test_merged_trace_holds_one_process_per_rank_and_every_event(run):
    names, slices = merged_slices_per_process(run / "report" / "merged.perfetto-trace")
    by_rank = {int(name.split()[1]): pid for pid, name in names.items() if name.startswith("rank ")}
    assert sorted(by_rank) == [0, 1]
    assert all(names[pid].endswith(")") for pid in by_rank.values())  # "rank R (host)"
    inputs = complete_events_per_rank(run)
    assert {rank: slices[pid] for rank, pid in by_rank.items()} == dict(inputs)
    ideal = [pid for pid, name in names.items() if name == IDEAL_PROCESS_NAME]
    assert len(ideal) <= 1 and all(slices[pid] > 0 for pid in ideal)   # drawn where the report replayed a step
