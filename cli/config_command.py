"""`fleetscope config`: every field `--set section.field=value` takes, with its type, default and docstring."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import textwrap
import typing
from functools import cache
from typing import Any

from ..trainer import config as train_config
from ..traces.validate import UsageError
from .exit_codes import EXIT_OK


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str
    """`section.field` as --set takes it."""
    type: str
    default: str
    doc: str


@cache
def _docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it in the class body (dataclass fields keep none at run time)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "|".join(str(choice) for choice in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def field_docs(cls: type = train_config.TrainConfig, instance: Any = None, prefix: str = "") -> list[FieldDoc]:
    """Every settable field under `cls`, in declaration order; sections are walked into."""
    instance = instance if instance is not None else cls(run_dir="RUN_DIR")
    hints, docs = typing.get_type_hints(cls), _docstrings(cls)
    fields = []
    for spec in dataclasses.fields(cls):
        value = getattr(instance, spec.name)
        if dataclasses.is_dataclass(value):
            fields += field_docs(type(value), value, prefix=f"{prefix}{spec.name}.")
            continue
        default = "(required)" if spec.default is dataclasses.MISSING else train_config.format_value(value)
        fields.append(FieldDoc(key=f"{prefix}{spec.name}", type=_type_name(hints[spec.name]),
                               default=default or '""', doc=docs.get(spec.name, "")))
    return fields


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("config", help="every trainer field --set takes: type, default and what it does")
    parser.add_argument("prefix", nargs="?", default="", metavar="SECTION[.FIELD]",
                        help="only fields starting with this, e.g. parallel or data.path (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of text")
    parser.set_defaults(handler=handle_config)


def handle_config(args: argparse.Namespace) -> int:
    fields = [f for f in field_docs() if f.key.startswith(args.prefix)]
    if not fields:
        keys = [f.key for f in field_docs()]
        words = sorted({k.split(".")[0] for k in keys} | {".".join(k.split(".")[:2]) for k in keys})
        close = difflib.get_close_matches(args.prefix, words, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"no field starts with {args.prefix!r}; {hint}(sections: "
                         f"{', '.join(sorted({k.split('.')[0] for k in keys}))})")
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in fields], indent=1))
        return EXIT_OK
    for f in fields:
        print(f"{f.key}: {f.type} = {f.default}")
        for line in textwrap.wrap(f.doc, 100):
            print(f"    {line}")
    return EXIT_OK


REGISTRY = [register]
