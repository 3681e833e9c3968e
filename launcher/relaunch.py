"""A relaunch of a recorded job with a change applied (`fleetscope tune`): pure planning, nothing runs.

    job_spec_from_record(spec)   job.json's `spec` (spec_record) -> the JobSpec it was launched with
    plan_relaunch(...)           that spec, the change's trainer arguments and environment, then the
                                 user's own --set (later wins), into a new run directory

The relaunch is the same job: scheduler, nodes, processes, steps, profiler schedule, seed and every other
setting come from the record; only what the change names, and the run directory, differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..traces.layout import RunLayout
from ..traces.validate import finite
from ..trainer.config import ConfigError, add_train_arguments, apply_overrides, train_assignments
from .runs import refuse_unusable_run_dir
from .spec import JobSpec
from .untrusted import require_plain_text

CHANGE_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*\Z")
"""Names a change may set: upper-case shell variable names (PYTORCH_ALLOC_CONF, NCCL_*)."""
USER_PROGRAM_SETTINGS = ("profiler.",)
"""Trainer settings that still mean something when the job runs the user's own program."""


@dataclass(frozen=True, kw_only=True)
class Relaunch:
    """The new job, and what was applied to the recorded one (job.json records it as `tuned_from`)."""

    spec: JobSpec
    source_run: Path
    assignments: tuple[str, ...]
    """Trainer settings applied, in order (the change's, then the user's --set)."""
    env: dict[str, str]
    """Environment the change adds or replaces."""

    def record(self, **about: Any) -> dict[str, Any]:
        """The `tuned_from` field of the new run's job.json; `about` adds the finding's identity."""
        return {"run": str(self.source_run), **about, "assignments": list(self.assignments), "env": dict(self.env)}


def plan_relaunch(spec_fields: Any, *, source_run: Path, new_run_dir: Path, train_args: Sequence[str] = (),
                  env: Sequence[tuple[str, str]] = (), overrides: Sequence[str] = ()) -> Relaunch:
    """The recorded job (`spec_fields`: job.json's `spec`) with the change applied, into `new_run_dir`.
    A ConfigError names what cannot be applied; nothing is touched."""
    source_run, new_run_dir = Path(source_run).absolute(), Path(new_run_dir).absolute()
    refuse_source_as_target(source_run, new_run_dir)
    try:
        recorded = job_spec_from_record(spec_fields)
    except ConfigError as error:  # the record is the problem, not the change: name the file
        raise ConfigError(f"{RunLayout.at(source_run).job_file}: {error}") from error
    assignments = tuple(change_assignments(train_args)) + tuple(overrides)
    refuse_run_dir_setting(assignments)
    changed_env = change_environment(env)
    if recorded.entry is not None:
        refuse_trainer_settings(assignments)
    train = apply_overrides(dataclasses.replace(recorded.train, run_dir=str(new_run_dir)), list(assignments))
    spec = dataclasses.replace(recorded, train=train, env={**recorded.env, **changed_env})
    return Relaunch(spec=spec, source_run=source_run, assignments=assignments, env=changed_env)


def refuse_source_as_target(source_run: Path, new_run_dir: Path) -> None:
    """The relaunch never writes into the run it starts from (nor anywhere inside it)."""
    refuse_unusable_run_dir(new_run_dir)
    source, target = source_run.resolve(), new_run_dir.resolve()
    if target == source or source in target.parents:
        raise ConfigError(f"run_dir: {new_run_dir} is {'' if target == source else 'inside '}the run being tuned "
                          f"({source_run}); the new run needs its own directory")


class _ArgumentError(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse would exit the process
        raise ConfigError(f"change: {message}")


def change_assignments(train_args: Sequence[str]) -> list[str]:
    """The trainer arguments of a change (`--set a.b=v`, `--compile MODE`, ...) as `a.b=v` assignments."""
    words = [require_plain_text(str(word), "change.train_args") for word in train_args]
    parser = _ArgumentError(prog="change", add_help=False)
    add_train_arguments(parser)
    return train_assignments(parser.parse_args(words))


def change_environment(env: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The change's environment, every name and value checked (values are quoted where they reach a shell)."""
    checked: dict[str, str] = {}
    for name, value in env:
        if not isinstance(name, str) or not CHANGE_ENV_NAME.match(name):
            raise ConfigError(f"change.env: {name!r} is not an environment variable name ([A-Z_][A-Z0-9_]*)")
        if not isinstance(value, str):
            raise ConfigError(f"change.env {name}: the value must be text, got {type(value).__name__}")
        checked[name] = require_plain_text(value, f"change.env {name}")
    return checked


def refuse_run_dir_setting(assignments: Sequence[str]) -> None:
    """The new run directory is --run-dir's (checked: new or empty, not the tuned run); a `run_dir=`
    assignment applied after it would send the job somewhere unchecked."""
    found = [a for a in assignments if a.partition("=")[0].strip() == "run_dir"]
    if found:
        raise ConfigError(f"{found[0]}: the new run directory is set by --run-dir only")


def refuse_trainer_settings(assignments: Sequence[str]) -> None:
    ignored = [a for a in assignments if not a.startswith(USER_PROGRAM_SETTINGS)]
    if ignored:
        raise ConfigError(f"change: {', '.join(ignored)} configure fleetscope's own trainer, but the run tuned runs "
                          "its own program (entry in job.json): only environment changes and profiler.* apply")


# --- job.json `spec` -> JobSpec ------------------------------------------------------------------


def job_spec_from_record(spec_fields: Any) -> JobSpec:
    """The JobSpec that `spec_record` wrote (dataclasses.asdict form), validated as at launch.
    A field the record lacks takes its default; a field this version does not know is refused."""
    return _build(JobSpec, spec_fields, "spec.")


def _build(cls: type, fields: Any, where: str) -> Any:
    if not isinstance(fields, dict):
        raise ConfigError(f"{where.rstrip('.')}: expected an object in job.json, got {type(fields).__name__}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(f"{where}{unknown[0]}: not a setting of this fleetscope version (the run was recorded by "
                          "another one?); relaunch it with `fleetscope launch` instead")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in fields
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}{missing[0]}: missing from job.json (a required setting without a default): the "
                          "record is damaged; relaunch it with `fleetscope launch` instead")
    return cls(**{name: _value(hints[name], value, f"{where}{name}") for name, value in fields.items()})


def _value(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{where}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _value(next(a for a in args if a is not type(None)), value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {args}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_value(args[0], item, where) for item in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
        return {_value(args[0], k, where): _value(args[1], v, f"{where} {k}") for k, v in value.items()}
    return _scalar(hint, value, where)


def _scalar(hint: Any, value: Any, where: str) -> Any:
    if hint is float and type(value) in (int, float):
        return _float_setting(value, where)
    if hint in (bool, int, str) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def _float_setting(value: int | float, where: str) -> float:
    """A JSON number as a float setting: NaN, Infinity and integers beyond float range are no setting."""
    number = finite(value)
    if number is None:
        raise ConfigError(f"{where}: expected a finite number, got {str(value)[:40]}")
    return number
