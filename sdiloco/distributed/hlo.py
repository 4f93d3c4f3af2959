"""Reading a compiled program: its collectives and the bytes each one moves.

`collectives` parses the text of a compiled XLA program (`.compile().as_text()`) for
its all-gathers, all-reduces, reduce-scatters, all-to-alls and collective-permutes;
`wire_bytes` picks out the all-gathers that `sharded_exchange` names per fragment, so
tests and benchmarks can check the bytes on the wire against
`Algorithm.bits_per_fragment`.
"""

import math
import re
from typing import NamedTuple


class Collective(NamedTuple):
    """One collective of a compiled program (see `collectives`)."""

    kind: str  # "all-gather", "all-reduce", ...
    dtype: str  # HLO element type, e.g. "u8", "f32"
    shape: tuple[int, ...]  # the result's shape
    group_size: int  # devices taking part
    bytes_per_device: int  # what one device contributes: its operand's bytes
    op_name: str  # the JAX name stack of the op (e.g. ".../sdiloco_fragment_1/...")


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


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives of a compiled XLA program and the bytes each device sends.

    Args:
        hlo_text: `jax.jit(f).lower(...).compile().as_text()`.

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
        size = _group_size(line)
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
                )
            )
    return out


def wire_bytes(hlo_text: str, num_replicas: int) -> dict[int, int]:
    """Bytes one replica sends to sync each fragment, read off a compiled step.

    Args:
        hlo_text: the compiled program of a step using `sharded_exchange`.
        num_replicas: M.

    Returns:
        `{fragment: bytes of one replica's message}`, from the all-gathers that
        `sharded_exchange` emits under the scope `sdiloco_fragment_<p>`, or
        `sdiloco_fragment_<p>_<q>...` when one compiled branch of a Streaming step
        serves fragments p, q, ... (each sends a message of that size).
    """
    out = {}
    for c in collectives(hlo_text):
        match = re.search(r"sdiloco_fragment_([\d_]+)", c.op_name)
        if c.kind == "all-gather" and match:
            size = math.prod(c.shape) // num_replicas
            out.update({int(p): size for p in match[1].split("_") if p})
    return out


# ----------------------------------------------------------------------------- helpers


def _group_size(line: str) -> int:
    """Devices per replica group of an HLO collective (1 if it cannot be read)."""
    groups = re.search(
        r"replica_groups=(\{\{[\d,]*\}|\[[\d,]*\]|mesh\[[^\]]*\] \{[^}]*\})", line
    )
    if not groups:
        return 1
    text = groups[1]
    if text.startswith("{{"):  # explicit groups: {{0,1,2,3},...}
        return len(text[2:-1].split(","))
    if text.startswith("["):  # iota groups: [num_groups,group_size]<=[...]
        return int(text[1:-1].split(",")[-1])
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", text))  # mesh['a'=4] {'a'}
    used = re.findall(r"'([^']+)'", text.split("{", 1)[1])
    return math.prod(int(sizes[a]) for a in used)
