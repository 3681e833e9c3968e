"""job.json: the record of one job (spec, plan, scheduler job ids, status, timestamps).

The only writer of the file: every scheduler records through `write_job_record`, which merges fields into
what is there and replaces the file atomically, so a reader never sees a half-written record.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Any

from .layout import RunLayout
from .safe_read import read_metadata
from .writer import write_bytes_atomically
from .jsontext import strict_dumps

FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
"""Recorded statuses after which the job will not change any more."""


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_job_record(layout: RunLayout) -> dict[str, Any]:
    try:
        if not os.path.lexists(layout.job_file):
            return {}
        record = json.loads(read_metadata(layout.job_file, within=layout.root))
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"{layout.job_file}: unreadable job record: {error}") from error


def write_job_record(layout: RunLayout, **fields: Any) -> dict[str, Any]:
    """Merge `fields` into job.json (created if absent), updating `updated_at`."""
    record = read_job_record(layout)
    record.update(fields)
    record["updated_at"] = now_iso()
    record.setdefault("created_at", record["updated_at"])
    write_bytes_atomically((strict_dumps(record, indent=2, default=str) + "\n").encode(), layout.job_file)
    return record
