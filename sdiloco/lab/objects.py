"""Objects in a config: a transform, a plug-in or an aggregator given as itself.

A config field that takes an object (`InnerConfig.transform`,
`OuterConfig.transform`, `StreamingConfig.plugins`, `StreamingConfig.aggregator`,
`StreamingConfig.compressor`) records in `config.json` what ran:

- one of ours (a plug-in, aggregator or compressor of `sdiloco`, an `eqx.Module`
  whose fields are its constructor's arguments): its qualified name and those
  arguments, `{"object": "sdiloco.aggregation.TrimmedMean", "args": {"trim": 0.25}}`;
  `from_dict` builds it again;
- a call recorded with `call(fn, **kwargs)`, e.g. `call(optax.lion,
  learning_rate=3e-4)`: the function's qualified name and the arguments, when both
  are plain data; built again the same way;
- anything else (a user's class, an optax transform built elsewhere): its name and
  `"recreatable": false`, with a note. Such a config trains, and its record says
  what ran, but it cannot be re-created from the file: loading it raises a
  `ValueError`, and the record machinery never counts such a record as
  reproducible (`recreatable`).
"""

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import equinox as eqx


NOT_RECREATABLE = (
    "a user's object: config.json records its name, not how to build it, so this "
    "run cannot be re-created from the file"
)


@dataclasses.dataclass(frozen=True)
class Call:
    """`fn(**kwargs)`, recorded as the function's qualified name and its arguments.

    Attributes:
        fn: the function (e.g. `optax.lion`).
        kwargs: its keyword arguments (plain data, for a record that re-creates it).
    """

    fn: Callable[..., Any]
    kwargs: dict[str, Any]

    def build(self) -> Any:
        """The object: `fn(**kwargs)`."""
        return self.fn(**self.kwargs)


def call(fn: Callable[..., Any], **kwargs: Any) -> Call:
    """`fn(**kwargs)` as a config records it, e.g. `call(optax.lion, learning_rate=
    3e-4)` for `InnerConfig.transform`."""
    if not callable(fn):
        raise ValueError(f"call(fn={fn!r}): fn must be callable.")
    return Call(fn, dict(kwargs))


def build(value: Any) -> Any:
    """The object a field holds (a `Call` is called; anything else is itself)."""
    return value.build() if isinstance(value, Call) else value


def encode(value: Any) -> Any:
    """What `config.json` records of an object field (see the module)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, Call):
        name = _name(value.fn)
        if _importable(name) is value.fn and _plain(value.kwargs):
            return {"object": name, "call": True, "args": dict(value.kwargs)}
        return {
            "object": name,
            "call": True,
            "recreatable": False,
            "note": NOT_RECREATABLE,
        }
    name = _name(type(value))
    if name.startswith("sdiloco.") and isinstance(value, eqx.Module):
        args = {
            f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
        if _plain(args) and _importable(name) is type(value):
            return {"object": name, "args": args}
    return {"object": name, "recreatable": False, "note": NOT_RECREATABLE}


def decode(data: Any, field: str) -> Any:
    """The object `encode` recorded in `data` for config field `field`.

    Raises:
        ValueError: naming the field and the object, when the record cannot be
            re-created (`"recreatable": false`) or names nothing importable.
    """
    if isinstance(data, list):
        return tuple(decode(v, field) for v in data)
    if not isinstance(data, dict) or "object" not in data:
        return data
    name = data["object"]
    if data.get("recreatable", True) is False:
        raise ValueError(
            f"{field}: {name} cannot be re-created from config.json ({data.get('note', NOT_RECREATABLE)}); "
            "build the config in Python with the object itself."
        )
    target = _importable(name)
    if target is None:
        raise ValueError(
            f"{field}: {name!r} is not importable; allowed: a qualified name."
        )
    args = {k: decode(v, field) for k, v in data.get("args", {}).items()}
    if data.get("call"):
        return Call(target, args)
    return target(**args)


def recreatable(data: Any) -> bool:
    """Whether a config's JSON data holds only objects it can build again."""
    if isinstance(data, dict):
        if data.get("recreatable", True) is False:
            return False
        return all(recreatable(v) for v in data.values())
    if isinstance(data, list):
        return all(recreatable(v) for v in data)
    return True


def _name(obj: Any) -> str:
    """`obj`'s qualified name, by its package's public path where it has one
    (`optax.lion` rather than `optax._src.alias.lion`)."""
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", repr(obj))
    public = f"{module.split('.')[0]}.{qualname}"
    return public if _importable(public) is obj else f"{module}.{qualname}"


def _importable(name: str) -> Any:
    """The object a qualified name names, or None."""
    module, _, attr = name.rpartition(".")
    while module:
        try:
            target: Any = importlib.import_module(module)
        except ImportError:
            module, _, head = module.rpartition(".")
            attr = f"{head}.{attr}"
            continue
        for part in attr.split("."):
            target = getattr(target, part, None)
        return target
    return None


def _plain(data: Any) -> bool:
    """Whether `data` is JSON data (recorded objects included)."""
    if data is None or isinstance(data, str | int | float | bool):
        return True
    if isinstance(data, list | tuple):
        return all(_plain(v) for v in data)
    if isinstance(data, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in data.items())
    return False
