"""Memory, input wait and compile evidence from synthetic trainer records with known amounts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fleetscope.analysis.analyze import analyze
from fleetscope.analysis.per_rank.trainer_records import growth_slope, memory_evidence
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal
from fleetscope.traces.formats import metric_line
from fleetscope.traces.formats import parse_step_record

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-fsdp-1rank"   # traces steps 4 and 5
LEAK_MB = 2.5
BASE_MB = 1000.0


def step_record(step: int, *, leak_mb: float = LEAK_MB, profiled: bool = False) -> dict:
    """Allocated peak BASE + leak x step (+300 in steps 0-1: optimizer state arriving); reserved 200 above,
    700 above in step 7 (the reserved peak); one retry in step 3; data 5 of 50 ms (10%)."""
    allocated = BASE_MB + leak_mb * step + (300.0 if step < 2 else 0.0)
    reserved = allocated + (700.0 if step == 7 else 200.0)
    return {"step": step, "rank": 0, "loss": 1.0, "step_time_ms": 50.0, "data_ms": 5.0, "forward_ms": 20.0,
            "backward_ms": 20.0, "optimizer_ms": 5.0, "tokens_per_s": 1.0, "max_memory_allocated_mb": allocated,
            "max_memory_reserved_mb": reserved, "alloc_retries": 1 if step == 3 else 0, "ooms": 0,
            "profiled": profiled}


COMPILE = {"rank": 0, "mode": "default", "backend": "inductor", "written_after_step": 7, "final": True,
           "compile_time_s": 12.5, "frames_compiled": 6, "graphs": 4, "graph_break_count": 2,
           "graph_breaks": [{"reason": "torch.compiler.disable", "count": 2}],
           "recompiles": [{"compile_id": "3/1", "function": "forward", "reason": "tensor size mismatch"}],
           "cuda_graphs": False, "cudagraph_skip_reasons": [],
           "steps_with_compilations": [{"step": 0, "frames": 5, "graph_breaks": 2, "recompiles": 0},
                                       {"step": 5, "frames": 1, "graph_breaks": 0, "recompiles": 1}]}


def run_dir(tmp_path: Path, *, leak_mb: float = LEAK_MB) -> Path:
    root = tmp_path / "run"
    shutil.copytree(FIXTURE, root)
    lines = "".join(metric_line(step_record(s, leak_mb=leak_mb, profiled=s in (4, 5))) for s in range(8))
    (root / "metrics" / "rank0.jsonl").write_text(lines)
    (root / "metrics" / "rank0.compile.json").write_text(json.dumps(COMPILE))
    return root


def test_memory_peaks_fragmentation_growth_and_retries(tmp_path):
    report = analyze(run_dir(tmp_path), use_hta=False, use_cache=False, write_default_outputs=False)
    (records,) = report.trainer.ranks
    memory = records.memory
    assert memory.peak_allocated_mb == BASE_MB + 300.0 + LEAK_MB     # step 1
    assert memory.peak_reserved_mb == BASE_MB + LEAK_MB * 7 + 700.0  # step 7
    assert memory.fragmentation_mb == 700.0
    assert memory.fragmentation_pct == pytest.approx(100 * 700.0 / (BASE_MB + LEAK_MB * 7 + 700.0))
    assert memory.growth_mb_per_step == pytest.approx(LEAK_MB, abs=1e-6)   # steps 2-7, exact line
    assert memory.leak_suspected and (memory.alloc_retries, memory.ooms) == (1, 0)
    assert records.input.data_pct == pytest.approx(10.0) and records.input.mean_data_ms == 5.0
    assert any("2.50 MiB/step (least-squares over steps 2-7): possible leak" in w for w in report.trainer.warnings)


def test_no_growth_is_no_leak():
    memory = memory_evidence([parse_step_record(step_record(s, leak_mb=0.0))[0] for s in range(8)])
    assert memory.growth_mb_per_step == pytest.approx(0.0, abs=1e-9) and not memory.leak_suspected


def test_too_few_steps_give_no_slope():
    assert growth_slope([0, 1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0, 5.0]) is None   # 3 steps after the first 2


def test_compile_in_a_traced_step_is_warned(tmp_path):
    report = analyze(run_dir(tmp_path), use_hta=False, use_cache=False, write_default_outputs=False)
    compiled = report.trainer.ranks[0].compile
    assert compiled.steps_with_compilations == [0, 5] and compiled.compiled_in_timed_steps == [5]
    assert (compiled.compile_time_s, compiled.graphs, compiled.graph_break_count) == (12.5, 4, 2)
    assert any("step(s) 5" in w for w in report.trainer.warnings)
    assert any("1 recompile" in w for w in report.trainer.warnings)
    text, html = render_terminal(report), render_html(report)
    assert "possible leak" in text and "torch.compile default/inductor" in text
    assert "Memory, input and compilation" in html and "tensor size mismatch" in html


def test_trace_directory_has_no_trainer_records(tmp_path):
    traces = tmp_path / "traces"
    shutil.copytree(FIXTURE / "traces" / "window000", traces)
    report = analyze(traces, use_hta=False, use_cache=False)
    assert report.trainer.status == "not recorded" and "run directory" in report.trainer.reason


def test_record_fields_are_in_the_documented_schema(tmp_path):
    import re

    from fleetscope.analysis.report import model as report_module

    data = analyze(run_dir(tmp_path), use_hta=False, use_cache=False, write_default_outputs=False).to_json()
    records = data["trainer"]["ranks"][0]
    keys = set(data["trainer"]) | set(records) | set(records["memory"]) | set(records["input"]) | set(records["compile"])
    assert {k for k in keys if not re.search(rf"\b{k}\b", report_module.__doc__)} == set()


def test_the_evidence_survives_the_json_round_trip(tmp_path):
    from fleetscope.analysis.analyze import load_report_json, write_report_json

    report = analyze(run_dir(tmp_path), use_hta=False, use_cache=False, write_default_outputs=False)
    loaded = load_report_json(write_report_json(report, tmp_path / "report.json"))
    assert loaded.trainer == report.trainer
    assert loaded.windows[0].gpu_time == report.windows[0].gpu_time
    assert loaded.windows[0].ranks[0].host_stalls == report.windows[0].ranks[0].host_stalls
    assert render_terminal(loaded) == render_terminal(report)
