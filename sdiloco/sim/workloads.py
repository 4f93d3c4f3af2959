"""What one training step of one replica costs: the simulator's workloads.

A `Workload` is a model on its hardware (docs/paper.md §5.1): its layers, its step time at
infinite bandwidth and the parameters it synchronizes. `paper_workload` gives the
scales the paper simulates (Table 4, Fig. 16), and `step_time_from_flops` derives a
step time from the 6·N rule for other models and hardware.
"""

import dataclasses

from .checks import check, positive


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model on its hardware: what one step of one replica costs (docs/paper.md §5.1).

    Example:
        >>> Workload(num_layers=24, step_time=0.1, num_params=1e9).num_layers
        24
    """

    num_layers: int
    """L, transformer blocks; the DAG has one node of each kind per layer."""
    step_time: float
    """Seconds per step at infinite bandwidth: pure compute plus any pipeline bubble."""
    num_params: float
    """Parameters synchronized across replicas (for an MoE, all experts count)."""
    name: str = ""
    """Label for tables, e.g. "1B"."""
    pipeline_stages: int = 1
    """Pipeline-parallel stages inside one replica; 1 is the paper's simulator."""
    microbatches: int = 1
    """GPipe microbatches per step; 1 is the paper's simulator."""

    def __post_init__(self):
        """Validate the fields."""
        check(self.num_layers >= 1, "num_layers", self.num_layers, "an int >= 1")
        check(
            positive(self.step_time), "step_time", self.step_time, "a finite float > 0"
        )
        check(
            positive(self.num_params),
            "num_params",
            self.num_params,
            "a finite float > 0",
        )
        check(
            1 <= self.pipeline_stages <= self.num_layers,
            "pipeline_stages",
            self.pipeline_stages,
            f"an int in [1, num_layers={self.num_layers}]",
        )
        check(self.microbatches >= 1, "microbatches", self.microbatches, "an int >= 1")


def paper_workload(name: str) -> Workload:
    """A model scale simulated in the paper (Table 4, Fig. 16; docs/paper.md §5.1).

    The step times are the paper's: 0.1, 0.8, 4.9, 26.9 and 20.1 s. The paper does
    not state the layer counts of Llama-3-405B (126) or DeepSeek-V3 (61); they are
    inferred.

    Args:
        name: "1B", "10B", "100B", "llama405b" or "deepseek_v3".

    Returns:
        The workload, with the nominal parameter count (1e9, ...).
    """
    presets = {
        "1B": (24, 0.1, 1e9),
        "10B": (48, 0.8, 10e9),
        "100B": (108, 4.9, 100e9),
        "llama405b": (126, 26.9, 405e9),
        "deepseek_v3": (61, 20.1, 671e9),
    }
    check(name in presets, "name", name, f"one of {sorted(presets)}")
    layers, step_time, params = presets[name]
    return Workload(
        num_layers=layers, step_time=step_time, num_params=params, name=name
    )


def step_time_from_flops(
    num_params: float,
    tokens_per_step: float,
    chip_flops: float,
    num_chips: int,
    mfu: float,
) -> float:
    """Pure-compute step time from the 6·N rule (Kaplan et al.; Table 4 caption).

    Args:
        num_params: N (activated parameters for a mixture-of-experts).
        tokens_per_step: global batch in tokens, all replicas together.
        chip_flops: peak FLOP/s of one chip.
        num_chips: chips of all replicas together.
        mfu: model FLOPs utilization in (0, 1] (60 % in the Table 4 caption).

    Returns:
        6 · N · tokens / (chips · FLOP/s · MFU), in seconds.

    Example:
        >>> round(step_time_from_flops(1e9, 2.0**20, 1e15, 100, 0.6), 4)
        0.1049
    """
    for field, value in [
        ("num_params", num_params),
        ("tokens_per_step", tokens_per_step),
        ("chip_flops", chip_flops),
        ("num_chips", num_chips),
    ]:
        check(positive(value), field, value, "a finite number > 0")
    check(0 < mfu <= 1, "mfu", mfu, "a float in (0, 1]")
    return 6.0 * num_params * tokens_per_step / (chip_flops * num_chips * mfu)
