"""The regression gate: several runs per side, a seeded noise model, sustained drops only, environments."""

import json
from pathlib import Path

import numpy as np
import pytest

from fleetscope.analysis.compare import compare
from fleetscope.analysis.gate import EXIT_OK, EXIT_REFUSED, EXIT_REGRESSION, direction, gate
from fleetscope.analysis.history import history
from fleetscope.analysis.render.gate_terminal import render_gate, render_history
from fleetscope.analysis.render.history_html import render_history_html
from fleetscope.cli.main import main
from fleetscope.traces.layout import RunLayout
from helpers.kineto import KinetoBuilder

ENV = {"gpu_model": "NVIDIA H200", "gpu_count": 8, "driver": "580.1", "cuda": "13.0", "torch": "2.11.0",
       "nccl": "2.28.9", "transformers": "5.17.0", "fleetscope": "0.1.0", "python": "3.11.7"}
STEPS = 20


def _run(root: Path, name: str, *, step_ms: float, noise_pct: float = 1.0, seed: int = 0, tokens: float = 1000.0,
         memory_mb: float | None = 500.0, data_ms: float = 2.0, env: dict | None = ENV,
         started: str = "2026-11-01T00:00:00+00:00") -> Path:
    """A run with two ranks' step metrics (step 0 start-up, one profiled step) and a job.json."""
    layout = RunLayout.at(root / name)
    rng = np.random.default_rng(seed)
    for rank in (0, 1):
        lines = [{"step": 0, "rank": rank, "step_time_ms": 10 * step_ms, "tokens_per_s": 1.0}]
        for step in range(1, STEPS + 1):
            jitter = 1 + rng.normal(0, noise_pct / 100)
            lines.append({"step": step, "rank": rank, "step_time_ms": step_ms * jitter,
                          "tokens_per_s": tokens / jitter, "max_memory_allocated_mb": memory_mb,
                          "data_ms": data_ms, "profiled": step == 5})
        layout.metrics_file(rank).parent.mkdir(parents=True, exist_ok=True)
        layout.metrics_file(rank).write_text("".join(json.dumps(line) + "\n" for line in lines))
    record = {"started_at": started, **({"environment": env} if env is not None else {})}
    layout.job_file.write_text(json.dumps(record))
    return layout.root


def _metric(result, name):
    return next(m for m in result.metrics if m.name == name)


def test_the_same_distribution_does_not_fail(tmp_path):
    base = [_run(tmp_path, f"b{i}", step_ms=100, seed=i) for i in range(3)]
    new = [_run(tmp_path, f"n{i}", step_ms=100, seed=10 + i) for i in range(3)]
    result = gate(base, new)
    assert result.exit_code == EXIT_OK and not result.regressions
    step = _metric(result, "step_time_ms")
    assert step.gated and step.base_steps == 3 * (STEPS - 1) and step.interval_pct[0] < 0 < step.interval_pct[1]
    assert gate(base, new).metrics == result.metrics                  # seeded: the same answer every time


def test_a_sustained_slowdown_fails_on_every_gated_metric(tmp_path):
    base = [_run(tmp_path, f"b{i}", step_ms=100, seed=i) for i in range(2)]
    new = [_run(tmp_path, f"n{i}", step_ms=110, tokens=900, memory_mb=560, data_ms=9.0, seed=10 + i)
           for i in range(2)]
    result = gate(base, new)
    assert result.exit_code == EXIT_REGRESSION
    assert {m.name for m in result.regressions} == {"step_time_ms", "tokens_per_s", "peak_memory_mb", "data_time_ms"}
    data = _metric(result, "data_time_ms")  # +7 ms of input wait: +350% of itself, +7% of the 100 ms step
    assert data.change_pct == pytest.approx(350.0) and data.step_cost_pct == pytest.approx(7.0, abs=0.2)
    assert "data_time_ms +350.0% (+7.0% of the step time)" in result.verdict
    step = _metric(result, "step_time_ms")
    assert step.change_pct == pytest.approx(10.0, abs=1.0)           # 10% slower, 1% step noise
    assert step.interval_pct[0] > 5 and all(c > 5 for c in step.new_run_changes_pct)
    assert _metric(result, "tokens_per_s").change_pct == pytest.approx(-10.0, abs=1.0)
    table = render_gate(result)
    assert "REGRESSION" in table
    # the table says what the verdict says: a part of the step with its cost to the step, each run's change in %
    (data_row,) = [line for line in table.splitlines() if line.startswith("data_time_ms")]
    assert "+350.0% (+7.0% of the step time)" in data_row
    (step_row,) = [line for line in table.splitlines() if line.startswith("step_time_ms")]
    assert all(f"{c:+.1f}%" in step_row for c in step.new_run_changes_pct)


def test_a_part_of_the_step_is_judged_by_what_it_costs_the_step(tmp_path):
    base = [_run(tmp_path, f"b{i}", step_ms=100, data_ms=0.3, seed=i) for i in range(2)]
    new = [_run(tmp_path, f"n{i}", step_ms=100, data_ms=0.5, seed=10 + i) for i in range(2)]
    result = gate(base, new)
    data = _metric(result, "data_time_ms")  # +67% of itself, 0.2% of the step: not a regression
    assert data.change_pct == pytest.approx(66.7, abs=0.1) and data.step_cost_pct == pytest.approx(0.2, abs=0.05)
    assert not data.regression and data.reason == "within 5% of the step time (+0.2%)"
    assert result.exit_code == EXIT_OK
    assert _metric(result, "step_time_ms").step_cost_pct is None


def test_one_slow_new_run_is_not_sustained(tmp_path):
    base = [_run(tmp_path, f"b{i}", step_ms=100, seed=i) for i in range(2)]
    new = [_run(tmp_path, "n0", step_ms=130, seed=10), _run(tmp_path, "n1", step_ms=100, seed=11)]
    result = gate(base, new)
    step = _metric(result, "step_time_ms")
    assert not step.regression and "not in every new run" in step.reason
    assert step.new_run_changes_pct[0] > 25 and abs(step.new_run_changes_pct[1]) < 2
    assert result.exit_code == EXIT_OK


def test_a_drop_inside_the_noise_does_not_fail(tmp_path):
    base = [_run(tmp_path, "b0", step_ms=100, noise_pct=30, seed=1)]
    new = [_run(tmp_path, "n0", step_ms=106, noise_pct=30, seed=2)]
    step = _metric(gate(base, new), "step_time_ms")
    assert step.interval_pct[0] < 0 < step.interval_pct[1] and not step.regression


def test_differing_environments_are_refused_unless_allowed(tmp_path):
    base = _run(tmp_path, "b0", step_ms=100)
    new = _run(tmp_path, "n0", step_ms=100, env={**ENV, "torch": "2.12.0", "gpu_count": 4})
    refused = gate([base], [new])
    assert refused.exit_code == EXIT_REFUSED and refused.refused and not refused.metrics
    assert refused.environment_differences == {"gpu_count": ["8", "4"], "torch": ["2.11.0", "2.12.0"]}
    assert "torch (2.11.0 vs 2.12.0)" in refused.verdict
    allowed = gate([base], [new], allow_env_change=True)
    assert allowed.exit_code == EXIT_OK and any("environments differ" in n for n in allowed.notes)


def test_a_run_without_fingerprint_is_compared_with_a_note(tmp_path):
    result = gate([_run(tmp_path, "b0", step_ms=100)], [_run(tmp_path, "n0", step_ms=100, env=None)])
    assert result.exit_code == EXIT_OK
    assert any("n0: no environment fingerprint" in n for n in result.notes)


def test_the_cli_gates_several_runs_and_keeps_the_pair_form(tmp_path, capsys):
    base = [str(_run(tmp_path, f"b{i}", step_ms=100, seed=i)) for i in range(2)]
    new = [str(_run(tmp_path, f"n{i}", step_ms=110, seed=10 + i)) for i in range(2)]
    args = ["compare", "--base", base[0], "--base", base[1], "--new", new[0], "--new", new[1]]
    assert main(args) == EXIT_REGRESSION
    assert "every new run worse" in capsys.readouterr().out
    assert main(["compare", "--base", base[0], "--new", base[1]]) == EXIT_OK
    assert main(["compare", base[0], "--new", new[0]]) == 2                    # both forms at once
    other = str(_run(tmp_path, "other", step_ms=100, env={**ENV, "nccl": "2.29.1"}))
    assert main(["compare", base[0], other]) == 2
    assert "nccl (2.28.9 vs 2.29.1)" in capsys.readouterr().err


def test_history_orders_runs_by_date_and_marks_the_regression(tmp_path, capsys):
    for index, (name, step_ms) in enumerate([("r-c", 100), ("r-a", 101), ("r-d", 99), ("r-b", 125)]):
        _run(tmp_path / "runs", name, step_ms=step_ms, seed=index, started=f"2026-11-0{index + 1}T00:00:00+00:00")
    result = history(tmp_path / "runs")
    assert [Path(r.path).name for r in result.runs] == ["r-c", "r-a", "r-d", "r-b"]
    assert [r.regressions for r in result.runs][:3] == [[], [], []]
    assert "step_time_ms" in result.runs[3].regressions
    assert "!" in render_history(result).splitlines()[-2]
    html = render_history_html(result)
    assert html.count("<svg") == 4 and 'fill="#e15759"' in html
    assert main(["history", str(tmp_path / "runs")]) == 0
    assert (tmp_path / "runs" / "history.html").read_text() == html


# --- one comparison: both forms of `compare`, one throughput, one noise rule ------------------------------


def _rank_steps(root: Path, name: str, rank_steps: dict[int, list[float]], *, tokens: float = 512.0) -> Path:
    """A run like _run's whose ranks have their own step times (ms per steady step), each rank processing
    `tokens` tokens a step (so its tokens_per_s is tokens / its step time, as the trainer writes it)."""
    run = _run(root, name, step_ms=100)
    layout = RunLayout.at(run)
    for rank, steps in rank_steps.items():
        lines = [{"step": 0, "rank": rank, "step_time_ms": 1000.0, "tokens_per_s": tokens}]
        lines += [{"step": step, "rank": rank, "step_time_ms": ms, "tokens_per_s": tokens / (ms / 1e3),
                   "data_ms": 1.0, "profiled": False} for step, ms in enumerate(steps, start=1)]
        layout.metrics_file(rank).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def _traces(run: Path) -> None:
    """Two ranks' trace of one step, so that compare() has a report to read beside the step metrics."""
    for rank in (0, 1):
        builder = KinetoBuilder(rank=rank, world_size=2)
        builder.step(3, 0.0, 1000).kernel("gemm", 50, 200, launch_ts=10)
        builder.write(run / "traces" / "window000" / f"rank{rank}.host.pt.trace.json")


def _cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().out


def _row(out: str, name: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [name])


def test_both_compare_forms_give_the_same_verdict_on_the_same_runs(tmp_path, capsys):
    # one run a side, 30% step noise, 6% slower: the steps do not show a regression beyond the noise (the
    # positional form said REGRESSION, exit 1, here); 20% slower with 1% noise is one for both forms
    base = str(_run(tmp_path, "b0", step_ms=100, noise_pct=30, seed=1))
    noisy = str(_run(tmp_path, "n0", step_ms=106, tokens=1000 * 100 / 106, noise_pct=30, seed=2))
    slower = str(_run(tmp_path, "n1", step_ms=120, tokens=1000 * 100 / 120, noise_pct=1, seed=3))
    for new, expected in ((noisy, EXIT_OK), (slower, EXIT_REGRESSION)):
        positional = _cli(["compare", base, new], capsys)
        gated = _cli(["compare", "--base", base, "--new", new], capsys)
        assert positional == gated and positional[0] == expected, positional[1]
    assert "worse, but within the noise" in _cli(["compare", base, noisy], capsys)[1]


def test_the_throughput_printed_is_the_one_the_gate_uses_and_follows_the_step_time(tmp_path, capsys):
    # rank 1 is 25% slower every step: the job's step is rank 1's, and so is its throughput
    rng = np.random.default_rng(4)
    fast, slow = list(100 + rng.normal(0, 2, STEPS)), list(125 + rng.normal(0, 2, STEPS))
    base = _rank_steps(tmp_path, "b0", {0: fast, 1: slow})
    new = _rank_steps(tmp_path, "n0", {0: [t * 0.9 for t in fast], 1: [t * 0.95 for t in slow]})
    for run in (base, new):
        _traces(run)
    gated = {m.name: m for m in gate([base], [new]).metrics}
    step, tokens = gated["step_time_ms"], gated["tokens_per_s"]
    assert tokens.base_median == pytest.approx(2 * 512 / step.base_median * 1e3)   # both ranks' tokens, slowest step
    assert 1 + tokens.change_pct / 100 == pytest.approx(1 / (1 + step.change_pct / 100))
    out = _cli(["compare", str(base), str(new)], capsys)[1]
    assert _row(out, "tokens_per_s")[1:3] == [f"{tokens.base_median:.2f}", f"{tokens.new_median:.2f}"]
    assert _row(out, "step_time_ms")[1:3] == [f"{step.base_median:.2f}", f"{step.new_median:.2f}"]
    compared = {m.name: m for m in compare(base, new).metrics}    # the API shows the gate's numbers as well
    assert (compared["tokens_per_s"].base, compared["tokens_per_s"].new) == (tokens.base_median, tokens.new_median)
    assert compared["step_time_ms"].regression == step.regression


def test_a_step_time_within_the_noise_leaves_tokens_per_s_within_the_noise(tmp_path):
    # rank 0 steady, rank 1 noisy and bounding the step; the new run speeds up rank 0 only: the job's step
    # time moves within the noise, so its tokens/s cannot be a gain beyond it (tokens/s summed per rank
    # medians said +5% beyond the noise here, while the step time said noise)
    rng = np.random.default_rng(7)
    noisy = [float(v) for v in 110 + rng.normal(0, 25, STEPS)]
    base = _rank_steps(tmp_path, "b0", {0: [100.0 + 0.1 * i for i in range(STEPS)], 1: noisy})
    new = _rank_steps(tmp_path, "n0", {0: [80.0 + 0.1 * i for i in range(STEPS)], 1: list(rng.permutation(noisy))})
    result = gate([base], [new])
    step, tokens = _metric(result, "step_time_ms"), _metric(result, "tokens_per_s")
    assert direction(step) == "unclear" and step.interval_pct[0] < 0 < step.interval_pct[1]
    assert direction(tokens) == "unclear" and tokens.interval_pct[0] < 0 < tokens.interval_pct[1]
    assert 1 + tokens.change_pct / 100 == pytest.approx(1 / (1 + step.change_pct / 100))
    low, high = step.interval_pct
    assert tokens.interval_pct == pytest.approx((100 / (1 + high / 100) - 100, 100 / (1 + low / 100) - 100))
    assert result.exit_code == EXIT_OK


def test_a_rank_missing_on_one_side_is_left_out_of_both(tmp_path):
    base = _run(tmp_path, "b0", step_ms=100, seed=1)
    new = _run(tmp_path, "n0", step_ms=100, seed=2)
    RunLayout.at(new).metrics_file(1).write_text("{not json\n")
    result = gate([base], [new])
    assert result.exit_code == EXIT_OK          # not a false 50% drop of tokens/s
    assert abs(_metric(result, "tokens_per_s").change_pct) < 2
    assert any("rank(s) 1 have no counterpart" in n for n in result.notes)
    assert any(n.startswith(f"{new}: metrics/rank1.jsonl: 1 bad line(s)") for n in result.notes)


def test_an_improvement_inside_the_noise_is_not_called_better(tmp_path):
    # the review's demo pair: step time -0.2% with an interval of -24..+119% was printed "better"
    base = [_run(tmp_path, "b0", step_ms=100, noise_pct=30, seed=1)]
    new = [_run(tmp_path, "n0", step_ms=99, noise_pct=30, seed=2)]
    step = _metric(gate(base, new), "step_time_ms")
    assert step.interval_pct[0] < 0 < step.interval_pct[1] and direction(step) == "unclear"
    assert "better" not in step.reason and "noise" in step.reason
    clear = [_run(tmp_path, "n1", step_ms=80, noise_pct=1, seed=3)]
    faster = _metric(gate(base, clear), "step_time_ms")
    assert direction(faster) == "gain" and faster.reason == "better"
