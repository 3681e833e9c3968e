"""What torch.compile did on one rank: compile time, graphs, graph breaks, recompiles, CUDA graphs.

Read from Dynamo's process-wide bookkeeping (`torch._dynamo.utils.counters` and the per-frame
`CompilationMetrics` of `get_compilation_metrics()`), which torch keeps whether or not anyone reads it:
reading it after each step is a few dictionary lookups, no device sync. Written to
`metrics/rank<R>.compile.json` at the end of every profiler window and at the end of the run.

Limits: the counters are per process, so they also count compilations outside the decoder blocks (on
CUDA the fused loss compiles its chunk kernel); Dynamo keeps at most its metrics limit of per-frame
records (compile time and recompile reasons come from those); a backward graph compiled lazily by
AOTAutograd in the first backward is part of its frame's compile time, not a frame of its own.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from ..traces.atomic import write_bytes_atomically
from ..traces.layout import RunLayout
from ..traces.jsontext import strict_dumps

log = logging.getLogger("fleetscope.trainer")


@dataclass(frozen=True, kw_only=True, slots=True)
class GraphBreak:
    reason: str
    """Dynamo's message for the break (its first line names the kind, e.g. a `torch.compiler.disable`d call)."""
    count: int
    """Times Dynamo hit this break while compiling (once per compiled frame that contains it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recompile:
    compile_id: str
    """Dynamo's `<frame>/<recompile>` id, e.g. `3/1`: frame 3's first recompilation."""
    function: str
    """Name of the recompiled Python function (resume functions after a break are `torch_dynamo_resume_in_*`)."""
    reason: str
    """The guard that failed, as Dynamo reports it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCompilations:
    step: int
    """Global training step during which Dynamo compiled something."""
    frames: int
    """Frames (graphs plus resume functions) compiled during the step."""
    graph_breaks: int
    """Graph breaks hit while compiling them."""
    recompiles: int
    """Of those frames, recompilations of a frame compiled before (a guard failed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileRecord:
    """One rank's `metrics/rank<R>.compile.json`."""

    rank: int
    mode: str
    """performance.compile."""
    backend: str
    """performance.compile_backend."""
    written_after_step: int
    """Last global step finished when this record was written (-1: before the first step)."""
    final: bool
    """Written at the end of the run (False: at a profiler window's end, the run went on)."""
    compile_time_s: float
    """Sum over compiled frames of Dynamo's whole-frame compile time (tracing plus backend), seconds."""
    frames_compiled: int
    """Frames Dynamo compiled successfully (counters["frames"]["ok"])."""
    graphs: int
    """Distinct FX graphs captured (counters["stats"]["unique_graphs"])."""
    graph_break_count: int
    """Sum of `graph_breaks` counts."""
    graph_breaks: list[GraphBreak] = field(default_factory=list)
    recompiles: list[Recompile] = field(default_factory=list)
    cuda_graphs: bool = False
    """The mode records CUDA graphs (reduce-overhead, max-autotune) and the device is CUDA."""
    cudagraph_skip_reasons: list[str] = field(default_factory=list)
    """Why Inductor did not use CUDA graphs for some graph (empty when it used them everywhere or was not asked)."""
    steps_with_compilations: list[StepCompilations] = field(default_factory=list)
    """Global steps that compiled anything; a step listed here is not a steady-state step."""


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return counters


def _compilation_metrics() -> list:
    from torch._dynamo.utils import get_compilation_metrics

    return get_compilation_metrics()


def _totals() -> tuple[int, int, int]:
    """(frames compiled, graph breaks hit, recompiles) so far in this process."""
    counters = _counters()
    recompiles = sum(1 for m in _compilation_metrics() if m.recompile_reason)
    return counters["frames"]["total"], sum(counters["graph_break"].values()), recompiles


class CompileWatch:
    """Notes after each step whether Dynamo compiled during it; writes the rank's compile record."""

    def __init__(self, *, layout: RunLayout, rank: int, mode: str, backend: str, use_cuda: bool):
        self._layout, self._rank, self._mode, self._backend = layout, rank, mode, backend
        self._cuda_graphs = use_cuda and mode in ("reduce-overhead", "max-autotune")
        self._before = _totals()
        self._steps: list[StepCompilations] = []
        self._last_step = -1

    def after_step(self, step: int) -> int:
        """Record what step `step` compiled (call after launching it); the frames it compiled."""
        totals = _totals()
        frames, breaks, recompiles = (now - then for now, then in zip(totals, self._before))
        self._before, self._last_step = totals, step
        if frames or breaks or recompiles:
            self._steps.append(StepCompilations(step=step, frames=frames, graph_breaks=breaks, recompiles=recompiles))
        return frames

    def record(self, *, final: bool) -> CompileRecord:
        counters = _counters()
        metrics = _compilation_metrics()
        breaks = [GraphBreak(reason=reason, count=count) for reason, count in counters["graph_break"].items()]
        return CompileRecord(
            rank=self._rank, mode=self._mode, backend=self._backend, written_after_step=self._last_step,
            final=final, compile_time_s=sum(m.entire_frame_compile_time_s or 0.0 for m in metrics),
            frames_compiled=counters["frames"]["ok"], graphs=counters["stats"]["unique_graphs"],
            graph_break_count=sum(b.count for b in breaks), graph_breaks=breaks,
            recompiles=[Recompile(compile_id=str(m.compile_id), function=m.co_name or "", reason=m.recompile_reason)
                        for m in metrics if m.recompile_reason],
            cuda_graphs=self._cuda_graphs,
            cudagraph_skip_reasons=sorted({m.cudagraph_skip_reason for m in metrics if m.cudagraph_skip_reason}),
            steps_with_compilations=list(self._steps),
        )

    def write(self, *, final: bool) -> None:
        record = self.record(final=final)
        path = self._layout.compile_file(self._rank)
        write_bytes_atomically(strict_dumps(asdict(record), indent=1).encode(), path)
        if final and self._rank == 0:
            log.info("compile record: %d graphs, %d graph breaks, %d recompiles, %.1f s compiling: %s",
                     record.graphs, record.graph_break_count, len(record.recompiles), record.compile_time_s, path)
