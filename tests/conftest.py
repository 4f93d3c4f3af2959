"""Test configuration: strict dtype promotion, several CPU devices, hypothesis profiles."""

import os
import tempfile


# Must happen before jax initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import hypothesis
import jax
import jax.random as jr
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 4)
# XLA:CPU compiles dominate the suite's time; identical programs (the same step built
# twice, e.g. a run and its resumed half) are compiled once and reused across runs.
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get(
        "SDILOCO_JAX_CACHE", os.path.join(tempfile.gettempdir(), "sdiloco-jax-cache")
    ),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

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
