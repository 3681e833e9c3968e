"""The parsed-trace cache: a second analysis of identical files reads their results instead of parsing,
gives the same report, and never trusts an entry that might be stale or unsafe."""

import json
import os
import shutil
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.per_rank import cache as result_cache
from fleetscope.analysis.per_rank.parse import parse_traces as analyze_sources
from fleetscope.analysis.inputs.resolve import resolve_input
from fleetscope.analysis.per_rank.cache import ENTRY_SUFFIX, ResultCache
from fleetscope.cli.main import main
from helpers.kineto import gpu_rank

RANKS = 3     # below the process-pool threshold: monkeypatched functions are seen by the workers' work


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    for rank in range(RANKS):
        gpu_rank(rank, world_size=RANKS, nccl_start=600 - 100 * rank).write(tmp_path / "traces" / f"rank{rank}.json")
    return tmp_path / "traces"


def _comparable(report) -> dict:
    data = report.to_json()
    data.pop("notes")
    data.pop("created_at")  # a second may pass between two analyses
    return data


def _hits(traces: Path, cache: Path) -> list[int]:
    """The ranks whose results come from the cache (misses are parsed and stored, as analyze does)."""
    outcomes = analyze_sources(resolve_input(traces).sources, cache=ResultCache(cache))
    return sorted(o.rank for o in outcomes if o.from_cache)


def _hit_note(report) -> str | None:
    return next((n for n in report.notes if "read from the parsed-trace cache" in n), None)


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{ENTRY_SUFFIX}"))


def test_second_analysis_reads_every_trace_from_the_cache_with_the_same_report(traces, tmp_path):
    cache = tmp_path / "cache"
    first = analyze(traces, use_hta=False, cache_dir=cache)
    assert _hit_note(first) is None and len(_entries(cache)) == RANKS
    second = analyze(traces, use_hta=False, cache_dir=cache)
    assert _hit_note(second).startswith(f"{RANKS} of {RANKS} trace(s) read from the parsed-trace cache")
    assert _comparable(second) == _comparable(first)
    assert _hits(traces, cache) == list(range(RANKS))


def test_a_rewritten_trace_is_parsed_again_even_with_the_same_size_and_time(traces, tmp_path):
    cache = tmp_path / "cache"
    analyze(traces, use_hta=False, cache_dir=cache)
    path = traces / "rank1.json"
    before = path.stat()
    later = gpu_rank(1, world_size=RANKS, nccl_start=300).write(tmp_path / "other.json")
    shutil.copyfile(later, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert _hits(traces, cache) == [0, 2]
    report = analyze(traces, use_hta=False, cache_dir=cache)
    assert _comparable(analyze(traces, use_hta=False, use_cache=False)) == _comparable(report)


def test_a_copied_run_hits_and_reports_its_own_paths(traces, tmp_path):
    cache = tmp_path / "cache"
    analyze(traces, use_hta=False, cache_dir=cache)
    copy = tmp_path / "copy"
    shutil.copytree(traces, copy)
    report = analyze(copy, use_hta=False, cache_dir=cache)
    assert _hit_note(report).startswith(f"{RANKS} of {RANKS}")
    outcomes = analyze_sources(resolve_input(copy).sources, cache=ResultCache(cache))
    assert all(o.from_cache and Path(o.path).parent == copy for o in outcomes)


def test_damaged_entries_are_misses_and_are_replaced(traces, tmp_path):
    cache = tmp_path / "cache"
    expected = _comparable(analyze(traces, use_hta=False, cache_dir=cache))
    for entry in _entries(cache):
        entry.write_bytes(b"not an entry")
    report = analyze(traces, use_hta=False, cache_dir=cache)
    assert _hit_note(report) is None and _comparable(report) == expected
    assert _hits(traces, cache) == list(range(RANKS))


def test_another_analysis_code_never_reads_these_entries(traces, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    analyze(traces, use_hta=False, cache_dir=cache)
    monkeypatch.setattr(result_cache, "code_digest", lambda: "a different fleetscope")
    assert _hits(traces, cache) == []


def test_a_cache_directory_others_can_write_is_not_used(traces, tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    report = analyze(traces, use_hta=False, cache_dir=cache)
    assert any("parsed-trace cache off" in n and "writable by other users" in n for n in report.notes)
    assert _entries(cache) == [] and report.complete


def test_no_cache_writes_nothing_and_the_default_comes_from_the_environment(traces, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSCOPE_CACHE_DIR", str(tmp_path / "from-env"))
    analyze(traces, use_hta=False, use_cache=False)
    assert not (tmp_path / "from-env").exists()
    analyze(traces, use_hta=False)
    assert len(_entries(tmp_path / "from-env")) == RANKS


def test_cli_analyze_no_cache_parses_again(traces, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["analyze", str(traces), "--json", str(out), "--no-hta", "--cache-dir", str(tmp_path / "c")]) == 0
    assert main(["analyze", str(traces), "--json", str(out), "--no-hta", "--cache-dir", str(tmp_path / "c")]) == 0
    assert any("read from the parsed-trace cache" in n for n in json.loads(out.read_text())["notes"])
    assert main(["analyze", str(traces), "--json", str(out), "--no-hta", "--no-cache"]) == 0
    assert not any("parsed-trace cache" in n for n in json.loads(out.read_text())["notes"])


def _replaced_entries_give_the_same_report(traces, cache, expected, tamper) -> None:
    """Tamper with every entry; the next analysis misses on each, parses again, gives the same report, and
    leaves a fresh entry of ours in its place."""
    for entry in _entries(cache):
        tamper(entry)
    report = analyze(traces, use_hta=False, cache_dir=cache)
    assert _hit_note(report) is None and _comparable(report) == expected and report.complete
    for entry in _entries(cache):
        assert entry.is_file() and not entry.is_symlink() and entry.stat().st_uid == os.getuid()
    assert _hits(traces, cache) == list(range(RANKS))


@pytest.fixture
def cached(traces, tmp_path):
    cache = tmp_path / "cache"
    return cache, _comparable(analyze(traces, use_hta=False, cache_dir=cache))


def test_a_symlinked_entry_is_not_followed_and_is_replaced(traces, cached, tmp_path):
    cache, expected = cached
    planted = tmp_path / "planted"
    planted.write_bytes(_entries(cache)[0].read_bytes())

    def link(entry):
        entry.unlink()
        entry.symlink_to(planted)

    _replaced_entries_give_the_same_report(traces, cache, expected, link)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_an_entry_owned_by_another_user_is_a_miss_and_is_replaced(traces, cached):
    cache, expected = cached
    _replaced_entries_give_the_same_report(traces, cache, expected, lambda entry: os.chown(entry, 12345, 12345))


def test_an_entry_others_can_write_is_a_miss(traces, cached):
    cache, expected = cached
    _replaced_entries_give_the_same_report(traces, cache, expected, lambda entry: entry.chmod(0o666))


def test_garbage_bytes_are_a_miss_and_are_replaced(traces, cached):
    cache, expected = cached
    _replaced_entries_give_the_same_report(traces, cache, expected, lambda entry: entry.write_bytes(os.urandom(300)))


@pytest.mark.parametrize("payload", [
    {"label": "x"},                                      # valid msgpack, a RankResult it is not
    [1, 2, 3],
    {"collectives": {"start_us": {"dtype": "|O", "shape": [1], "data": b"\x80\x04N."}}},  # object dtype
])
def test_valid_msgpack_of_the_wrong_shape_is_a_miss(traces, cached, payload):
    import msgspec

    cache, expected = cached
    _replaced_entries_give_the_same_report(
        traces, cache, expected, lambda entry: entry.write_bytes(_with_checksum(msgspec.msgpack.encode(payload))))


def test_an_entry_with_a_wrong_array_dtype_does_not_decode():
    import msgspec

    from fleetscope.analysis.per_rank.cache import decode_entry, encode_entry
    from helpers.kineto import gpu_rank as build

    assert decode_entry(b"\xc1") is None
    entry = encode_entry(_one_result(build))
    assert decode_entry(entry) is not None and decode_entry(entry[:-1] + bytes([entry[-1] ^ 1])) is None
    document = msgspec.msgpack.decode(entry[16:])
    document["collectives"]["start_us"]["dtype"] = "|O"
    assert decode_entry(_with_checksum(msgspec.msgpack.encode(document))) is None
    document["collectives"]["start_us"] = {"dtype": "<f8", "shape": [3], "data": b"\0" * 5}
    assert decode_entry(_with_checksum(msgspec.msgpack.encode(document))) is None


def _with_checksum(payload: bytes) -> bytes:
    import hashlib

    return hashlib.blake2b(payload, digest_size=16).digest() + payload


def _one_result(build):
    import tempfile

    from fleetscope.analysis.inputs.sources import TraceSource
    from fleetscope.analysis.per_rank.parse import analyze_trace

    with tempfile.TemporaryDirectory() as directory:
        path = build(0, world_size=1).write(Path(directory) / "rank0.json")
        return analyze_trace(TraceSource(path=path, label="rank0.json", window=None))


def test_merge_after_analyze_reads_every_trace_from_the_cache(tmp_path):
    """postprocess parses each trace once: merge finds analyze's entries (none is written again)."""
    from fleetscope.analysis.merge.run import merge
    from hostile_runs import make_run

    layout = make_run(tmp_path / "run", world_size=5)
    cache = tmp_path / "cache"
    analyze(layout.root, use_hta=False, cache_dir=cache)
    written = {entry.name: entry.stat().st_ino for entry in _entries(cache)}
    assert len(written) == 5
    merged = merge(layout.root, cache_dir=cache)
    assert len(merged.ranks) == 5
    assert {entry.name: entry.stat().st_ino for entry in _entries(cache)} == written
    assert _hits(layout.root, cache) == list(range(5))


def test_postprocess_gather_parses_each_trace_for_analyze_with_the_same_report(tmp_path):
    """postprocess's gather reads each trace once for itself and the parse (ParsingInspector): analyze then
    finds every trace in the cache, and its report is the one an uncached analyze gives."""
    from fleetscope.analysis.per_rank.parse import ParsingInspector
    from fleetscope.traces.gather import gather
    from hostile_runs import make_run

    layout = make_run(tmp_path / "run", world_size=5)   # above the pool threshold: gather's workers parse
    reference = analyze(layout.root, use_hta=False, use_cache=False, write_default_outputs=False)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    manifest = gather(layout.root, inspector=ParsingInspector(cache))
    assert len(manifest.traces) == 5 and len(_entries(cache)) == 5
    written = {entry.name: entry.stat().st_ino for entry in _entries(cache)}
    outcomes = []
    cached = analyze(layout.root, use_hta=False, cache_dir=cache, write_default_outputs=False, on_parsed=outcomes.extend)
    assert all(o.from_cache and o.parsed_while_gathering for o in outcomes) and len(outcomes) == 5
    assert _hit_note(cached) is None        # the report's one parse of each file: no cache note
    assert _comparable(cached) == _comparable(reference)
    assert {entry.name: entry.stat().st_ino for entry in _entries(cache)} == written
    gather(layout.root, inspector=ParsingInspector(cache))   # a second gather keeps the entries it finds
    assert {entry.name: entry.stat().st_ino for entry in _entries(cache)} == written


def test_a_trace_the_parse_cannot_use_is_still_judged_by_gather_and_explained_by_analyze(tmp_path):
    from fleetscope.analysis.per_rank.parse import ParsingInspector
    from fleetscope.traces.gather import gather
    from hostile_runs import make_run

    layout = make_run(tmp_path / "run", world_size=4)
    victim = sorted(layout.traces_dir.rglob("rank2.*"))[0]
    victim.write_bytes(b'{"traceEvents": [1, 2, 3]}')   # valid JSON, events that are not objects
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    plain = gather(layout.root)
    inspected = gather(layout.root, inspector=ParsingInspector(cache))
    assert inspected.traces == plain.traces
    assert [p.reason for p in inspected.problems] == [p.reason for p in plain.problems]
    assert len(_entries(cache)) == 3
    outcomes = []
    analyze(layout.root, use_hta=False, cache_dir=cache, write_default_outputs=False, on_parsed=outcomes.extend)
    assert sum(getattr(o, "from_cache", False) for o in outcomes) == 3


def _imports_by_parsing_the_module(path: Path, module: str) -> set[str]:
    """The reference for the import scan: every import node of the whole module's syntax tree."""
    import ast
    import importlib.util

    names = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.rpartition(".")[0]) \
                if node.level else node.module or ""
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("fleetscope.")}


@pytest.mark.parametrize("root", [result_cache.RESULT_MODULE, "fleetscope.analysis.per_rank.hta_rank",
                                  "fleetscope.analysis.analyze", "fleetscope.cli.main"])
def test_the_import_scan_of_the_code_digest_finds_what_parsing_each_module_finds(root):
    files = result_cache.result_source_files(root)
    assert len(files) > 3
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        scanned = set(result_cache._fleetscope_imports(path, module, path.name == "__init__.py"))
        assert scanned == _imports_by_parsing_the_module(path, package + ".x" if path.name == "__init__.py"
                                                         else module), module


def test_the_import_scan_follows_statements_over_lines_and_skips_prose(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        '"""Docs.\n\nfrom the trace we learn (a sentence, not an import)\nimport this is prose\n"""\n'
        "from fleetscope.traces import (\n    kineto,\n  layout)\n"
        "import fleetscope.analysis.per_rank.events as events, os\n"
        "def f():\n    from fleetscope.analysis.per_rank.steps \\\n        import find_steps  # (unbalanced\n"
        "    from . import sibling  # a comment ( with a parenthesis\n")
    found = set(result_cache._fleetscope_imports(source, "fleetscope.analysis.mod", False))
    assert found == {"fleetscope.traces", "fleetscope.traces.kineto", "fleetscope.traces.layout",
                     "fleetscope.analysis.per_rank.events", "fleetscope.analysis.per_rank.steps",
                     "fleetscope.analysis.per_rank.steps.find_steps", "fleetscope.analysis",
                     "fleetscope.analysis.sibling"}


def test_under_umask_000_entries_stay_private_and_are_used(traces, tmp_path):
    """A umask that grants everyone write would make every entry one the cache refuses to read: the cache was
    written and never used. Entries are created 0o600 whatever the umask."""
    cache = tmp_path / "cache"
    previous = os.umask(0)
    try:
        analyze(traces, use_hta=False, cache_dir=cache)
        second = analyze(traces, use_hta=False, cache_dir=cache)
    finally:
        os.umask(previous)
    assert all(entry.stat().st_mode & 0o777 == 0o600 for entry in _entries(cache))
    assert _hit_note(second).startswith(f"{RANKS} of {RANKS} trace(s) read from the parsed-trace cache")


def test_a_planted_link_in_the_staging_name_is_removed_not_followed(tmp_path):
    from fleetscope.traces.atomic import staging_path, write_bytes_atomically

    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    destination = tmp_path / "out.json"
    staging_path(destination).symlink_to(victim)
    write_bytes_atomically(b"new", destination)
    assert victim.read_text() == "keep" and destination.read_bytes() == b"new"
    assert not staging_path(destination).exists()
