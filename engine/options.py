"""Options declared once, as dataclass fields, and turned into command-line flags.

A config dataclass (EngineConfig, MockTiming, ...) declares each option with its type,
default and a one-line description (`option(default, "help")`). `add_flags` turns
those fields into argparse flags with vLLM's spelling (`max_num_seqs` ->
`--max-num-seqs`, a bool `enable_prefix_caching` -> `--enable-prefix-caching` /
`--no-enable-prefix-caching`), and `given` reads back only the flags the user passed,
so the defaults stay where they are declared. deployments.cli feeds the Serve app's
pydantic fields through the same two functions.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence


def option(default: Any, help: str, *, choices: Sequence[str] | None = None,
           parse: Callable[[list[str]], Any] | None = None) -> Any:
    """A dataclass field that is also a documented option. parse: the flag takes one or
    more values and this turns them into the option's value (ValueError: exit 2 naming
    the flag), for flags whose values follow vLLM's own syntax."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices,
                                                        "parse": parse})


@dataclass(frozen=True)
class Option:
    """One option as the command line sees it."""

    name: str  # the field's name; the flag is --name-with-dashes
    kind: type  # int, float, str, bool, or dict (a JSON value)
    default: Any
    help: str
    nullable: bool = False  # None is a valid value (JSON null for dict options)
    choices: Sequence[str] | None = None
    parse: Callable[[list[str]], Any] | None = None  # values -> value (see option())

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def option_kind(annotation: Any) -> tuple[type, bool]:
    """(kind, nullable) of a field annotation: `int | None` -> (int, True); anything
    that is not a plain scalar (a nested model, a dict) is a JSON value."""
    if isinstance(annotation, str):
        raise TypeError(f"unresolved annotation {annotation!r}: resolve with get_type_hints")
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        kind, _ = option_kind(inner[0]) if len(inner) == 1 else (dict, True)
        return kind, type(None) in args
    if origin is typing.Literal:
        return type(args[0]), False
    if annotation in (int, float, str, bool):
        return annotation, False
    return dict, False


def dataclass_options(cls: type, skip: Iterable[str] = (), prefix: str = "") -> list[Option]:
    """The documented fields of a config dataclass as Options (names get `prefix`)."""
    hints = typing.get_type_hints(cls)
    skipped = set(skip)
    found = []
    for f in dataclasses.fields(cls):
        if f.name in skipped or "help" not in f.metadata:
            continue
        kind, nullable = option_kind(hints[f.name])
        found.append(Option(prefix + f.name, kind, f.default, f.metadata["help"], nullable,
                            f.metadata.get("choices"), f.metadata.get("parse")))
    return found


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
_BINARY = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def human_int(text: str) -> int:
    """An integer as vLLM's command line takes it: 2048, 8k (8,000), 8K (8,192),
    1.5M (1,572,864), so `--max-model-len 32k` works as it does with vllm serve."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        return int(text)
    number, suffix = match.groups()
    value = float(number) * (_DECIMAL.get(suffix) or _BINARY[suffix])
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def _int_value(text: str) -> int:
    try:
        return human_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (a whole number, "
                                         "or one such as 8k, 8K, 1M)") from None


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc.msg}") from None


_PARSERS: dict[type, Callable[[str], Any]] = {int: _int_value, float: float, str: str,
                                               dict: _json_value}


class _Parsed(argparse.Action):
    """Stores parse(values) for a flag with vLLM's multi-value syntax."""

    def __init__(self, *args: Any, parse: Callable[[list[str]], Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parse = parse

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            setattr(namespace, self.dest, self.parse(list(values)))
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
              options: Iterable[Option]) -> None:
    """One flag per option; unset flags are absent from the parsed namespace."""
    for opt in options:
        shown = "none" if opt.default is None else json.dumps(opt.default) \
            if opt.kind is dict else opt.default
        text = f"{opt.help} (default: {shown})"
        if opt.kind is bool:
            parser.add_argument(opt.flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
            continue
        if opt.parse is not None:
            parser.add_argument(opt.flag, nargs="+", action=_Parsed, parse=opt.parse,
                                default=argparse.SUPPRESS, help=text, metavar="VALUE")
            continue
        parser.add_argument(opt.flag, type=_PARSERS[opt.kind], default=argparse.SUPPRESS,
                            choices=opt.choices, help=text,
                            metavar="JSON" if opt.kind is dict else None)


def given(namespace: argparse.Namespace, options: Iterable[Option]) -> dict[str, Any]:
    """The options the user set on the command line, by field name."""
    values = vars(namespace)
    return {opt.name: values[opt.name] for opt in options if opt.name in values}


__all__ = ["Option", "option", "option_kind", "dataclass_options", "add_flags", "given"]
