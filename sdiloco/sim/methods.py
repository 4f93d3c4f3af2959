"""The simulator's methods: when the (outer) gradients cross the link, and how big.

A `Method` describes one training method to the simulator (§1.3, §1.4): H, the
fragments and their pattern, the overlap τ and the bits per parameter. The factories
build the methods of Table 4 and of the paper's figures. They are named `*_method` so
that they do not clash with the algorithm's factories (`sdiloco.data_parallel`,
`sdiloco.diloco`, ...), which build what is trained rather than what is simulated.
"""

import dataclasses
import math

import numpy as np

from .checks import check, positive


TABLE4_BITS_PER_PARAM = 13.4
"""Bits on the wire per nominal parameter for a full sync, fitted on Table 4's 1B rows.

`benchmarks/table4_timing.py --fit` scans this constant. For every value in
[13.32, 13.56], all 20 cells of the four non-FP4 1B rows land on the paper's grid
point and the FP4 row is within one grid step; all 25 cells stay within one grid step
over [12.99, 14.23]. 13.4 ≈ 16 bits × 0.84, as docs/paper.md §5.2 item 8 expects. The
constant is kept for every model size.
"""

BF16_BITS_PER_PARAM = 16.0
"""bf16 outer gradients of a nominal-size model; reproduces Table 1 (docs/paper.md §6.2)."""

FP4_FACTOR = 4.0
"""FP4 (E3M0) variants send 4 bits where the others send 16."""


@dataclasses.dataclass(frozen=True)
class Method:
    """When the (outer) gradients cross the link and how big they are (§1.3, §1.4).

    Data-Parallel is `inner_steps=1`. Vanilla DiLoCo has no fragments. Streaming DiLoCo
    sets `layers_per_fragment`. Overlap sets τ = `overlap_steps`, FP4 divides
    `bits_per_param` by 4, and the eager variant sets τ = H (docs/paper.md §1.13.2).

    Example:
        >>> Method(name="DiLoCo", inner_steps=100).num_fragments(24)
        1
    """

    name: str = ""
    """Label for tables."""
    inner_steps: int = 1
    """H: each fragment (or the whole model) is synced once every H steps."""
    layers_per_fragment: int | None = None
    """Layers per fragment; None means the whole model is one fragment (DP, DiLoCo)."""
    pattern: str = "strided"
    """ "strided" (layer ℓ is in fragment ℓ mod P; paper default) or "sequential"."""
    overlap_steps: int = 0
    """τ: the sync sent at step t is needed by the forward of step t + 1 + τ (τ ≤ H)."""
    bits_per_param: float = BF16_BITS_PER_PARAM
    """Bits on the wire per parameter for a full sync (ring all-reduce factor included;
    2(1 − 1/M) = 1 for M = 2 replicas)."""

    def __post_init__(self):
        """Validate the fields."""
        check(self.inner_steps >= 1, "inner_steps", self.inner_steps, "an int >= 1")
        lpf = self.layers_per_fragment
        check(lpf is None or lpf >= 1, "layers_per_fragment", lpf, "None or >= 1")
        check(
            self.pattern in ("strided", "sequential"),
            "pattern",
            self.pattern,
            '"strided" or "sequential"',
        )
        check(
            0 <= self.overlap_steps <= self.inner_steps,
            "overlap_steps",
            self.overlap_steps,
            f"an int in [0, inner_steps={self.inner_steps}]",
        )
        check(
            positive(self.bits_per_param),
            "bits_per_param",
            self.bits_per_param,
            "a finite float > 0",
        )

    def num_fragments(self, num_layers: int) -> int:
        """P = ⌈L / layers per fragment⌉, or 1 without fragments (docs/paper.md §1.4)."""
        if self.layers_per_fragment is None:
            return 1
        return math.ceil(num_layers / self.layers_per_fragment)

    def fragment_of_layer(self, num_layers: int) -> np.ndarray:
        """Fragment of each layer, 0-based, strided or sequential (§2.2, Fig. 2).

        Example:
            >>> Method(inner_steps=9, layers_per_fragment=3).fragment_of_layer(6)
            array([0, 1, 0, 1, 0, 1])
        """
        num_fragments = self.num_fragments(num_layers)
        layers = np.arange(num_layers)
        if num_fragments == 1:
            return np.zeros(num_layers, dtype=np.int64)
        if self.pattern == "strided":
            return layers % num_fragments
        assert self.layers_per_fragment is not None  # num_fragments > 1
        return layers // self.layers_per_fragment

    def sync_offsets(self, num_fragments: int) -> np.ndarray:
        """t_p = round(p·H/P): fragment p syncs at the steps t with (t+1−t_p) % H == 0.

        Implements docs/paper.md §5.2 item 5 (offsets spread evenly, §1.4).
        """
        p = np.arange(num_fragments)
        return np.floor(p * self.inner_steps / num_fragments + 0.5).astype(np.int64)

    def default_num_steps(self) -> int:
        """Simulated window: 3·H steps, at least 60 (docs/paper.md §5.2 item 6)."""
        return max(3 * self.inner_steps, 60)


def data_parallel_method(bits_per_param: float = TABLE4_BITS_PER_PARAM) -> Method:
    """Data-Parallel: every gradient is reduced at every step (Table 4, row 1)."""
    return Method(name="Data-Parallel", inner_steps=1, bits_per_param=bits_per_param)


def diloco_method(
    inner_steps: int = 100, bits_per_param: float = TABLE4_BITS_PER_PARAM
) -> Method:
    """Vanilla DiLoCo: the whole model every H steps, blocking (Table 4, row 2)."""
    return Method(
        name="Vanilla DiLoCo", inner_steps=inner_steps, bits_per_param=bits_per_param
    )


def streaming_method(
    inner_steps: int = 100,
    *,
    layers_per_fragment: int = 3,
    pattern: str = "strided",
    overlap_steps: int = 0,
    fp4: bool = False,
    bits_per_param: float = TABLE4_BITS_PER_PARAM,
) -> Method:
    """Streaming DiLoCo, optionally overlapped and FP4 (Table 4, rows 3-5).

    Args:
        inner_steps: H.
        layers_per_fragment: 3 in the paper.
        pattern: "strided" (the paper's default) or "sequential" (Fig. 7).
        overlap_steps: τ; 1 in the paper's overlapped rows.
        fp4: send 4-bit E3M0 outer gradients (bits divided by `FP4_FACTOR`).
        bits_per_param: bits per parameter before FP4.

    Returns:
        The method.
    """
    name = "Streaming DiLoCo"
    if overlap_steps or fp4:
        name += " w/ overlapped" if overlap_steps else " w/"
        name += " FP4 com." if fp4 else " com."
    return Method(
        name=name,
        inner_steps=inner_steps,
        layers_per_fragment=layers_per_fragment,
        pattern=pattern,
        overlap_steps=overlap_steps,
        bits_per_param=bits_per_param / FP4_FACTOR if fp4 else bits_per_param,
    )


def eager_method(
    inner_steps: int = 100,
    *,
    layers_per_fragment: int | None = 3,
    fp4: bool = True,
    bits_per_param: float = TABLE4_BITS_PER_PARAM,
) -> Method:
    """Eager updates: one whole outer step of overlap, τ = H (docs/paper.md §1.13.2).

    The outer gradient sent at a sync is applied at the fragment's next sync. The
    link therefore has H steps of compute to carry it ("1-outer-step eager", Eager
    Table 2).
    """
    name = "Eager Streaming DiLoCo" if layers_per_fragment else "Eager DiLoCo"
    return Method(
        name=name + (" FP4" if fp4 else ""),
        inner_steps=inner_steps,
        layers_per_fragment=layers_per_fragment,
        overlap_steps=inner_steps,
        bits_per_param=bits_per_param / FP4_FACTOR if fp4 else bits_per_param,
    )


def table4_methods(bits_per_param: float = TABLE4_BITS_PER_PARAM) -> list[Method]:
    """The five methods of Table 4, in order: H = 100, 3 layers/fragment, τ = 1."""
    return [
        data_parallel_method(bits_per_param),
        diloco_method(100, bits_per_param),
        streaming_method(100, bits_per_param=bits_per_param),
        streaming_method(100, overlap_steps=1, bits_per_param=bits_per_param),
        streaming_method(100, overlap_steps=1, fp4=True, bits_per_param=bits_per_param),
    ]
