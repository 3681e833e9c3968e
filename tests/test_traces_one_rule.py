"""One rule of steadiness, one finiteness check, one parse of a step-metrics line.

The package is scanned with `ast`: a second definition of either rule fails here, with the file and line, so
a reader that needs "is this a steady step" or "is this a finite number" asks traces/formats.py `is_steady` /
`steady` or traces/validate.py `finite` instead of writing its own. Then StepRecord's parser is fed hostile
lines: none may raise, each is a record of finite numbers or a reason.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
from pathlib import Path

import pytest
from fleetscope.traces.formats import MAX_STEP, StepRecord, is_steady, parse_step_record, steady

ROOT = Path(__file__).resolve().parents[1]
NOT_THE_PACKAGE = {"tests", "bench", "docs", "build", "dist", "slurm"}
"""Tests and benchmarks check and measure; they define no rule the analysis reads."""

STEADY_HOME = "traces/formats.py"
STEADY_RULES = {"is_steady", "steady"}
FINITE_HOME = "traces/validate.py"
FINITE_RULES = {"finite"}
OLD_NAMES = {("traces/validate.py", "finite_number"), ("traces/validate.py", "is_finite_number")}
"""Aliases of `finite` / `is_bounded_number` (no second definition) kept for analysis/merge/'s readers."""

SCALAR_CHECKS_LEFT = {"cli/": 4, "trainer/config.py": 4, "analysis/options.py": 2, "analysis/merge/": 1}
"""Scalar finiteness checks of their own under these paths, which other owners are changing this round
(argument and config validation, the merged trace's check): counted so none is added; each goes to `finite`
with its owner's next change. Lower a count when one goes; never raise one."""

_RULE_NAME = re.compile(r"steady|finite", re.IGNORECASE)


def package_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not ({".venv", "__pycache__"} | NOT_THE_PACKAGE) & set(p.relative_to(ROOT).parts[:1] + p.parts)
                  and not p.relative_to(ROOT).parts[0].startswith("."))


@functools.cache
def parsed() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), filename=str(p)) for p in package_files()}


def _called_names(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            target = call.func
            names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _defined_names(tree: ast.Module) -> list[tuple[str, int, ast.AST]]:
    """(name, line, node) of every function defined anywhere in the module and every module-level name bound to
    a lambda or to another name (a function under a second name; type aliases and constants are not rules)."""
    found = [(n.name, n.lineno, n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.value, (ast.Lambda, ast.Name, ast.Attribute)):
            found += [(t.id, statement.lineno, statement) for t in statement.targets if isinstance(t, ast.Name)]
    return found


def test_the_package_is_scanned():
    files = parsed()
    assert STEADY_HOME in files and FINITE_HOME in files and "analysis/gate.py" in files and len(files) > 100


def test_the_rules_are_defined_in_their_home():
    defined = {path: {name for name, _, _ in _defined_names(tree)} for path, tree in parsed().items()}
    assert STEADY_RULES <= defined[STEADY_HOME] and FINITE_RULES <= defined[FINITE_HOME]


def test_no_second_steadiness_rule_or_finiteness_helper():
    """A function (or module-level name) named for steadiness or finiteness outside the rule's home must take
    its answer from the rule: it calls `is_steady` / `steady` / `finite`, or another such reader that does
    (gate.py's steady_metrics reads the steady records through steady())."""
    candidates = {}
    for path, tree in parsed().items():
        for name, line, node in _defined_names(tree):
            if not _RULE_NAME.search(name) or (path, name) in OLD_NAMES:
                continue
            if (path == STEADY_HOME and name in STEADY_RULES) or (path == FINITE_HOME and name in FINITE_RULES):
                continue
            candidates[(path, name, line)] = _called_names(node)
    delegating = set()
    while True:   # readers that reach a rule through other readers
        reached = STEADY_RULES | FINITE_RULES | {name for _, name, _ in delegating}
        more = {key for key, calls in candidates.items() if key not in delegating and calls & reached}
        if not more:
            break
        delegating |= more
    own_rules = sorted(f"{path}:{line} {name}" for path, name, line in set(candidates) - delegating)
    assert not own_rules, ("a steadiness rule or finiteness check of its own (ask traces/formats.py is_steady / "
                           f"steady or traces/validate.py finite): {own_rules}")


def _scalar_uses(tree: ast.Module) -> list[int]:
    """Lines of math.isfinite(...) calls (always on a scalar) and of np.isfinite(...) used as a truth value (an
    if / while / assert / conditional expression / comprehension test, an and / or / not operand): an array's
    truth value is an error, so these are scalars too. np.isfinite masking an array (`a[np.isfinite(a)]`,
    `~np.isfinite(a)`, `np.isfinite(a).all()`) is vectorised numpy, which `finite` does not replace: allowed."""
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tests += node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tests.append(node.operand)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
    lines = [t.lineno for t in tests if _isfinite_call(t, "np", "numpy")]
    lines += [n.lineno for n in ast.walk(tree) if _isfinite_call(n, "math")]
    return sorted(set(lines))


def _isfinite_call(node: ast.AST, *modules: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "isfinite"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in modules)


def test_no_scalar_finiteness_check_outside_finite():
    found = {path: lines for path, tree in parsed().items() if path != FINITE_HOME and (lines := _scalar_uses(tree))}
    left = {prefix: {p: lines for p, lines in found.items() if p.startswith(prefix)} for prefix in SCALAR_CHECKS_LEFT}
    elsewhere = {p: lines for p, lines in found.items() if not any(p.startswith(prefix) for prefix in left)}
    assert not elsewhere, f"a scalar finiteness check of its own (use traces/validate.py finite): {elsewhere}"
    counted = {prefix: sum(map(len, files.values())) for prefix, files in left.items()}
    beyond = {prefix: left[prefix] for prefix, n in counted.items() if n > SCALAR_CHECKS_LEFT[prefix]}
    assert not beyond, f"a scalar finiteness check added (use traces/validate.py finite): {beyond}"
    stale = {prefix: n for prefix, n in counted.items() if n < SCALAR_CHECKS_LEFT[prefix]}
    assert not stale, f"fewer checks left than counted: lower SCALAR_CHECKS_LEFT to {stale}"


def test_the_scan_sees_what_it_forbids(tmp_path):
    source = ("import math\nimport numpy as np\n"
              "def is_finite_enough(x):\n    return math.isfinite(x)\n"
              "def steady_steps(records):\n    return [r for r in records if r.step > 0]\n"
              "def steady_metrics(records):\n    return steady(records)\n"
              "is_finite_too = is_finite_enough\n"
              "def masked(a):\n    return a[np.isfinite(a)] if np.isfinite(a).all() else a\n"
              "def scalar(x):\n    return 1 if np.isfinite(x) else 0\n")
    tree = ast.parse(source)
    names = {name for name, _, _ in _defined_names(tree) if _RULE_NAME.search(name)}
    assert names == {"is_finite_enough", "steady_steps", "steady_metrics", "is_finite_too"}
    assert _scalar_uses(tree) == [4, 13]
    calls = {name: _called_names(node) for name, _, node in _defined_names(tree)}
    assert "steady" in calls["steady_metrics"] and not calls["steady_steps"] & STEADY_RULES


# -- StepRecord: one parse of a step-metrics line ----------------------------------------------------------


GOOD = {"step": 3, "rank": 0, "loss": 2.5, "step_time_ms": 100.0, "data_ms": 3.0, "tokens_per_s": 200.0,
        "profiled": False, "alloc_retries": 0}


def line(**changes) -> str:
    return json.dumps({**GOOD, **changes})


def test_a_trainer_line_is_a_typed_record_and_unknown_fields_are_ignored():
    record, why = parse_step_record(line(some_future_field=[1, 2], comm_buckets=4))
    assert why is None and record == StepRecord(step=3, rank=0, loss=2.5, step_time_ms=100.0, data_ms=3.0,
                                                tokens_per_s=200.0, alloc_retries=0, comm_buckets=4)
    assert isinstance(record.comm_buckets, int) and isinstance(record.step_time_ms, float)
    with pytest.raises(AttributeError):
        record.step = 4   # frozen


@pytest.mark.parametrize("text, reason", [
    ('{"step": 3, "step_time_ms": NaN}', "a non-finite number"),
    ('{"step": 3, "loss": Infinity}', "a non-finite number"),
    ('{"step": 3, "loss": -Infinity}', "a non-finite number"),
    ('{"step": NaN}', "no integer step"),
    ('{"step": "3"}', "no integer step"),
    ('{"step": 3.0}', "no integer step"),
    ('{"step": true}', "no integer step"),
    ('{"step": -1}', "no integer step"),
    ('{"loss": 1.0}', "no integer step"),
    ('{"step": ' + str(2**64) + '}', "beyond"),
    ('{"step": ' + "9" * 5000 + '}', "not JSON"),
    ('{"step": 3, "step_time_ms": "12"}', "is not a number"),
    ('{"step": 3, "step_time_ms": -1}', "outside"),
    ('{"step": 3, "step_time_ms": ' + str(10**400) + '}', "outside"),
    ('{"step": 3, "rank": -2}', "is not a rank"),
    ('{"step": 3, "rank": "0"}', "is not a rank"),
    ('{"step": 3, "profiled": "yes"}', "is not true or false"),
    ('{"step": 3, "profiled": 1}', "is not true or false"),
    ('[1, 2]', "not a JSON object"),
    ('"step"', "not a JSON object"),
    ('{"step": 3', "not JSON"),
    ("[" * 100000, "not JSON"),
    ("", "not JSON"),
])
def test_a_hostile_line_is_refused_with_a_reason_never_a_traceback(text, reason):
    record, why = parse_step_record(text)
    assert record is None and reason in why


@pytest.mark.parametrize("field, value", [
    ("loss", "nan"), ("loss", 10**400), ("loss", [1.0]), ("loss", {"a": 1}), ("loss", True), ("loss", None),
    ("compiled_frames", "three"), ("tflops", None), ("data_ms", None),
])
def test_an_unusable_value_of_a_field_without_bounds_is_unknown(field, value):
    record, why = parse_step_record(line(**{field: value}))
    assert why is None and getattr(record, field) is None


def test_missing_fields_are_unknown_and_bytes_and_dicts_parse_alike():
    record, _ = parse_step_record(b'{"step": 0}')
    assert record == StepRecord(step=0) and record.step_time_ms is None and record.profiled is False
    assert parse_step_record(json.loads(line()))[0] == parse_step_record(line())[0]


def test_every_kept_number_is_finite():
    for text in (line(tflops=1e6, mfu_pct=50), line(loss=-1e308), line(loss=1e300, comm_mb=0)):
        assert parse_step_record(text)[1] is None
        record, _ = parse_step_record(text)
        for name in ("loss", "step_time_ms", "tflops", "mfu_pct", "comm_mb"):
            value = getattr(record, name)
            assert value is None or (type(value) is float and math.isfinite(value))


# -- the steadiness rule --------------------------------------------------------------------------------


def records(*steps: int, profiled: tuple[int, ...] = (), first: tuple[int, ...] = ()) -> list[StepRecord]:
    return [StepRecord(step=s, profiled=s in profiled, first_of_process=s in first) for s in steps]


def test_steady_leaves_out_the_first_step_the_profiled_ones_and_a_restarts_first():
    kept = steady(records(5, 6, 7, 8, 9, 10, profiled=(7, 8), first=(9,)))
    assert [r.step for r in kept] == [6, 10]
    assert steady([]) == [] and steady(records(4)) == []


def test_steady_takes_the_lowest_step_as_the_first_in_any_order_and_more_warm_up_on_request():
    assert [r.step for r in steady(records(9, 3, 4, 5))] == [9, 4, 5]
    assert [r.step for r in steady(records(0, 1, 2, 3, 4), warmup_steps=3)] == [3, 4]


def test_is_steady_is_elementwise_and_absent_records_are_never_steady():
    import numpy as np

    steps = np.array([[-1, 0, 1, 2], [4, 5, 6, -1]])
    lowest = np.array([[0], [4]])
    mask = is_steady(steps, lowest, np.array([[0, 0, 1, 0], [0, 0, 0, 0]], dtype=bool), False)
    assert mask.tolist() == [[False, False, False, True], [False, True, True, False]]
    assert MAX_STEP == 2**53
