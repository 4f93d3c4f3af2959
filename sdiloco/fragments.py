"""Fragments: a partition of the parameters into P disjoint parts that sync in turn.

Streaming DiLoCo (Douillard et al., 2025, §2.2, Fig. 2) synchronises one *fragment* of
the model at a time. A fragment here is described by an integer **label** per array leaf
of the parameters, or per row of a leaf's leading axis (for transformers whose blocks are
stacked on one layer axis, a row is a layer). Labels are host-side NumPy constants: inside
the jitted step a fragment is selected with array masks built from them, so which
fragment syncs at step t is traced data and one compiled program serves every step.

Only inexact (floating-point) array leaves are parameters; every other leaf (integers,
functions, static fields of an Equinox module) is ignored.

Three ways to build fragments:

- `fragments_by_layer`: by layer index for models whose blocks are stacked on one axis,
  strided or sequential, with all non-block parameters in fragment 0
  (docs/contract.md §1);
- `fragments_from_path`: a label computed from each leaf's key path (e.g. the
  index of `model.layers[i]` in an Equinox model whose layers are a list);
- `fragments_from_labels`: an explicit label per leaf or per row, for any pytree;
- `fragments_from_masks`: one boolean mask per fragment, checked to partition exactly.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from .custom_types import Params


@dataclasses.dataclass(frozen=True, eq=False)
class Fragments:
    """A partition of the parameters' elements into `num_fragments` fragments.

    Attributes:
        labels: one integer NumPy array per parameter leaf (in `jax.tree.leaves` order of
            the inexact-array part of the parameters): shape `()` puts the whole leaf in
            one fragment, shape `(leaf.shape[0],)` gives one label per row.
        shapes: the shape of each parameter leaf.
        num_fragments: P; every label is in `[0, P)` and every fragment is non-empty.
        names: optional display names of the fragments (e.g. "1_2" when one compiled
            branch serves fragments 1 and 2), used in the exchange's name scopes.
        first_send: the step each fragment is first sent, f_p >= 1 (the stagger of
            the schedule); None: `schedule.default_first_send`, `H + round(p·H/P)`.
            Set it with `dataclasses.replace(fragments, first_send=(...))`.
    """

    labels: tuple[np.ndarray, ...]
    shapes: tuple[tuple[int, ...], ...]
    num_fragments: int
    names: tuple[str, ...] | None = None
    first_send: tuple[int, ...] | None = None

    def mask(self, selected: Bool[Array, "*batch P"]) -> list[Bool[Array, "..."]]:
        """Boolean masks of the selected fragments, one per leaf, broadcastable to it.

        Args:
            selected: which fragments to select (traced), optionally with leading batch
                axes (e.g. `[M, P]`: one selection per replica).

        Returns:
            One mask per parameter leaf, of shape `selected.shape[:-1] + labels.shape +
            (1,) * k`: it broadcasts against the leaf (with the same leading batch axes)
            without rank promotion.
        """
        batch = selected.shape[:-1]
        masks = []
        for labels, shape in zip(self.labels, self.shapes):
            m = selected[..., jnp.asarray(labels)]
            trail = (1,) * (len(shape) - labels.ndim)
            masks.append(m.reshape(batch + labels.shape + trail))
        return masks

    def sizes(self) -> np.ndarray:
        """Number of parameter elements in each fragment, shape `[P]`."""
        return self.group_sum(lambda shape: int(np.prod(shape, dtype=np.int64)))

    def group_sum(self, cost: Callable[[tuple[int, ...]], int]) -> np.ndarray:
        """Sum `cost(shape)` over the groups of each fragment (a group = a leaf or a row).

        A group is what a quantizer scales as one tensor: a whole leaf, or one row of a
        leaf labelled per row (one layer of a stacked transformer).

        Returns:
            Python integers (exact, no overflow) in an object array of shape `[P]`.
        """
        total = np.zeros(self.num_fragments, dtype=object)
        for labels, shape in zip(self.labels, self.shapes):
            if labels.ndim == 0:
                total[int(labels)] += cost(shape)
            else:
                row = cost(shape[1:])
                for p in labels.tolist():
                    total[p] += row
        return total


def parameter_leaves(params: Params) -> list[Array]:
    """The parameter leaves of `params`: its inexact arrays, in `jax.tree.leaves` order."""
    return jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))


def fragments_by_layer(
    params: Params,
    *,
    blocks: Callable[[Params], Any],
    layers_per_fragment: int = 3,
    pattern: str = "strided",
) -> Fragments:
    """Fragments by layer index, for a model whose blocks are stacked on one axis or
    held in a list (or tuple) of layers.

    The L blocks (0-based ℓ) form `P_b = L / layers_per_fragment` fragments, numbered
    1..P_b: strided puts block ℓ in fragment `1 + ℓ mod P_b`, sequential in
    `1 + ℓ // layers_per_fragment`. Every other parameter (embeddings, final norm, head)
    is fragment 0, so `P = P_b + 1`; a model with no non-block parameters has fragments
    `0..P_b-1` instead (docs/contract.md §1; docs/paper.md §1.4).

    Args:
        params: the parameters (any pytree, e.g. an Equinox model).
        blocks: selects the blocks, e.g. `lambda model: model.blocks`: either one
            subtree whose parameter leaves share a leading (layer) dimension L, or a
            list or tuple of L layers (`lambda mlp: mlp.layers` for an
            `eqx.nn.MLP`), layer ℓ being element ℓ.
        layers_per_fragment: blocks per fragment; must divide L.
        pattern: `"strided"` (default, as in the paper) or `"sequential"`.

    Returns:
        The fragments.

    Raises:
        ValueError: on an unknown pattern, an L that `layers_per_fragment` does not
            divide, block leaves of different leading sizes, or no block leaves.

    Examples:
        >>> import jax.numpy as jnp
        >>> params = {"embed": jnp.zeros((4, 2)), "blocks": {"w": jnp.zeros((6, 2, 2))}}
        >>> frags = fragments_by_layer(params, blocks=lambda p: p["blocks"])
        >>> frags.num_fragments, frags.labels[0].tolist()
        (3, [1, 2, 1, 2, 1, 2])
        >>> layers = {"layers": [{"w": jnp.zeros((2, 2))} for _ in range(4)]}
        >>> fragments_by_layer(layers, blocks=lambda p: p["layers"],
        ...                    layers_per_fragment=2).num_fragments
        2
    """
    if pattern not in ("strided", "sequential"):
        raise ValueError(
            f"pattern={pattern!r} is not supported; allowed: 'strided', 'sequential'."
        )
    if not isinstance(layers_per_fragment, int) or layers_per_fragment < 1:
        raise ValueError(
            f"layers_per_fragment={layers_per_fragment!r}; must be an integer >= 1."
        )
    try:
        selected = blocks(params)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ValueError(f"blocks={blocks!r} does not select a subtree: {e}") from e
    if isinstance(selected, list | tuple):
        return _by_layer_list(
            params, blocks, len(selected), layers_per_fragment, pattern
        )
    flags = jax.tree.map(lambda _: False, params)
    try:
        flags = eqx.tree_at(
            blocks, flags, replace_fn=lambda sub: jax.tree.map(lambda _: True, sub)
        )
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ValueError(f"blocks={blocks!r} does not select a subtree: {e}") from e
    leaves = jax.tree.leaves(params)
    flag_leaves = jax.tree.leaves(flags)
    is_block = [f for leaf, f in zip(leaves, flag_leaves) if eqx.is_inexact_array(leaf)]
    shapes = [tuple(x.shape) for x in parameter_leaves(params)]
    block_shapes = [s for s, b in zip(shapes, is_block) if b]
    if not block_shapes:
        raise ValueError("blocks selects no floating-point array leaves.")
    layer_dims = {s[0] if s else None for s in block_shapes}
    if len(layer_dims) != 1 or None in layer_dims:
        raise ValueError(
            "every parameter leaf under `blocks` must share one leading layer axis; "
            f"got leading sizes {sorted(map(str, layer_dims))}."
        )
    num_layers = int(next(iter(layer_dims)) or 0)
    block_labels = _layer_labels(num_layers, layers_per_fragment, pattern)
    has_rest = not all(is_block)
    block_labels = block_labels + int(has_rest)
    labels = tuple(
        block_labels.astype(np.int32) if b else np.asarray(0, np.int32)
        for b in is_block
    )
    num_block_frags = num_layers // layers_per_fragment
    return Fragments(labels, tuple(shapes), num_block_frags + int(has_rest))


def _layer_labels(num_layers: int, layers_per_fragment: int, pattern: str):
    """The 0-based block fragment of each of `num_layers` layers."""
    if num_layers % layers_per_fragment:
        raise ValueError(
            f"layers_per_fragment={layers_per_fragment} does not divide the number of "
            f"layers {num_layers}; allowed: a divisor of {num_layers}."
        )
    layer = np.arange(num_layers)
    if pattern == "strided":
        return layer % (num_layers // layers_per_fragment)
    return layer // layers_per_fragment


def _by_layer_list(
    params: Params, blocks: Callable, count: int, layers_per_fragment: int, pattern
) -> Fragments:
    """`fragments_by_layer` where `blocks` selects a list or tuple of `count`
    layers: every leaf of layer ℓ is labelled with ℓ's fragment, the rest 0."""
    if count == 0:
        raise ValueError("blocks selects an empty list of layers.")
    block_labels = _layer_labels(count, layers_per_fragment, pattern).tolist()
    rest = -1
    tree = jax.tree.map(lambda _: rest, params)
    tree = eqx.tree_at(
        blocks,
        tree,
        replace_fn=lambda layers: type(layers)(
            jax.tree.map(lambda _: block_labels[i], layer)
            for i, layer in enumerate(layers)
        ),
    )
    inside = [
        lab != rest
        for leaf, lab in zip(jax.tree.leaves(params), jax.tree.leaves(tree))
        if eqx.is_inexact_array(leaf)
    ]
    if not any(inside):
        raise ValueError("blocks selects no floating-point array leaves.")
    shift = 0 if all(inside) else 1  # the non-block parameters are fragment 0
    return fragments_from_labels(
        params, jax.tree.map(lambda lab: 0 if lab == rest else lab + shift, tree)
    )


def fragments_from_path(
    params: Params, label: Callable[[tuple, Array], Any]
) -> Fragments:
    """Fragments from a function of each parameter leaf's key path.

    Args:
        params: the parameters (any pytree, e.g. an Equinox model).
        label: `label(path, leaf) -> int` (the whole leaf) or an integer array of
            shape `(leaf.shape[0],)` (one label per row), for each floating-point
            array leaf; `path` is its JAX key path (`jax.tree_util.keystr(path)`
            reads it as text, e.g. `.layers[1].weight`). Labels must use every
            value of `0..P-1`.

    Returns:
        The fragments.

    Raises:
        ValueError: as `fragments_from_labels`.

    Examples:
        >>> import jax.numpy as jnp
        >>> params = {"embed": jnp.zeros(3), "layers": [jnp.zeros(2), jnp.zeros(2)]}
        >>> def by_layer(path, leaf):  # layer i -> fragment 1 + i, the rest 0
        ...     return 1 + path[1].idx if path[0].key == "layers" else 0
        >>> fragments_from_path(params, by_layer).num_fragments
        3
    """
    labels = jax.tree_util.tree_map_with_path(
        lambda path, leaf: label(path, leaf) if eqx.is_inexact_array(leaf) else 0,
        params,
    )
    return fragments_from_labels(params, labels)


def fragments_from_labels(params: Params, labels: Any) -> Fragments:
    """Fragments from an explicit integer label per leaf, or per row of a leaf.

    Args:
        params: the parameters.
        labels: a pytree with the structure of `params` whose entry for each parameter
            leaf is an integer (the whole leaf) or an integer array of shape
            `(leaf.shape[0],)` (one label per row); entries for non-parameter leaves are
            ignored. Labels must use every value of `0..P-1` (no gap).

    Returns:
        The fragments.

    Raises:
        ValueError: on a structure mismatch, a label of the wrong shape, a negative
            label, or a fragment id in `0..P-1` that labels nothing (a gap).

    Examples:
        >>> import jax.numpy as jnp
        >>> params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 4))}
        >>> fragments_from_labels(params, {"a": 0, "b": [1, 0]}).num_fragments
        2
    """
    p_struct = jax.tree.structure(params)
    try:
        pairs = p_struct.flatten_up_to(labels)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"labels (a {type(labels).__name__}) must have the structure of params, "
            "one entry per leaf (for an Equinox model: the model with an integer in "
            "place of each array); to label by layer or by name, use "
            "fragments_by_layer(params, blocks=lambda m: m.layers) or "
            "fragments_from_path(params, fn) instead."
        ) from e
    out, shapes = [], []
    for leaf, lab in zip(jax.tree.leaves(params), pairs):
        if not eqx.is_inexact_array(leaf):
            continue
        lab = np.asarray(lab)
        if lab.dtype.kind not in "iu":
            raise ValueError(f"labels must be integers; got dtype {lab.dtype}.")
        if lab.ndim > 1 or (
            lab.ndim == 1 and (not leaf.ndim or lab.shape[0] != leaf.shape[0])
        ):
            raise ValueError(
                f"a label for a leaf of shape {leaf.shape} must be a scalar or have "
                f"shape ({leaf.shape[0] if leaf.ndim else '-'},); got {lab.shape}."
            )
        out.append(lab.astype(np.int32))
        shapes.append(tuple(leaf.shape))
    if not out:
        raise ValueError("params has no floating-point array leaves.")
    used = np.unique(np.concatenate([x.reshape(-1) for x in out]))
    if used.min() < 0:
        raise ValueError(f"labels must be >= 0; got {int(used.min())}.")
    num = int(used.max()) + 1
    missing = sorted(set(range(num)) - set(used.tolist()))
    if missing:
        raise ValueError(
            f"fragments {missing} label no parameter (a gap); labels must use every "
            f"value of 0..{num - 1}."
        )
    return Fragments(tuple(out), tuple(shapes), num)


def fragments_from_masks(params: Params, masks: Sequence[Any]) -> Fragments:
    """Fragments from one boolean mask per fragment, checked to partition exactly.

    Args:
        params: the parameters.
        masks: P pytrees with the structure of `params`; each entry is a bool (the whole
            leaf) or a bool array of shape `(leaf.shape[0],)` (per row). Every parameter
            element must be in exactly one mask.

    Returns:
        The fragments, fragment p being `masks[p]`.

    Raises:
        ValueError: when an element is in two masks (overlap) or in none (gap).
    """
    if len(masks) < 1:
        raise ValueError("masks must hold at least one fragment.")
    p_struct = jax.tree.structure(params)
    per_mask = []
    for i, m in enumerate(masks):
        try:
            per_mask.append(p_struct.flatten_up_to(m))
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"masks[{i}] must have the structure of params ({p_struct}); {e}"
            ) from e
    labels = []
    for j, leaf in enumerate(jax.tree.leaves(params)):
        if not eqx.is_inexact_array(leaf):
            labels.append(None)
            continue
        rows = leaf.shape[0] if leaf.ndim else 1
        count = np.zeros(rows, np.int64)
        lab = np.zeros(rows, np.int32)
        for p, flat in enumerate(per_mask):
            m = np.broadcast_to(np.asarray(flat[j], bool), (rows,))
            count += m
            lab = np.where(m, p, lab)
        if (count > 1).any():
            raise ValueError(
                f"parameter leaf {j} (shape {leaf.shape}) is in more than one fragment "
                "(overlap); masks must be disjoint."
            )
        if (count == 0).any():
            raise ValueError(
                f"parameter leaf {j} (shape {leaf.shape}) is in no fragment (gap); "
                "masks must cover every parameter."
            )
        labels.append(lab[0] if (lab == lab[0]).all() else lab)
    return fragments_from_labels(params, jax.tree.unflatten(p_struct, labels))


def single_fragment(params: Params) -> Fragments:
    """The whole model as one fragment (vanilla DiLoCo, P = 1)."""
    shapes = tuple(tuple(x.shape) for x in parameter_leaves(params))
    if not shapes:
        raise ValueError("params has no floating-point array leaves.")
    return Fragments(tuple(np.asarray(0, np.int32) for _ in shapes), shapes, 1)


def check_matches(fragments: Fragments, params: Params) -> None:
    """Raise ValueError unless `fragments` was built for parameters shaped like `params`."""
    shapes = tuple(tuple(x.shape) for x in parameter_leaves(params))
    if shapes != fragments.shapes:
        raise ValueError(
            "fragments were built for parameter leaves of shapes "
            f"{fragments.shapes}, but the parameters have shapes {shapes}."
        )
