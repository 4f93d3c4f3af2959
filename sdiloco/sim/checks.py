"""Argument checks shared by the simulators: a `ValueError` that names the bad value."""

import math


def check(ok: bool, field: str, value: object, allowed: str) -> None:
    """Raise `ValueError("field=value; expected allowed")` unless `ok`."""
    if not ok:
        raise ValueError(f"{field}={value!r}; expected {allowed}")


def positive(x: object) -> bool:
    """Whether `x` is a finite int or float > 0."""
    return isinstance(x, int | float) and math.isfinite(x) and x > 0
