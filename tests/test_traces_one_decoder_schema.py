"""One Kineto decoder schema: how an event is decoded (its msgspec Structs, the phase letters, the duration rule,
the category names) is defined in traces/kineto_schema.py only.

Scans every module of the package with `ast` (tests and benchmarks aside) for what would be a second definition:
- a msgspec Struct of a trace event or document: a class or `msgspec.defstruct` with a `ph`, `cat` or
  `traceEvents` field or tagged by `ph`, and every Struct such a class names in its fields (its args, its events);
- a collection literal of two or more phase letters (a phase set, also inline: `phase in ("s", "t", "f")`);
- a collection literal or dict holding two or more Kineto category names (a category set or table);
- the duration rule: a `.get("dur", <literal>)` (what a missing `dur` means) or the rule's problem texts.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fleetscope.traces import kineto_schema

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "traces" / "kineto_schema.py"
_SKIPPED_DIRS = {"tests", "bench", "build", "dist", "node_modules", "__pycache__"}

PHASE_LETTERS = frozenset(kineto_schema.CHROME_PHASES) | {kineto_schema.COMPLETE, kineto_schema.METADATA}
CATEGORY_NAMES = frozenset(kineto_schema.KIND_OF_CATEGORY) | {kineto_schema.TRACE_SPAN_CATEGORY}
RULE_TEXTS = frozenset((kineto_schema.NON_NUMERIC_TIME, kineto_schema.NEGATIVE_DURATION,
                        kineto_schema.TIME_BEYOND_INT64))
EVENT_KEYS = frozenset(("ph", "cat", "traceEvents"))

KNOWN_ELSEWHERE = {
    # (module, what): why it is not in the schema yet. Each entry must still be found (the list only shrinks).
    ("analysis/per_rank/hta_native_views.py",
     "category set ('kernel', 'Kernel', 'gpu_memset', 'Memset', 'gpu_memcpy', 'Memcpy', 'mtia_ccp_events')"):
        "HTA's own idle-kernel list (hta_native_views.py reproduces HTA), with a category Kineto's table lacks",
}


def _package_modules() -> list[Path]:
    return sorted(path for path in ROOT.rglob("*.py")
                  if not (set(path.relative_to(ROOT).parts[:-1]) & _SKIPPED_DIRS)
                  and not any(part.startswith(".") for part in path.relative_to(ROOT).parts))


def _strings(node: ast.AST) -> list[str] | None:
    """The elements of a tuple, list or set literal (or a frozenset/tuple/set call of one) when all are strings."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple") \
            and len(node.args) == 1:
        node = node.args[0]
    if not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return None
    values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return values if len(values) == len(node.elts) else None


def _literal_sets(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        keys = None
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        values = _strings(node) if keys is None else keys
        if not values:
            continue
        if len(values) >= 2 and all(v in PHASE_LETTERS for v in values):
            found.append(f"phase set {tuple(values)}")
        elif sum(v in CATEGORY_NAMES for v in values) >= 2:
            found.append(f"category set {tuple(values)}")
    return found


def _duration_rules(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value == "dur" \
                and isinstance(node.args[1], ast.Constant):  # a literal: not the schema's MISSING_DURATION_US
            found.append(f"duration rule .get('dur', {ast.unparse(node.args[1])})")
        elif isinstance(node, ast.Constant) and node.value in RULE_TEXTS:
            found.append(f"duration rule text {node.value!r}")
    return found


def _is_struct_base(base: ast.AST) -> bool:
    return isinstance(base, ast.Attribute) and base.attr == "Struct" or isinstance(base, ast.Name) and base.id == "Struct"


def _event_structs(tree: ast.AST) -> list[str]:
    """Structs of trace events and documents, and the Structs their fields name (args, events)."""
    classes: dict[str, tuple[set[str], set[str], bool]] = {}  # name -> (fields, names in annotations, ph-tagged)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            mentioned = {n.id for s in node.body if isinstance(s, ast.AnnAssign) for n in ast.walk(s.annotation)
                         if isinstance(n, ast.Name)}
            tagged = any(k.arg == "tag_field" for k in node.keywords)
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            classes[node.name] = (fields, mentioned | bases, tagged or any(map(_is_struct_base, node.bases)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "defstruct":
            found.append(f"Struct {ast.unparse(node.args[0]) if node.args else '?'} (defstruct)")
    structs = {name for name, (_, _, is_struct) in classes.items() if is_struct}
    changed = True
    while changed:  # subclasses of a Struct are Structs
        changed = False
        for name, (_, mentioned, _) in classes.items():
            if name not in structs and mentioned & structs and any(b in structs for b in mentioned):
                structs.add(name)
                changed = True
    events = {name for name in structs if classes[name][0] & EVENT_KEYS or
              any(k.arg == "tag_field" for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name
                  for k in n.keywords)}
    changed = True
    while changed:  # and what they name: their args and events, their variants
        changed = False
        for name in structs - events:
            if any(name in classes[e][1] for e in events) or classes[name][1] & events:
                events.add(name)
                changed = True
    return found + [f"Struct {name}" for name in sorted(events)]


def _definitions_outside_schema() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for path in _package_modules():
        if path == SCHEMA:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        module = path.relative_to(ROOT).as_posix()
        for what in _event_structs(tree) + _literal_sets(tree) + _duration_rules(tree):
            found[(module, what)] = found.get((module, what), 0) + 1
    return found


def test_the_decoder_schema_is_defined_once():
    found = _definitions_outside_schema()
    unexpected = sorted(key for key in found if key not in KNOWN_ELSEWHERE)
    assert not unexpected, "defined outside traces/kineto_schema.py (import it from there):\n" + "\n".join(
        f"  {module}: {what}" for module, what in unexpected)


def test_the_exceptions_still_exist():
    gone = sorted(set(KNOWN_ELSEWHERE) - set(_definitions_outside_schema()))
    assert not gone, f"moved to the schema or removed: drop from KNOWN_ELSEWHERE: {gone}"


def test_the_scan_finds_what_it_looks_for():
    """The checks see each kind of definition (so a passing scan means something)."""
    source = '''
import msgspec
PHASES = ("s", "t", "f")
KINDS = {"kernel": 1, "gpu_memcpy": 2}
class Args(msgspec.Struct):
    stream: int = -1
class Event(msgspec.Struct, tag_field="ph"):
    args: Args | None = None
class Other(msgspec.Struct):
    cat: str = ""
def duration(event):
    return event.get("dur", 0)
'''
    tree = ast.parse(source)
    found = _event_structs(tree) + _literal_sets(tree) + _duration_rules(tree)
    assert found == ["Struct Args", "Struct Event", "Struct Other", "phase set ('s', 't', 'f')",
                     "category set ('kernel', 'gpu_memcpy')", "duration rule .get('dur', 0)"]


def test_the_schema_itself_holds_each_definition():
    tree = ast.parse(SCHEMA.read_text(encoding="utf-8"))
    assert _literal_sets(tree) and _event_structs(tree)
    assert kineto_schema.UNDRAWN_PHASES and set(kineto_schema.GPU_TRACK_CATEGORIES) <= CATEGORY_NAMES
