"""What makes two runs the same job: compare, the gate and history compare like with like.

A run's identity is read from its job.json (traces/jobfile.py) and, for the world size, from its report:
world size, model (family, preset, config path), parallel layout (mode, tp, ep, pp, dp_replicate), batch,
sequence length, gradient accumulation, precision and device of fleetscope's trainer; for a user program
(`launch -- PROGRAM ...`), the program and its arguments. Only fields both sides record are compared: a
report.json alone knows its world size, nothing else.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from fleetscope.traces.jobfile import read_job_record
from fleetscope.traces.layout import RunLayout
from fleetscope.traces.validate import UsageError

TRAINER_FIELDS = (
    ("model", "family"), ("model", "preset"), ("model", "path"),
    ("parallel", "mode"), ("parallel", "tp"), ("parallel", "ep"), ("parallel", "pp"), ("parallel", "dp_replicate"),
    ("data", "batch_size"), ("data", "seq_len"), ("optim", "accumulation_steps"),
    ("performance", "precision"), ("performance", "device"),
)
"""Trainer settings that change what a step computes (job.json spec.train)."""
MAX_VALUE_CHARS = 120


def job_identity(run_dir: str | Path | None, world_size: int | None = None) -> dict[str, str]:
    """Field -> value (as text) of one run; `world_size` from its report when job.json has none."""
    identity: dict[str, str] = {}
    record = read_job_record(RunLayout.at(run_dir)) if run_dir is not None else {}
    size = record.get("world_size") if _is_int(record.get("world_size")) else world_size
    if _is_int(size):
        identity["world size"] = str(size)
    spec = record.get("spec") if isinstance(record.get("spec"), dict) else {}
    entry = spec.get("entry")
    if isinstance(entry, dict):
        identity["program"] = program_text(entry)
        return identity
    train = spec.get("train") if isinstance(spec.get("train"), dict) else {}
    for section, name in TRAINER_FIELDS:
        values = train.get(section)
        if isinstance(values, dict) and name in values and isinstance(values[name], (str, int, float, bool)):
            identity[f"{section}.{name}"] = _text(str(values[name]))
    return identity


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def program_text(entry: dict) -> str:
    """A user program as job.json's `entry` records it ("/opt/train.py --lr 1e-3"), printable and bounded."""
    args = entry.get("args") if isinstance(entry.get("args"), list) else []
    words = [entry.get("program"), *args]
    return _text(" ".join(shlex.quote(str(w)) for w in words if w is not None) or "unknown program")


def _text(value: str) -> str:
    """Printable and bounded: job.json is anyone's file."""
    clean = "".join(c if c.isprintable() else "?" for c in value)
    return clean if len(clean) <= MAX_VALUE_CHARS else clean[: MAX_VALUE_CHARS - 3] + "..."


def identity_differences(identities: list[dict[str, str]]) -> dict[str, list[str]]:
    """Field -> its distinct values, for each field every identity records and they do not agree on."""
    if len(identities) < 2:
        return {}
    shared = set(identities[0]).intersection(*identities[1:])
    differences = {}
    for name in sorted(shared, key=lambda n: (n != "world size", n)):
        values = list(dict.fromkeys(identity[name] for identity in identities))
        if len(values) > 1:
            differences[name] = values
    return differences


def differences_text(differences: dict[str, list[str]]) -> str:
    return "; ".join(f"{name}: {' vs '.join(values)}" for name, values in differences.items())


class DifferentJobs(UsageError):
    """The runs are not the same job (a refusal: exit 2)."""

    def __init__(self, differences: dict[str, list[str]]):
        self.differences = differences
        super().__init__(f"REFUSED: the runs are different jobs ({differences_text(differences)}); "
                         "--allow-different-jobs compares them anyway")
