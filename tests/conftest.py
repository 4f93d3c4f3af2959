"""Test configuration: strict dtype promotion, several CPU devices, hypothesis profiles."""

import os


# Must happen before jax initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import hypothesis
import jax
import jax.random as jr
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 4)

hypothesis.settings.register_profile(
    "dev", max_examples=20, derandomize=True, database=None, deadline=None
)
hypothesis.settings.register_profile(
    "ci", max_examples=100, derandomize=True, database=None, deadline=None
)
hypothesis.settings.load_profile(os.environ.get("SDILOCO_HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def getkey():
    """Return a function that hands out fresh, deterministic PRNG keys."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey
