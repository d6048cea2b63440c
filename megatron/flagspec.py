"""Command-line flags declared beside the config fields they set.

A config dataclass field declared with `flag("--main-spelling", "--alias", default=..., group=..., help=...)` carries
its flag: the parser (megatron/arguments.py `build_parser`) is generated from these declarations, and
`copy_flags(cls, namespace)` copies the parsed values into the dataclass. So each flag's name, type, choices, help and
default exist once, and the field's default is the command line's.

- The argparse type and action follow from the field's default: a bool default gives a switch (`store_true`; with
  `negate=True` the switch sets the field to False, as `--no-fp8-wgrad` does for `fp8_wgrad`), an int / float default
  an int / float flag. An enum default gives its value on the command line and the enum in the config.
- `derived=True`: the field is computed from this flag and others in one named step of arguments.py (the padded
  vocabulary, the global batch size); the flag's default is then `cli_default` (None unless given).
- `more`: further flags that feed the same field's derivation (`--train-samples` beside `--train-iters`).
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

_UNSET = object()
# A field annotation (a string under `from __future__ import annotations`) -> the type its flag parses.
_ANNOTATED = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float}


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the main spelling first, then upstream aliases
    group: str  # the --help group's title (arguments.GROUPS)
    help: Optional[str] = None
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[Sequence[Any]] = None
    metavar: Optional[str] = None
    nargs: Optional[str] = None
    action: Any = None  # "store_true", argparse.BooleanOptionalAction; None: from the field's default
    default: Any = _UNSET  # the parser's default where it is not the field's (derived fields, `more` flags)
    dest: Optional[str] = None
    negate: bool = False  # a switch that sets a True-by-default field to False
    derived: bool = False  # set by arguments.py from this flag and others, not copied as given
    convert: Optional[Callable[[Any], Any]] = None  # parsed value -> field value (default: the field's enum)

    def add_to(self, group: argparse._ArgumentGroup, field_default: Any = _UNSET,
               field_type: Optional[type] = None) -> argparse.Action:
        default = self.default if self.default is not _UNSET else field_default
        default = None if default is _UNSET else default
        if self.negate:
            default = False
        kwargs: dict[str, Any] = {"default": default.value if isinstance(default, enum.Enum) else default}
        action = self.action
        if action is None and isinstance(kwargs["default"], bool):
            action = "store_true"
        if action is not None:
            kwargs["action"] = action
        else:
            kind = self.type or (type(kwargs["default"]) if isinstance(kwargs["default"], (int, float)) else None)
            kwargs["type"] = kind or field_type or str
        for name in ("help", "choices", "metavar", "nargs", "dest"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return group.add_argument(*self.names, **kwargs)

    @property
    def dest_name(self) -> str:
        """The attribute the parsed value lands on (argparse's rule: the first long spelling, dashes to _)."""
        return self.dest or self.names[0].lstrip("-").replace("-", "_")


def flag(*names: str, group: str, default: Any = dataclasses.MISSING, cli_default: Any = _UNSET,
         more: Sequence[Flag] = (), **spec) -> Any:
    """A dataclass field (`default`: none, a required field) with its command-line flag `names` (parser default
    `cli_default` where it is not the field's) and `more` flags feeding its derivation."""
    return dataclasses.field(default=default,
                             metadata={"flags": (Flag(tuple(names), group, default=cli_default, **spec), *more)})


def declared(cls: type) -> Iterator[tuple[dataclasses.Field, Flag]]:
    """(field, flag) of every flag declared on `cls`'s fields, in field order; a field's `more` flags follow it."""
    for field in dataclasses.fields(cls):
        for declared_flag in field.metadata.get("flags", ()):
            yield field, declared_flag


def field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _UNSET


def add_flags(groups: dict[str, argparse._ArgumentGroup], cls: type) -> None:
    """Add every flag declared on `cls` to its group (a KeyError names a group the parser does not have)."""
    for field, declared_flag in declared(cls):
        main = declared_flag is field.metadata["flags"][0]
        declared_flag.add_to(groups[declared_flag.group], field_default(field) if main else _UNSET,
                             _ANNOTATED.get(str(field.type)) if main else None)


def copy_flags(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """{field: value} for every field of `cls` whose main flag is copied as given (not derived): the parsed value,
    negated for a negating switch, converted to the field's enum."""
    values = {}
    for field in dataclasses.fields(cls):
        flags = field.metadata.get("flags", ())
        if not flags or flags[0].derived:
            continue
        main = flags[0]
        value = getattr(namespace, main.dest_name)
        if main.negate:
            value = not value
        default = field_default(field)
        if main.convert is not None:
            value = main.convert(value)
        elif isinstance(default, enum.Enum) and value is not None:
            value = type(default)(value)
        values[field.name] = value
    return values


def changed_from_default(cls: type, namespace: argparse.Namespace) -> list[str]:
    """The main spellings of `cls`'s copied flags set to something other than their field's default."""
    defaults = {f.name: field_default(f) for f in dataclasses.fields(cls)}
    main = dict(declared_flags(cls))
    return [main[name].names[0] for name, value in copy_flags(cls, namespace).items() if value != defaults[name]]


def declared_flags(cls: type) -> Iterator[tuple[str, Flag]]:
    """(field name, main flag) of `cls`'s fields that declare one."""
    for field in dataclasses.fields(cls):
        flags = field.metadata.get("flags", ())
        if flags:
            yield field.name, flags[0]


# The --help groups, in the order --help lists them (Megatron's grouping).
NETWORK = "network size"
REGULARIZATION = "regularization and optimizer"
TRAINING = "batch, schedule and training"
PRECISION = "mixed precision"
FP8 = "fp8"
CHECKPOINTING = "checkpointing"
LOGGING = "logging"
DATA = "data and tokenizer"
DISTRIBUTED = "distributed"
DEEPSPEED = "deepspeed"
COMPAT = "Megatron-DeepSpeed compatibility (docs/guides/migrate.md)"
GROUPS = (NETWORK, REGULARIZATION, TRAINING, PRECISION, FP8, CHECKPOINTING, LOGGING, DATA, DISTRIBUTED, DEEPSPEED,
          COMPAT)
