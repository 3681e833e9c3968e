"""Terminal sections of the evidence: collective bandwidth (and the sections after it in the report)."""

from __future__ import annotations

from fleetscope.analysis.per_rank.names import PHASES
from fleetscope.analysis.per_rank.profiling_cost import MIN_STEPS
from fleetscope.analysis.report.model import Report, WindowReport

BANDWIDTH_ROWS_SHOWN = 5
STALL_RANKS_SHOWN = 8


def evidence_sections(report: Report) -> list[str]:
    """The evidence sections of the terminal summary, each a titled block (empty ones left out)."""
    return [s for s in (_time(report), _stalls(report), _bandwidth(report), _records(report)) if s]


def _titled(title: str, lines: list[str]) -> str:
    return f"{title}\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def _bandwidth(report: Report) -> str:
    """A status note (not recorded, not matched, a lower bound) once for every window it applies to, then each
    window's rows."""
    notes: dict[str, list[str]] = {}
    rows = []
    for window in report.windows:
        bandwidth = window.bandwidth
        if bandwidth is None:
            continue
        label = "-" if window.window is None else str(window.window)
        if bandwidth.status != "ok":
            notes.setdefault(f"bandwidth {bandwidth.status}: {bandwidth.reason}", []).append(label)
        prefix = f"window {label}: "
        rows += [prefix + row.verdict for row in bandwidth.rows[:BANDWIDTH_ROWS_SHOWN]]
        if len(bandwidth.rows) > BANDWIDTH_ROWS_SHOWN:
            rows.append(f"{prefix}... {len(bandwidth.rows) - BANDWIDTH_ROWS_SHOWN} more rows in the JSON/HTML report")
    lines = [f"{_windows_label(labels)}: {note}" for note, labels in notes.items()] + rows
    return _titled("Collective bandwidth (bus bandwidth vs link peak, nccl-tests formulas)", lines)


def _windows_label(labels: list[str]) -> str:
    return f"window {labels[0]}" if len(labels) == 1 else f"windows {', '.join(labels)}"


def _w(window: WindowReport) -> str:
    return f"window {'-' if window.window is None else window.window}: "


def mean_phases_ms(window: WindowReport) -> dict[str, float]:
    """Mean host wall time of each phase per step, over the window's steps of every rank that have it."""
    values: dict[str, list[float]] = {}
    for rank in window.ranks:
        for step in rank.steps:
            for phase, ms in step.phases_ms.items():
                values.setdefault(phase, []).append(ms)
    return {p: sum(values[p]) / len(values[p]) for p in PHASES if p in values}


def _shares(totals_us: dict[str, float], total_us: float, keep: int = 8) -> str:
    return ", ".join(f"{name} {us / 1000:.2f} ms ({100 * us / total_us:.0f}%)"
                     for name, us in list(totals_us.items())[:keep]) if total_us > 0 else "-"


def _time(report: Report) -> str:
    lines = []
    for window in report.windows:
        phases = mean_phases_ms(window)
        if phases:
            lines.append(_w(window) + "host phases, mean per step: "
                         + " | ".join(f"{phase} {ms:.2f} ms" for phase, ms in phases.items()))
        gpu = window.gpu_time
        if gpu is None:
            continue
        steps = max((len(rank.steps) for rank in window.ranks), default=0)
        lines.append(_w(window) + f"GPU time in the window {gpu.total_us / 1000:.2f} ms (all ranks, {steps} "
                     "profiled steps), by launching phase: "
                     + _shares(gpu.by_phase_us, gpu.total_us))
        lines.append(_w(window) + "by kernel category: " + _shares(gpu.by_category_us, gpu.total_us))
        if gpu.by_range_us:
            lines.append(_w(window) + "by user range: " + _shares(gpu.by_range_us, gpu.total_us, keep=5))
        if gpu.by_op_us:
            lines.append(_w(window) + "top ops: " + _shares(gpu.by_op_us, gpu.total_us, keep=5))
    gpu = any(window.gpu_time is not None for window in report.windows)
    return _titled("Where the time went (phases on the host" + ("; GPU time by the range that launched it)" if gpu
                                                              else ")"), lines)


def stall_totals(stalls) -> dict[str, float]:
    """Per-step means of a rank's HostStalls (sync calls, blocked ms, tensor reads, copies, input ms)."""
    steps = stalls.steps or []
    count = max(len(steps), 1)
    return {
        "syncs": sum(s.sync_count for s in steps) / count,
        "sync_ms": sum(s.sync_us for s in steps) / count / 1000,
        "reads": sum(s.tensor_reads for s in steps) / count,
        "dtoh": sum(s.dtoh_count for s in steps) / count,
        "input_ms": sum(s.input_wait_us for s in steps) / count / 1000,
        "pageable": sum(s.pageable_copy_count for s in steps) / count,
        "pageable_ms": sum(s.pageable_copy_us for s in steps) / count / 1000,
    }


def idle_per_step_ms(stalls) -> dict[str, float]:
    """A rank's idle time inside its steps by cause, mean ms per profiled step, largest first (report.json's
    idle_by_cause_us is the sum over the profiled steps)."""
    count = max(len(stalls.steps or []), 1)
    return {cause: us / count / 1000 for cause, us in
            sorted(stalls.idle_by_cause_us.items(), key=lambda item: -item[1])}


def _count(mean: float) -> str:
    """A per-step mean of a count: whole when it is ("74 tensor reads"), else one decimal."""
    return f"{mean:.0f}" if abs(mean - round(mean)) < 0.05 else f"{mean:.1f}"


def _idle_word(rank) -> str:
    """Whose idle time: the GPU's, or on a CPU trace the host's (no op running)."""
    return "CPU" if rank.utilization is not None and rank.utilization.basis == "cpu" else "GPU"


def _stalls(report: Report) -> str:
    lines = []
    for window in report.windows:
        ranks = [r for r in window.ranks if r.host_stalls is not None]
        ranks.sort(key=lambda r: -(stall_totals(r.host_stalls)["sync_ms"] + stall_totals(r.host_stalls)["input_ms"]))
        for rank in ranks[:STALL_RANKS_SHOWN]:
            t = stall_totals(rank.host_stalls)
            causes = ", ".join(f"{cause} {ms:.2f} ms" for cause, ms in idle_per_step_ms(rank.host_stalls).items()) or "-"
            paged = (f", {_count(t['pageable'])} pageable copies ({t['pageable_ms']:.2f} ms on the host)"
                     if t["pageable"] else "")
            lines.append(f"{_w(window)}rank {rank.rank}: per step {_count(t['syncs'])} syncs ({t['sync_ms']:.2f} ms "
                         f"blocked), {_count(t['reads'])} tensor reads, {_count(t['dtoh'])} copies to host{paged}, input wait "
                         f"{t['input_ms']:.2f} ms; {_idle_word(rank)} idle by cause: {causes}")
            steps = len(rank.host_stalls.steps or [])
            lines += [f"{_w(window)}  held at {f.frame}: {f.count} {f.what} "
                      f"call(s), {f.us / 1000:.2f} ms in the window ({steps} profiled steps)"
                      for f in rank.host_stalls.frames]
        if len(ranks) > STALL_RANKS_SHOWN:
            lines.append(f"{_w(window)}... {len(ranks) - STALL_RANKS_SHOWN} more ranks in the JSON/HTML report")
    return _titled("Host stalls (ranks with the most blocked + input time first)", lines)


def memory_line(memory) -> str:
    frag = (f", fragmentation {memory.fragmentation_mb:.1f} MiB ({memory.fragmentation_pct:.0f}% of reserved)"
            if memory.fragmentation_mb is not None and memory.fragmentation_pct is not None else "")
    reserved = f" / {memory.peak_reserved_mb:.1f} MiB reserved" if memory.peak_reserved_mb is not None else ""
    growth = ("growth -" if memory.growth_mb_per_step is None
              else f"growth {memory.growth_mb_per_step:+.2f} MiB/step{' (LEAK?)' if memory.leak_suspected else ''}")
    return (f"peak {memory.peak_allocated_mb:.1f} MiB allocated{reserved}{frag}, {growth}, "
            f"{memory.alloc_retries} retries, {memory.ooms} OOMs")


def compile_line(compiled) -> str:
    breaks = f"{compiled.graph_break_count} graph breaks"
    if compiled.graph_breaks:
        breaks += f" (top: {str(compiled.graph_breaks[0].get('reason', '')).splitlines()[0][:80]})"
    return (f"torch.compile {compiled.mode}/{compiled.backend}: {compiled.compile_time_s:.1f} s, "
            f"{compiled.frames_compiled} frames, {compiled.graphs} graphs, {breaks}, "
            f"{len(compiled.recompiles)} recompiles, compiled in steps {compiled.steps_with_compilations or '-'}")


def difference_text(difference, before=None) -> str:
    """A profiling-cost difference (median, 95% interval); unmeasured, why: too few steps on its own side, or
    none to compare with before the first window (`before`: that Phase), which thousands of steps after it
    cannot make up for."""
    if difference is None:
        if before is not None and len(before.steps) < MIN_STEPS:
            return ("not measured: no steady step before the first window" if not before.steps else
                    f"not measured: fewer than {MIN_STEPS} steady steps before the first window")
        return "too few steps"
    return f"{difference.median_pct:+.1f}% [{difference.low_pct:+.1f}, {difference.high_pct:+.1f}]"


def profiling_line(cost) -> str:
    """Steady steps before the first window vs inside the windows and after the last (median, 95% interval)."""
    before = f"{cost.before.median_ms:.2f} ms" if cost.before.median_ms is not None else "-"
    return (f"before the first window {before} ({len(cost.before.steps)} steps); inside "
            f"{difference_text(cost.inside_vs_before, cost.before)} ({len(cost.inside.steps)} steps); after the last "
            f"{difference_text(cost.after_vs_before, cost.before)} ({len(cost.after.steps)} steps); "
            f"excluded: {cost.excluded}")


def profiling_cost_headline(report: Report) -> str:
    """The measured profiling cost, said in the header beside the profiled steps it inflates: the rank whose
    windows cost most (inside them against its steady steps before the first, step metrics); "" where no rank
    measured it."""
    trainer = report.trainer
    ranks = trainer.ranks if trainer is not None and trainer.status == "ok" else []
    measured = [(r.rank, r.profiling.inside_vs_before) for r in ranks
                if r.profiling is not None and r.profiling.inside_vs_before is not None]
    if not measured:
        return ""
    rank, cost = max(measured, key=lambda item: (item[1].median_pct, -item[0]))
    who = f"rank {rank}" if len(measured) == 1 else f"rank {rank}, the most of {len(measured)} ranks"
    return f"profiling cost {difference_text(cost)} (the windows' steps vs the steady steps before them, {who})"


def _records(report: Report) -> str:
    trainer = report.trainer
    if trainer is None:
        return ""
    if trainer.status != "ok":
        return _titled("Memory, input and compilation (trainer records)", [f"{trainer.status}: {trainer.reason}"])
    lines = []
    for records in trainer.ranks[:STALL_RANKS_SHOWN]:
        if records.memory is not None:
            lines.append(f"rank {records.rank}: memory: {memory_line(records.memory)}")
        if records.input is not None:
            lines.append(f"rank {records.rank}: input (data_ms): mean {records.input.mean_data_ms:.2f} ms, "
                         f"max {records.input.max_data_ms:.2f} ms, {records.input.data_pct:.1f}% of step time "
                         f"({records.input.basis})")
        if records.compile is not None:
            lines.append(f"rank {records.rank}: {compile_line(records.compile)}")
        if records.profiling is not None:
            lines.append(f"rank {records.rank}: profiling cost: {profiling_line(records.profiling)}")
    if len(trainer.ranks) > STALL_RANKS_SHOWN:
        lines.append(f"... {len(trainer.ranks) - STALL_RANKS_SHOWN} more ranks in the JSON/HTML report")
    lines += [f"WARNING {w}" for w in trainer.warnings]
    if trainer.missing_ranks:
        lines.append(f"no records for ranks {trainer.missing_ranks}")
    return _titled("Memory, input and compilation (trainer records)", lines)
