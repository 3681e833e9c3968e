"""HTML sections of the evidence: collective bandwidth (and the sections after it in the report)."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.per_rank.host_stalls import GAP_CAUSES
from fleetscope.analysis.per_rank.names import PHASES
from fleetscope.analysis.render.evidence_text import compile_line, difference_text, idle_per_step_ms, stall_totals
from fleetscope.analysis.render.html_table import table
from fleetscope.analysis.report.model import Report, WindowReport


def evidence_sections(report: Report) -> str:
    """The evidence sections of the HTML report, concatenated."""
    return "".join((_time(report), _stalls(report), _bandwidth(report), _records(report)))


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


_BANDWIDTH_HEADER = ["collective", "group", "size", "scope", "ranks", "instances", "GB moved", "moving ms",
                     "wait %", "algbw GB/s", "busbw GB/s", "peak GB/s", "% of peak"]


def _bandwidth(report: Report) -> str:
    parts = []
    for window in report.windows:
        bandwidth = window.bandwidth
        if bandwidth is None:
            continue
        title = f"<h3>window {'-' if window.window is None else window.window}</h3>"
        if bandwidth.status != "ok":
            parts.append(f"{title}<p>{escape(bandwidth.status)}: {escape(bandwidth.reason)}</p>")
            if not bandwidth.rows:
                continue
            title = ""
        rows = [[r.collective, r.group or "-", r.size_bucket, r.scope, str(r.members), str(r.instances),
                 _f(r.total_bytes / 1e9, 3), _f(r.moving_us / 1000, 2), _f(r.wait_pct), _f(r.algbw_gbps),
                 _f(r.busbw_gbps), _f(r.peak_busbw_gbps, 0), _f(r.peak_pct)] for r in bandwidth.rows]
        verdicts = "".join(f"<li>{escape(r.verdict)}</li>" for r in bandwidth.rows[:5])
        parts.append(f"{title}<ul>{verdicts}</ul>" + table(_BANDWIDTH_HEADER, rows, left=(0, 1, 2, 3))
                     + f"<p class=\"note\">Peaks: {escape(bandwidth.peak_source)}.</p>")
    if not parts:
        return ""
    return ("<h2>Collective bandwidth</h2><p class=\"note\">Data movement = own end minus the last rank's "
            "arrival; waiting = last arrival minus own arrival. busbw = algbw x the nccl-tests factor "
            "(all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; others 1).</p>"
            + "".join(parts))


def _window_title(window: WindowReport) -> str:
    return f"<h3>window {'-' if window.window is None else window.window}</h3>"


def _phase_table(window: WindowReport) -> str:
    """Mean host wall time of each phase per step, one row per rank."""
    rows = []
    for rank in window.ranks:
        means = []
        for phase in PHASES:
            values = [s.phases_ms[phase] for s in rank.steps if phase in s.phases_ms]
            means.append(_f(sum(values) / len(values), 2) if values else "-")
        rows.append([str(rank.rank), str(len(rank.steps)), *means])
    if not any(any(cell != "-" for cell in row[2:]) for row in rows):
        return ""
    return ("<p>Host phases, mean ms per step</p>"
            + table(["rank", "steps", *(f"{p} ms" for p in PHASES)], rows, labels=2))


def _share_table(title: str, totals_us: dict[str, float], total_us: float) -> str:
    rows = [[name, _f(us / 1000, 3), _f(100 * us / total_us if total_us > 0 else None)]
            for name, us in totals_us.items()]
    return f"<p>{escape(title)}</p>" + table(["", "GPU ms in the window", "%"], rows, left=(0,)) if rows else ""


def _time(report: Report) -> str:
    parts = []
    for window in report.windows:
        gpu = window.gpu_time
        body = _phase_table(window)
        if gpu is not None:
            body += (_share_table("GPU time by phase (the range that launched it)", gpu.by_phase_us, gpu.total_us)
                     + _share_table("GPU time by kernel category", gpu.by_category_us, gpu.total_us)
                     + _share_table("GPU time by user range (innermost record_function)", gpu.by_range_us,
                                    gpu.total_us)
                     + _share_table("GPU time by host op (the innermost op that launched it)", gpu.by_op_us,
                                    gpu.total_us))
        if body:
            parts.append(_window_title(window) + body)
    if not parts:
        return ""
    return ("<h2>Phases and GPU time</h2><p class=\"note\">Host phases are the wall time of the trainer's "
            "record_function ranges. GPU time (kernels, copies, fills; all ranks summed) goes to the phase "
            "and user range that launched it, through the CUDA correlation id.</p>" + "".join(parts))


def _stalls(report: Report) -> str:
    parts = []
    for window in report.windows:
        rows = []
        stalled = [rank for rank in window.ranks if rank.host_stalls is not None]
        causes = [c for c in GAP_CAUSES if any(c in r.host_stalls.idle_by_cause_us for r in stalled)]
        header = ["rank", "syncs/step", "blocked ms/step", "tensor reads/step", "copies to host/step",
                  "input wait ms/step", *(f"idle: {cause} ms/step" for cause in causes)]
        for rank in stalled:
            t, idle = stall_totals(rank.host_stalls), idle_per_step_ms(rank.host_stalls)
            rows.append([str(rank.rank), _f(t["syncs"]), _f(t["sync_ms"], 3), _f(t["reads"]), _f(t["dtoh"]),
                         _f(t["input_ms"], 3), *(_f(idle.get(cause, 0.0), 3) for cause in causes)])
        if rows:
            parts.append(_window_title(window) + table(header, rows))
    if not parts:
        return ""
    return ("<h2>Host stalls</h2><p class=\"note\">Every column is a mean per profiled step. Syncs: "
            "cudaStream/Device/EventSynchronize; tensor reads: "
            "aten::_local_scalar_dense (.item()); input wait: DataLoader fetches. GPU idle gaps inside the "
            "steps get one cause each: input wait (half covered by a fetch), host collective (half covered by "
            "gloo/c10d communication on the host), host sync (starts during or just "
            "after a sync), short gaps (&lt; 10 us), device dependency, host busy elsewhere; on CPU traces the idle "
            "time inside the steps is where no op runs (no op running), the merged trace's idle slices.</p>" + "".join(parts))


_MEMORY_HEADER = ["rank", "steps", "peak allocated MiB", "peak reserved MiB", "fragmentation MiB",
                  "fragmentation %", "growth MiB/step", "leak?", "alloc retries", "OOMs", "data ms (mean)",
                  "data % of step"]


def _memory_row(records) -> list[str]:
    m, data = records.memory, records.input
    cells = ([str(len(m.steps)), _f(m.peak_allocated_mb), _f(m.peak_reserved_mb), _f(m.fragmentation_mb),
              _f(m.fragmentation_pct), _f(m.growth_mb_per_step, 2), "yes" if m.leak_suspected else "no",
              str(m.alloc_retries), str(m.ooms)] if m is not None else ["-"] * 9)
    cells += [_f(data.mean_data_ms, 2), _f(data.data_pct)] if data is not None else ["-", "-"]
    return [str(records.rank), *cells]


_PROFILING_HEADER = ["rank", "before: steps", "before: median ms", "inside: steps", "inside vs before",
                     "after: steps", "after vs before"]


def _profiling_row(records) -> list[str]:
    cost = records.profiling
    return [str(records.rank), str(len(cost.before.steps)), _f(cost.before.median_ms, 2), str(len(cost.inside.steps)),
            difference_text(cost.inside_vs_before, cost.before), str(len(cost.after.steps)),
            difference_text(cost.after_vs_before, cost.before)]


def _records(report: Report) -> str:
    trainer = report.trainer
    if trainer is None:
        return ""
    head = "<h2>Memory, input and compilation</h2>"
    if trainer.status != "ok":
        return head + f"<p>{escape(trainer.status)}: {escape(trainer.reason)}</p>"
    warnings = "".join(f"<li class=\"bad\">{escape(w)}</li>" for w in trainer.warnings)
    body = (f"<ul>{warnings}</ul>" if warnings else "") + table(_MEMORY_HEADER, [_memory_row(r) for r in trainer.ranks])
    profiled = [r for r in trainer.ranks if r.profiling is not None]
    if profiled:
        body += ("<h3>What profiling cost (steady steps before the first window vs inside and after)</h3>"
                 + table(_PROFILING_HEADER, [_profiling_row(r) for r in profiled])
                 + f"<p class=\"note\">Median step time difference, 95% bootstrap interval; excluded: "
                 f"{escape(profiled[0].profiling.excluded)}.</p>")
    compiled = [r for r in trainer.ranks if r.compile is not None]
    if compiled:
        body += "<h3>torch.compile</h3><ul>" + "".join(
            f"<li>rank {r.rank}: {escape(compile_line(r.compile))}</li>" for r in compiled) + "</ul>"
        breaks = [[str(r.rank), str(b.get("count", "")), str(b.get("reason", ""))]
                  for r in compiled for b in r.compile.graph_breaks]
        if breaks:
            body += "<p>Graph breaks</p>" + table(["rank", "count", "reason"], breaks, left=(2,))
        recompiles = [[str(r.rank), str(c.get("compile_id", "")), str(c.get("function", "")), str(c.get("reason", ""))]
                      for r in compiled for c in r.compile.recompiles]
        if recompiles:
            body += "<p>Recompiles</p>" + table(["rank", "id", "function", "reason"], recompiles, left=(2, 3))
    note = ("<p class=\"note\">From the trainer's metrics/rank&lt;R&gt;.jsonl (per-step allocator peaks, "
            "data_ms) and rank&lt;R&gt;.compile.json. Growth: least-squares slope of the allocated peak per step, "
            "first 2 steps left out; leak suspected from 1 MiB/step.</p>")
    return head + note + body
