"""The Python API: a run (or a directory of traces, or one trace) as typed objects, for notebooks and scripts.

    from fleetscope.analysis import open_run, diff
    run = open_run("runs/r1")
    run.report.verdict                 # the Report `fleetscope analyze` writes (analysis/report/model.py)
    run.advice.findings[0].change      # what `fleetscope advise` prints
    run.events(rank=0)                 # one rank's event table as a pandas DataFrame
    run.step_times()                   # the trace's step time per (window, step): the report's definition
    run.whole_run                      # every step of every rank (timelines), or None
    diff(run.path, "runs/r2")          # where the step's time moved (analysis/diff.py)

The command line is a layer over the same calls: analyze, advise and diff print what these return. Nothing here
writes into the run (the report files are written by `fleetscope analyze`); parsed traces come from the
parsed-trace cache when it holds them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas

    from fleetscope.analysis.advise.model import Advice
    from fleetscope.analysis.cross_rank.whole_run import WholeRun
    from fleetscope.analysis.options import AnalyzeOptions
    from fleetscope.analysis.report.model import Report

EVENT_COLUMNS = ("name", "kind", "start_us", "dur_us", "thread", "device", "correlation")
"""The columns of Run.events: the event table's (per_rank/events.py), `kind` as its name (cpu_op, kernel, ...)."""


@dataclass(frozen=True)
class Run:
    """A run directory, a directory of traces or one trace file (what `fleetscope analyze` takes)."""

    path: Path
    options: "AnalyzeOptions | None" = None
    """What the report computes (analysis/options.py); None: `fleetscope analyze`'s defaults with HTA's views off."""

    @functools.cached_property
    def report(self) -> "Report":
        """The analysis of its traces, with its run records (as `fleetscope analyze` makes it)."""
        from fleetscope.analysis.analyze import analyze
        from fleetscope.analysis.options import AnalyzeOptions

        return analyze(self.path, self.options or AnalyzeOptions(use_hta=False), write_default_outputs=False)

    @functools.cached_property
    def advice(self) -> "Advice":
        from fleetscope.analysis.advise import advise

        return advise(self.path)

    @functools.cached_property
    def whole_run(self) -> "WholeRun | None":
        """Every step of every rank from the run's timelines (None for a directory of traces)."""
        from fleetscope.analysis.cross_rank.whole_run import whole_run_section
        from fleetscope.traces.layout import RunLayout

        return whole_run_section(RunLayout.at(self.path)) if self.path.is_dir() else None

    @property
    def ranks(self) -> list[int]:
        return self.report.analyzed_ranks

    def step_times(self) -> dict[tuple[int | None, int], float]:
        """(window, step) -> the slowest rank's time of that profiled step, ms (quantities.py's definition, the one
        the report's step time is the median of)."""
        from fleetscope.analysis.quantities import trace_step_times

        return trace_step_times(self.report.windows)

    def events(self, rank: int = 0, window: int | None = None) -> "pandas.DataFrame":
        """One rank's event table (the first of its windows unless `window` names one) as a DataFrame, sorted by
        start (EVENT_COLUMNS). Raises LookupError naming the ranks there are."""
        import pandas

        from fleetscope.analysis.per_rank.events import Kind
        from fleetscope.analysis.per_rank.rank import read_decoded
        from fleetscope.traces.kineto import read_raw

        found = [r for w in self.report.windows for r in w.ranks
                 if r.rank == rank and (window is None or w.window == window)]
        if not found:
            raise LookupError(f"{self.path}: no trace of rank {rank}" + (f" in window {window}" if window is not None
                              else "") + f" (ranks: {self.ranks})")
        path = self.path / found[0].label if self.path.is_dir() else self.path   # labels are relative to the root
        table = read_decoded(path, read_raw(path, within=self.path if self.path.is_dir() else None)).events
        kinds = {int(kind): kind.name.lower() for kind in Kind}
        return pandas.DataFrame({
            "name": [table.names[i] for i in table.name_id.tolist()],
            "kind": [kinds.get(int(k), "other") for k in table.kind.tolist()],
            "start_us": table.start_us, "dur_us": table.dur_us, "thread": table.thread, "device": table.device,
            "correlation": table.correlation,
        }, columns=list(EVENT_COLUMNS))


def open_run(path: str | Path, options: "AnalyzeOptions | None" = None) -> Run:
    """A run, a directory of traces or a trace file, analyzed with `options` when its report is asked for;
    raises FileNotFoundError for a path that does not exist."""
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"{path}: no such run directory, trace directory or trace file")
    return Run(resolved, options)
