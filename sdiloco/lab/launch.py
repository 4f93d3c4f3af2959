"""Run Streaming DiLoCo over processes and hosts with JAX's distributed runtime.

One command per process (here two processes on one machine, CPU collectives over gloo):

    python -m sdiloco.lab.launch --coordinator 127.0.0.1:12345 --num-processes 2 \\
        --process-id 0 --steps 50 --out params.npz &
    python -m sdiloco.lab.launch --coordinator 127.0.0.1:12345 --num-processes 2 \\
        --process-id 1 --steps 50

Each process calls `jax.distributed.initialize`, builds the replica mesh over every
global device (`distributed.replica_mesh`), builds the model (`sdiloco.lab.model` preset)
and the same initial state, and feeds **only its own replicas' data shards** (the grain
iterators of `sdiloco.lab.data`, assembled into global arrays with
`jax.make_array_from_process_local_data`). The jitted step is the library's
`streaming_diloco(...).step` with `exchange=distributed.sharded_exchange(mesh)`: the
inner steps run where their replica lives, and a fragment sync all-gathers the packed
4-bit payload. Every process prints the losses and the bytes each fragment sync puts on
the wire (read off the compiled program); process 0 writes the final global parameters
with `--out`.

On a real cluster: start one process per host with the same `--coordinator` (host 0's
address) and `--num-processes`, and its own `--process-id` (or let
`jax.distributed.initialize()` detect them under SLURM / Cloud TPU / Kubernetes). Use
one replica per island of fast interconnect (a host, a slice); the devices inside an
island hold that replica. The mesh here has only the `"replica"` axis, so every device
holds whole replicas; to spread one replica over the devices of its island, add a
second mesh axis (e.g. `"data"`, shape `(M, devices_per_island)`) and shard the batch's
second axis over it (data parallelism inside the replica, whose gradient all-reduce
stays on the fast links), or the parameters' large axes (FSDP). That is not built here.

What is and is not overlapped in practice: the algorithm is overlapped in the paper's
sense (a fragment sent at step t is applied at t + τ, so its exchange may take up to τ
inner steps), but in this single jitted program the all-gather of step t is issued and
awaited inside step t: XLA does not carry a collective across jitted calls, so the
replicas still wait for the bytes of each sync. With τ >= 1 the exchanged value is not
needed until a later step, so a runtime that issues the collective asynchronously (XLA's
async collectives on GPU/TPU, or a step split into "send" and "receive" programs) can
hide it behind the next τ inner steps; on CPU (gloo) nothing is hidden.
"""

import argparse
import dataclasses
import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh

from .. import distributed
from ..compression import FORMATS
from ..fragments import Fragments, fragments_by_layer
from ..streaming import Algorithm, streaming_diloco
from .data import load_corpus, make_replica_iterators, stack_batches
from .model import ModelConfig, Transformer, loss_fn, preset


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to train: a preset transformer with Streaming DiLoCo on Shakespeare."""

    preset: str = "tiny-xs"
    """Model preset of `sdiloco.lab.model.preset`."""
    seq_len: int | None = None
    """Override of the preset's sequence length."""
    num_layers: int | None = None
    """Override of the preset's number of blocks."""
    width: int | None = None
    """Override of the preset's width (the MLP stays 4 × width)."""
    num_replicas: int | None = None
    """M; default: one per device of the mesh (one per process with one device each)."""
    global_batch_size: int = 8
    """Sequences per step over all replicas (divisible by M)."""
    steps: int = 100
    """Inner steps to run."""
    sync_every: int = 10
    """H."""
    layers_per_fragment: int = 2
    """Blocks per fragment (strided); the non-block parameters are fragment 0."""
    overlap: int = 1
    """τ."""
    alpha: float = 0.5
    """α of the merge."""
    compressor: str | None = "e3m0"
    """Outer-gradient format (`quantization.FORMATS`), or None for float32."""
    error_feedback: bool = False
    """Carry the quantization residual into the next send."""
    inner_lr: float = 1e-3
    """AdamW learning rate (β = (0.9, 0.99), clip 1.0, weight decay 0.1)."""
    outer_lr: float = 0.4
    """Outer SGD learning rate (Nesterov, momentum 0.9)."""
    seed: int = 0
    """Model init and data shuffle seed."""

    def __post_init__(self):
        if self.compressor is not None and self.compressor not in FORMATS:
            raise ValueError(
                f"LaunchConfig.compressor={self.compressor!r}; allowed: {FORMATS} "
                "or None."
            )
        for name in ("global_batch_size", "steps", "sync_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LaunchConfig.{name}={value!r}; must be an int >= 1.")


class Keys(NamedTuple):
    """The independent PRNG keys of a run, split from `jr.key(config.seed)`."""

    model: Any  # [] key: the model's initialisation
    algorithm: Any  # [] key: the algorithm state (e.g. stochastic rounding)


def keys(config: LaunchConfig) -> Keys:
    """Split the run's one root key into the model's and the algorithm's."""
    model, algorithm = jr.split(jr.key(config.seed))
    return Keys(model, algorithm)


class RunResult(NamedTuple):
    """What `run` returns (host values, the same on every process)."""

    global_params: Any  # θ_g at the end, NumPy leaves
    losses: list[float]  # mean training loss of each step
    bits_per_fragment: list[int]  # accounting: bits one replica sends per fragment
    fragment_sizes: list[int]  # parameters per fragment (fp32 would send 4 bytes each)
    wire_bytes: list[int] | None  # measured per fragment: bytes one replica sends


def build(
    config: LaunchConfig, num_replicas: int, mesh: Mesh | None = None
) -> tuple[Transformer, Algorithm]:
    """The model and the `Algorithm` (with the sharded exchange when given a mesh).

    Returns:
        `(params, algorithm)`.
    """
    params = Transformer(model_config(config), key=keys(config).model)
    fragments = alg_fragments(params, config)
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(config.inner_lr, b1=0.9, b2=0.99, weight_decay=0.1),
    )
    extra = {} if mesh is None else {"exchange": distributed.sharded_exchange(mesh)}
    alg = streaming_diloco(
        loss_fn,
        inner=inner,
        outer=optax.sgd(config.outer_lr, momentum=0.9, nesterov=True),
        num_replicas=num_replicas,
        sync_every=config.sync_every,
        fragments=fragments,
        overlap=config.overlap,
        alpha=config.alpha,
        compressor=config.compressor,
        error_feedback=config.error_feedback,
        **extra,
    )
    return params, alg


def model_config(config: LaunchConfig) -> ModelConfig:
    """The preset's `ModelConfig` with the overrides of `config` applied."""
    overrides = {"seq_len": config.seq_len, "num_layers": config.num_layers}
    if config.width is not None:
        overrides.update(width=config.width, mlp_hidden=4 * config.width)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(preset(config.preset), **overrides)


def alg_fragments(params: Transformer, config: LaunchConfig) -> Fragments:
    """Strided fragments of `config.layers_per_fragment` blocks, non-blocks apart."""
    return fragments_by_layer(
        params,
        blocks=lambda m: m.blocks,
        layers_per_fragment=config.layers_per_fragment,
    )


def run(
    config: LaunchConfig,
    mesh: Mesh | None = None,
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Train for `config.steps` steps; the training loop of every process.

    Args:
        config: what to train.
        mesh: a `distributed.replica_mesh` (replicas sharded over its devices, which
            may span processes); None simulates all replicas vmapped on one device,
            the reference the distributed run must reproduce.
        log: called with one line per step (e.g. `print`); None is silent.

    Returns:
        The final global parameters, the losses and the communication accounting.
    """
    if mesh is None:
        num_replicas = config.num_replicas or 1
        local = list(range(num_replicas))
    else:
        num_replicas = config.num_replicas or mesh.size
        local = distributed.process_replicas(mesh, num_replicas)
    params, alg = build(config, num_replicas, mesh)
    iterators = make_replica_iterators(
        load_corpus("train"),
        num_replicas=num_replicas,
        global_batch_size=config.global_batch_size,
        seq_len=params.config.seq_len,
        seed=config.seed,
    )

    def next_batch():
        batch = stack_batches([next(iterators[m]) for m in local])
        if mesh is None:
            return jax.tree.map(jnp.asarray, batch)
        return distributed.shard_batch(batch, mesh, num_replicas)

    state = alg.init(params, keys(config).algorithm)
    batch = next_batch()
    wire = None
    if mesh is None:
        step = eqx.filter_jit(alg.step)
    else:
        state = distributed.shard_state(state, mesh)
        compiled = (
            distributed.sharded_step(alg.step, mesh).lower(state, batch).compile()
        )
        step = compiled
        measured = distributed.wire_bytes(compiled.compiled.as_text(), num_replicas)
    bits = [int(b) for b in alg.bits_per_fragment(params)]
    sizes = [int(n) for n in alg_fragments(params, config).sizes()]
    if mesh is not None:
        wire = [measured.get(p, 0) for p in range(len(sizes))]
    losses = []
    for t in range(1, config.steps + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss/train"])
        losses.append(loss)
        if log is not None:
            sent = np.asarray(metrics["sync/sent"]).nonzero()[0].tolist()
            log(
                f"step {t} loss {loss:.4f} sent {sent} "
                f"bits {float(metrics['comm/bits']):.0f} "
                f"({time.perf_counter() - start:.3f} s)"
            )
        if t < config.steps:
            batch = next_batch()
    final = jax.tree.map(_host, state.global_params)
    return RunResult(final, losses, bits, sizes, wire)


def save_params(path: str, params: Any) -> None:
    """Write the array leaves of `params` to an `.npz`, keyed by their tree paths."""
    np.savez(path, **flat_params(params))


def flat_params(params: Any) -> dict[str, np.ndarray]:
    """`{tree path: NumPy array}` of the array leaves of `params`."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(params, eqx.is_array))[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def params_digest(params: Any) -> str:
    """SHA-256 of the bytes of every array leaf of `params` (for cross-process checks)."""
    h = hashlib.sha256()
    for name, x in sorted(flat_params(params).items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: `python -m sdiloco.lab.launch --help`."""
    args = _parser().parse_args(argv)
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if values.get("compressor") == "none":
        values["compressor"] = None
    config = LaunchConfig(**values)
    if args.coordinator is not None:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.init_timeout,
        )
    try:
        pid = jax.process_index()
        mesh = distributed.replica_mesh(*_replica_devices(config.num_replicas))

        def log(line):
            print(f"[process {pid}] {line}", flush=True)

        result = run(config, mesh, log)
        log(f"fragment sizes (parameters) {result.fragment_sizes}")
        log(f"bits per fragment (accounting) {result.bits_per_fragment}")
        log(
            f"bytes per fragment on the wire (one replica's message) "
            f"{result.wire_bytes}; fp32 would be "
            f"{[4 * n for n in result.fragment_sizes]}"
        )
        log(f"final_params_sha256 {params_digest(result.global_params)}")
        if args.out and pid == 0:
            save_params(args.out, result.global_params)
    finally:
        if args.coordinator is not None:
            jax.distributed.shutdown()
    return 0


def _replica_devices(num_replicas: int | None) -> tuple[int, list]:
    """M and the devices of the replica axis: all of them, or evenly strided ones.

    With fewer replicas than devices (e.g. M = 2 on 2 hosts of 4 devices), replica m
    lives on the first device of its block of `device_count / M` devices; the others
    stay idle until a second mesh axis gives them work (see the module docstring).
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    m = num_replicas or len(devices)
    if m < len(devices) and len(devices) % m == 0:
        devices = devices[:: len(devices) // m]
    return m, devices


def _host(x):
    if not eqx.is_array(x):
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sdiloco.lab.launch",
        description="Streaming DiLoCo over processes/hosts (jax.distributed).",
    )
    p.add_argument("--coordinator", help="host:port of process 0; omit for one process")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--init-timeout", type=int, default=60, help="seconds")
    p.add_argument("--preset")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--num-replicas", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--sync-every", type=int)
    p.add_argument("--layers-per-fragment", type=int)
    p.add_argument("--overlap", type=int)
    p.add_argument("--alpha", type=float)
    p.add_argument("--compressor", help=f"one of {FORMATS} or 'none'")
    p.add_argument("--error-feedback", action="store_true", default=None)
    p.add_argument("--inner-lr", type=float)
    p.add_argument("--outer-lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="process 0 writes the final global params (.npz)")
    return p


if __name__ == "__main__":
    sys.exit(main())
