"""The report's `whole_run` section: every step of every rank from the whole-run timelines, no traces.

Sources, per rank: `metrics/rank<R>.timeline` (traces/timeline.py), else its step metrics
`metrics/rank<R>.jsonl` (older runs: no start times, so no lateness for that rank). A file that cannot be
used is named in `notes` and the other ranks are analyzed.

Definitions (steady steps and the slowest rank per step as analysis/quantities.py defines step time):
  steady step          traces/formats.py is_steady: not the rank's first (FLAG_FIRST, or its lowest step), not profiled
  median step time     per step, the median over ranks of their steady step_ms
  peers' median        per step, the median of a value over the other ranks that know it (leaving the rank
                       out: of two ranks, the median of both would halve a straggler's excess)
  excess               a rank's value less its peers' median that step, ms, in three signals: step time
                       (step_ms), input wait (data_ms), late at the first collective (its aligned arrival at
                       the first collective); under synchronous data parallelism the peers wait for a
                       straggler inside their own steps, so every rank's step time rises together and only
                       the input wait or the arrival shows who they wait for
  signal noise         per rank and signal, the robust step-to-step spread of its excess (MAD of successive
                       differences: a level shift moves one of them) over the run's first STEP_BLOCK steps,
                       at least NOISE_FLOOR of the median step time
  excess level         1 + the noise-weighted mean of a rank's known excesses that step (each signal weighted by
                       1 / its noise on that rank) over the median step time: the series whose change points
                       (traces/change_points.py) delimit the segments. A mean, not the largest: the largest of
                       a step time level with the peers' and an arrival spread around it is half-rectified
                       noise, which the search's robust noise scale underrates. Weighted: with equal weights a
                       signal that is noise on this host (arrivals spread by +-40 ms on a loaded machine)
                       drowns a clean one (a late input of 40 ms), and 1 / noise makes the mean's shift, in its
                       own noise, that of the signal that moved. A segment is looked at when its level is
                       SLOW_EXCESS x the smallest weight share up (what one signal SLOW_EXCESS up makes of the
                       mean), then sized per signal
  slow rank            a segment at least SLOW_EXCESS above its peers for at least MIN_SLOW_STEPS steady steps
                       (SHORT_SLOW_STEPS when it stands SHORT_SIGMAS noise scales high),
                       named by the signal with the largest median excess over it and sized as that excess
                       in percent of the median rank's steady step time before the change
  profiled window      a run of consecutive steps that some rank recorded with FLAG_PROFILED

Scale: records are read in blocks of STEP_BLOCK steps across all ranks (a few hundred MB at most at 1,024
ranks); what stays for the whole run is one float16 log excess level per rank and step, per-step figures
(with each signal's order statistics, for the peers' median), and the binned heatmaps. A block's ranks are
read, and its steps figured in chunks of CHUNK_VALUES, on WORKERS threads. A timeline's records are checked
as the pass reads them (read_timeline checks every record as it opens the file, which cost a fifth of the
analysis): one with a record that cannot be true has the whole run read again the checked way, so that the
record is named and left out exactly as before. The change-point search runs once per rank, on the excess
level, not once per signal: at 1,024 ranks x 100,000 steps each search costs ~5 ms, so per signal it would
cost ~10 s more (bench/whole_run_scale.py).

Modules, in the order the data flows: scan.py (each rank's records read block by block, checked, accumulated on
WORKERS threads), statistics.py (per-step order statistics: the median and each rank's excess over its peers),
episodes.py (slow-rank episodes from each rank's change points), sentences.py (what the section says),
section.py (whole_run_section: the scan's figures made into the report's WholeRun); model.py holds the types and
the tuning constants. The public names are re-exported here.
"""

from __future__ import annotations

from fleetscope.analysis.cross_rank.whole_run.model import (
    CHUNK_VALUES,
    CONSISTENT_STEPS_SHARE,
    EVIDENCE_SOURCE,
    MAX_CHANGES_SHOWN,
    MAX_RANK_BINS,
    MAX_STEP_BINS,
    MIN_CHANGE_LEVEL,
    MIN_NOISE_VALUES,
    MIN_SLOW_STEPS,
    NOISE_FLOOR,
    PROFILE_STEPS,
    SHORT_SIGMAS,
    SHORT_SLOW_STEPS,
    SLOW_EXCESS,
    SOURCE_JSONL,
    SOURCE_TIMELINE,
    STATUS_NOT_RECORDED,
    STATUS_OK,
    STEP_BLOCK,
    WORKERS,
    ChangePoint,
    Heatmap,
    SlowRank,
    WholeRun,
    WindowCheck,
    largest_episode,
    run_straggler,
    sized_changes,
    window_label,
)
from fleetscope.analysis.cross_rank.whole_run.scan import (
    CAUSE_SLACK,
    SIGNAL_ARRIVAL,
    SIGNAL_DATA,
    SIGNAL_STEP,
    SIGNALS,
    SIGNALS_BY_CAUSE,
)
from fleetscope.analysis.cross_rank.whole_run.section import MAX_STEP_GAP, whole_run_section
from fleetscope.analysis.cross_rank.whole_run.sentences import RecordSuggestion

__all__ = [
    "CAUSE_SLACK", "CHUNK_VALUES", "CONSISTENT_STEPS_SHARE", "EVIDENCE_SOURCE", "MAX_CHANGES_SHOWN", "MAX_RANK_BINS",
    "MAX_STEP_BINS", "MAX_STEP_GAP", "MIN_CHANGE_LEVEL", "MIN_NOISE_VALUES", "MIN_SLOW_STEPS", "NOISE_FLOOR",
    "PROFILE_STEPS", "SHORT_SIGMAS", "SHORT_SLOW_STEPS", "SIGNALS", "SIGNALS_BY_CAUSE", "SIGNAL_ARRIVAL",
    "SIGNAL_DATA", "SIGNAL_STEP", "SLOW_EXCESS", "SOURCE_JSONL", "SOURCE_TIMELINE", "STATUS_NOT_RECORDED",
    "STATUS_OK", "STEP_BLOCK", "WORKERS", "ChangePoint", "Heatmap", "RecordSuggestion", "SlowRank", "WholeRun",
    "WindowCheck", "largest_episode", "run_straggler", "sized_changes", "whole_run_section", "window_label",
]
