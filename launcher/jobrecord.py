"""job.json: the launcher's record of a job (spec, plan, scheduler id, status, timestamps)."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from typing import Any

from ..traces.layout import RunLayout
from ..traces.writer import write_bytes_atomically
from .spec import JobSpec


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_job_record(layout: RunLayout) -> dict[str, Any]:
    try:
        return json.loads(layout.job_file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ValueError(f"{layout.job_file}: unreadable job record: {error}") from error


def write_job_record(layout: RunLayout, **fields: Any) -> dict[str, Any]:
    """Merge `fields` into job.json (created if absent), updating `updated_at`."""
    record = read_job_record(layout)
    record.update(fields)
    record["updated_at"] = now_iso()
    record.setdefault("created_at", record["updated_at"])
    write_bytes_atomically((json.dumps(record, indent=2, default=str) + "\n").encode(), layout.job_file)
    return record


def spec_record(spec: JobSpec) -> dict[str, Any]:
    """The resolved spec as JSON, with the world size readers (gather) rely on."""
    return {"spec": dataclasses.asdict(spec), "world_size": spec.world_size, "scheduler": spec.scheduler}
