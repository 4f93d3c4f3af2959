"""The paper's published simulator numbers, typed once (docs/paper.md §3).

What the notebooks and benchmarks compare the simulator against. The tests keep their
own independent copy, so that a typo here cannot make a comparison pass.
"""

TABLE4_CU_TARGETS: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95, 0.99)
"""The compute utilizations of Table 4's columns."""

TABLE4_1B_GBPS: dict[str, tuple[float, ...]] = {
    "Data-Parallel": (86.8, 152.6, 184.2, 222.3, 569.0),
    "Vanilla DiLoCo": (1.4, 6.2, 13.3, 23.3, 86.8),
    "Streaming DiLoCo": (1.4, 5.2, 9.1, 16.0, 28.1),
    "Streaming DiLoCo w/ overlapped com.": (1.4, 4.3, 6.2, 9.1, 11.0),
    "Streaming DiLoCo w/ overlapped FP4 com.": (0.4, 0.9, 1.7, 2.0, 3.0),
}
"""Table 4, 1B rows: Gbit/s needed for each CU target, in `table4_methods()` order
(the 10B and 100B rows are not in our copy of the paper)."""

TABLE4_METHOD_KEYS: tuple[str, ...] = (
    "data_parallel",
    "diloco",
    "streaming",
    "streaming_overlap",
    "streaming_overlap_fp4",
)
"""Short keys of the methods of `table4_methods()`, in order (the preset names)."""
