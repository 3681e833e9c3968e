"""gather's cheap inspection (kineto.identify_trace) judges a file exactly as the full parse does, and so
does postprocess's gather, which identifies a file from the per-rank parse's own decode (ParsingInspector).

identify_trace decodes only event names and the identifying fields; the reference is the identity read
from the whole document (decode_trace). On intact traces, real and built, and on traces damaged the way
the fuzz tier damages them, both give the same identity, or both refuse the file with the same reason.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetscope.analysis.per_rank.parse import ParsingInspector
from fleetscope.traces.kineto import TraceReadError, _identity_of, decode_trace, identify_trace
from hostile_runs import good_rank
from test_hostile_fuzz import byte_mutations, dumps, fuzz_settings, mutate_bytes, mutate_values, value_mutations

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
NAME = Path("rank2.json")


def _outcome(identify, raw: bytes):
    try:
        return identify(raw)
    except TraceReadError as error:
        return ("refused", error.reason)


def _gathered(raw: bytes):
    """What postprocess's gather records: the identity from the parse's own decode (ParsingInspector),
    identify_trace where that decoder does not take the file."""
    inspected = ParsingInspector(Path("unused-cache")).identify(raw, NAME)
    return inspected[0] if inspected is not None else identify_trace(raw, NAME)


def _both(raw: bytes):
    cheap = _outcome(lambda data: identify_trace(data, NAME), raw)
    full = _outcome(lambda data: _identity_of(decode_trace(data, NAME)), raw)
    assert _outcome(_gathered, raw) == cheap
    return cheap, full


@pytest.mark.parametrize("fixture", ["h200-small-hf-eager-2steps.json.gz", "h200-ddp-gloo-2rank"])
def test_a_real_trace_is_identified_as_the_full_parse_identifies_it(fixture):
    path = FIXTURES / fixture
    path = path if path.is_file() else sorted(path.rglob("rank1*.json.gz"))[0]
    cheap, full = _both(path.read_bytes())
    assert cheap == full
    assert cheap.event_count > 1000 and cheap.steps


def test_a_built_trace_has_its_rank_world_size_host_and_steps():
    document = good_rank(1, world_size=4).document()
    document["host_name"] = "node7"
    identity = identify_trace(json.dumps(document).encode(), NAME)
    assert (identity.rank, identity.world_size, identity.host_name, identity.steps) == (1, 4, "node7", [1])
    assert identity.event_count == len(document["traceEvents"])


@pytest.mark.parametrize("raw", [
    b"", b"[]", b'[{"name": "ProfilerStep#3"}]', b'{"traceEvents": [1, "x", {"name": "ProfilerStep#2"}]}',
    b'{"traceEvents": {}}', b'{"nope": []}', b'{"traceEvents": [{"name": "\xff"}]}',
    b'{"traceEvents": []' , b'{"traceEvents": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'\xef\xbb\xbf{"traceEvents": []}', b'{"traceEvents": [{"name": NaN}]}',
    b'{"traceEvents": [], "distributedInfo": {"rank": 18446744073709551616, "world_size": 1e400}}',
    gzip.compress(gzip.compress(b'{"traceEvents": []}')), gzip.compress(b'{"traceEvents": [')[:-4],
], ids=lambda raw: repr(raw[:24]))
def test_odd_files_are_judged_alike(raw):
    cheap, full = _both(raw)
    assert cheap == full


@fuzz_settings(150)
@given(operations=st.one_of(byte_mutations, value_mutations), compressed=st.booleans())
def test_damaged_traces_are_judged_alike(operations, compressed):
    document = good_rank(2, world_size=3).document()
    if isinstance(operations[0][0], str):
        data = mutate_bytes(json.dumps(document).encode(), operations)
    else:
        data = dumps(mutate_values(document, operations))
    cheap, full = _both(gzip.compress(data, mtime=0) if compressed else data)
    assert cheap == full
