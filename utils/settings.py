"""Typed settings: one config dataclass (with nested section dataclasses) gives a command's flags, reads its
YAML file and merges the two with one rule: explicit flag > file > default.

Every leaf field of a config is one *setting* with a flat name: the field's own name, or the name the
composing config gives it (`section(..., rename=...)`, e.g. diffusers' `image_interpolation_mode` for
`DataConfig.interpolation`). Flat names are unique across the whole config, so `--name`, a flat YAML key
`name: value` and a nested one (`data: {interpolation: value}`) all name the same setting. A flag's help is
its field's docstring. Bad input (an unknown key, a value of the wrong type, a value the config refuses) is
one `InputError` naming the key and where it came from (the file, or the flag).

It lives at the bottom of the project (beside `InputError`) so that component configs anywhere above can be
composed with it; it imports neither torch nor the CLI.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import difflib
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError

__all__ = ["Setting", "add_flags", "assemble", "build", "checked", "from_mapping", "merge", "read_yaml", "section",
           "settings"]

_SECTION = "typed_settings.section"  # the dataclasses.field metadata key of a section
_CHECKED = "typed_settings.checked"  # the dataclasses.field metadata key of a setting its config judges itself


@dataclass(frozen=True)
class _SectionSpec:
    rename: Mapping[str, str]
    hide: frozenset[str]


def section(cls: type, *, default: Callable[[], Any] | None = None, rename: Mapping[str, str] | None = None,
            hide: Iterable[str] = ()) -> Any:
    """A config field holding the section dataclass `cls`, built by `default` (else `cls()`): the composing
    config's defaults may differ from the owner's. `rename` maps some of its fields to the setting names users
    type; `hide` keeps fields out of the settings (the composing config derives them)."""
    spec = _SectionSpec(dict(rename or {}), frozenset(hide))
    return dataclasses.field(default_factory=default or cls, metadata={_SECTION: spec})


def checked(default: Any = None) -> Any:
    """A setting field judged by its config's own check (`__post_init__`), not only by its annotation: a flag's
    text that fits no member of the type and a file's value of another type reach the config as given, so one
    check answers with one message whichever way the value came (flag, file or Python), e.g. a chunk size."""
    return dataclasses.field(default=default, metadata={_CHECKED: True})


@dataclass(frozen=True)
class Setting:
    """One leaf field of a config."""

    name: str
    """Flat name: the flag `--name` and the flat YAML key."""
    path: tuple[str, ...]
    """Attribute path from the config, e.g. `("data", "interpolation")`."""
    type: Any
    """The field's resolved annotation."""
    default: Any
    """The value in the config's default instance."""
    help: str
    """The field's docstring on one line."""
    checked: bool = False
    """Values its type does not fit go on to the config's own check (a field declared with `checked`)."""

    @property
    def key(self) -> str:
        """The nested YAML key, e.g. `data.interpolation`."""
        return ".".join(self.path)

    @property
    def flaggable(self) -> bool:
        """True when the type has a command-line form (scalars, optional scalars, lists of scalars, literals)."""
        return _flag_form(self.type) is not None


# -- discovering the settings of a config ------------------------------------------------------------------------
@functools.cache
def settings(cls: type) -> dict[str, Setting]:
    """Flat name -> `Setting` of every leaf field of the config dataclass `cls`, sections in field order.

    A field is a section when declared with `section(...)` or annotated with a dataclass type. Raises
    `TypeError` when two settings share a flat name (a composition error, not a user's).
    """
    out: dict[str, Setting] = {}
    _walk(cls, None, (), _SectionSpec({}, frozenset()), out)  # the fields' defaults, not cls(): it may need this
    return out


def _walk(cls: type, default: Any, prefix: tuple[str, ...], spec: _SectionSpec, out: dict[str, Setting]) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name in spec.hide:
            continue
        tp = hints[f.name]
        value = getattr(default, f.name) if default is not None else _field_default(f)
        sub = f.metadata.get(_SECTION)
        if sub is not None or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            _walk(tp, value, (*prefix, f.name), sub or _SectionSpec({}, frozenset()), out)
            continue
        name = spec.rename.get(f.name, f.name)
        if name in out:
            raise TypeError(f"{cls.__name__}: setting '{name}' ({'.'.join((*prefix, f.name))}) is already "
                            f"{out[name].key}")
        out[name] = Setting(name, (*prefix, f.name), tp, value, docs.get(f.name, ""), _CHECKED in f.metadata)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string right after the field) on one line, for `cls` and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                out[node.target.id] = " ".join(nxt.value.value.split())
    return out


# -- types ---------------------------------------------------------------------------------------------------
def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _strip_none(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    args = _union_args(tp)
    if args is None or type(None) not in args:
        return tp, tp is type(None)
    rest = tuple(a for a in args if a is not type(None))
    return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007 - built from a tuple


def _flag_form(tp: Any) -> tuple[str, Any, tuple | None] | None:
    """("bool" | "list" | "scalar", element type, choices) of a setting's flag; None when it has none."""
    tp, _ = _strip_none(tp)
    if tp is bool:
        return "bool", bool, None
    if tp in (int, float, str):
        return "scalar", tp, None
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        kinds = {type(c) for c in choices}
        return ("scalar", kinds.pop(), choices) if len(kinds) == 1 and kinds <= {int, float, str} else None
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp) or (str,)
        return ("list", elem, None) if elem in (int, float, str) else None
    args = _union_args(tp)
    if args is not None and all(a in (int, float, str) or _scalar_literal(a) for a in args):
        return "scalar", _text_parser(tp), None  # e.g. `int | Literal["auto"]`: a chunk size or "auto"
    return None


def _scalar_literal(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Literal and all(
        type(c) in (int, float, str) for c in typing.get_args(tp))


@functools.cache
def _text_parser(tp: Any) -> Callable[[str], Any]:
    """The argparse `type` of a union of scalars and literals: a literal's text first, then each scalar type in
    the union's order; else argparse's one-line error naming the flag."""
    members = _union_args(tp) or (tp,)
    literals = [c for a in members if _scalar_literal(a) for c in typing.get_args(a)]
    scalars = [a for a in members if a in (int, float, str)]

    def parse(text: str) -> Any:
        for c in literals:
            if str(c) == text:
                return c
        for a in scalars:
            try:
                return a(text)
            except ValueError:
                continue
        raise argparse.ArgumentTypeError(f"expected {_describe(tp)}, got {text!r}")

    parse.__name__ = " | ".join(a.__name__ if a in scalars else " | ".join(map(repr, typing.get_args(a)))
                                for a in members)
    return parse


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp in (bool, int, float, str):
        return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]
    args = _union_args(tp)
    if args is not None:
        return " or ".join(_describe(a) for a in args)
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        return repr(choices[0]) if len(choices) == 1 else "one of " + ", ".join(repr(c) for c in choices)
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp) or (Any,)
        return f"a list of {_describe(elem)}" if elem is not Any else "a list"
    if typing.get_origin(tp) is dict or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(tp: Any, value: Any) -> Any:
    """`value` (as read from YAML) checked against the annotation `tp`; `TypeError` when it does not fit.
    A number written as a string (`1e-4`, which YAML 1.1 reads as text) is taken for a float setting; a
    single item for a list setting."""
    args = _union_args(tp)
    if args is not None:
        for a in args:
            try:
                return coerce(a, value)
            except TypeError:
                continue
        raise TypeError(_describe(tp))
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise TypeError("null")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, datetime.date):  # YAML reads 2021-10-14 as a date: a text setting takes its ISO text
            return value.isoformat()
    elif typing.get_origin(tp) is typing.Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
    elif typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp) or (Any,)
        items = value if isinstance(value, (list, tuple)) else [value]
        return [coerce(elem, v) for v in items]
    elif typing.get_origin(tp) is dict or tp is dict:
        if isinstance(value, Mapping):
            return dict(value)
    else:
        return value  # a type this module does not know: the config's own checks judge it
    raise TypeError(_describe(tp))


# -- flags ---------------------------------------------------------------------------------------------------
def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, defaults: bool = False,
              only: Iterable[str] | None = None, grouped: bool = False) -> list[Setting]:
    """Add `--name` for every setting of `cls` that has a command-line form (or those in `only`, in that order).

    With `defaults=False` (a config file may fill what the command line does not give) each flag's default is
    `argparse.SUPPRESS`, so the parsed namespace holds exactly the given flags; with `defaults=True` it is the
    setting's default. The help is the field's docstring, plus "(default: X)" unless X is None or False.
    `grouped` shows the flags of each top-level section under its name in --help.
    """
    table = settings(cls)
    chosen = [table[n] for n in only] if only is not None else [s for s in table.values() if s.flaggable]
    groups: dict[str, Any] = {}
    for s in chosen:
        target = parser
        if grouped and len(s.path) > 1:
            if s.path[0] not in groups:
                groups[s.path[0]] = parser.add_argument_group(s.path[0], field_docs(cls).get(s.path[0]))
            target = groups[s.path[0]]
        form = _flag_form(s.type)
        if form is None:
            raise TypeError(f"{cls.__name__}.{s.key}: {_describe(s.type)} has no command-line form")
        kind, elem, choices = form
        if s.checked:
            elem = _as_given(elem)
        text = s.help
        if s.default is not None and s.default is not False and "default:" not in text:
            text = f"{text.rstrip('.')} (default: {s.default})"
        kw: dict[str, Any] = {"default": s.default if defaults else argparse.SUPPRESS,
                              "help": text.replace("%", "%%")}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction if s.default is True else "store_true"
        else:
            kw.update(type=elem, choices=choices, nargs="+" if kind == "list" else None)
        target.add_argument(f"--{s.name}", **kw)
    return chosen


@functools.cache
def _as_given(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, or the text itself when it does not parse (a `checked` setting: its config judges the text)."""

    def lenient(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            return text

    lenient.__name__ = getattr(parse, "__name__", "text")
    return lenient


# -- files ---------------------------------------------------------------------------------------------------
def read_yaml(path: str | Path, cls: type, *, not_settings: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings of `cls` in the YAML file `path` as flat name -> value (checked against the field types).
    `not_settings`: top-level keys users may write that are not settings (e.g. another tool's flag names), each
    with the line that says what to write instead (`from_mapping`)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_loader())  # noqa: S506 - a SafeLoader
    except OSError as exc:
        raise InputError(f"{path}: cannot read the config ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise InputError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of setting names, got {type(data).__name__}")
    return from_mapping(data, cls, str(path), not_settings)


@functools.cache
def _loader() -> type:
    """`yaml.SafeLoader` that reads a date (`2021-10-14`) as its text: the setting's own check judges it (YAML
    would refuse `2021-13-01` with a bare "month must be in 1..12")."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)
    return Loader


def from_mapping(data: Mapping[str, Any], cls: type, source: str,
                 not_settings: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flat name -> checked value of a mapping that holds flat keys (`image_interpolation_mode: bicubic`) and/or
    nested sections (`data: {interpolation: bicubic}`, where a section also takes the flat names of its
    settings). One `InputError` naming `source` and the key for an unknown key (for a top-level key of
    `not_settings`, its line instead of a close name), a repeated setting or a value of the wrong type."""
    table = settings(cls)
    by_path = {s.path: s for s in table.values()}
    sections = {s.path[:i] for s in table.values() for i in range(1, len(s.path))}
    out: dict[str, Any] = {}
    written: dict[str, str] = {}

    def visit(mapping: Mapping[str, Any], prefix: tuple[str, ...]) -> None:
        for key, value in mapping.items():
            where = ".".join((*prefix, str(key)))
            s = by_path.get((*prefix, key))
            if s is None and key in table and table[key].path[:len(prefix)] == prefix:
                s = table[key]
            if s is None and (*prefix, key) in sections:
                if not isinstance(value, Mapping):
                    raise InputError(f"{source}: {where}: expected a mapping (a section), got {value!r}")
                visit(value, (*prefix, key))
                continue
            if s is None and not prefix and key in (not_settings or {}):
                raise InputError(f"{source}: {key}: {not_settings[key]}")
            if s is None:
                raise InputError(f"{source}: unknown setting '{where}'{_hint(str(key), table, sections)}")
            if s.name in written:
                raise InputError(f"{source}: {where}: set twice (also as {written[s.name]})")
            try:
                out[s.name] = coerce(s.type, value)
            except TypeError:
                if not s.checked:
                    raise InputError(f"{source}: {where}: expected {_describe(s.type)}, got {value!r}") from None
                out[s.name] = value  # the config's own check judges it, as it judges a flag's or Python's value
            written[s.name] = where

    visit(data, ())
    return out


def _hint(key: str, table: Mapping[str, Setting], sections: set[tuple[str, ...]]) -> str:
    names = [*table, *{".".join(p) for p in sections}, *{s.path[-1] for s in table.values()}]
    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


# -- merging and building ------------------------------------------------------------------------------------
def merge(cls: type, args: argparse.Namespace, file_values: Mapping[str, Any] | None = None,
          source: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """The one precedence rule of every command: a flag given on the command line > the file's value > the
    default (left out).

    A setting is given when `args` holds it with a value other than None: `add_flags` (`defaults=False`, as a
    command with a config file adds them) leaves a flag out of the namespace unless it is typed, and an optional
    positional left out holds None (no flag gives None). So an explicit value equal to the default (`--seed 0`)
    still beats the file (`seed: 3`). Returns the flat values and where each came from ("--name", or `source`
    for the file's), for `build`'s messages.
    """
    values = dict(file_values or {})
    origin = dict.fromkeys(values, source)
    for name in settings(cls):
        if getattr(args, name, None) is not None:
            values[name], origin[name] = getattr(args, name), f"--{name}"
    return values, origin


def assemble(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments of `cls` (top-level fields, sections built) from flat settings; a section given
    as an object (as `dataclasses.replace` passes it) is the base its flat settings override."""
    table = settings(cls)
    unknown = [k for k in values if k not in table and k not in {f.name for f in dataclasses.fields(cls)}]
    if unknown:
        raise TypeError(f"{cls.__name__}() got an unexpected keyword argument '{unknown[0]}'")
    return _assemble(cls, (), values, table)


def _assemble(cls: type, prefix: tuple[str, ...], values: Mapping[str, Any],
              table: Mapping[str, Setting]) -> dict[str, Any]:
    depth = len(prefix)
    mine = {s.path[depth]: values[n] for n, s in table.items() if n in values and len(s.path) == depth + 1
            and s.path[:depth] == prefix}
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = (*prefix, f.name)
        is_section = _SECTION in f.metadata or (isinstance(hints[f.name], type)
                                                 and dataclasses.is_dataclass(hints[f.name]))
        inner = {n for n, s in table.items() if n in values and s.path[:depth + 1] == path and len(s.path) > depth + 1}
        if not is_section:
            if f.name in mine:
                kwargs[f.name] = mine[f.name]
            elif depth == 0 and f.name in values:
                kwargs[f.name] = values[f.name]
            continue
        base = values.get(f.name) if depth == 0 else None
        if base is None and not inner:
            continue
        if base is None:
            base = _field_default(f)
        if inner:
            base = dataclasses.replace(base, **_assemble(type(base), path, values, table))
        kwargs[f.name] = base
    return kwargs


def build(cls: type, values: Mapping[str, Any], origin: Mapping[str, str] | None = None) -> Any:
    """`cls` from flat settings; a `ValueError` or `TypeError` of the config becomes one `InputError` naming the
    setting as the user wrote it: `--name ...` for a flag, `FILE: name ...` for a file's key (`origin` maps flat
    names to "--name" or the file)."""
    try:
        return cls(**assemble(cls, values))
    except (ValueError, TypeError) as exc:
        raise InputError(explain(cls, exc, origin or {})) from exc


def explain(cls: type, exc: BaseException, origin: Mapping[str, str]) -> str:
    """The one line for a config's refusal `exc`: its leading field name in the user's spelling and source."""
    msg = str(exc)
    head = msg.split(" ", 1)[0].rstrip(":,")
    field = head.rsplit(".", 1)[-1]  # an owner's own message names `Owner.field` (AlignmentConfig.cpus)
    table = settings(cls)
    name = head if head in table else next((n for n, s in table.items() if s.path[-1] == field), None)
    if name is None:
        return msg if isinstance(exc, ValueError) else f"bad setting: {msg}"
    msg = name + msg[len(head):]
    where = origin.get(name)
    if where is None or where.startswith("--"):
        return f"--{msg}"
    return f"{where}: {msg}"
