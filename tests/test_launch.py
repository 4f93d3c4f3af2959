"""The multi-process launcher's host-side pieces (the runs are in test_distributed)."""

import jax
import jax.numpy as jnp
import jax.random as jr

from sdiloco.lab import launch


def test_model_and_algorithm_keys_are_independent():
    config = launch.LaunchConfig(preset="tiny-xxs", seed=3)
    keys = launch.keys(config)
    model_key, alg_key = jr.key_data(keys.model), jr.key_data(keys.algorithm)
    assert not jnp.array_equal(model_key, alg_key)
    assert jnp.array_equal(jr.key_data(launch.keys(config).model), model_key)
    # The model is initialised from its own key, not from the root key, which would
    # correlate it with the algorithm's randomness.
    params, _ = launch.build(config, num_replicas=1)
    expected = launch.Transformer(launch.model_config(config), key=keys.model)
    root = launch.Transformer(launch.model_config(config), key=jr.key(config.seed))
    same = jax.tree.map(jnp.array_equal, params, expected)
    assert all(jax.tree.leaves(same))
    differs = jax.tree.map(jnp.array_equal, params, root)
    assert not all(jax.tree.leaves(differs))
