"""The run directory: the one contract between launcher, trainer, traces and analysis.

Every path a writer or a reader uses is built here, so the two can never disagree.

    <run_dir>/
      job.json                 resolved job spec, launch plan, scheduler job id, status
      manifest.json            every trace (rank, host, window, steps, bytes, sha256), missing ranks
      metrics/rank<R>.jsonl    one JSON line per step
      metrics/rank<R>.compile.json   torch.compile record of that rank (graphs, breaks, recompiles)
      metrics/rank<R>.moe.jsonl      MoE routing records: one JSON line per (step, MoE layer)
      traces/<window>/rank<R>.<host>.pt.trace.json.gz
      clock/rank<R>.json       this rank's clock offset to rank 0
      logs/                    per-rank stdout/stderr
      report/                  report.json, report.html, merged.perfetto-trace
      checkpoints/
      memory/rank<R>.<when>.pickle   CUDA allocator snapshots (open at pytorch.org/memory_viz)
      requests/request<N>.json        on-demand profiling requests (`fleetscope profile`); .status.json beside
      captures/window<NNN>.json       why an unplanned window was recorded (requested or triggered)
      flight_recorder/rank<R>.json    Flight Recorder dump of a rank; hang.rank<R>.json: who saw no progress
      cache/parsed-traces/            the parsed-trace cache of a parse fanned out over Slurm (shared storage)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

JOB_FILE = "job.json"
MANIFEST_FILE = "manifest.json"
METRICS_DIR = "metrics"
TRACES_DIR = "traces"
CLOCK_DIR = "clock"
LOGS_DIR = "logs"
REPORT_DIR = "report"
CHECKPOINTS_DIR = "checkpoints"
MEMORY_DIR = "memory"
REQUESTS_DIR = "requests"
CAPTURES_DIR = "captures"
FLIGHT_RECORDER_DIR = "flight_recorder"
COMPILE_SUFFIX = ".compile.json"
MOE_SUFFIX = ".moe.jsonl"
STEP_METRICS_RE = re.compile(r"^rank(?P<rank>\d+)\.jsonl$")
TIMELINE_SUFFIX = ".timeline"
TIMELINE_RE = re.compile(r"^rank(?P<rank>\d+)%s$" % re.escape(TIMELINE_SUFFIX))
RECORD_FILE_RE = re.compile(r"^rank(?P<rank>\d+)(?:\.jsonl|%s|%s|%s)$"
                            % (re.escape(TIMELINE_SUFFIX), re.escape(COMPILE_SUFFIX), re.escape(MOE_SUFFIX)))
"""Any of a rank's record files under metrics/: step metrics, timeline, compile record, MoE records."""
"""Step-metrics files only: `rank*.jsonl` as a glob also matches `rank<R>.moe.jsonl`."""

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
MERGED_TRACE = "merged.perfetto-trace"
MERGED_JSON = "merged.trace.json.gz"

TRACE_SUFFIX = ".pt.trace.json.gz"
WINDOW_FORMAT = "window{index:03d}"
TRACE_NAME_FORMAT = "rank{rank}.{host}{attempt}" + TRACE_SUFFIX

# Host names end up in file names: keep them to a safe alphabet.
_UNSAFE_HOST_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
TRACE_NAME_RE = re.compile(
    r"^rank(?P<rank>\d+)\.(?P<host>[A-Za-z0-9_.-]+?)(?:\.attempt(?P<attempt>\d+))?"
    + re.escape(TRACE_SUFFIX)
    + "$"
)
WINDOW_RE = re.compile(r"^window(?P<index>\d+)$")


def safe_host(host: str) -> str:
    """A host name usable inside a file name (no separators, no shell metacharacters)."""
    cleaned = _UNSAFE_HOST_CHARS.sub("_", host).strip(".")
    return cleaned or "unknown-host"


def window_name(index: int) -> str:
    if index < 0:
        raise ValueError(f"window index must be >= 0, got {index}")
    return WINDOW_FORMAT.format(index=index)


def trace_file_name(rank: int, host: str, attempt: int = 0) -> str:
    """`rank3.node7.pt.trace.json.gz`; a requeued attempt adds `.attempt1` so nothing is overwritten."""
    suffix = f".attempt{attempt}" if attempt else ""
    return TRACE_NAME_FORMAT.format(rank=rank, host=safe_host(host), attempt=suffix)


@dataclass(frozen=True)
class ParsedTraceName:
    rank: int
    host: str
    attempt: int


def parse_trace_file_name(name: str) -> ParsedTraceName | None:
    match = TRACE_NAME_RE.match(name)
    if match is None:
        return None
    return ParsedTraceName(
        rank=int(match["rank"]), host=match["host"], attempt=int(match["attempt"] or 0)
    )


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one run directory. Pure: constructing it touches no file."""

    root: Path

    @classmethod
    def at(cls, root: str | Path) -> "RunLayout":
        return cls(Path(root).expanduser().absolute())

    @property
    def job_file(self) -> Path:
        return self.root / JOB_FILE

    @property
    def manifest_file(self) -> Path:
        return self.root / MANIFEST_FILE

    @property
    def metrics_dir(self) -> Path:
        return self.root / METRICS_DIR

    @property
    def traces_dir(self) -> Path:
        return self.root / TRACES_DIR

    @property
    def clock_dir(self) -> Path:
        return self.root / CLOCK_DIR

    @property
    def logs_dir(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def report_dir(self) -> Path:
        return self.root / REPORT_DIR

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def report_json(self) -> Path:
        return self.report_dir / REPORT_JSON

    @property
    def report_html(self) -> Path:
        return self.report_dir / REPORT_HTML

    @property
    def merged_trace(self) -> Path:
        return self.report_dir / MERGED_TRACE

    @property
    def merged_json(self) -> Path:
        return self.report_dir / MERGED_JSON

    @property
    def memory_dir(self) -> Path:
        return self.root / MEMORY_DIR

    def memory_snapshot(self, rank: int, when: str) -> Path:
        return self.memory_dir / f"rank{rank}.{when}.pickle"

    def metrics_file(self, rank: int) -> Path:
        return self.metrics_dir / f"rank{rank}.jsonl"

    def compile_file(self, rank: int) -> Path:
        """`metrics/rank<R>.compile.json`: the rank's compilation record (trainer/compile_record.py)."""
        return self.metrics_dir / f"rank{rank}{COMPILE_SUFFIX}"

    def moe_file(self, rank: int) -> Path:
        """`metrics/rank<R>.moe.jsonl`: the rank's MoE routing records (traces/formats.py MoeRecord)."""
        return self.metrics_dir / f"rank{rank}{MOE_SUFFIX}"

    def step_metrics_files(self) -> list[Path]:
        """Every `metrics/rank<R>.jsonl`, by rank (never the .moe.jsonl or .compile.json records)."""
        if not self.metrics_dir.is_dir():
            return []
        found = [(int(m["rank"]), p) for p in self.metrics_dir.iterdir() if (m := STEP_METRICS_RE.match(p.name))]
        return [p for _, p in sorted(found)]

    def timeline_file(self, rank: int) -> Path:
        """`metrics/rank<R>.timeline`: one binary record per step of the rank (traces/timeline.py)."""
        return self.metrics_dir / f"rank{rank}{TIMELINE_SUFFIX}"

    def timeline_ranks(self) -> list[int]:
        """Ranks with a `metrics/rank<R>.timeline` entry, from one listing of the folder, in rank order."""
        return sorted(rank for rank, pattern in self._record_names() if pattern is TIMELINE_RE)

    def ranks_with_records(self) -> set[int]:
        """Ranks with any record file under metrics/, from one listing of the folder: readers iterate over
        these rather than stat three paths per rank of a declared world size (2^20 of them in a forged job)."""
        return {rank for rank, pattern in self._record_names() if pattern is RECORD_FILE_RE}

    def _record_names(self) -> list[tuple[int, re.Pattern]]:
        """(rank, pattern) for every metrics/ entry named by RECORD_FILE_RE, and again for TIMELINE_RE."""
        try:
            names = [entry.name for entry in os.scandir(self.metrics_dir)]
        except OSError:
            return []
        return [(int(m["rank"]), pattern) for name in names for pattern in (RECORD_FILE_RE, TIMELINE_RE)
                if (m := pattern.match(name))]

    def clock_file(self, rank: int) -> Path:
        return self.clock_dir / f"rank{rank}.json"

    def window_dir(self, window: int) -> Path:
        return self.traces_dir / window_name(window)

    def trace_file(self, window: int, rank: int, host: str, attempt: int = 0) -> Path:
        return self.window_dir(window) / trace_file_name(rank, host, attempt)

    @property
    def requests_dir(self) -> Path:
        return self.root / REQUESTS_DIR

    def request_file(self, number: int) -> Path:
        """`requests/request<N>.json`: one on-demand profiling request (traces/capture.py)."""
        return self.requests_dir / f"request{number}.json"

    def request_status_file(self, number: int) -> Path:
        """`requests/request<N>.status.json`: what became of request N (written by rank 0)."""
        return self.requests_dir / f"request{number}.status.json"

    @property
    def captures_dir(self) -> Path:
        return self.root / CAPTURES_DIR

    def capture_record(self, window: int) -> Path:
        """`captures/window<NNN>.json`: why unplanned window NNN was recorded."""
        return self.captures_dir / f"{window_name(window)}.json"

    @property
    def flight_recorder_dir(self) -> Path:
        return self.root / FLIGHT_RECORDER_DIR

    def flight_recorder_file(self, rank: int) -> Path:
        """`flight_recorder/rank<R>.json`: the rank's Flight Recorder entries (traces/flight_recorder.py)."""
        return self.flight_recorder_dir / f"rank{rank}.json"

    def hang_marker(self, rank: int) -> Path:
        """`flight_recorder/hang.rank<R>.json`: rank R saw no step progress for too long."""
        return self.flight_recorder_dir / f"hang.rank{rank}.json"

    @property
    def dump_request_flag(self) -> Path:
        """`flight_recorder/dump-requested`: present once any rank asks every rank to dump."""
        return self.flight_recorder_dir / "dump-requested"

    def is_run_dir(self) -> bool:
        """A run directory has a job file, a manifest, or a traces/ folder."""
        return (
            self.job_file.is_file()
            or self.manifest_file.is_file()
            or self.traces_dir.is_dir()
        )

    def relative(self, path: Path) -> str:
        """Manifest paths are relative to the run directory so the directory can move."""
        return Path(path).absolute().relative_to(self.root).as_posix()


# Scheduler logs inside <run>/logs/: the launcher writes them, `fleetscope status` and `logs` read them.
SLURM_LOGS_SUBDIR = "slurm"
"""Slurm's own logs (batch scripts, per-task stdout/stderr): <run>/logs/slurm/."""
SUBMITIT_ERRORS_FORMAT = "submitit-{job_id}"
"""submitit ranks' error files: <run>/logs/submitit-<job>/attempt_<K>/<rank>/error.json (torchrun's layout)."""
TORCHX_NODE_LOGS_FORMAT = "torchx-node{replica}"
"""torchrun's per-node log tree under TorchX: <run>/logs/torchx-node<N>/<rdzv id>_*/attempt_<K>/<local rank>/."""
TORCHX_LOCAL_LOGS_SUBDIR = "torchx-local"


def slurm_logs_dir(layout: RunLayout) -> Path:
    return layout.logs_dir / SLURM_LOGS_SUBDIR


def submitit_error_file(layout: RunLayout, job_id: str, attempt: str, rank: int) -> Path:
    return layout.logs_dir / SUBMITIT_ERRORS_FORMAT.format(job_id=job_id) / f"attempt_{attempt}" / str(rank) / "error.json"


def submitit_rank_stderr(layout: RunLayout, job_id: str, rank: int) -> Path:
    """submitit's stderr of one task: <run>/logs/slurm/<job>_<rank>_log.err."""
    return slurm_logs_dir(layout) / f"{job_id}_{rank}_log.err"


def torchx_node_logs_dir(layout: RunLayout, replica: str) -> Path:
    return layout.logs_dir / TORCHX_NODE_LOGS_FORMAT.format(replica=replica)


def torchx_local_logs_dir(layout: RunLayout) -> Path:
    return layout.logs_dir / TORCHX_LOCAL_LOGS_SUBDIR


PARSED_TRACE_CACHE_SUBDIR = "cache/parsed-traces"
"""The parsed-trace cache a Slurm fan-out fills by default: on the run directory's filesystem, which every
node already sees (the traces are read from it)."""
FANOUT_FORMAT = "fanout-{array_job_id}"
"""One fan-out's records: <run>/logs/slurm/fanout-<array job>/task<I>.json and reduce.json."""
FANOUT_TASK_LOG_PATTERN = "fanout-%A_%a.out"
"""sbatch's pattern of an array task's log (%A: array job, %a: task), in <run>/logs/slurm/."""


def parsed_trace_cache_dir(layout: RunLayout) -> Path:
    return layout.root / PARSED_TRACE_CACHE_SUBDIR


def fanout_dir(layout: RunLayout, array_job_id: str) -> Path:
    return slurm_logs_dir(layout) / FANOUT_FORMAT.format(array_job_id=array_job_id)


def fanout_task_record(layout: RunLayout, array_job_id: str, task: int) -> Path:
    return fanout_dir(layout, array_job_id) / f"task{task}.json"


def fanout_reduce_record(layout: RunLayout, array_job_id: str) -> Path:
    return fanout_dir(layout, array_job_id) / "reduce.json"


def fanout_task_log(layout: RunLayout, array_job_id: str, task: int) -> Path:
    """What FANOUT_TASK_LOG_PATTERN expands to for one task."""
    name = FANOUT_TASK_LOG_PATTERN.replace("%A", array_job_id).replace("%a", str(task))
    return slurm_logs_dir(layout) / name


COLLECTED_SUBDIR = "collected"
"""Claims of traces filed by `--collect-traces` (traces/collect.py): <run>/logs/collected/."""


def collected_claim(layout: RunLayout, window: int, rank: int, digest: str) -> Path:
    """The claim one collected file's content makes on its rank and window (created exclusively, once)."""
    return layout.logs_dir / COLLECTED_SUBDIR / f"{window_name(window)}.rank{rank}.{digest[:32]}"


def run_holding_traces(path: str | Path) -> Path | None:
    """The run directory (one with a job file or a manifest) whose traces/ holds `path`, symlinks resolved;
    None when `path` lies in no run's traces/."""
    real = Path(os.path.realpath(path))
    for folder in real.parents:
        run = RunLayout.at(folder.parent)
        if folder.name == TRACES_DIR and (run.job_file.is_file() or run.manifest_file.is_file()):
            return run.root
    return None
