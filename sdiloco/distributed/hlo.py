"""Reading a compiled program: its collectives and the bytes each one moves.

`collectives` parses the text of a compiled XLA program (`.compile().as_text()`) for
its all-gathers, all-reduces, reduce-scatters, all-to-alls and collective-permutes;
`wire_bytes` picks out the all-gathers that `sharded_exchange` names per fragment, so
tests and benchmarks can check the bytes on the wire against
`Algorithm.bits_per_fragment`.
"""

import math
import re
from typing import Any, NamedTuple

import numpy as np


class Collective(NamedTuple):
    """One collective of a compiled program (see `collectives`)."""

    kind: str  # "all-gather", "all-reduce", ...
    dtype: str  # HLO element type, e.g. "u8", "f32"
    shape: tuple[int, ...]  # the result's shape
    group_size: int  # devices taking part
    bytes_per_device: int  # what one device contributes: its operand's bytes
    op_name: str  # the JAX name stack of the op (e.g. ".../sdiloco_fragment_1/...")
    axes: tuple[str, ...] | None = None  # the mesh axes its groups span (given a mesh)


_COLLECTIVE = re.compile(
    r"=\s*(?P<result>\([^)]*\)|[a-z]+\d*\[[\d,]*\]\S*)\s+"
    r"(?P<kind>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<shape>[\d,]*)\]")
_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


def collectives(hlo_text: str, mesh: Any = None) -> list[Collective]:
    """The collectives of a compiled XLA program and the bytes each device sends.

    Args:
        hlo_text: `jax.jit(f).lower(...).compile().as_text()`.
        mesh: the `jax.sharding.Mesh` the program was compiled for; when given, each
            collective's `axes` names the mesh axes its device groups span (a group's
            devices differ along exactly those axes), e.g. `("replica",)` for the
            exchange's all-gather and `("data",)` for a gradient all-reduce inside an
            island.

    Returns:
        One `Collective` per array a collective instruction produces (a combined
        all-reduce of a tuple gives one per element; those inside `lax.cond`
        branches are included, whether or not they run). For an all-gather,
        `bytes_per_device` is the result's bytes divided by the group size; for the
        other kinds, the result's bytes.
    """
    out = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        groups = _groups(line)
        if not groups and mesh is not None:  # no groups named: every device
            groups = [list(range(mesh.size))]
        size = len(groups[0]) if groups else 1
        axes = None if mesh is None else _axes(groups, mesh)
        name = re.search(r'op_name="([^"]*)"', line)
        for array in _ARRAY.finditer(match["result"]):
            shape = tuple(int(s) for s in array["shape"].split(",") if s)
            nbytes = math.prod(shape) * _ITEMSIZE.get(array["dtype"], 4)
            if match["kind"] == "all-gather":
                nbytes //= size
            out.append(
                Collective(
                    match["kind"],
                    array["dtype"],
                    shape,
                    size,
                    nbytes,
                    name[1] if name else "",
                    axes,
                )
            )
    return out


def by_axis(hlo_text: str, mesh: Any) -> dict[tuple[str, ...], dict[str, int]]:
    """Bytes each device sends per step, by the mesh axes a collective spans and kind.

    Every collective of the program counts once (those in `lax.cond` branches too, as
    if every branch ran), so for a Streaming step this is the bytes of a step in which
    every fragment is sent.

    Returns:
        `{axes: {kind: bytes per device}}`, e.g.
        `{("data",): {"all-reduce": ...}, ("replica",): {"all-gather": ...}}`.
    """
    out: dict[tuple[str, ...], dict[str, int]] = {}
    for c in collectives(hlo_text, mesh):
        per_kind = out.setdefault(c.axes or (), {})
        per_kind[c.kind] = per_kind.get(c.kind, 0) + c.bytes_per_device
    return out


def wire_bytes(hlo_text: str, num_replicas: int, mesh: Any = None) -> dict[int, int]:
    """Bytes one replica sends to sync each fragment, read off a compiled step.

    Args:
        hlo_text: the compiled program of a step using `sharded_exchange`.
        num_replicas: M.
        mesh: the mesh it was compiled for; needed when the mesh has a `"data"` axis
            of size D > 1, where each of a replica's D devices sends `1/D` of its
            message across `"replica"` and the island re-assembles it over `"data"`.

    Returns:
        `{fragment: bytes of one replica's message across the replica axis}`, from the
        all-gathers that `sharded_exchange` emits under the scope
        `sdiloco_fragment_<p>`, or `sdiloco_fragment_<p>_<q>...` when one compiled
        branch of a Streaming step serves fragments p, q, ... (each sends a message of
        that size).
    """
    data = 1 if mesh is None else dict(mesh.shape).get("data", 1)
    out = {}
    for c in collectives(hlo_text, mesh):
        match = re.search(r"sdiloco_fragment_([\d_]+)", c.op_name)
        if c.kind != "all-gather" or not match:
            continue
        if mesh is not None and c.axes != ("replica",):
            continue  # the island's re-assembly, not the wide-area bytes
        size = math.prod(c.shape) // num_replicas * data
        out.update({int(p): size for p in match[1].split("_") if p})
    return out


# ----------------------------------------------------------------------------- helpers


def _groups(line: str) -> list[list[int]] | None:
    """The device groups of an HLO collective, or None if it names none."""
    pairs = re.search(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}", line)
    if pairs:  # collective-permute: each (source, target) pair is a group
        return [
            [int(i) for i in g.split(",") if i]
            for g in re.findall(r"\{([\d,]*)\}", pairs[1])
        ]
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        return [
            [int(i) for i in g.split(",") if i]
            for g in re.findall(r"\{([\d,]*)\}", explicit[1])
        ]
    iota = re.search(
        r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line
    )
    if iota:
        shape = [int(s) for s in iota[1].split(",")]
        dims = [int(s) for s in iota[2].split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota[3]:
            ids = ids.transpose([int(s) for s in iota[3].split(",")])
        return ids.reshape(shape[0], -1).tolist()
    named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if named:  # mesh['axis_0'=2,'axis_1'=2] {'axis_0'}: groups along the named axes
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", named[1]))
        names = list(sizes)
        used = [names.index(a) for a in re.findall(r"'([^']+)'", named[2])]
        ids = np.arange(math.prod(int(s) for s in sizes.values()))
        ids = ids.reshape([int(s) for s in sizes.values()])
        rest = [i for i in range(len(names)) if i not in used]
        size = math.prod(ids.shape[i] for i in used)
        return ids.transpose(rest + used).reshape(-1, size).tolist()
    return None


def _axes(groups: list[list[int]] | None, mesh: Any) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ."""
    if not groups:
        return ()
    shape = tuple(mesh.devices.shape)
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), shape))  # [axes, n]
        varying |= {
            n for n, c in zip(mesh.axis_names, coords) if len(set(c.tolist())) > 1
        }
    return tuple(n for n in mesh.axis_names if n in varying)
