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

TABLE1_1B_STEPS: dict[str, int] = {"25B": 24_300, "100B": 97_200, "250B": 243_000}
"""Table 1 (1B model): inner steps of each token budget."""

TABLE1_1B_HOURS: dict[str, tuple[float, float, float, float]] = {
    "25B": (0.67, 109, 0.67, 0.88),
    "100B": (2.7, 438, 2.7, 3.5),
    "250B": (6.75, 1097, 6.75, 8.75),
}
"""Table 1 (1B): hours of Data-Parallel at +inf and at 1 Gbit/s, then of Streaming
DiLoCo with overlapped FP4 at +inf and at 1 Gbit/s."""

REBUTTAL_STEPS: int = 186_250
"""The review rebuttal's wall-clock table (docs/paper.md §9): steps of its 1B run."""

REBUTTAL_TEXT: dict[str, dict[float, str]] = {
    "Data-Parallel": {1.0: "21 days", 10.0: "2 days", 100.0: "10 h", 1000.0: "5 h"},
    "DiLoCo": {1.0: "12 h", 10.0: "6 h", 100.0: "5 h", 1000.0: "5 h"},
    "Streaming DiLoCo, overlapped FP4": {
        1.0: "6 h",
        10.0: "5 h",
        100.0: "5 h",
        1000.0: "5 h",
    },
}
"""The rebuttal's wall clock per method and bandwidth (written "GiB"), as printed."""

REBUTTAL_HOURS: dict[str, dict[float, float]] = {
    "Data-Parallel": {1.0: 21 * 24, 10.0: 2 * 24, 100.0: 10, 1000.0: 5},
    "DiLoCo": {1.0: 12, 10.0: 6, 100.0: 5, 1000.0: 5},
    "Streaming DiLoCo, overlapped FP4": {1.0: 6, 10.0: 5, 100.0: 5, 1000.0: 5},
}
"""`REBUTTAL_TEXT` in hours."""
