"""Validation of config fields and the one loader of configs from JSON-like data.

Every config is a frozen dataclass checked in `__post_init__` with the helpers here,
each raising `ValueError` naming the field, the value and what is allowed. `from_dict`
builds any config (nested configs from dicts, tuples from lists, unknown fields
refused); a field typed as a union of configs that carry a `kind` (the method configs)
is built from the class whose `kind` the data names.

A field that holds an object (a transform, a plug-in, an aggregator) is declared
with `object_field(default)`: `to_dict` records it with `objects.encode` and
`from_dict` builds it with `objects.decode`.

A field added after records were written is declared with `new_field(default)`:
`to_dict` leaves it out while it holds its default, so the JSON of every config that
does not use it, and the run-record keys hashed from that JSON
(`sdiloco.paper.experiments.record_key`), stay as they were; `from_dict` reads it
either way.
"""

import copy
import dataclasses
import types
import typing
from typing import Any

from . import objects


_NEW = "sdiloco.new_field"
_OBJECT = "sdiloco.object_field"


def from_dict(cls: Any, data: dict) -> Any:
    """A config of class `cls` (or of the union member named by `data["kind"]`).

    Raises:
        ValueError: naming the config, the unknown field and the allowed ones, or the
            unknown `kind` and the allowed ones.
    """
    data = dict(data)
    if isinstance(cls, types.UnionType):
        cls = _member(cls, data.pop("kind", None))
    elif "kind" in data and hasattr(cls, "kind") and not _is_field(cls, "kind"):
        kind = data.pop("kind")
        if kind != cls.kind:
            raise ValueError(f"kind={kind!r} for a {cls.__name__} ({cls.kind!r}).")
    check_fields(cls, data)
    hints = typing.get_type_hints(cls)
    objects_ = {f.name for f in dataclasses.fields(cls) if f.metadata.get(_OBJECT)}
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if name in objects_:
            value = objects.decode(value, f"{cls.__name__}.{name}")
        elif isinstance(value, dict) and _is_config_union(hint):
            value = from_dict(hint, value)
        elif isinstance(value, dict) and dataclasses.is_dataclass(hint):
            value = from_dict(hint, value)
        elif isinstance(value, dict) and _optional_config(hint) is not None:
            value = from_dict(_optional_config(hint), value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def new_field(default: Any) -> Any:
    """A dataclass field with an immutable `default`, left out of `to_dict` while it
    holds that default (see the module docstring)."""
    return dataclasses.field(default=default, metadata={_NEW: True})


def object_field(default: Any) -> Any:
    """A `new_field` that holds an object (`objects`): recorded by name and
    arguments."""
    return dataclasses.field(default=default, metadata={_NEW: True, _OBJECT: True})


def to_dict(config: Any) -> Any:
    """`dataclasses.asdict`, leaving out every `new_field` that holds its default
    (object fields recorded with `objects.encode`)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        out = {}
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if f.metadata.get(_NEW) and _same(value, f.default):
                continue
            out[f.name] = (
                objects.encode(value) if f.metadata.get(_OBJECT) else to_dict(value)
            )
        return out
    if isinstance(config, tuple | list):
        return type(config)(to_dict(v) for v in config)
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return copy.deepcopy(config)


def replace(config: Any, **changes: Any) -> Any:
    """`dataclasses.replace` that refuses unknown fields (naming them) and applies
    dicts of changes to nested configs."""
    check_fields(type(config), changes)
    nested = {
        f.name: replace(getattr(config, f.name), **changes[f.name])
        for f in dataclasses.fields(config)
        if isinstance(changes.get(f.name), dict)
        and dataclasses.is_dataclass(getattr(config, f.name))
    }
    return dataclasses.replace(config, **{**changes, **nested})


def check_fields(cls: type, changes: dict) -> None:
    """Raise ValueError unless every key of `changes` is a field of `cls`."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in changes:
        if key not in names:
            raise ValueError(
                f"{cls.__name__} has no field {key!r}; its fields: {names}."
            )


def coerce(config: Any, name: str, cls: type) -> None:
    """In `__post_init__`: build field `name` from a dict, if it was given one."""
    value = getattr(config, name)
    if isinstance(value, dict):
        object.__setattr__(config, name, from_dict(cls, value))


def positive(name: str, value: Any) -> None:
    """A number > 0."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r}; must be a number > 0.")


def positive_int(name: str, value: Any) -> None:
    """An integer >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; must be an integer >= 1.")


def nonnegative_int(name: str, value: Any) -> None:
    """An integer >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r}; must be an integer >= 0.")


def choice(name: str, value: Any, allowed: tuple) -> None:
    """One of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {allowed}.")


def in_range(name, value, low, high, allowed: str, open_high: bool = False) -> None:
    """A number in `[low, high]` (`[low, high)` with `open_high`; no bound if None)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and value >= low
    if ok and high is not None:
        ok = value < high if open_high else value <= high
    if not ok:
        raise ValueError(f"{name}={value!r}; must be in {allowed}.")


def _is_field(cls: type, name: str) -> bool:
    """Whether `name` is a field of `cls` (not a class variable such as a method
    config's `kind`)."""
    return any(f.name == name for f in dataclasses.fields(cls))


def _optional_config(hint: Any) -> Any:
    """The config class of a `Config | None` hint, else None."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    members = [a for a in args if a is not type(None)]
    if len(args) == 2 and len(members) == 1 and dataclasses.is_dataclass(members[0]):
        return members[0]
    return None


def _is_config_union(hint: Any) -> bool:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    return bool(args) and all(hasattr(a, "kind") for a in args)


def _member(union: Any, kind: Any) -> type:
    members = {a.kind: a for a in typing.get_args(union)}
    if kind not in members:
        raise ValueError(f"method kind={kind!r}; allowed: {sorted(members)}.")
    return members[kind]


def _same(value: Any, default: Any) -> bool:
    """Whether a field holds its default (an object compared by identity first:
    an array-holding module's `==` is not a bool)."""
    if value is default:
        return True
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # an object whose == is elementwise
        return False
