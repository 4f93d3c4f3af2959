"""Host-side configuration: frozen dataclasses that `build()` the runtime objects.

Jitted code never reads these: `InnerConfig.build()` returns an optax transformation,
a method config's `build()` an `Algorithm`. There is one config class per method, each
holding only the fields that method uses:

* `DataParallelConfig` → `sdiloco.data_parallel`;
* `DiLoCoConfig` → `sdiloco.diloco` (P = 1, τ = 0, α = 0, float32 outer gradients);
* `StreamingConfig` → `sdiloco.streaming_diloco` (fragments, overlap, compression).

A config's JSON names its method (`"method": {"kind": "streaming", ...}`) and is read
back by the one loader, `fields.from_dict` (used by `RunConfig.from_json`). Paper settings are
named presets (`PRESETS`), each a function returning a `RunConfig`.

Defaults follow docs/paper.md §8: M = 2, H = 100, τ = 1, α = 0.5, 3 layers per fragment
strided, E3M0 outer gradients, outer SGD(0.4, Nesterov 0.9), inner AdamW
β = (0.9, 0.99) with clipping 1.0, warmup then cosine to 5 %.
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.contrib

from ..sim.chaos import Failures
from . import fields, model as model_lib, objects
from .methods import (
    METHODS as METHODS,
    SPARSIFIERS as SPARSIFIERS,
    DataParallelConfig as DataParallelConfig,
    DecoupledAggregator as DecoupledAggregator,
    DiLoCoConfig as DiLoCoConfig,
    MethodConfig as MethodConfig,
    OuterConfig as OuterConfig,
    StreamingConfig as StreamingConfig,
    method_from_dict as method_from_dict,
    quorum_size,
    replace_method as replace_method,
)


INNER_KINDS = ("adamw", "muon")
"""The inner optimizers (`InnerConfig.kind`)."""

MUON_MATRICES: dict[str, tuple[Any, Any]] = {
    "w_q": (1, (2, 3)),
    "w_k": (1, (2, 3)),
    "w_v": (1, (2, 3)),
    "w_o": ((1, 2), 3),
    "w_up": (1, 2),
    "w_down": (1, 2),
}
"""The lab Transformer's weight matrices, leaves of its stacked `blocks` (axis 0 the
layer): name → (input axes, output axes) of the matrix that Muon orthogonalises, one
per layer. `w_q` `[L, d, h, k]` is the `d × h·k` matrix of each layer."""


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer: AdamW (or Muon) with warmup + cosine decay and gradient
    clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 50
    """Linear warmup from 0 to `lr` (unless `warmup_fraction` is set)."""
    warmup_fraction: float | None = None
    """The warmup as a fraction of the run's steps (`round(fraction · steps)`, at
    least 1), which keeps the schedule's shape when the budget changes; when set it
    replaces `warmup_steps`. The tuned presets set it (`TUNED`)."""
    min_lr_ratio: float = 0.05
    """Cosine decay ends at `min_lr_ratio * lr` (5 % in the companion papers)."""
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay (optax.adamw's, multiplied by the learning rate)."""
    clip_norm: float | None = 1.0
    """Clip gradients to this global L2 norm (None: no clipping)."""
    kind: str = fields.new_field("adamw")
    """"adamw", or "muon" (MuLoCo's inner optimizer, `optax.contrib.muon`): Muon on
    the blocks' weight matrices (`MUON_MATRICES`, orthogonalised per layer), Adam on
    the embedding and the norm scales (with `b1`, `b2` and Nesterov momentum, as
    optax's Muon does). Both sides take the schedule, `eps` and `weight_decay`; Muon's
    updates are scaled to an RMS of 0.2 (`consistent_rms`, Liu et al. 2025), about
    AdamW's, so that one learning rate serves both."""
    transform: Any = fields.object_field(None)
    """An optax transformation to use as it is, instead of the one the fields above
    describe (which are then not used): e.g. `lab.objects.call(optax.lion,
    learning_rate=1e-4)`, which `config.json` can re-create, or any
    `optax.GradientTransformation` object, which it records by name only."""

    def __post_init__(self):
        fields.choice("InnerConfig.kind", self.kind, INNER_KINDS)
        fields.positive("InnerConfig.lr", self.lr)
        fields.nonnegative_int("InnerConfig.warmup_steps", self.warmup_steps)
        if self.warmup_fraction is not None:
            fields.positive("InnerConfig.warmup_fraction", self.warmup_fraction)
            fields.in_range(
                "InnerConfig.warmup_fraction",
                self.warmup_fraction,
                0,
                1,
                "(0, 1)",
                open_high=True,
            )
        fields.in_range("InnerConfig.min_lr_ratio", self.min_lr_ratio, 0, 1, "[0, 1]")
        fields.in_range("InnerConfig.b1", self.b1, 0, 1, "[0, 1)", open_high=True)
        fields.in_range("InnerConfig.b2", self.b2, 0, 1, "[0, 1)", open_high=True)
        fields.positive("InnerConfig.eps", self.eps)
        fields.in_range("InnerConfig.weight_decay", self.weight_decay, 0, None, ">= 0")
        if self.clip_norm is not None:
            fields.positive("InnerConfig.clip_norm", self.clip_norm)

    def warmup(self, total_steps: int) -> int:
        """Warmup steps of a run of `total_steps`."""
        if self.warmup_fraction is None:
            return self.warmup_steps
        return max(1, round(self.warmup_fraction * total_steps))

    def schedule(self, total_steps: int, peak: Any = None) -> optax.Schedule:
        """Warmup then cosine decay to `min_lr_ratio * lr` at `total_steps`:
        `warmup_cosine` at this config's warmup and length (`lengths`), peak `peak`
        (a traced value, as `build` passes) or `lr`. The numbers are
        `optax.warmup_cosine_decay_schedule`'s, bitwise."""
        warmup, decay_steps = self.lengths(total_steps)
        peak = self.lr if peak is None else peak
        return warmup_cosine(peak, warmup, decay_steps, self._alpha())

    def _alpha(self) -> float:
        """The cosine's floor over its peak, computed as optax computes `end / peak`
        (its `end` is `min_lr_ratio · lr`), to the last bit."""
        return self.min_lr_ratio * self.lr / self.lr

    def lengths(self, total_steps: int) -> tuple[int, int]:
        """`(warmup, decay_steps)` of a run of `total_steps`: the warmup kept below
        the run's length, the cosine at least one step long (optax's rules)."""
        warmup = min(self.warmup(total_steps), max(total_steps - 1, 0))
        return warmup, max(total_steps, warmup + 1)

    def build(self, total_steps: int) -> optax.GradientTransformation:
        """The optax transformation for a run of `total_steps` inner steps.

        The peak learning rate, the warmup and the schedule's length are values of
        the optimizer state, not constants of the program (`optax.inject_hyperparams`;
        `hyperparams["learning_rate"]`, `["warmup_steps"]`, `["decay_steps"]`): runs
        that differ only in them (the trials of a learning-rate or warmup sweep, or
        two budgets of one model) compile one program. The initial values stay
        constants where the step itself initialises a state (a replica that comes
        back without a live peer, in a run with `failures`): such runs share a
        program across failure traces, not hyperparameters.
        A `transform` is returned as it is.
        """
        if self.transform is not None:
            return objects.build(self.transform)
        warmup, decay_steps = self.lengths(total_steps)
        adamw = optax.inject_hyperparams(
            lambda learning_rate, warmup_steps, decay_steps: self._optimizer(
                warmup_cosine(learning_rate, warmup_steps, decay_steps, self._alpha())
            )
        )(learning_rate=self.lr, warmup_steps=warmup, decay_steps=decay_steps)
        if self.clip_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), adamw)

    def _optimizer(self, schedule: optax.Schedule) -> optax.GradientTransformation:
        """AdamW, or Muon, on `schedule`."""
        if self.kind == "muon":
            return optax.contrib.muon(
                schedule,
                eps=self.eps,
                weight_decay=self.weight_decay,
                adam_b1=self.b1,
                adam_b2=self.b2,
                adam_weight_decay=self.weight_decay,
                muon_weight_dimension_numbers=muon_dimensions,
                consistent_rms=0.2,
            )
        return optax.adamw(
            schedule,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


def warmup_cosine(
    peak: Any, warmup: Any, decay_steps: Any, alpha: float
) -> optax.Schedule:
    """Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to
    `alpha · peak` at `decay_steps`, where every argument but `alpha` may be a
    traced value.

    The numbers are `optax.warmup_cosine_decay_schedule(0, peak, warmup,
    decay_steps, end)`'s with `alpha = end / peak`, bitwise: optax's operations
    (`optax.linear_schedule` joined to `optax.cosine_decay_schedule` at `warmup`),
    with each division by a length written as the product XLA makes of it (the
    comment below). optax's own pieces cannot take a traced warmup or length (they
    test them in Python), which would make every warmup and every budget of a sweep
    a program of its own. `warmup` = 0 starts at the cosine, as optax's does. The
    caller keeps `0 <= warmup < decay_steps` (`InnerConfig.lengths`).
    """

    def schedule(count: Any) -> Any:
        # Where optax divides by a constant (the warmup, the cosine's length), XLA
        # multiplies by the constant's reciprocal; the records were made with that
        # arithmetic. A traced divisor is not rewritten, so the product is written
        # here: dividing would move the learning rate by an ulp at some steps.
        # optax.linear_schedule(0.0, peak, warmup): a polynomial of power 1.
        ramp_count = jnp.clip(count, 0, warmup)
        frac = 1 - ramp_count * (1 / jnp.asarray(warmup, jnp.float32))
        ramp = (0.0 - peak) * (frac**1) + peak
        # optax.cosine_decay_schedule(peak, decay_steps - warmup, alpha), from warmup
        # (optax's π · since / length, folded as XLA folds it).
        length = jnp.asarray(decay_steps - warmup, jnp.float32)
        since = jnp.minimum(count - warmup, length)
        cosine = 0.5 * (1 + jnp.cos(since * (jnp.pi * (1 / length))))
        decayed = (1 - alpha) * cosine**1.0 + alpha
        return jnp.where(count < warmup, ramp, peak * decayed)

    return schedule


def muon_dimensions(params: Any) -> Any:
    """Which leaves of the lab Transformer's `params` Muon takes, and as which matrix:
    `optax.contrib.MuonDimensionNumbers` for the blocks' weight matrices
    (`MUON_MATRICES`; the layer axis is a batch axis, so each layer is
    orthogonalised on its own), None (Adam) for the rest.

    optax's default rule (Muon for every 2-D leaf) would take the embedding and the
    stacked norm scales `[L, d]` and leave every stacked matrix `[L, ...]` to Adam.

    Raises:
        ValueError: if `params` has no such matrix (not the lab Transformer).
    """

    def dims(path: Any, leaf: Any) -> Any:
        del leaf
        names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        if names[:1] == ["blocks"] and names[-1] in MUON_MATRICES:
            return optax.contrib.MuonDimensionNumbers(*MUON_MATRICES[names[-1]])
        return None

    out = jax.tree_util.tree_map_with_path(dims, params)
    is_dims = lambda x: isinstance(x, optax.contrib.MuonDimensionNumbers)  # noqa: E731
    if not any(is_dims(x) for x in jax.tree.leaves(out, is_leaf=is_dims)):
        raise ValueError(
            "InnerConfig.kind='muon' found none of the weight matrices "
            f"{sorted(MUON_MATRICES)} under `blocks`; it is for the lab Transformer."
        )
    return out


TOKEN_DTYPES = ("uint8", "uint16", "uint32")
"""The dtypes a token file may hold (`DataConfig.token_dtype`)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched."""

    global_batch_size: int = 16
    """Sequences per step over all replicas (split evenly: B / M each)."""
    seed: int = 0
    """Seed of the shuffle (the data order)."""
    token_file: str | None = None
    """A user token file (.npy or raw) instead of the embedded Shakespeare corpus."""
    token_dtype: str = "uint16"
    """dtype of a raw `token_file`: "uint8", "uint16" or "uint32" (a `.npy` file's
    dtype is read from its header). Every id must be below the model's vocabulary."""
    heldout_fraction: float = 0.1
    """Fraction of a user token file held out for evaluation (its tail)."""
    validation: bool = False
    """Tuning: evaluate on a validation split carved out of the training data (the
    corpus's `data.VALIDATION_PLAYS`, or the tail `heldout_fraction` of a token file's
    training part) and train on the rest; the held-out split stays unseen."""

    def __post_init__(self):
        fields.positive_int("DataConfig.global_batch_size", self.global_batch_size)
        fields.choice("DataConfig.token_dtype", self.token_dtype, TOKEN_DTYPES)
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(
                f"DataConfig.heldout_fraction={self.heldout_fraction!r}; must be in "
                "(0, 1)."
            )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; serialisable to JSON."""

    name: str = "run"
    """A label (the preset's name, e.g. "muloco"); not part of what is trained:
    record keys and checkpoints leave it out. `title()` adds the knobs that tell
    runs of one preset apart."""
    model: str = "tiny-s"
    """A model preset name (`model.preset`)."""
    vocab_size: int | None = fields.new_field(None)
    """The model's vocabulary instead of the preset's (None: the preset's; 256 for
    the tiny models): token ids run over `[0, vocab_size)`."""
    method: MethodConfig = dataclasses.field(default_factory=StreamingConfig)
    """The method and its knobs: a `DataParallelConfig`, `DiLoCoConfig` or
    `StreamingConfig` (or a dict with its `kind`)."""
    inner: InnerConfig = dataclasses.field(default_factory=InnerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    steps: int = 600
    """Total inner steps."""
    seed: int = 0
    """Seed of the model initialisation and stochastic compressors."""
    eval_every: int = 100
    """Evaluate the held-out loss every this many steps (and at the end)."""
    eval_windows: int | None = None
    """Held-out windows per evaluation, spread evenly over the split and the same for
    every method and batch (`data.evaluation_windows`); None: every window."""
    eval_params: tuple[str, ...] = ("global",)
    """Which parameters to evaluate: any of "global", "average", "first"."""
    log_every: int = 10
    """Steps between two rows of the metrics history."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end, if `out_dir`)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    failures: Failures | None = None
    """Replica failures and stragglers to simulate (`sdiloco.sim.chaos`): the run
    feeds the seeded trace's participation to every step; None: every replica takes
    part in every step."""

    def __post_init__(self):
        if isinstance(self.method, dict):
            object.__setattr__(self, "method", method_from_dict(self.method))
        fields.coerce(self, "inner", InnerConfig)
        fields.coerce(self, "data", DataConfig)
        if not isinstance(self.method, tuple(METHODS.values())):
            raise ValueError(
                f"RunConfig.method={self.method!r}; must be one of "
                f"{[c.__name__ for c in METHODS.values()]}."
            )
        if isinstance(self.eval_params, list):
            object.__setattr__(self, "eval_params", tuple(self.eval_params))
        model_lib.preset(self.model)  # raises ValueError on an unknown name
        if self.vocab_size is not None:
            fields.positive_int("RunConfig.vocab_size", self.vocab_size)
        for name in ("steps", "eval_every", "log_every"):
            fields.positive_int(f"RunConfig.{name}", getattr(self, name))
        if self.eval_windows is not None:
            fields.positive_int("RunConfig.eval_windows", self.eval_windows)
        fields.nonnegative_int("RunConfig.checkpoint_every", self.checkpoint_every)
        fields.positive_int("RunConfig.keep_checkpoints", self.keep_checkpoints)
        bad = [p for p in self.eval_params if p not in ("global", "average", "first")]
        if bad or not self.eval_params:
            raise ValueError(
                f"RunConfig.eval_params={self.eval_params!r}; allowed: a non-empty "
                "subset of ('global', 'average', 'first')."
            )
        m = self.method.num_replicas
        if self.data.global_batch_size % m:
            raise ValueError(
                f"DataConfig.global_batch_size={self.data.global_batch_size} is not "
                f"divisible by num_replicas={m}; the global batch is split evenly."
            )
        if isinstance(self.method, StreamingConfig):
            layers = model_lib.preset(self.model).num_layers
            if layers % self.method.layers_per_fragment:
                raise ValueError(
                    "StreamingConfig.layers_per_fragment="
                    f"{self.method.layers_per_fragment} does not divide the {layers} "
                    f"layers of model {self.model!r}."
                )

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with fields changed; `method`/`inner`/`data` may be dicts of changes
        (a `method` dict with another `kind` switches the method)."""
        if isinstance(changes.get("failures"), dict):
            base = self.failures or Failures()
            changes["failures"] = fields.replace(base, **changes["failures"])
        for name in ("method", "inner", "data"):
            if isinstance(changes.get(name), dict) and name == "method":
                changes[name] = replace_method(self.method, **changes[name])
            elif isinstance(changes.get(name), dict):
                changes[name] = fields.replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    def title(self) -> str:
        """The name with the model and the method's H, M and tau, read from the
        config as it is (after every change), e.g. "muloco tiny-s M=2 H=10 tau=1":
        the progress bar's and the loss plot's title."""
        m = self.method
        parts = [self.name, self.model, f"M={m.num_replicas}"]
        for knob, label in (("sync_every", "H"), ("overlap", "tau")):
            value = getattr(m, knob, None)
            if isinstance(value, tuple):  # one tau per fragment
                value = ",".join(map(str, value))
            if value is not None:
                parts.append(f"{label}={value}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """The config as plain JSON-able data; the method carries its `kind`.

        Fields added after the first records (`fields.new_field`) are left out while
        they hold their default, so those records keep their keys."""
        d = fields.to_dict(self)
        d["method"] = {"kind": self.method.kind, **d["method"]}
        return d

    def model_config(self) -> model_lib.ModelConfig:
        """The model's config: the preset `model`, with `vocab_size` if set."""
        mc = model_lib.preset(self.model)
        if self.vocab_size is None:
            return mc
        return dataclasses.replace(mc, vocab_size=self.vocab_size)

    def to_json(self) -> str:
        """The config as canonical JSON (keys the run cache and checkpoints)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        """Inverse of `to_json`."""
        return fields.from_dict(cls, json.loads(text))


# ----------------------------------------------------------------------------- presets


def _make(
    name: str,
    method: MethodConfig,
    changes: dict[str, Any],
    inner: InnerConfig | None = None,
) -> RunConfig:
    """A `RunConfig` from a preset's method (and inner optimizer, default AdamW) and
    user changes (dicts change sub-configs)."""
    changes = dict(changes)
    if inner is not None and isinstance(changes.get("inner"), dict):
        changes["inner"] = fields.replace(inner, **changes["inner"])
    elif inner is not None:
        changes.setdefault("inner", inner)
    if isinstance(changes.get("method"), dict):
        method = replace_method(method, **changes.pop("method"))
    data = changes.pop("data", None)  # with the method, so both are checked together
    data = fields.replace(DataConfig(), **data) if isinstance(data, dict) else data
    config = RunConfig(
        name=changes.pop("name", name), method=method, data=data or DataConfig()
    )
    return config.replace(**changes)


def data_parallel_preset(**changes: Any) -> RunConfig:
    """Data-Parallel (the paper's baseline)."""
    return _make("data_parallel", DataParallelConfig(), changes)


def diloco_preset(sync_every: int = 30, **changes: Any) -> RunConfig:
    """DiLoCo (P = 1, τ = 0, α = 0, float32 outer gradients); the paper uses H = 30."""
    return _make("diloco", DiLoCoConfig(sync_every=sync_every), changes)


def streaming_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo without overlap (τ = 0, α = 0) or quantization."""
    method = StreamingConfig(
        sync_every=sync_every, overlap=0, alpha=0.0, quantizer=None
    )
    return _make("streaming", method, changes)


def streaming_overlap_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo with overlapped communication (τ = 1, α = 0.5), float32."""
    method = StreamingConfig(
        sync_every=sync_every, overlap=1, alpha=0.5, quantizer=None
    )
    return _make("streaming_overlap", method, changes)


def streaming_overlap_fp4_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo with overlapped FP4 communication: the paper's final method."""
    method = StreamingConfig(
        sync_every=sync_every, overlap=1, alpha=0.5, quantizer="e3m0"
    )
    return _make("streaming_overlap_fp4", method, changes)


def muloco_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """MuLoCo (arXiv 2505.23725): the paper's final method (`streaming_overlap_fp4`:
    H = 100, τ = 1, α = 0.5, outer Nesterov) with what MuLoCo changes: Muon as the
    inner optimizer (`InnerConfig.kind="muon"`) and 2-bit outer gradients with error
    feedback instead of E3M0, with a scale per row (`compressor="int2:row,ef"`): with
    one scale per tensor the ternary grid zeroes most entries, and at tiny-xxs
    (20 tokens per parameter, 50 rounds, seed 0) the held-out loss was 3.51 against
    2.12 per row."""
    method = StreamingConfig(
        sync_every=sync_every,
        overlap=1,
        alpha=0.5,
        quantizer=None,
        compressor="int2:row,ef",
    )
    return _make("muloco", method, changes, inner=InnerConfig(kind="muon"))


def sparseloco_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """SparseLoCo (arXiv 2508.15706): the paper's final method (`streaming_overlap_fp4`:
    H = 100, τ = 1, α = 0.5, AdamW inside) with what SparseLoCo changes: the top 3 %
    of every chunk of 64, 2-bit, error feedback with decay 0.9
    (`compressor="topk:0.03/64,int2,ef:0.9"`), and an outer SGD without momentum at
    learning rate 1 (`OuterConfig(kind="sgd", lr=1.0, momentum=0.0)`), since the
    error-feedback accumulator takes the place of outer momentum."""
    method = StreamingConfig(
        sync_every=sync_every,
        overlap=1,
        alpha=0.5,
        quantizer=None,
        compressor="topk:0.03/64,int2,ef:0.9",
        outer=OuterConfig(kind="sgd", lr=1.0, momentum=0.0),
    )
    return _make("sparseloco", method, changes)


def eager_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Eager updates (Kale et al., arXiv 2502.12996): the paper's final method
    (`streaming_overlap_fp4`: H = 100, τ = 1, α = 0.5, E3M0, outer Nesterov) with
    what Eager changes: `merge="eager"`, each replica's own outer gradient's step
    stands in for the average during the overlap and is corrected on arrival."""
    method = StreamingConfig(
        sync_every=sync_every, overlap=1, alpha=0.5, quantizer="e3m0", merge="eager"
    )
    return _make("eager", method, changes)


def decoupled_preset(
    sync_every: int = 100, quorum: int | None = None, **changes: Any
) -> RunConfig:
    """Decoupled DiLoCo's aggregation (arXiv 2604.21428, as secondary sources report
    it) on the paper's final method (`streaming_overlap_fp4`: H = 100, τ = 1,
    α = 0.5, E3M0 outer gradients, outer Nesterov): a fragment's round merges only
    with a minimum quorum of K senders, and then by the radial-directional average
    weighted by steps (tokens² / steps with equal batches), the embedding by the
    weighted mean: `DecoupledAggregator(quorum)`, i.e. `quorum(K,
    radial_directional(1.0, plain_shapes=(embedding shape,)))`.

    - K: `quorum`, or ⌈M/2⌉ (None, the default; `DecoupledAggregator` says why).
    - The embedding's shape: `[vocab_size, width]` of the run's model, read off it
      when the method is built; the lab Transformer's head is the same (tied) leaf.
      Both follow the final model and M, however they were changed.
    - Adoption: by the α-blend (`alpha=0.5`, the default), or by overwrite with
      `method={"alpha": 0.0}` (`--alpha 0`: each replica takes θ_g).

    Only the aggregation is Decoupled DiLoCo's: the learners still take in each
    round at its step (no adaptive grace window, no learner that never blocks).
    Its goodput and loss are not measured yet (the `decoupled_goodput` notebook).

    Raises:
        ValueError: on `quorum` not an int in [1, M] (naming it, M and what is
            allowed), before anything is built.
    """
    method = StreamingConfig(
        sync_every=sync_every,
        overlap=1,
        alpha=0.5,
        quantizer="e3m0",
        aggregator=DecoupledAggregator(quorum),
    )
    config = _make("decoupled", method, changes)
    aggregator = getattr(config.method, "aggregator", None)  # a method switched
    if isinstance(aggregator, DecoupledAggregator):
        quorum_size(aggregator.k, config.method.num_replicas)
    return config


PRESETS: dict[str, Callable[..., RunConfig]] = {
    "data_parallel": data_parallel_preset,
    "diloco": diloco_preset,
    "streaming": streaming_preset,
    "streaming_overlap": streaming_overlap_preset,
    "streaming_overlap_fp4": streaming_overlap_fp4_preset,
    "muloco": muloco_preset,
    "sparseloco": sparseloco_preset,
    "eager": eager_preset,
    "decoupled": decoupled_preset,
}
"""The paper's method names and the methods after it → preset functions. The default
preset is "streaming_overlap_fp4" ("Streaming DiLoCo with overlapped FP4
communication")."""

DERIVED: dict[str, tuple[str, tuple[str, ...]]] = {
    "muloco": ("streaming_overlap_fp4", ()),
    "sparseloco": ("streaming_overlap_fp4", ("method.outer",)),
    "eager": ("streaming_overlap_fp4", ()),
    "decoupled": ("streaming_overlap_fp4", ()),
}
"""A method built on another preset → (that preset, the config paths the method sets
itself). Where the method has no tuned values of its own, `preset` starts it from its
base's tuned values but those paths, so the two differ only in what the method
changes."""


def preset(name: str, *, tuned: bool = True, **changes: Any) -> RunConfig:
    """The `RunConfig` of a named preset, with changes (see `RunConfig.replace`).

    With `tuned` (the default), a method and model size that the tuning protocol has
    swept (`TUNED`) start from the chosen inner learning rate, outer learning rate
    and momentum, and global batch; a value given in `changes` still wins. Other
    methods and sizes keep the preset's own values, as does `tuned=False`.
    """
    if name not in PRESETS:
        raise ValueError(f"preset={name!r}; allowed: {sorted(PRESETS)}.")
    if "quorum" in changes and name != "decoupled":
        raise ValueError(
            f"quorum={changes['quorum']!r} with preset {name!r}; allowed: preset "
            "'decoupled' (its minimum quorum K)."
        )
    if "sync_every" in changes and name == "data_parallel":
        raise ValueError(
            f"sync_every={changes['sync_every']!r} with preset 'data_parallel'; "
            "Data-Parallel synchronises every step and has no H."
        )
    config = PRESETS[name](**changes)
    if not tuned:
        return config
    given = set(_paths(changes))
    values = TUNED.get(name, {}).get(config.model)
    if values is None and name in DERIVED:
        base, own = DERIVED[name]
        given |= set(own)
        values = TUNED.get(base, {}).get(config.model)
    for path, value in (values or {}).items():
        if not any(path == g or path.startswith(g + ".") for g in given):
            config = config.replace(**_nested(path, value))
    return config


def _load_tuned() -> dict[str, dict[str, dict[str, Any]]]:
    text = (pathlib.Path(__file__).parent / "tuned.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


TUNED: dict[str, dict[str, dict[str, Any]]] = _load_tuned()
"""Preset → model size → the tuned values (dotted config paths), as chosen by the
tuning protocol (`sdiloco.paper.tuning`, written by the `hyperparameter_sweep`
notebook into `sdiloco/lab/tuned.json`): 20 tokens per parameter, 50 outer rounds,
validation split, one seed."""


def _paths(changes: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths a (nested) changes dict sets; `sync_every` is the method's."""
    out = []
    for key, value in changes.items():
        key = "method.sync_every" if not prefix and key == "sync_every" else key
        if isinstance(value, dict):
            out += _paths(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _nested(path: str, value: Any) -> dict[str, Any]:
    """`{"a": {"b": value}}` for "a.b"."""
    head, *rest = path.split(".")
    for part in reversed(rest):
        value = {part: value}
    return {head: value}


# ----------------------------------------------------------------------------- budgets


DEFAULT_WARMUP_FRACTION: float = 1 / 6
"""The warmup of a budgeted run whose preset has no tuned warmup (`Regime.apply`)."""


@dataclasses.dataclass(frozen=True)
class PerBatch:
    """The evaluation set of the records made before the fixed set: `batches` times
    the run's own global batch of held-out windows, so a method's batch decided how
    much text it was scored on. Kept only so that those records stay readable; every
    new run scores a fixed set (`RunConfig.eval_windows`)."""

    batches: int

    def windows(self, config: RunConfig) -> int:
        return self.batches * config.data.global_batch_size


@dataclasses.dataclass(frozen=True)
class Regime:
    """The budget of a run: tokens per parameter and, for the DiLoCo family, rounds.

    The one place that turns a budget into steps, H and a warmup, for the CLI
    (`--tokens-per-param`, `--rounds`), the notebooks (`sdiloco.paper.experiments
    .setup`) and the tuning protocol alike. A budget in these units keeps its meaning
    when the batch or the model changes: `apply` sets the steps (tokens per parameter
    × parameters ÷ tokens per step) and H (steps ÷ rounds), so a larger batch trains
    fewer steps on the same tokens with the same number of syncs.

    Attributes:
        tokens_per_param: training tokens divided by the model's parameters (20 is
            the compute-optimal budget of the Chinchilla study).
        rounds: outer rounds (syncs of each fragment); H = steps // rounds. None
            keeps the config's H.
        evals: evaluations per run (the last at the end).
        eval_windows: held-out windows per evaluation, the same for every method
            (None: every window); `PerBatch(k)` re-reads the records scored the old
            way, on k of the run's own batches.
        warmup_fraction: None keeps the config's `inner.warmup_fraction` (a tuned
            preset's) or sets `DEFAULT_WARMUP_FRACTION`; a number forces that
            fraction as `inner.warmup_steps` (how the records made before the warmup
            was tuned set it).
    """

    tokens_per_param: float = 20.0
    rounds: int | None = 50
    evals: int = 4
    eval_windows: int | None | PerBatch = None
    warmup_fraction: float | None = None

    def __post_init__(self):
        fields.positive("Regime.tokens_per_param", self.tokens_per_param)
        if self.rounds is not None:
            fields.positive_int("Regime.rounds", self.rounds)
        fields.positive_int("Regime.evals", self.evals)

    def scaled(self, factor: float | int) -> "Regime":
        """`factor` times the tokens and the rounds: the same H on a longer run
        (the paper's overtraining budgets keep H and sync more often)."""
        rounds = None if self.rounds is None else round(self.rounds * factor)
        return dataclasses.replace(
            self, tokens_per_param=self.tokens_per_param * factor, rounds=rounds
        )

    def steps(self, config: RunConfig) -> int:
        """Inner steps of `config`'s model and batch at this budget."""
        mc = config.model_config()
        tokens_per_step = config.data.global_batch_size * mc.seq_len
        return math.ceil(self.tokens_per_param * mc.num_params() / tokens_per_step)

    def apply(self, config: RunConfig) -> RunConfig:
        """`config` with its steps, H, warmup and evaluation set from the budget.

        Raises:
            ValueError: if the rounds leave H < 2 (naming the rounds, H and steps).
        """
        steps = self.steps(config)
        windows = self.eval_windows
        if isinstance(windows, PerBatch):
            windows = windows.windows(config)
        if self.warmup_fraction is not None:
            warmup = max(1, round(steps * self.warmup_fraction))
            inner = {"warmup_steps": warmup, "warmup_fraction": None}
        else:
            fraction = config.inner.warmup_fraction
            inner = {"warmup_fraction": fraction or DEFAULT_WARMUP_FRACTION}
        changes: dict[str, Any] = {
            "steps": steps,
            "eval_every": max(1, steps // self.evals),
            "eval_windows": windows,
            "log_every": max(1, min(10, steps // 4)),
            "inner": inner,
        }
        if self.rounds is not None and hasattr(config.method, "sync_every"):
            h = steps // self.rounds
            if h < 2:
                raise ValueError(
                    f"Regime.rounds={self.rounds} leaves H={h} for {steps} steps of "
                    f"{config.model!r}; need H >= 2 (fewer rounds or more tokens)."
                )
            changes["method"] = {"sync_every": h}
        return config.replace(**changes)
