"""Shared fixtures of the test suite."""

import fnmatch
import json
import os
import tempfile
from pathlib import Path

import pytest

from helpers import check_in_engine, trace_processor
from helpers.slurm_cluster import slurm_cluster  # noqa: F401  (session fixture: a real local Slurm cluster)

MERGED_TRACE_GLOB = "*.perfetto-trace"


def pytest_configure(config):
    config.addinivalue_line("markers", "damaged_trace: the test damages a merged trace on purpose (no engine check)")
    # Every report and advice fleetscope builds during the suite, in this process or any it starts, is checked
    # against analysis/invariants.py; the violations land here and fail the test that caused them.
    os.environ.setdefault("FLEETSCOPE_INVARIANTS_LOG", tempfile.mkdtemp(prefix="fleetscope-invariants-"))


_violations_read: dict = {}
"""Violation file -> bytes already reported."""


@pytest.fixture(autouse=True)
def reports_keep_their_invariants():
    """After each test, every report and advice built since the last check kept analysis/invariants.py's rules."""
    yield
    found = []
    for log in sorted(Path(os.environ["FLEETSCOPE_INVARIANTS_LOG"]).glob("violations-*.jsonl")):
        data = log.read_bytes()
        new, _violations_read[log] = data[_violations_read.get(log, 0):], len(data)
        found += [json.loads(line) for line in new.decode().splitlines() if line.strip()]
    assert not found, "invariants broken:\n" + "\n".join(
        f"{v['kind']} {v['path']}: " + "; ".join(v["problems"][:5]) for v in found)


@pytest.fixture(autouse=True)
def private_parsed_trace_cache(tmp_path_factory, monkeypatch):
    """Each test analyzes with an empty parsed-trace cache of its own (never the user's ~/.cache), so
    no test sees results another one stored; subprocesses inherit it through the environment."""
    monkeypatch.setenv("FLEETSCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("parsed-trace-cache")))


_engine_checked: dict = {}
"""Merged trace path -> (mtime ns, size) when it was last checked in the engine."""


def _merged_traces(base: Path) -> list[Path]:
    """The merged traces under `base`, sorted. os.walk passes over a folder that vanishes while it is walked (the
    session's Slurm daemons remove their job folders under the same temporary directory at any moment), where
    Path.rglob raises FileNotFoundError."""
    return sorted(Path(folder) / name for folder, _, names in os.walk(base)
                  for name in fnmatch.filter(names, MERGED_TRACE_GLOB))


@pytest.fixture(autouse=True)
def merged_traces_pass_the_engine(request, tmp_path_factory):
    """After each test, every merged trace written under the session's temporary directories since the
    last check (by the test, its fixtures or the processes it ran: merge, postprocess, demo) is loaded
    in Perfetto's trace processor and compared with its read-back (tests/helpers/__init__.py:check_in_engine).
    Does nothing where no trace processor is found (tests/test_merge_verify.py skips with a reason)."""
    yield
    if trace_processor() is None:
        return
    damaged = request.node.get_closest_marker("damaged_trace") is not None
    for trace in _merged_traces(tmp_path_factory.getbasetemp()):
        if trace.is_symlink() or not trace.is_file():
            continue  # the merge never writes through a link (tests plant them to check it refuses)
        try:
            stat = trace.stat()
        except FileNotFoundError:
            continue  # removed since the walk listed it
        if _engine_checked.get(trace) == (stat.st_mtime_ns, stat.st_size):
            continue
        _engine_checked[trace] = (stat.st_mtime_ns, stat.st_size)
        if not damaged:
            check_in_engine(trace)
