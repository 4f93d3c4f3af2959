"""Host-side configuration: frozen dataclasses that `build()` the runtime objects.

Jitted code never reads these: `InnerConfig.build()` returns an optax transformation,
`MethodConfig.build()` an `Algorithm`. Paper settings are named presets (`PRESETS`),
one per method name of the paper, each a function returning a `RunConfig`.

Defaults follow PAPER.md §8: M = 2, H = 100, τ = 1, α = 0.5, 3 layers per fragment
strided, E3M0 outer gradients, outer SGD(0.4, Nesterov 0.9), inner AdamW
β = (0.9, 0.99) with clipping 1.0, warmup then cosine to 5 %.
"""

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import optax

from ..compression import FORMATS, dare, fed_dropout, quantizer, top_k
from ..data_parallel import data_parallel
from ..fedpart import freeze_unsynced
from ..fragments import Fragments, fragments_by_layer
from ..schedule import make_schedule
from ..streaming import NONFINITE_POLICIES, Algorithm, streaming_diloco
from . import model as model_lib


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r}; must be a number > 0.")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; must be an integer >= 1.")


def _nonnegative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r}; must be an integer >= 0.")


METHODS = ("data_parallel", "diloco", "streaming")
SPARSIFIERS = ("fed_dropout", "dare", "top_k")


@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer: AdamW with warmup + cosine decay and gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 50
    """Linear warmup from 0 to `lr`."""
    min_lr_ratio: float = 0.05
    """Cosine decay ends at `min_lr_ratio * lr` (5 % in the companion papers)."""
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay (optax.adamw's, multiplied by the learning rate)."""
    clip_norm: float | None = 1.0
    """Clip gradients to this global L2 norm (None: no clipping)."""

    def __post_init__(self):
        _positive("InnerConfig.lr", self.lr)
        _nonnegative_int("InnerConfig.warmup_steps", self.warmup_steps)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"InnerConfig.min_lr_ratio={self.min_lr_ratio!r}; must be in [0, 1]."
            )
        if self.clip_norm is not None:
            _positive("InnerConfig.clip_norm", self.clip_norm)

    def schedule(self, total_steps: int) -> optax.Schedule:
        """Warmup then cosine decay to `min_lr_ratio * lr` at `total_steps`."""
        warmup = min(self.warmup_steps, max(total_steps - 1, 0))
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.lr,
            warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1),
            end_value=self.min_lr_ratio * self.lr,
        )

    def build(self, total_steps: int) -> optax.GradientTransformation:
        """The optax transformation for a run of `total_steps` inner steps."""
        adamw = optax.adamw(
            self.schedule(total_steps),
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )
        if self.clip_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), adamw)


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum, constant learning rate."""

    lr: float = 0.4
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self):
        _positive("OuterConfig.lr", self.lr)
        if not 0 <= self.momentum < 1:
            raise ValueError(
                f"OuterConfig.momentum={self.momentum!r}; must be in [0, 1)."
            )

    def build(self) -> optax.GradientTransformation:
        """`optax.sgd(lr, momentum, nesterov)`."""
        return optax.sgd(
            self.lr, momentum=self.momentum or None, nesterov=self.nesterov
        )


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """Which algorithm, and its knobs (SPEC §1)."""

    method: str = "streaming"
    """"data_parallel", "diloco" or "streaming"."""
    num_replicas: int = 2
    """M."""
    sync_every: int = 100
    """H (ignored by Data-Parallel)."""
    layers_per_fragment: int = 3
    """Blocks per fragment (Streaming only; non-block parameters are fragment 0)."""
    pattern: str = "strided"
    """"strided" or "sequential"."""
    overlap: int | tuple[int, ...] = 1
    """τ, one int or one per replica."""
    alpha: float = 0.5
    """The mixing factor α."""
    quantizer: str | None = "e3m0"
    """Outer-gradient format (one of `FORMATS`) or None for float32."""
    granularity: str = "tensor"
    rounding: str = "nearest"
    error_feedback: bool = False
    sparsifier: str | None = None
    """A value-dropping compressor instead of a quantizer (one of `SPARSIFIERS`; set
    `quantizer=None`): FedDropout, DARE or Top-K (paper Fig. 11)."""
    drop_rate: float = 0.5
    """Fraction of the outer gradient's entries the `sparsifier` drops (Top-K keeps
    the largest `1 - drop_rate`)."""
    freeze_unsynced: bool = False
    """FedPart-style: train only the fragment synchronised next (paper §3.3.1)."""
    nonfinite: str = "skip"
    outer: OuterConfig = dataclasses.field(default_factory=OuterConfig)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(
                f"MethodConfig.method={self.method!r}; allowed: {METHODS}."
            )
        if self.quantizer is not None and self.quantizer not in FORMATS:
            raise ValueError(
                f"MethodConfig.quantizer={self.quantizer!r}; allowed: {FORMATS} or None."
            )
        if self.sparsifier is not None:
            if self.sparsifier not in SPARSIFIERS:
                raise ValueError(
                    f"MethodConfig.sparsifier={self.sparsifier!r}; allowed: "
                    f"{SPARSIFIERS} or None."
                )
            if self.quantizer is not None:
                raise ValueError(
                    f"MethodConfig.sparsifier={self.sparsifier!r} with quantizer="
                    f"{self.quantizer!r}; set quantizer=None to use a sparsifier."
                )
        if not 0 <= self.drop_rate < 1:
            raise ValueError(
                f"MethodConfig.drop_rate={self.drop_rate!r}; must be in [0, 1)."
            )
        if self.freeze_unsynced and self.method != "streaming":
            raise ValueError(
                f"MethodConfig.freeze_unsynced=True with method={self.method!r}; "
                "freezing applies to method='streaming' only."
            )
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"MethodConfig.nonfinite={self.nonfinite!r}; allowed: {NONFINITE_POLICIES}."
            )
        if isinstance(self.overlap, list):
            object.__setattr__(self, "overlap", tuple(self.overlap))
        if isinstance(self.outer, dict):
            object.__setattr__(self, "outer", OuterConfig(**self.outer))
        # Validate the schedule and merge knobs now, before any compute.
        if self.method != "data_parallel":
            self.build(lambda p, b: 0.0, optax.sgd(0.0), None)

    def fragments(self, model: Any) -> Fragments:
        """The fragments of `model` (stacked `blocks`) for this config's layers per
        fragment and pattern; the non-block parameters are fragment 0."""
        return fragments_by_layer(
            model,
            blocks=lambda m: m.blocks,
            layers_per_fragment=self.layers_per_fragment,
            pattern=self.pattern,
        )

    def build(
        self,
        loss_fn: Callable[..., Any],
        inner: optax.GradientTransformation,
        model: Any,
        *,
        has_aux: bool = False,
        **kwargs: Any,
    ) -> Algorithm:
        """The `Algorithm` for `model` (whose `blocks` are stacked, for Streaming).

        Extra keyword arguments go to `streaming_diloco` (e.g. `exchange`).
        """
        if self.method == "data_parallel":
            return data_parallel(
                loss_fn, inner=inner, num_replicas=self.num_replicas, has_aux=has_aux
            )
        streaming = self.method == "streaming"
        fragments = self.fragments(model) if streaming and model is not None else None
        q = None
        if streaming and self.quantizer is not None:
            q = quantizer(
                self.quantizer, granularity=self.granularity, rounding=self.rounding
            )
        if streaming and self.sparsifier is not None:
            q = {
                "fed_dropout": lambda: fed_dropout(self.drop_rate),
                "dare": lambda: dare(self.drop_rate),
                "top_k": lambda: top_k(1.0 - self.drop_rate),
            }[self.sparsifier]()
        if self.freeze_unsynced and fragments is not None:
            schedule = make_schedule(
                self.sync_every,
                fragments.num_fragments,
                self.num_replicas,
                self.overlap,
            )
            inner = freeze_unsynced(inner, fragments, schedule)
        return streaming_diloco(
            loss_fn,
            inner=inner,
            outer=self.outer.build(),
            num_replicas=self.num_replicas,
            sync_every=self.sync_every,
            fragments=fragments,
            overlap=self.overlap if streaming else 0,
            alpha=self.alpha if streaming else 0.0,
            compressor=q,
            error_feedback=self.error_feedback and streaming,
            nonfinite=self.nonfinite,
            has_aux=has_aux,
            **kwargs,
        )


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
    """dtype of a raw `token_file`."""
    heldout_fraction: float = 0.1
    """Fraction of a user token file held out for evaluation (its tail)."""

    def __post_init__(self):
        _positive_int("DataConfig.global_batch_size", self.global_batch_size)
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(
                f"DataConfig.heldout_fraction={self.heldout_fraction!r}; must be in (0, 1)."
            )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; serialisable to JSON."""

    name: str = "run"
    model: str = "tiny-s"
    """A model preset name (`model.preset`)."""
    method: MethodConfig = dataclasses.field(default_factory=MethodConfig)
    inner: InnerConfig = dataclasses.field(default_factory=InnerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    steps: int = 600
    """Total inner steps."""
    seed: int = 0
    """Seed of the model initialisation and stochastic compressors."""
    eval_every: int = 100
    """Evaluate the held-out loss every this many steps (and at the end)."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    eval_params: tuple[str, ...] = ("global",)
    """Which parameters to evaluate: any of "global", "average", "first"."""
    log_every: int = 10
    """Steps between two rows of the metrics history."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end, if `out_dir`)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""

    def __post_init__(self):
        for name in ("method", "inner", "data"):
            value = getattr(self, name)
            if isinstance(value, dict):
                cls = {"method": MethodConfig, "inner": InnerConfig, "data": DataConfig}
                object.__setattr__(self, name, cls[name](**value))
        if isinstance(self.eval_params, list):
            object.__setattr__(self, "eval_params", tuple(self.eval_params))
        model_lib.preset(self.model)  # raises ValueError on an unknown name
        _positive_int("RunConfig.steps", self.steps)
        _positive_int("RunConfig.eval_every", self.eval_every)
        _positive_int("RunConfig.eval_batches", self.eval_batches)
        _positive_int("RunConfig.log_every", self.log_every)
        _nonnegative_int("RunConfig.checkpoint_every", self.checkpoint_every)
        _positive_int("RunConfig.keep_checkpoints", self.keep_checkpoints)
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
        if self.method.method == "streaming":
            layers = model_lib.preset(self.model).num_layers
            if layers % self.method.layers_per_fragment:
                raise ValueError(
                    f"MethodConfig.layers_per_fragment={self.method.layers_per_fragment} "
                    f"does not divide the {layers} layers of model {self.model!r}."
                )

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with fields changed; `method`/`inner`/`data` may be dicts of changes."""
        for name in ("method", "inner", "data"):
            if isinstance(changes.get(name), dict):
                changes[name] = dataclasses.replace(
                    getattr(self, name), **changes[name]
                )
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The config as canonical JSON (used to check a checkpoint's config)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        """Inverse of `to_json`."""
        d = json.loads(text)
        method = d.pop("method")
        method["outer"] = OuterConfig(**method["outer"])
        if isinstance(method.get("overlap"), list):
            method["overlap"] = tuple(method["overlap"])
        return cls(
            method=MethodConfig(**method),
            inner=InnerConfig(**d.pop("inner")),
            data=DataConfig(**d.pop("data")),
            **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()},
        )


# ----------------------------------------------------------------------------- presets


def _make(name: str, method: MethodConfig, changes: dict[str, Any]) -> RunConfig:
    """A `RunConfig` from a preset's method and user changes (dicts change sub-configs)."""
    changes = dict(changes)
    if isinstance(changes.get("method"), dict):
        method = dataclasses.replace(method, **changes.pop("method"))
    for key, cls in (("inner", InnerConfig), ("data", DataConfig)):
        if isinstance(changes.get(key), dict):
            changes[key] = cls(**changes[key])
    return RunConfig(name=changes.pop("name", name), method=method, **changes)


def data_parallel_preset(**changes: Any) -> RunConfig:
    """Data-Parallel (the paper's baseline)."""
    return _make("data_parallel", MethodConfig(method="data_parallel"), changes)


def diloco_preset(sync_every: int = 30, **changes: Any) -> RunConfig:
    """DiLoCo (P = 1, τ = 0, α = 0, float32 outer gradients); the paper uses H = 30."""
    method = MethodConfig(
        method="diloco", sync_every=sync_every, overlap=0, alpha=0.0, quantizer=None
    )
    return _make(f"diloco_h{sync_every}", method, changes)


def streaming_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo without overlap (τ = 0, α = 0) or quantization."""
    method = MethodConfig(sync_every=sync_every, overlap=0, alpha=0.0, quantizer=None)
    return _make(f"streaming_h{sync_every}", method, changes)


def streaming_overlap_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo with overlapped communication (τ = 1, α = 0.5), float32."""
    method = MethodConfig(sync_every=sync_every, overlap=1, alpha=0.5, quantizer=None)
    return _make(f"streaming_overlap_h{sync_every}", method, changes)


def streaming_overlap_fp4_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo with overlapped FP4 communication: the paper's final method."""
    method = MethodConfig(sync_every=sync_every, overlap=1, alpha=0.5, quantizer="e3m0")
    return _make(f"streaming_overlap_fp4_h{sync_every}", method, changes)


PRESETS: dict[str, Callable[..., RunConfig]] = {
    "data_parallel": data_parallel_preset,
    "diloco": diloco_preset,
    "streaming": streaming_preset,
    "streaming_overlap": streaming_overlap_preset,
    "streaming_overlap_fp4": streaming_overlap_fp4_preset,
}
"""The paper's method names → preset functions. The default preset is
"streaming_overlap_fp4" ("Streaming DiLoCo with overlapped FP4 communication")."""

PAPER_NAMES: dict[str, str] = {
    "data_parallel": "Data-Parallel",
    "diloco": "DiLoCo",
    "streaming": "Streaming DiLoCo",
    "streaming_overlap": "Streaming DiLoCo with overlapped communication",
    "streaming_overlap_fp4": "Streaming DiLoCo with overlapped FP4 communication",
}


def preset(name: str, **changes: Any) -> RunConfig:
    """The `RunConfig` of a named preset, with changes (see `RunConfig.replace`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; allowed: {sorted(PRESETS)}.")
    return PRESETS[name](**changes)
