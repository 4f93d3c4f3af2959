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
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int

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

    def gather(self, leaves: list[Array], j: Int[ArrayLike, ""], axis: int = 0):
        """Member j's pieces of `leaves` (rows taken along `axis`)."""
        return [
            self.gather_one(k, leaves[i], j, axis) for k, i in enumerate(self.leaves)
        ]

    def scatter(
        self,
        leaves: list[Array],
        j: Int[ArrayLike, ""],
        pieces: list[Array],
        axis: int = 0,
    ) -> list[Array]:
        """`leaves` with member j's elements replaced by `pieces`."""
        leaves = list(leaves)
        for k, (i, piece) in enumerate(zip(self.leaves, pieces)):
            leaves[i] = self.scatter_one(k, leaves[i], j, piece, axis)
        return leaves

    def gather_one(
        self,
        k: int,
        x: Array,
        j: Int[ArrayLike, ""],
        axis: int = 0,
        fused: bool = False,
    ) -> Array:
        """Member j's piece of `x`, an array shaped like touched leaf k (with `axis`
        leading batch axes).

        `fused`: for reads inside `Visit.isolated`, whose conditional has read
        everything before any write to the leaves: strided or contiguous rows are
        read as one slice, which XLA fuses into the computation. Otherwise rows are
        read one by one (see `ROW_BY_ROW`): a slice read beside an in-place update
        of the same leaf made XLA copy the leaf whole.
        """
        rows = self.rows[k]
        if rows is None:
            return x
        start, stride = _progression(rows, x.shape[axis])
        if rows.shape[1] <= ROW_BY_ROW and not (fused and stride is not None):
            table = jnp.asarray(rows)[j]
            return jnp.stack(
                [
                    jax.lax.dynamic_index_in_dim(x, table[r], axis, keepdims=False)
                    for r in range(rows.shape[1])
                ],
                axis,
            )
        if stride is None:  # any rows: a gather
            return jnp.take(x, jnp.asarray(rows)[j], axis)
        first = jnp.asarray(start)[j]
        if stride == 1:  # contiguous rows: a dynamic slice
            return jax.lax.dynamic_slice_in_dim(x, first, rows.shape[1], axis)
        # Every `stride`-th row from `first`: view the rows as [count, stride].
        folded = _fold(x, axis, rows.shape[1], stride)
        return jax.lax.dynamic_index_in_dim(folded, first, axis + 1, keepdims=False)

    def scatter_one(
        self, k: int, x: Array, j: Int[ArrayLike, ""], piece: Array, axis: int = 0
    ) -> Array:
        """`x` (shaped like touched leaf k) with member j's elements set to `piece`."""
        rows = self.rows[k]
        piece = piece.astype(x.dtype)
        if rows is None:
            return piece
        if rows.shape[1] <= ROW_BY_ROW:
            table = jnp.asarray(rows)[j]
            for r in range(rows.shape[1]):
                row = jax.lax.index_in_dim(piece, r, axis, keepdims=False)
                x = jax.lax.dynamic_update_index_in_dim(x, row, table[r], axis)
            return x
        start, stride = _progression(rows, x.shape[axis])
        if stride is None:
            index = (slice(None),) * axis + (jnp.asarray(rows)[j],)
            return x.at[index].set(piece)
        first = jnp.asarray(start)[j]
        if stride == 1:
            return jax.lax.dynamic_update_slice_in_dim(x, piece, first, axis)
        folded = _fold(x, axis, rows.shape[1], stride)
        new = jax.lax.dynamic_update_index_in_dim(folded, piece, first, axis + 1)
        return new.reshape(x.shape)

    def update_one(
        self,
        k: int,
        x: Array,
        j: Int[ArrayLike, ""],
        fn: Callable[..., Array],
        others: tuple[Array, ...],
        axes: tuple[int, ...],
        unknown_zero: Int[ArrayLike, ""],
    ) -> Array:
        """`x` (shaped like touched leaf k) with member j's piece `p` replaced by
        `fn(p, *pieces of others)`, for an elementwise `fn` (it may broadcast).

        `axes` gives the row axis of `x`, then of each of `others`. A piece of at most
        `ROW_BY_ROW` rows is updated one row at a time, each row read from `x` as it
        is after the writes before it: XLA then fuses the read, `fn` and the write
        into one in-place update, where a computation in a `Visit.isolated` writes
        its result out and copies it in (measured on the merge of a 0.5M-value
        fragment of 2 replicas on XLA:CPU: 0.57 ms less per arrival). `fn` then
        gets rows that keep their row axis, of size 1: a row read without it and
        written back with it (a reshape between the two) made XLA:CPU copy each row
        out of `x` before its update (8 rows of `[2, 16, 256, 256]`: 0.23-0.29 ms
        against 0.10-0.12 with the axis kept).
        `unknown_zero` is added to every row index: a value that is 0 whenever this
        runs but that XLA cannot prove so (`~visit.live`). With constant row indices
        (a group of one member) XLA proves the rows apart and reads them from `x`
        before the writes, which makes it copy the leaf whole.
        """
        rows = self.rows[k]
        if rows is None:
            return fn(x, *others).astype(x.dtype)
        if rows.shape[1] > ROW_BY_ROW:
            pieces = [
                self.gather_one(k, a, j, axis) for a, axis in zip((x,) + others, axes)
            ]
            return self.scatter_one(k, x, j, fn(*pieces), axes[0])
        table = jnp.asarray(rows)[j] + unknown_zero
        for r in range(rows.shape[1]):
            pieces = _rows((x,) + others, axes, table[r], keepdims=True)
            x = jax.lax.dynamic_update_index_in_dim(
                x, fn(*pieces).astype(x.dtype), table[r], axes[0]
            )
        return x

    def piece_fragments(self) -> Fragments:
        """The pieces as one fragment (groups: whole pieces, or their rows), for the
        compressors and the exchange."""
        labels = tuple(
            np.asarray(0, np.int32) if r is None else np.zeros(r.shape[1], np.int32)
            for r in self.rows
        )
        return Fragments(labels, self.shapes, 1, ("_".join(map(str, self.members)),))

    def flatten(self, pieces: list[Array]) -> Array:
        """One vector of the pieces (for an in-flight slot)."""
        return jnp.concatenate([x.reshape(-1) for x in pieces])

    def unflatten(self, vector: Array) -> list[Array]:
        """Inverse of `flatten` (on the first `size` elements of `vector`)."""
        out, start = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape, dtype=np.int64))
            out.append(vector[start : start + n].reshape(shape))
            start += n
        return out


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
        row = jax.lax.dynamic_slice(slots, (k, 0 * k), (1, group.size))
        return group.unflatten(row[0])

    def write(
        self, slots: Array, group: Group, p: Int[ArrayLike, ""], pieces: list[Array]
    ) -> Array:
        """`slots` with fragment p's pieces stored in its in-flight slot."""
        k = jnp.asarray(self.slot_of)[p]
        row = group.flatten(pieces).astype(slots.dtype)[None]
        return jax.lax.dynamic_update_slice(slots, row, (k, 0 * k))

    def write_rows(
        self,
        slots: Array,
        group: Group,
        p: Int[ArrayLike, ""],
        j: Int[ArrayLike, ""],
        fn: Callable[..., Array],
        sources: tuple[list[Array], ...],
        axes: tuple[int, ...],
    ) -> Array:
        """`slots` with fragment p's slot set to `fn` of its pieces of `sources`, for
        an elementwise `fn`: `write(slots, group, p, fn(*pieces))` computed piece by
        piece, and row by row for a piece of at most `ROW_BY_ROW` rows.

        Each source is a list of the touched leaves (`axes`: the row axis of each).
        XLA fuses each row's read, `fn` and write into one in-place update of the
        slot, where `write` copies in a result computed before (the float32 send
        of a 0.5M-value fragment of 2 replicas on XLA:CPU, in the profiler: 0.95 ms
        instead of 1.58, of which 0.29 is the finiteness check).
        """
        k = jnp.asarray(self.slot_of)[p]
        start = 0
        for t, shape in enumerate(group.shapes):
            rows = group.rows[t]
            leaves = [source[t] for source in sources]
            if rows is None or rows.shape[1] > ROW_BY_ROW:
                pieces = [
                    group.gather_one(t, x, j, axis) for x, axis in zip(leaves, axes)
                ]
                parts = [(start, fn(*pieces))]
            else:
                table = jnp.asarray(rows)[j]
                per = int(np.prod(shape[1:], dtype=np.int64))
                parts = [
                    (start + r * per, fn(*_rows(leaves, axes, table[r])))
                    for r in range(rows.shape[1])
                ]
            for offset, value in parts:
                row = value.reshape(1, -1).astype(slots.dtype)
                slots = jax.lax.dynamic_update_slice(slots, row, (k, 0 * k + offset))
            start += int(np.prod(shape, dtype=np.int64))
        return slots

    def for_each(
        self,
        selected: Bool[Array, " P"],
        fn: Callable[["Visit", Any, Any], Any],
        carry: Any,
        inputs: Any = None,
    ) -> Any:
        """`carry = fn(visit, inputs, carry)` for every selected fragment p.

        One loop per group, over the group's selected members only (usually one
        fragment in all, often none): the program holds one copy of `fn` per group,
        not per fragment, and a step where nothing is selected runs no iteration.
        The fragments are visited group by group, so `fn` must not depend on the
        order (each fragment touches only its own elements).

        `inputs` holds what `fn` reads and does not change (e.g. θ_g when sending),
        `carry` what it updates. `fn` reads the state only through them, never from
        a closure, and either computes inside `visit.isolated` (which reads the
        touched leaves whole and gathers the fragment's pieces itself,
        `gather_one(..., fused=True)`, so that XLA fuses the reads into the
        computation) and scatters the results back (`visit.group.scatter`, in
        place), or, for an elementwise update, updates the leaves row by row in
        place (`visit.group.update_one`). Why:

        - no conditional holds the state: a `lax.switch` over the groups, with the
          parameters among its operands, made XLA copy the whole carried leaves on
          entry to and exit from the branch (about 4x the model's bytes per
          synchronised fragment); a piece is instead read and written in place in
          the loop body;
        - nothing is hoisted out of the loop: XLA moves what does not depend on the
          loop (with one whole-leaf fragment, as in DiLoCo: Δ, its quantization, the
          all-gather; always: broadcasts of constants, such as a quantizer's grid
          over the fragment) before it, to run at every step whether or not
          anything is selected. An optimization barrier ties the state read to the
          iteration, and `isolated` keeps the computation in a conditional on the
          iteration being live, which XLA cannot resolve.
        """
        for group in self.groups:
            members = jnp.asarray(group.members, jnp.int32)
            chosen = selected[members]
            if len(group.members) == 1:  # no search (a few thunks fewer per step)
                order = jnp.zeros(1, jnp.int32)
            else:
                order = jnp.nonzero(chosen, size=len(group.members), fill_value=0)[0]
            count = jnp.sum(chosen, dtype=jnp.int32)

            def body(i, carry, group=group, members=members, order=order, count=count):
                # The counter i itself goes through the barrier: with one member,
                # order[i] does not depend on i and the barrier would not hold.
                i, j, ins, carry = jax.lax.optimization_barrier(
                    (i, order[i], inputs, carry)
                )
                return fn(Visit(group, j, members[j], i < count), ins, carry)

            carry = jax.lax.fori_loop(0, count, body, carry)
        return carry


@dataclasses.dataclass(frozen=True)
class Visit:
    """One selected fragment in `Layout.for_each`.

    Attributes:
        group: the fragment's group.
        j: its position among the group's members (traced).
        p: the fragment (traced).
        live: true (traced): the loop iteration is a real one.
    """

    group: Group
    j: Int[Array, ""]
    p: Int[Array, ""]
    live: Bool[Array, ""]

    def isolated(self, compute: Callable[..., Any], *operands: Any) -> Any:
        """`compute(*operands)`, kept inside the loop over the selected fragments.

        It runs in a conditional on `live`, whose other branch (never taken) gives
        zeros of the same structure: `live` itself, broadcast. A literal zero would be
        a constant of the compiled program, and XLA:CPU sets up every constant of a
        program at each call, whether or not its branch runs (about 0.2 µs each).
        Operands (and closed-over arrays) are only read,
        so nothing is copied; pass the touched leaves whole and gather the pieces
        inside `compute`: pieces gathered outside would be written out before the
        conditional and read again inside it (measured on the send of a 0.5M-value
        fragment on XLA:CPU: 2.3 ms outside, 1.2 ms inside).
        """
        shapes = jax.eval_shape(compute, *operands)

        def skip(live, *_):
            return jax.tree.map(
                lambda s: jnp.broadcast_to(live.astype(s.dtype), s.shape), shapes
            )

        return jax.lax.cond(
            self.live, lambda _, *xs: compute(*xs), skip, self.live, *operands
        )


ROW_BY_ROW = 64
"""A piece of at most this many rows of a stacked leaf is written one row at a time
(a dynamic index per row): XLA:CPU then updates the leaf in place, where a strided or
contiguous slice of several rows made it copy the whole leaf. It is read the same way,
unless the read is `fused` (inside `Visit.isolated`) and the rows are strided or
contiguous (one slice, fused into its consumer). More rows use one slice or gather,
keeping the program small."""


def _rows(
    arrays, axes, index: Int[ArrayLike, ""], keepdims: bool = False
) -> list[Array]:
    """Row `index` of each array, taken along its axis in `axes` (kept, of size 1,
    with `keepdims`)."""
    return [
        jax.lax.dynamic_index_in_dim(x, index, axis, keepdims=keepdims)
        for x, axis in zip(arrays, axes)
    ]


def _progression(rows: np.ndarray, length: int) -> tuple[np.ndarray, int | None]:
    """Whether every member's rows are `start + stride·k` (`stride` shared): the
    starts and the stride, or `(rows, None)`. Strided fragments of stacked layers have
    the stride P_b and count·stride = the layers; sequential ones the stride 1."""
    count = rows.shape[1]
    start = rows[:, 0]
    if count == 1:
        return start, 1
    stride = int(rows[0, 1] - rows[0, 0])
    expected = start[:, None] + stride * np.arange(count)[None, :]
    if stride < 1 or not np.array_equal(rows, expected):
        return rows, None
    if stride > 1 and (count * stride != length or np.any(start >= stride)):
        return rows, None
    return start, stride


def _fold(x: Array, axis: int, count: int, stride: int) -> Array:
    """`x` with its rows axis viewed as `[count, stride]` (row-major: a free reshape)."""
    return x.reshape(x.shape[:axis] + (count, stride) + x.shape[axis + 1 :])


def make_layout(fragments: Fragments, schedule: Schedule) -> Layout:
    """Group the fragments by shape signature and give each one an in-flight slot."""
    signatures: dict[tuple, list[int]] = {}
    for p in range(fragments.num_fragments):
        sig = []
        for i, (labels, shape) in enumerate(zip(fragments.labels, fragments.shapes)):
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
            shape = fragments.shapes[i]
            if count is None:
                rows.append(None)
                shapes.append(tuple(shape))
            else:
                table = [np.flatnonzero(fragments.labels[i] == p) for p in members]
                rows.append(np.asarray(table, np.int32))
                shapes.append((count,) + tuple(shape[1:]))
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
    h, tau = schedule.sync_every, min(schedule.overlap)
    horizon = max(schedule.first_send) + 2 * h + tau + 1
    busy: dict[int, list[int]] = {}  # step -> fragments holding a slot
    for p, f in enumerate(schedule.first_send):
        for t in range(f, horizon, h):
            for s in range(t, t + tau + 1):
                busy.setdefault(s, []).append(p)
    conflicts = {p: set() for p in range(schedule.num_fragments)}
    for holders in busy.values():
        for p in holders:
            conflicts[p].update(q for q in holders if q != p)
    slot_of = np.zeros(schedule.num_fragments, np.int32)
    for p in range(schedule.num_fragments):
        taken = {int(slot_of[q]) for q in conflicts[p] if q < p}
        slot_of[p] = min(k for k in range(schedule.num_fragments) if k not in taken)
    return slot_of, int(slot_of.max()) + 1
