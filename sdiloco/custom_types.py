"""jaxtyping aliases shared across sdiloco (defined once, as in diffrax)."""

from typing import Any

from jaxtyping import Array, PyTree


Params = PyTree[Any, "P"]
"""Parameters of one model: any pytree (an Equinox module included)."""

Replicated = PyTree[Any, "P"]
"""The same structure as `Params`, every array leaf with a leading replica axis M."""

Batch = PyTree[Any]
"""One step of data for all replicas: every leaf has a leading axis of size M."""

Metrics = dict[str, Array]
"""Flat, `/`-namespaced metrics of one step."""
