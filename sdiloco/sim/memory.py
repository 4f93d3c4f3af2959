"""Accelerator memory of Data-Parallel, DiLoCo and Streaming DiLoCo (paper §2.5).

Data-Parallel keeps the parameters (1×) and the Adam state (2×). DiLoCo adds the outer
(global) parameters (1×) and the outer Nesterov momentum (1×), 5/3 of Data-Parallel.
Streaming DiLoCo needs the outer state of one fragment at a time. With the rest
offloaded to host memory, HBM holds 2 × |fragment| more than Data-Parallel: about 2 %
for a 100B model with 108 layers and 3 layers per fragment (docs/paper.md §1.10).

Examples:
    >>> from sdiloco.sim.memory import GIB, memory_footprint, overhead_vs_data_parallel
    >>> round(overhead_vs_data_parallel(1e9, "diloco"), 4)
    1.6667
    >>> dp = memory_footprint(100e9, "data_parallel")
    >>> sd = memory_footprint(100e9, "streaming", num_layers=108, layers_per_fragment=3)
    >>> round(dp.hbm_bytes / GIB, 1), round(sd.overhead_bytes / GIB, 1)
    (1117.6, 20.7)
"""

import dataclasses
import math

from .checks import check, positive


METHODS = ("data_parallel", "diloco", "streaming")
"""The methods `memory_footprint` knows."""

GIB = 2**30
"""Bytes per GiB. The paper's "1,117 GB" and "20 GB" are GiB (docs/paper.md §1.10)."""


@dataclasses.dataclass(frozen=True)
class MemoryFootprint:
    """Bytes of training state on one replica (paper §2.5); all fields are bytes."""

    params: float
    """Inner parameters (1×)."""
    inner_optimizer: float
    """Adam's first and second moments (2×)."""
    outer_params_hbm: float
    """Outer (global) parameters kept in accelerator memory."""
    outer_momentum_hbm: float
    """Outer Nesterov momentum kept in accelerator memory."""
    host_offloaded: float
    """Outer parameters and momentum kept in host (CPU) memory."""

    @property
    def hbm_bytes(self) -> float:
        """All bytes in accelerator memory."""
        return (
            self.params
            + self.inner_optimizer
            + self.outer_params_hbm
            + self.outer_momentum_hbm
        )

    @property
    def overhead_bytes(self) -> float:
        """Accelerator bytes on top of Data-Parallel (the outer state in HBM)."""
        return self.outer_params_hbm + self.outer_momentum_hbm


# This differs from the paper in:
# 1. The fragment is the largest one, ⌈L / P⌉ layers of num_params / L parameters
#    each. The paper's footnote uses |p| / L of all parameters, which is the same when
#    layers_per_fragment divides L and the embeddings are not counted.
def memory_footprint(
    num_params: float,
    method: str,
    *,
    num_layers: int | None = None,
    layers_per_fragment: int = 3,
    offload: bool = True,
    bytes_per_value: float = 4.0,
    fragment_params: float | None = None,
) -> MemoryFootprint:
    """Training-state memory of one replica, in bytes (paper §2.5 and its footnote).

    Args:
        num_params: parameters of the model.
        method: "data_parallel", "diloco" or "streaming".
        num_layers: L; required for "streaming" unless `fragment_params` is given.
        layers_per_fragment: |p| in layers (3 in the paper).
        offload: for "streaming", keep only the synced fragment's outer state in HBM.
        bytes_per_value: 4 for FP32, as in the paper's footnote.
        fragment_params: parameters of the largest fragment, if known exactly (e.g.
            from the real parameter tree); this overrides the per-layer estimate.

    Returns:
        The footprint.
    """
    check(positive(num_params), "num_params", num_params, "a finite float > 0")
    check(method in METHODS, "method", method, f"one of {METHODS}")
    check(positive(bytes_per_value), "bytes_per_value", bytes_per_value, "a float > 0")
    check(
        layers_per_fragment >= 1,
        "layers_per_fragment",
        layers_per_fragment,
        "an int >= 1",
    )
    value = num_params * bytes_per_value
    outer = 0.0 if method == "data_parallel" else value
    hbm = outer
    if method == "streaming" and offload:
        hbm = _fragment_params(
            num_params, num_layers, layers_per_fragment, fragment_params
        )
        hbm *= bytes_per_value
    return MemoryFootprint(
        params=value,
        inner_optimizer=2 * value,
        outer_params_hbm=hbm,
        outer_momentum_hbm=hbm,
        host_offloaded=2 * (outer - hbm),
    )


def overhead_vs_data_parallel(num_params: float, method: str, **kwargs) -> float:
    """HBM of `method` over HBM of Data-Parallel: 5/3 for DiLoCo (paper §2.5).

    Args:
        num_params: parameters of the model.
        method: "data_parallel", "diloco" or "streaming".
        **kwargs: passed to `memory_footprint`.

    Returns:
        The ratio, ≥ 1.
    """
    base = memory_footprint(num_params, "data_parallel", **kwargs).hbm_bytes
    return memory_footprint(num_params, method, **kwargs).hbm_bytes / base


def _fragment_params(num_params, num_layers, layers_per_fragment, fragment_params):
    if fragment_params is not None:
        check(
            positive(fragment_params) and fragment_params <= num_params,
            "fragment_params",
            fragment_params,
            f"a float in (0, num_params={num_params}]",
        )
        return float(fragment_params)
    check(
        num_layers is not None and num_layers >= 1,
        "num_layers",
        num_layers,
        'an int >= 1 for method "streaming" (or give fragment_params)',
    )
    assert num_layers is not None  # checked above
    num_fragments = math.ceil(num_layers / layers_per_fragment)
    largest = -(-num_layers // num_fragments)  # ⌈L / P⌉ layers
    return num_params * largest / num_layers
