"""Tests for the memory calculator (paper §2.5; docs/paper.md §1.10)."""

import math

import pytest
from hypothesis import given, strategies as st

from sdiloco.sim.memory import GIB, memory_footprint, overhead_vs_data_parallel


def test_diloco_needs_five_thirds_of_data_parallel():
    # "our method requires 66% (5/3) more memory compared to Data-Parallel"
    for n in (35e6, 1e9, 100e9):
        assert overhead_vs_data_parallel(n, "diloco") == pytest.approx(5 / 3, rel=1e-15)
        no_offload = overhead_vs_data_parallel(
            n, "streaming", num_layers=24, offload=False
        )
        assert no_offload == pytest.approx(5 / 3, rel=1e-15)


def test_streaming_100b_offloaded_is_two_percent():
    # "For a 100 billion parameter model ... |p| = three layers ... 108 layers, that
    # amounts to a 2% increase of memory (additional 20 GB to 1,117 GB)."
    dp = memory_footprint(100e9, "data_parallel")
    sd = memory_footprint(100e9, "streaming", num_layers=108, layers_per_fragment=3)
    assert dp.hbm_bytes == 100e9 * 3 * 4
    assert sd.overhead_bytes == pytest.approx(100e9 * 2 * 4 * 3 / 108, rel=1e-15)
    assert math.floor(dp.hbm_bytes / GIB) == 1117
    assert math.floor(sd.overhead_bytes / GIB) == 20
    ratio = overhead_vs_data_parallel(
        100e9, "streaming", num_layers=108, layers_per_fragment=3
    )
    assert ratio == pytest.approx(1 + 2 / 108, rel=1e-15)
    assert round(100 * (ratio - 1)) == 2
    # The outer state that is not in HBM is on the host.
    assert sd.host_offloaded == pytest.approx(2 * 100e9 * 4 * (1 - 3 / 108))


def test_breakdown_of_each_method():
    n = 1e9
    dp = memory_footprint(n, "data_parallel")
    assert (dp.params, dp.inner_optimizer, dp.overhead_bytes, dp.host_offloaded) == (
        4e9,
        8e9,
        0.0,
        0.0,
    )
    dl = memory_footprint(n, "diloco")
    assert (dl.outer_params_hbm, dl.outer_momentum_hbm, dl.host_offloaded) == (
        4e9,
        4e9,
        0.0,
    )
    bf16 = memory_footprint(n, "diloco", bytes_per_value=2.0)
    assert bf16.hbm_bytes == 5 * 2e9


@given(
    num_layers=st.sampled_from([6, 9, 24, 61, 108, 126]),
    layers_per_fragment=st.sampled_from([1, 2, 3, 4]),
)
def test_streaming_sits_between_data_parallel_and_diloco(
    num_layers, layers_per_fragment
):
    kw = dict(num_layers=num_layers, layers_per_fragment=layers_per_fragment)
    sd = memory_footprint(1e9, "streaming", **kw)
    dp = memory_footprint(1e9, "data_parallel", **kw)
    dl = memory_footprint(1e9, "diloco", **kw)
    assert dp.hbm_bytes < sd.hbm_bytes <= dl.hbm_bytes
    # HBM and host together always hold the whole outer state.
    assert sd.overhead_bytes + sd.host_offloaded == pytest.approx(dl.overhead_bytes)
    # The fragment is the largest one: ceil(L / P) layers.
    P = math.ceil(num_layers / layers_per_fragment)
    largest = math.ceil(num_layers / P)
    assert sd.outer_params_hbm == pytest.approx(4e9 * largest / num_layers)


def test_exact_fragment_size_overrides_the_estimate():
    sd = memory_footprint(1.27e9, "streaming", fragment_params=1.5e8)
    assert sd.outer_params_hbm == sd.outer_momentum_hbm == 1.5e8 * 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_params=0.0, method="diloco"), "num_params"),
        (dict(num_params=math.inf, method="diloco"), "num_params"),
        (dict(num_params=1e9, method="fsdp"), "method"),
        (dict(num_params=1e9, method="diloco", bytes_per_value=0.0), "bytes_per_value"),
        (dict(num_params=1e9, method="streaming"), "num_layers"),
        (dict(num_params=1e9, method="streaming", num_layers=0), "num_layers"),
        (
            dict(num_params=1e9, method="streaming", layers_per_fragment=0),
            "layers_per_fragment",
        ),
        (
            dict(num_params=1e9, method="streaming", fragment_params=2e9),
            "fragment_params",
        ),
    ],
)
def test_bad_inputs_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        memory_footprint(**kwargs)
