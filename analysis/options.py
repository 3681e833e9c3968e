"""What an analysis computes and how: one typed set of options, taken by analyze(), postprocess() and the library.

The command line builds it from its flags (cli/analysis_args.py); the per-call plumbing (where the report is
written, progress callbacks, records already read) stays keyword arguments of analyze() itself.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from fleetscope.analysis.cross_rank.stragglers import DEFAULT_MIN_LATENESS_US
from fleetscope.analysis.per_rank.names import comm_kernel_rule
from fleetscope.analysis.report.build import DEFAULT_HTA_MAX_RANKS, HTA_RANKS_ALL, HTA_RANKS_AUTO


@dataclass(frozen=True, kw_only=True, slots=True)
class AnalyzeOptions:
    """The options of one analysis (the defaults are `fleetscope analyze`'s)."""

    use_hta: bool = True
    """Run Holistic Trace Analysis' views on GPU windows (CLI: off with --no-hta)."""
    hta_ranks: str | tuple[int, ...] = HTA_RANKS_AUTO
    """The ranks HTA's views cover: auto (the ranks the report points at), all, or these ranks (--hta-ranks)."""
    hta_max_ranks: int = DEFAULT_HTA_MAX_RANKS
    """With hta_ranks auto: at most this many ranks per window."""
    hta_oracle: bool = False
    """Also run stock HTA's analyzers on the same ranks and record how far apart they are (--hta-oracle)."""
    use_cache: bool = True
    """Reuse parsed traces of identical trace files (CLI: off with --no-cache)."""
    cache_dir: Path | None = None
    """The parsed-trace cache; None: per_rank/cache.py default_cache_dir() (--cache-dir)."""
    workers: int | None = None
    """Processes that parse traces at once; None: chosen from the cores and the number of traces."""
    min_lateness_us: float = DEFAULT_MIN_LATENESS_US
    """A rank later than its peers by less than this is not called a straggler."""
    link_peak_gbps: float | None = None
    """Peak bus bandwidth of the links in GB/s; None: the table of known links (--link-peak)."""
    comm_kernel_pattern: str | None = None
    """Kernels matching this regular expression communicate too, besides NCCL's (--comm-kernel-pattern)."""

    def __post_init__(self) -> None:
        if isinstance(self.hta_ranks, list):  # a list given by a caller: kept as a tuple, the options stay hashable
            object.__setattr__(self, "hta_ranks", tuple(self.hta_ranks))
        if isinstance(self.hta_ranks, str) and self.hta_ranks not in (HTA_RANKS_AUTO, HTA_RANKS_ALL):
            raise ValueError(f"hta_ranks: {HTA_RANKS_AUTO!r}, {HTA_RANKS_ALL!r} or a list of ranks, "
                             f"got {self.hta_ranks!r}")
        if self.hta_max_ranks < 1:
            raise ValueError(f"hta_max_ranks must be >= 1, got {self.hta_max_ranks}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not math.isfinite(self.min_lateness_us) or self.min_lateness_us < 0:
            raise ValueError(f"min_lateness_us must be a finite number >= 0, got {self.min_lateness_us}")
        if self.link_peak_gbps is not None and not (math.isfinite(self.link_peak_gbps) and self.link_peak_gbps > 0):
            raise ValueError(f"link_peak_gbps must be a finite number > 0, got {self.link_peak_gbps}")
        comm_kernel_rule(self.comm_kernel_pattern)  # an invalid pattern fails here, before any work

    @property
    def hta_rank_choice(self) -> str | list[int]:
        """hta_ranks as the HTA stage takes it (auto, all, or a list)."""
        return self.hta_ranks if isinstance(self.hta_ranks, str) else list(self.hta_ranks)


OPTION_NAMES = frozenset(field.name for field in dataclasses.fields(AnalyzeOptions))


def with_overrides(options: AnalyzeOptions, overrides: dict) -> AnalyzeOptions:
    """`options` with the keyword arguments of analyze()'s older spelling (use_hta=False, ...) applied; a name
    that is no field of AnalyzeOptions is a TypeError, as for any unknown keyword."""
    if not isinstance(options, AnalyzeOptions):
        raise TypeError(f"options must be AnalyzeOptions, got {type(options).__name__}")
    unknown = sorted(set(overrides) - OPTION_NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)} (AnalyzeOptions fields: "
                        f"{', '.join(sorted(OPTION_NAMES))})")
    return dataclasses.replace(options, **overrides) if overrides else options
