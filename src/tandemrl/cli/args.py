"""Flags from leaf configs: one `--name` per dataclass field, its attribute docstring as `--help`.

`--config run.yaml` supplies defaults, flags override; the resolved config is saved with the run.
Parsing is strict: no abbreviations (`--learning_rat` is an error, never `--learning_rate`), and a bad
flag or value is one line with a "did you mean" (raised as ValueError, which `tandem` prints, exit 2).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from typing import Any


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, showing a bool flag as `--flag [true|false], --no-flag`."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, BoolFlag):
            return f"{action.option_strings[0]} [true|false], {action.option_strings[1]}"
        return super()._format_action_invocation(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse without prefix matching, whose errors raise a one-line ValueError instead of a usage dump."""

    def __init__(self, *, hints: dict[str, str] | None = None, **kwargs: Any):
        kwargs.setdefault("formatter_class", functools.partial(HelpFormatter, max_help_position=36, width=110))
        super().__init__(allow_abbrev=False, **kwargs)
        self.hints = hints or {}  # {typed name: flag name} for "did you mean" where spelling is no guide (lr -> learning_rate)

    def error(self, message: str) -> typing.NoReturn:
        raise ValueError(self._explain(message))

    def _explain(self, message: str) -> str:
        if message.startswith("unrecognized arguments: "):
            unknown = message.removeprefix("unrecognized arguments: ").split()
            flag = next((a.split("=")[0] for a in unknown if a.startswith("-")), None)
            if flag is None:
                return f"unexpected value {unknown[0]!r} (every value follows its --flag); see `{self.prog} --help`"
            flags = [f for f in self._option_string_actions if f not in ("-h", "--help")]
            return f"unknown flag {flag}{did_you_mean(flag, flags, hints=self.hints)}; see `{self.prog} --help`"
        return message

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            hint = did_you_mean(str(value), [str(c) for c in action.choices])
            raise argparse.ArgumentError(action, f"{value!r} is not one of {choices}{hint}")


def did_you_mean(word: str, candidates: typing.Iterable[str], *, hints: dict[str, str] | None = None) -> str:
    """Example: did_you_mean("--learning_rat", ["--learning_rate", "--seed"]) -> " (did you mean --learning_rate?)".
    `hints` maps bare names to bare names, consulted first: {"lr": "learning_rate"} sends --lr to --learning_rate."""
    dashes = word[: len(word) - len(word.lstrip("-"))]
    hinted = (hints or {}).get(word.lstrip("-"))
    if hinted is not None:
        return f" (did you mean {dashes}{hinted}?)"
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


TRUE_FORMS, FALSE_FORMS = ("true", "yes", "y", "t", "1", "on"), ("false", "no", "n", "f", "0", "off")
BOOL_FORMS = "true/false, yes/no, y/n, t/f, 1/0 or on/off, in any case"
"""A bool's forms: HfArgumentParser's string_to_bool (so TRL's), and yaml 1.1's on/off."""


def parse_bool(text: str) -> bool:
    """A bool flag's value (argparse's type). Example: parse_bool("True") -> True; parse_bool("n") -> False"""
    try:
        return to_bool("", text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false (write {BOOL_FORMS})") from None


def to_bool(key: str, value: Any) -> bool:
    """The value of the setting `key` as a bool: every place a bool is read (flags, yaml, TRL's keys) reads it here.

    Example: to_bool("use_dora", "no") -> False; to_bool("bf16", "maybe") -> ValueError naming bf16 and the forms
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in TRUE_FORMS:
        return True
    if text in FALSE_FORMS:
        return False
    raise ValueError(f"setting {key}: {value!r} is not true or false (write {BOOL_FORMS})")


class BoolFlag(argparse.Action):
    """`--flag` and `--flag true|false` (TRL's form) set it, `--no-flag` clears it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        names = [*option_strings, *(f"--no-{s[2:]}" for s in option_strings if s.startswith("--"))]
        super().__init__(names, dest, nargs="?", type=parse_bool, metavar="true|false", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        negated = bool(option_string and option_string.startswith("--no-"))
        if negated and values is not None:
            raise argparse.ArgumentError(self, f"{option_string} takes no value (write --{self.dest} {'false' if values else 'true'})")
        setattr(namespace, self.dest, (not negated) if values is None else values)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


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
        return None, {"action": BoolFlag}
    if origin is typing.Literal:
        return type(args[0]), {"choices": list(args), "metavar": "{" + ",".join(map(str, args)) + "}"}
    if origin in (tuple, list):
        kind, extra = _parser_for(args[0])
        return kind, {**extra, "nargs": "*"}
    if tp in (int, float, str):
        return tp, {"metavar": {int: "INT", float: "FLOAT", str: "TEXT"}[tp]}
    if tp is dict or origin is dict:
        return _json_object, {"metavar": "JSON"}
    return str, {"metavar": "TEXT"}


def _json_object(text: str) -> dict[str, Any]:
    """A dict flag's value: a JSON object. Example: '{"enable_thinking": false}' -> {"enable_thinking": False}."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {text!r}")
    return value


def add_config_args(
    parser: argparse.ArgumentParser, cls: type, *, title: str | None = None, notes: dict[str, str] | None = None, raw: typing.Collection[str] = ()
) -> None:
    """One flag per field of `cls`, in a help group titled `title` (default: from the class name); defaults
    are left unset so that yaml and recipes can fill them. `notes[field]` is appended to a flag's help
    (e.g. where a task recipe overrides its default). Flags in `raw` keep their values as text (checked
    when the config is built, after other forms of a value are translated: TRL's `--logging_steps 0.1`)."""
    summary = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())  # the first paragraph, whole
    group = parser.add_argument_group(title or group_title(cls), summary or None)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        kind, extra = _parser_for(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        parts = [docs.get(f.name, ""), _default_text(default), (notes or {}).get(f.name, "")]
        help_text = " ".join(p for p in parts if p).replace("%", "%%")
        if f.name in raw:
            kind = str
            extra.pop("choices", None)
        if kind is not None:
            extra["type"] = kind
        group.add_argument(f"--{f.name}", default=argparse.SUPPRESS, help=help_text, **extra)


def group_title(cls: type) -> str:
    """Example: group_title(LocalSyncConfig) -> "Local sync"."""
    words = re.findall(r"[A-Z][a-z0-9]*|[a-z0-9]+", cls.__name__.removesuffix("Config")) or [cls.__name__]
    return " ".join([words[0], *(w.lower() for w in words[1:])])


def _default_text(default: Any) -> str:
    """Example: 1e-06 -> "(default: 1e-06)"; True -> "(default: on)"; "", () or {} -> "" (nothing to show)."""
    if isinstance(default, bool):
        return f"(default: {'on' if default else 'off'})"
    if default is None or default == "" or default == () or default == {}:
        return ""
    shown = " ".join(map(str, default)) if isinstance(default, (tuple, list)) else default
    return f"(default: {shown})"


def build_config(cls: type, values: dict[str, Any]) -> Any:
    """Instantiates `cls` from the values that name its fields, each coerced to its field's type (YAML
    reads `learning_rate: 1e-6` as a string), lists into tuples where typed so; ValueError names the field."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: coerce(f.name, values[f.name], hints[f.name]) for f in dataclasses.fields(cls) if f.name in values})


def coerce(name: str, value: Any, tp: Any) -> Any:
    """`value` as the field `name` of type `tp` takes it. Example: coerce("learning_rate", "1e-6", float) -> 1e-06"""
    kind, extra = _parser_for(tp)
    if extra.get("nargs") == "*":
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce_one(name, v, kind, extra.get("choices")) for v in items)
    return _coerce_one(name, value, kind, extra.get("choices"))


def _coerce_one(name: str, value: Any, kind: Any, choices: list | None) -> Any:
    if kind is _json_object and value is not None:
        return _mapping(name, value)
    if value is None or kind not in (None, int, float, str):  # None, or a kind YAML already gives whole
        return value
    if kind is None:
        return to_bool(name, value)
    wanted = {int: "an integer", float: "a number", str: "text"}[kind]
    if kind is str:
        ok, result = isinstance(value, (str, int, float)) and not isinstance(value, bool), str(value)
    else:
        try:
            number = float(value) if isinstance(value, str) and kind is int else value
            ok = not isinstance(value, bool) and isinstance(number, (int, float, str)) and (kind is float or float(number).is_integer())
            result = kind(number) if ok else None
        except (TypeError, ValueError):
            ok, result = False, None
    if not ok:
        raise ValueError(f"setting {name}: {value!r} is not {wanted}")
    if choices is not None and result not in choices:
        raise ValueError(f"setting {name}: {value!r} is not one of {', '.join(map(str, choices))}{did_you_mean(str(value), map(str, choices))}")
    return result


def _mapping(name: str, value: Any) -> dict[str, Any]:
    """A dict setting's value: a yaml mapping, or a JSON object's text (as the flag takes it)."""
    if isinstance(value, str):
        try:
            value = _json_object(value)
        except argparse.ArgumentTypeError:
            pass
    if not isinstance(value, dict):
        raise ValueError(f"setting {name}: {value!r} is not a mapping (write its keys indented under it, or a JSON object)")
    return value


def load_yaml(path: str) -> dict[str, Any]:
    """The {flag: value} of a --config file, null values left out (they mean "not set")."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_unique_key_loader()) or {}
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist; pass an existing --config path") from None
    except DuplicateKey as error:
        raise ValueError(f"config file {path!r}: {error}; keep one of them") from None
    except yaml.YAMLError as error:  # malformed, or a tag safe_load refuses (!!python/object and the like)
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"config file {path!r} is not plain YAML{where}: {problem}; write flag: value lines") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of flag names to values")
    # null is "not set", as if the line were absent: the recipe's or the default value applies. TRL writes
    # null for its unset keys; a None that reached a number crashed (`max_steps: null`, rollout's `port: null`),
    # and `learning_rate: null` skipped the task recipe's rate for the dataclass default
    return {key: value for key, value in data.items() if value is not None}


class DuplicateKey(Exception):
    """A yaml mapping naming a key twice (PyYAML keeps the last silently)."""


@functools.cache
def _unique_key_loader() -> type:
    """yaml's SafeLoader, refusing a mapping that names a key twice (a merge key's `<<` keys may be overridden)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in lines:
                        raise DuplicateKey(f"key {key} is set twice (lines {lines[key]} and {line})")
                    lines[key] = line
                except TypeError:  # an unhashable key: the constructor below says so
                    continue
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def check_known(
    values: dict[str, Any], classes: list[type], source: str, *, command: str, also: typing.Collection[str] = (), hints: dict[str, str] | None = None
) -> None:
    """A --config file may only name flags of `command` (and the names in `also`)."""
    known = {f.name for cls in classes for f in dataclasses.fields(cls)} | set(also)
    unknown = sorted(set(values) - known)
    if unknown:
        hint = did_you_mean(unknown[0], known, hints=hints)
        raise ValueError(f"{source}: unknown setting(s) {', '.join(unknown)}{hint}; see `tandem {command} --help`")


def dump_yaml(values: dict[str, Any]) -> str:
    """A flat {flag: value} as the YAML `--config` reads (tuples as lists), in the given order."""
    import yaml

    return yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}, sort_keys=False)
