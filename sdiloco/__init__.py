"""sdiloco: Streaming DiLoCo in JAX + Equinox + Optax."""

__version__ = "0.1.0"
