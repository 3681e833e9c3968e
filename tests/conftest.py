"""Shared fixtures of the test suite."""

import fnmatch
import json
import os
import tempfile
import time
from dataclasses import dataclass
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


MOE_EP_RUNS = {
    "ep4_hot": ("parallel.ep=4", "faults.hot_expert=3"),
    "ep2_dp2_hot": ("parallel.ep=2", "faults.hot_expert=2"),
    "ep4_none": ("parallel.ep=4",),
}
"""The expert-parallel cases both the MoE analysis tests (tests/test_cross_rank_moe.py) and the MoE advice tests
(tests/test_advise_moe.py) read: a hot expert on one rank, one replicated over two, none."""


@pytest.fixture(scope="session")
def moe_ep_runs(tmp_path_factory) -> Path:
    """Real 4-rank gloo runs of the trainer (tiny qwen3_moe, 6 steps, steps 2-4 profiled with shapes, no
    post-processing), one run directory per MOE_EP_RUNS case, launched once for every test that reads them."""
    from helpers import fleetscope

    out = tmp_path_factory.mktemp("moe-ep")
    for name, overrides in MOE_EP_RUNS.items():
        sets = [arg for item in (*overrides, "profiler.record_shapes=true") for arg in ("--set", item)]
        completed = fleetscope("launch", "--run-dir", str(out / name), "--nproc-per-node", "4", "--device", "cpu",
                               "--model", "qwen3_moe", "--preset", "tiny", "--steps", "6",
                               "--profile", "wait=1,warmup=1,active=3", "--no-post", *sets)
        assert completed.returncode == 0, f"{name}: {completed.stderr[-3000:]}"
    return out


@pytest.fixture(scope="session")
def families_reference(tmp_path_factory) -> Path:
    """The unsharded model every parallel layout is compared with: tests/dist_scripts/train_families.py on one
    process with the whole global batch of 8 sequences, every family, REFERENCE_STEPS steps; one run for the
    layout tests (tests/test_trainer_parallel.py, tests/test_trainer_expert_parallel.py). Its directory holds
    one folder per family."""
    from helpers import REFERENCE_STEPS, REPO, torchrun

    out = tmp_path_factory.mktemp("families-reference") / "reference"
    completed = torchrun(1, str(REPO / "tests" / "dist_scripts" / "train_families.py"), "--out", str(out),
                         "--mode", "ddp", "--tp", "1", "--ep", "1", "--batch", "8",
                         "--steps", str(REFERENCE_STEPS), timeout=900)
    assert completed.returncode == 0, f"reference:\n{completed.stderr[-4000:]}"
    return out


_engine_checked: dict = {}
"""Merged trace path -> (mtime ns, size) when it was last checked in the engine."""


@dataclass(frozen=True)
class _ScannedFolder:
    """One folder as last listed: its modification time, its sub-folders and the merged traces directly in it."""
    mtime_ns: int
    folders: tuple[str, ...]
    traces: tuple[str, ...]


_scanned: dict[str, _ScannedFolder] = {}
"""Folder path -> what its last listing found. A folder whose modification time is unchanged has the same entries,
so each check lists only the folders written since the last one (the session's temporary tree grows to tens of
thousands of files; listing all of it after each of the suite's tests cost minutes)."""

_RECENT_NS = 2_000_000_000
"""A folder modified this recently is listed again next time: file systems stamp modification times coarsely (a
clock tick), so a file added in the same tick as the listing would leave the time unchanged."""


def _list_folder(folder: str) -> _ScannedFolder | None:
    """`folder`'s sub-folders (links not followed; none in a virtual environment the suite built) and merged traces,
    or None where it vanished or cannot be read (the session's Slurm daemons remove their job folders under the same
    temporary directory at any moment)."""
    folders, traces, virtual_environment = [], [], False
    try:
        mtime_ns = os.stat(folder).st_mtime_ns
        with os.scandir(folder) as entries:
            for entry in entries:
                virtual_environment |= entry.name == "pyvenv.cfg"
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                elif fnmatch.fnmatch(entry.name, MERGED_TRACE_GLOB):
                    traces.append(entry.path)
    except OSError:
        return None
    return _ScannedFolder(mtime_ns, () if virtual_environment else tuple(folders), tuple(traces))


_finished: set[str] = set()
"""Temporary folders of tests already checked (`tmp_path`): no merged trace is written there later, so they are
not walked again."""


def _merged_traces(base: Path) -> list[Path]:
    """The merged traces under `base`, sorted; folders unchanged since their last listing are not listed again."""
    found, pending, now_ns = [], [str(base)], time.time_ns()
    while pending:
        folder = pending.pop()
        if folder in _finished:
            continue
        try:
            mtime_ns = os.stat(folder).st_mtime_ns
        except OSError:
            _scanned.pop(folder, None)
            continue
        scanned = _scanned.get(folder)
        if scanned is None or scanned.mtime_ns != mtime_ns:
            scanned = _list_folder(folder)
            if scanned is None:
                continue
            if now_ns - scanned.mtime_ns > _RECENT_NS:
                _scanned[folder] = scanned
            else:
                _scanned.pop(folder, None)
        pending.extend(scanned.folders)
        found.extend(scanned.traces)
    return sorted(Path(trace) for trace in found)


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
    if isinstance(request.node.funcargs.get("tmp_path"), Path):
        _finished.add(str(request.node.funcargs["tmp_path"]))
