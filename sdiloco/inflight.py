"""Work and storage proportional to a fragment: fragment groups and in-flight slots.

A fragment's elements are a static set: whole leaves and rows of stacked leaves. A
`Group` gathers those elements of a fragment out of the parameter leaves (its
*pieces*) and scatters them back, so that computing Δ, compressing, exchanging, the
outer step and the merge touch only the fragment being synchronised. Fragments with the
same shape signature share one group, whose row indices are a table indexed by the
member's position: one compiled loop body serves them all (e.g. every block fragment
of a stacked transformer), so the program does not grow with P.

The averaged outer gradient Δ̄ of a sent fragment waits in an in-flight *slot* until
its outer step (τ_min steps later). `make_layout` reads off the schedule how many
fragments can be in flight at once and gives each fragment a slot no other fragment
uses while it is in flight; the buffer is `[num_slots, slot_size]`, `slot_size` the
largest fragment. With the default schedule and τ < H / P one slot suffices.

How the loops are compiled, and why, is in docs/implementation.md.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int

from ._xla import loop_over_selected
from .fragments import Fragments
from .schedule import Schedule


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """Fragments with one shape signature: which leaves they touch, and which rows.

    Attributes:
        members: the fragment ids, in order.
        leaves: the parameter leaves the fragments touch (indices into the leaves).
        rows: per touched leaf, None (the whole leaf) or an int32 table
            `[len(members), r]` of the rows each member holds.
        shapes: per touched leaf, the shape of one member's piece.
    """

    members: tuple[int, ...]
    leaves: tuple[int, ...]
    rows: tuple[np.ndarray | None, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """Elements of one member fragment."""
        return int(sum(np.prod(s, dtype=np.int64) for s in self.shapes))

    def piece_fragments(self) -> Fragments:
        """The pieces as one fragment (groups: whole pieces, or their rows), for the
        compressors and the exchange."""
        labels = tuple(
            np.asarray(0, np.int32) if r is None else np.zeros(r.shape[1], np.int32)
            for r in self.rows
        )
        return Fragments(labels, self.shapes, 1, ("_".join(map(str, self.members)),))

    def unflatten(self, vector: Array) -> list[Array]:
        """The pieces laid out one after the other in `vector` (an in-flight slot)."""
        out, start = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape, dtype=np.int64))
            out.append(vector[start : start + n].reshape(shape))
            start += n
        return out


@dataclasses.dataclass(frozen=True)
class Visit:
    """One fragment of a group, as `Layout.for_each` visits it: it reads and writes
    the fragment's elements of any array shaped like the parameter leaves.

    Attributes:
        group: the fragment's group.
        p: the fragment's id (traced).
        rows: per touched leaf, None (the whole leaf) or the `[r]` rows it holds
            (traced: data to the compiler, see `Layout.for_each`).
    """

    group: Group
    p: Int[Array, ""]
    rows: tuple[Int[Array, " r"] | None, ...]

    @staticmethod
    def of(group: Group, j: Int[ArrayLike, ""]) -> "Visit":
        """Member j of `group`, outside a loop (e.g. to read a fragment in a test)."""
        rows = tuple(None if r is None else jnp.asarray(r)[j] for r in group.rows)
        return Visit(group, jnp.asarray(group.members, jnp.int32)[j], rows)

    def gather(self, leaves: list[Array], axis: int = 0) -> list[Array]:
        """The fragment's pieces of `leaves` (all the leaves; rows along `axis`)."""
        return [
            self.gather_one(k, leaves[i], axis) for k, i in enumerate(self.group.leaves)
        ]

    def scatter(
        self, leaves: list[Array], pieces: list[Array], axis: int = 0
    ) -> list[Array]:
        """`leaves` with the fragment's elements replaced by `pieces`."""
        leaves = list(leaves)
        for k, (i, piece) in enumerate(zip(self.group.leaves, pieces)):
            leaves[i] = self.scatter_one(k, leaves[i], piece, axis)
        return leaves

    def update(
        self,
        leaves: list[Array],
        others: list[Array],
        fn: Callable[[Array, Array], Array],
        axis: int = 0,
    ) -> list[Array]:
        """`leaves` with the fragment's piece x of each replaced by `fn(x, y)`, y
        the same piece of `others` (rows along `axis` of `leaves`, along the first
        axis of `others`), for an elementwise `fn` that may broadcast `y` against x.

        A stacked leaf is updated one row at a time, in place: the row is read,
        transformed and written back with its row axis kept (size 1), so no piece
        of the fragment's size is made.
        """
        leaves = list(leaves)
        for k, i in enumerate(self.group.leaves):
            x, y, rows = leaves[i], others[i], self.rows[k]
            if rows is None:
                leaves[i] = fn(x, y).astype(x.dtype)
                continue
            for r in range(rows.shape[0]):
                row = jax.lax.dynamic_slice_in_dim(x, rows[r], 1, axis)
                new = fn(row, jax.lax.dynamic_slice_in_dim(y, rows[r], 1, 0))
                x = jax.lax.dynamic_update_slice_in_dim(
                    x, new.astype(x.dtype), rows[r], axis
                )
            leaves[i] = x
        return leaves

    def gather_one(self, k: int, x: Array, axis: int = 0) -> Array:
        """The fragment's piece of `x`, an array shaped like touched leaf k (with
        `axis` leading batch axes).

        Rows are read (and written, `scatter_one`) one at a time, a dynamic slice
        each: slices work in any memory space (an offloaded θ_g lives in host
        memory, where a gather's index arithmetic cannot run) and let XLA update
        the leaf in place (docs/performance.md).
        """
        rows = self.rows[k]
        if rows is None:
            return x
        return jnp.stack(
            [
                jax.lax.dynamic_index_in_dim(x, rows[r], axis, keepdims=False)
                for r in range(rows.shape[0])
            ],
            axis,
        )

    def scatter_one(self, k: int, x: Array, piece: Array, axis: int = 0) -> Array:
        """`x` (shaped like touched leaf k) with the fragment's elements set to
        `piece`."""
        rows = self.rows[k]
        piece = piece.astype(x.dtype)
        if rows is None:
            return piece
        for r in range(rows.shape[0]):
            row = jax.lax.index_in_dim(piece, r, axis, keepdims=False)
            x = jax.lax.dynamic_update_index_in_dim(x, row, rows[r], axis)
        return x


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The groups of a partition and the in-flight slots of a schedule.

    Attributes:
        groups: the fragment groups.
        group_of: `[P]` the group of each fragment.
        index_in_group: `[P]` each fragment's position among its group's members.
        slot_of: `[P]` the in-flight slot of each fragment.
        num_slots: K, the most fragments in flight at once.
        slot_size: the elements of the largest fragment.
    """

    groups: tuple[Group, ...]
    group_of: np.ndarray
    index_in_group: np.ndarray
    slot_of: np.ndarray
    num_slots: int
    slot_size: int

    def read(self, slots: Array, group: Group, p: Int[ArrayLike, ""]) -> list[Array]:
        """Fragment p's pieces from its in-flight slot (`slots` is `[K, slot_size]`)."""
        k = jnp.asarray(self.slot_of)[p]
        row = jax.lax.dynamic_slice_in_dim(slots, k, 1, axis=0)[0, : group.size]
        return group.unflatten(row)

    def write(
        self, slots: Array, group: Group, p: Int[ArrayLike, ""], pieces: list[Array]
    ) -> Array:
        """`slots` with fragment p's pieces stored in its in-flight slot, one after
        the other (each written in place at its offset)."""
        k = jnp.asarray(self.slot_of)[p]
        offset = 0
        for piece in pieces:
            row = piece.reshape(1, -1).astype(slots.dtype)
            start = (k, jnp.asarray(offset, k.dtype))
            slots = jax.lax.dynamic_update_slice(slots, row, start)
            offset += row.shape[1]
        return slots

    def for_each(
        self,
        selected: Bool[Array, " P"],
        fn: Callable[[Visit, Any, Any], Any],
        carry: Any,
        inputs: Any = None,
    ) -> Any:
        """`carry = fn(visit, inputs, carry)` for every selected fragment p.

        One loop per group over the group's selected members (usually one fragment
        in all, often none): the program holds one copy of `fn` per group, not per
        fragment. Fragments are visited group by group, so `fn` must not depend on
        the order (each fragment touches only its own elements). `inputs` holds
        what `fn` only reads (θ_g when sending), `carry` what it updates; `fn`
        reads the state through them, never from a closure, so that none of its
        work can run outside the loop (`_xla.loop_over_selected`).

        The row tables go through the loop's barrier with the inputs: to the
        compiler, which rows a fragment holds is data. Known rows (a group of one
        member, whose table is a constant) let XLA read every row before any
        write, which it can do only on a copy of the leaf.
        """
        for group in self.groups:
            members = jnp.asarray(group.members, jnp.int32)
            tables = tuple(None if r is None else jnp.asarray(r) for r in group.rows)

            def body(j, inputs, carry, group=group, members=members):
                tables, inputs = inputs
                rows = tuple(None if t is None else t[j] for t in tables)
                return fn(Visit(group, members[j], rows), inputs, carry)

            selection = selected[members]
            carry = loop_over_selected(selection, body, (tables, inputs), carry)
        return carry


def make_layout(fragments: Fragments, schedule: Schedule) -> Layout:
    """Group the fragments by shape signature and give each one an in-flight slot."""
    signatures: dict[tuple, list[int]] = {}
    for p in range(fragments.num_fragments):
        sig = []
        for i, labels in enumerate(fragments.labels):
            if labels.ndim == 0:
                if int(labels) == p:
                    sig.append((i, None))
            elif np.any(labels == p):
                sig.append((i, int(np.sum(labels == p))))
        signatures.setdefault(tuple(sig), []).append(p)
    groups, group_of = [], np.zeros(fragments.num_fragments, np.int32)
    index_in = np.zeros(fragments.num_fragments, np.int32)
    for g, (sig, members) in enumerate(signatures.items()):
        rows, shapes = [], []
        for i, count in sig:
            shape = tuple(fragments.shapes[i])
            if count is None:
                rows.append(None)
                shapes.append(shape)
            else:
                table = [np.flatnonzero(fragments.labels[i] == p) for p in members]
                rows.append(np.asarray(table, np.int32))
                shapes.append((count,) + shape[1:])
        groups.append(
            Group(tuple(members), tuple(i for i, _ in sig), tuple(rows), tuple(shapes))
        )
        for j, p in enumerate(members):
            group_of[p], index_in[p] = g, j
    slot_of, num_slots = assign_slots(schedule)
    slot_size = max(g.size for g in groups)
    return Layout(tuple(groups), group_of, index_in, slot_of, num_slots, slot_size)


def assign_slots(schedule: Schedule) -> tuple[np.ndarray, int]:
    """A slot per fragment such that no two fragments in flight at once share one.

    A fragment sent at t holds its slot over `[t, t + τ_min]` (its outer step reads it
    at `t + τ_min`; a send at that step needs its own slot). The schedule is periodic
    with period H once every fragment has been sent, so two periods after the last
    first send show every overlap; fragments are coloured greedily.

    Returns:
        `slot_of` `[P]` and the number of slots.
    """
    h, tau = schedule.sync_every, schedule.min_overlap
    horizon = max(schedule.first_send) + 2 * h + tau + 1
    busy: dict[int, list[int]] = {}  # step -> fragments holding a slot
    for p, f in enumerate(schedule.first_send):
        for t in range(f, horizon, h):
            for s in range(t, t + tau + 1):
                busy.setdefault(s, []).append(p)
    conflicts: dict[int, set[int]] = {p: set() for p in range(schedule.num_fragments)}
    for holders in busy.values():
        for p in holders:
            conflicts[p].update(q for q in holders if q != p)
    slot_of = np.zeros(schedule.num_fragments, np.int32)
    for p in range(schedule.num_fragments):
        taken = {int(slot_of[q]) for q in conflicts[p] if q < p}
        slot_of[p] = min(k for k in range(schedule.num_fragments) if k not in taken)
    return slot_of, int(slot_of.max()) + 1
