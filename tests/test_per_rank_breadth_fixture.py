"""Gradient accumulation on a real GPU (tests/fixtures/gpu/h200-small-accumulation): one optimizer step holds
its micro-batches' ranges, and the step metrics count the tokens of all of them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.traces.formats import STEP_MARKER_PREFIX, parse_microbatch_range, parse_step_marker, read_metric_records

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-small-accumulation"
MICRO_BATCHES, BATCH, SEQ = 4, 4, 2048


def test_the_profiled_optimizer_step_holds_one_range_per_micro_batch():
    (trace,) = (FIXTURE / "traces" / "window000").glob("*.pt.trace.json.gz")
    events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
    (step,) = [e for e in events if str(e.get("name", "")).startswith(STEP_MARKER_PREFIX)
               and e.get("cat") == "user_annotation"]  # the host range (the GPU copy is on the stream)
    inside = [e for e in events if parse_microbatch_range(str(e.get("name", ""))) is not None
              and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]]
    assert sorted(parse_microbatch_range(e["name"]) for e in inside) == list(range(MICRO_BATCHES))
    assert parse_step_marker(step["name"]) == 7


def test_metrics_count_every_micro_batch_and_the_report_reads_the_run():
    records = read_metric_records(FIXTURE / "metrics" / "rank0.jsonl").records
    for record in records:
        assert record.tokens_per_s * record.step_time_ms / 1e3 == pytest.approx(
            MICRO_BATCHES * BATCH * SEQ, rel=1e-6)
    report = analyze(FIXTURE, write_default_outputs=False, use_hta=False, use_cache=False)
    assert report.complete and [s.step for w in report.windows for r in w.ranks for s in r.steps] == [7]
