"""Flags from leaf configs: one `--name` per dataclass field, its attribute docstring as `--help`.

`--config run.yaml` supplies defaults, flags override; the resolved config is saved with the run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right below each field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _parser_for(tp: Any) -> tuple[Any, dict[str, Any]]:
    """(type callable, extra add_argument kwargs) for a field annotation."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _parser_for(args[0])
    if tp is bool:
        return _bool, {"nargs": "?", "const": True}
    if origin is typing.Literal:
        return type(args[0]), {"choices": list(args)}
    if origin in (tuple, list):
        return _parser_for(args[0])[0], {"nargs": "*"}
    if tp in (int, float, str):
        return tp, {}
    return str, {}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_config_args(parser: argparse.ArgumentParser, cls: type, *, title: str | None = None) -> None:
    """One flag per field of `cls`; defaults are left unset so that yaml and recipes can fill them."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        kind, extra = _parser_for(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        group.add_argument(
            f"--{f.name}", type=kind, default=argparse.SUPPRESS, help=f"{docs.get(f.name, '')} (default: {default})", **extra
        )


def build_config(cls: type, values: dict[str, Any]) -> Any:
    """Instantiates `cls` from the values that name its fields (lists become tuples where typed so)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
            if typing.get_origin(hints[f.name]) is tuple and isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist; pass an existing --config path") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of flag names to values")
    return data


def check_known(values: dict[str, Any], classes: list[type], source: str, *, command: str) -> None:
    """A --config file may only name flags of `command`."""
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{source}: unknown setting(s) {', '.join(unknown)}; see `tandem {command} --help`")
