"""Fragment groups and in-flight slots: exact partitions, conflict-free slots, and a
state whose in-flight storage is sized by the schedule."""

import re

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import toy_params
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco import streaming
from sdiloco.inflight import Visit, assign_slots, make_layout
from sdiloco.schedule import make_schedule


@settings(max_examples=40)
@given(
    h=st.integers(2, 12),
    p=st.integers(1, 6),
    taus=st.lists(st.integers(0, 11), min_size=1, max_size=3),
    offsets=st.lists(st.integers(1, 30), min_size=6, max_size=6),
    default=st.booleans(),
)
def test_slots_never_shared_while_in_flight(h, p, taus, offsets, default):
    taus = [t % h for t in taus]
    first = None if default else offsets[:p]
    schedule = make_schedule(h, p, len(taus), taus, first)
    slot_of, k = assign_slots(schedule)
    assert 1 <= k <= p and set(slot_of.tolist()) == set(range(k))
    # Brute force: walk the schedule; every fragment holding a slot at t (sent at s,
    # s <= t <= s + τ_min) holds a different one.
    tau = min(taus)
    sends = [
        (s, q)
        for q, f in enumerate(schedule.first_send)
        for s in range(f, f + 6 * h, h)
    ]
    for t in range(1, max(schedule.first_send) + 5 * h):
        holders = [q for s, q in sends if s <= t <= s + tau]
        assert len({int(slot_of[q]) for q in holders}) == len(holders)


def test_default_schedule_needs_one_slot():
    # f_p = H + round(pH/P): sends H/P apart, so with τ < H/P one slot suffices.
    for h, p, tau in ((100, 8, 1), (20, 3, 1), (30, 1, 0), (12, 4, 2)):
        assert assign_slots(make_schedule(h, p, 2, tau))[1] == 1


def test_groups_partition_the_elements_and_share_branches():
    params = toy_params(jr.key(0), layers=6)
    frags = sdiloco.fragments_by_layer(
        params, blocks=lambda q: q["blocks"], layers_per_fragment=2
    )
    layout = make_layout(frags, make_schedule(6, frags.num_fragments, 2, 1))
    # The non-block fragment and the block fragments: two groups, not P branches.
    assert len(layout.groups) == 2 and frags.num_fragments == 4
    leaves = jax.tree.leaves(params)
    count = [jnp.zeros(x.shape, jnp.int32) for x in leaves]
    for p in range(frags.num_fragments):
        group = layout.groups[layout.group_of[p]]
        j = jnp.asarray(layout.index_in_group[p])
        visit = Visit.of(group, j)
        pieces = visit.gather(leaves)
        assert sum(x.size for x in pieces) == group.size == frags.sizes()[p]
        back = visit.scatter(leaves, pieces)  # scatter(gather) is the identity
        assert all(bool(jnp.all(a == b)) for a, b in zip(back, leaves))
        ones = [jnp.ones(s, jnp.int32) for s in group.shapes]
        added = visit.scatter([jnp.zeros_like(c) for c in count], ones)
        count = [c + a for c, a in zip(count, added)]
        np.testing.assert_array_equal(  # the fragment is exactly its mask
            np.concatenate([np.ravel(a) for a in added]),
            np.concatenate(
                [
                    np.ravel(np.broadcast_to(np.asarray(m), x.shape))
                    for m, x in zip(frags.mask(jnp.arange(4) == p), leaves)
                ]
            ).astype(np.int32),
        )
    assert all(bool(jnp.all(c == 1)) for c in count)  # every element exactly once
    assert layout.slot_size == max(frags.sizes())


def test_state_holds_one_slot_of_the_largest_fragment():
    params = toy_params(jr.key(1), layers=6)
    frags = sdiloco.fragments_by_layer(
        params, blocks=lambda q: q["blocks"], layers_per_fragment=2
    )
    alg = sdiloco.streaming_diloco(
        lambda q, b: 0.0,
        inner=optax.adamw(1e-3),
        num_replicas=2,
        sync_every=12,
        fragments=frags,
        overlap=1,
    )
    state = jax.eval_shape(alg.init, params)
    assert state.inflight.shape == (1, max(frags.sizes()))
    n = sum(x.size for x in jax.tree.leaves(params))
    share = sdiloco.per_replica_bytes(state)
    # θ_m, Adam's two moments, θ_g, the outer momentum: 5N; plus the slot, the
    # scalars (step, Adam's counts, key) and the per-fragment bookkeeping (sent at,
    # each replica's steps since the sync, who sent the Δ in flight and their steps
    # then): far below the old 6N.
    p, m = frags.num_fragments, 2
    assert share["inflight"] == 4 * max(frags.sizes()) < 4 * n
    assert state.senders.shape == state.sent_steps.shape == (p, m)
    bookkeeping = 4 * p * (1 + 2 * m) + p * m + p + m
    assert sum(share.values()) <= 4 * (5 * n + max(frags.sizes())) + 64 + bookkeeping


# ------------------------------------------------------ the compiled sync's shape


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """HLO computation name -> its instruction lines, and the entry's name."""
    comps: dict[str, list[str]] = {}
    name = entry = ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            head = line.split(" (")[0].split()
            name = head[-1].lstrip("%")
            comps[name] = []
            if head[0] == "ENTRY":
                entry = name
        elif name and line.startswith("  "):
            comps[name].append(line.strip())
    return comps, entry


def _elements(line: str) -> int:
    m = re.match(r"%?[\w.\-]+ = \w+\[([\d,]*)\]", line)
    if not m:
        return 0
    return int(np.prod([int(d) for d in m.group(1).split(",") if d]))


def _op(line: str) -> str | None:
    """The opcode of an HLO instruction line."""
    m = re.search(r"\}? ([\w-]+)\(", line.split(" = ", 1)[-1])
    return m.group(1) if m else None


def _always_run(comps: dict[str, list[str]], entry: str) -> set[str]:
    """The computations that run whenever the program does: reachable from the
    entry without entering a loop body or a conditional branch (fusions are judged
    by their own instruction in the caller)."""
    seen, todo = set(), [entry]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            for line in comps[c]:
                if " fusion(" not in line:
                    todo.extend(re.findall(r"to_apply=%?([\w.\-]+)", line))
    return seen


COMPRESSORS = {
    "e3m0": "e3m0",
    "e2m1": "e2m1",  # a table searched by comparisons
    "e4m3": "e4m3",  # a table searched by searchsorted
    "float32": None,
    "stochastic": lambda: sdiloco.quantizer("e3m0", rounding="stochastic"),
    "rows": lambda: sdiloco.quantizer("e3m0", granularity="row"),
}


@pytest.mark.hlo
@pytest.mark.parametrize("comp", sorted(COMPRESSORS))
@pytest.mark.parametrize("kind", ["streaming", "streaming P=4", "diloco"])
def test_compiled_sync_works_only_inside_the_loops_and_copies_no_leaf(kind, comp):
    """The sync half of a step (send, outer step, merge), compiled with the state
    donated: outside the loops over due fragments nothing of a fragment's size is
    computed (XLA hoists loop-invariant work, e.g. DiLoCo's Δ or a quantizer's grid
    broadcast over the fragment, to run at every step unless prevented), and nothing
    copies a whole leaf (a conditional holding the parameters made XLA copy them on
    entry and exit; a write fused with a read of the same leaf copies it too). For
    each kind of compressor: a quantizer's grid, or a stochastic one's random
    counters, are work of the fragment's size that does not depend on the fragment.
    With P = 4, three fragments share one loop body, which finds their rows at run
    time. M = 3, so that no piece has the size of a whole leaf. What XLA makes from
    no operand at all (the iota of a stochastic rounding's counters) may run before
    the loops: it is a constant, written once per step (docs/performance.md)."""
    m = 3
    params = {
        "embed": jnp.ones((8, 16)),
        "blocks": jnp.ones((8, 64, 64)),
        "head": jnp.ones((64,)),
    }
    streams = kind.startswith("streaming")
    labels = {"embed": 0, "head": 0, "blocks": np.arange(8) % (4 if "4" in kind else 2)}
    alg = sdiloco.streaming_diloco(  # DiLoCo: one whole-model fragment, τ = 0
        lambda q, b: 0.0,
        inner=optax.adamw(1e-3),
        num_replicas=m,
        sync_every=8,
        fragments=sdiloco.fragments_from_labels(params, labels) if streams else None,
        overlap=1 if streams else 0,
        compressor=c() if callable(c := COMPRESSORS[comp]) else c,
    )
    spec = alg.spec

    def sync(state):
        state = streaming.send(spec, state)
        sent = spec.schedule.sent(state.step)
        local = streaming.LocalResult(jnp.zeros(m), {}, sent)
        return streaming.sync_phase(spec, state, local)

    state = alg.init(params, key=jax.random.key(0))
    text = jax.jit(sync, donate_argnums=0).lower(state).compile().as_text()
    comps, entry = _computations(text)
    quarter = 64 * 64  # one block: a quarter of the smallest fragment at P = 2
    free = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
    free |= {"while", "call", "conditional"}
    for name in _always_run(comps, entry):
        for line in comps[name]:
            op = _op(line)
            if " fusion()" in line:  # from no operand: a constant (an iota of
                continue  # random counters), which XLA may make before the loops
            if _elements(line) >= quarter and op and op not in free:
                raise AssertionError(f"fragment-sized work at every step: {line}")
    if not streams:
        return  # a whole-leaf fragment: a copy of a leaf is a copy of the fragment
    whole = {8 * 64 * 64, m * 8 * 64 * 64}  # a stacked leaf of θ_g, of the replicas
    copies = [
        line
        for lines in comps.values()
        for line in lines
        if " copy(" in line and _elements(line) in whole
    ]
    assert not copies, copies
