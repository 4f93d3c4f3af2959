"""Host-side configuration: frozen dataclasses that `build()` the runtime objects.

Jitted code never reads these: `InnerConfig.build()` returns an optax transformation,
a method config's `build()` an `Algorithm`. There is one config class per method, each
holding only the fields that method uses:

* `DataParallelConfig` → `sdiloco.data_parallel`;
* `DiLoCoConfig` → `sdiloco.diloco` (P = 1, τ = 0, α = 0, float32 outer gradients);
* `StreamingConfig` → `sdiloco.streaming_diloco` (fragments, overlap, compression).

A config's JSON names its method (`"method": {"kind": "streaming", ...}`) and is read
back by the one loader, `from_dict` (used by `RunConfig.from_json`). Paper settings are
named presets (`PRESETS`), each a function returning a `RunConfig`.

Defaults follow docs/paper.md §8: M = 2, H = 100, τ = 1, α = 0.5, 3 layers per fragment
strided, E3M0 outer gradients, outer SGD(0.4, Nesterov 0.9), inner AdamW
β = (0.9, 0.99) with clipping 1.0, warmup then cosine to 5 %.
"""

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import optax

from ..base import Algorithm
from ..compression import FORMATS, Compressor, dare, fed_dropout, quantizer, top_k
from ..data_parallel import data_parallel
from ..fedpart import freeze_unsynced
from ..fragments import Fragments, fragments_by_layer
from ..schedule import make_schedule
from ..streaming import NONFINITE_POLICIES, diloco, streaming_diloco
from . import model as model_lib


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
        _in_range("InnerConfig.min_lr_ratio", self.min_lr_ratio, 0, 1, "[0, 1]")
        _in_range("InnerConfig.b1", self.b1, 0, 1, "[0, 1)", open_high=True)
        _in_range("InnerConfig.b2", self.b2, 0, 1, "[0, 1)", open_high=True)
        _positive("InnerConfig.eps", self.eps)
        _in_range("InnerConfig.weight_decay", self.weight_decay, 0, None, ">= 0")
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
    """The outer optimizer: SGD with (Nesterov) momentum, constant learning rate."""

    lr: float = 0.4
    momentum: float = 0.9
    """0 gives plain SGD (with lr 1: periodic averaging)."""
    nesterov: bool = True

    def __post_init__(self):
        _positive("OuterConfig.lr", self.lr)
        _in_range("OuterConfig.momentum", self.momentum, 0, 1, "[0, 1)", open_high=True)

    def build(self) -> optax.GradientTransformation:
        """`optax.sgd(lr, momentum, nesterov)`."""
        return optax.sgd(
            self.lr, momentum=self.momentum or None, nesterov=self.nesterov
        )


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    """Data-Parallel, the paper's baseline: gradients averaged every step."""

    kind: ClassVar[str] = "data_parallel"
    num_replicas: int = 2
    """M."""

    def __post_init__(self):
        _positive_int("DataParallelConfig.num_replicas", self.num_replicas)

    def build(
        self,
        loss_fn: Callable[..., Any],
        inner: optax.GradientTransformation,
        model: Any,
        *,
        has_aux: bool = False,
    ) -> Algorithm:
        """The `Algorithm` (`model` is unused: Data-Parallel has no fragments)."""
        del model
        return data_parallel(
            loss_fn, inner=inner, num_replicas=self.num_replicas, has_aux=has_aux
        )


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo: the whole model synced every H steps, float32, no overlap."""

    kind: ClassVar[str] = "diloco"
    num_replicas: int = 2
    """M."""
    sync_every: int = 30
    """H (the paper's DiLoCo baseline uses 30)."""
    outer: OuterConfig = dataclasses.field(default_factory=OuterConfig)
    nonfinite: str = "skip"
    """Policy for a non-finite outer gradient: "skip", "apply" or "raise"."""

    def __post_init__(self):
        _positive_int("DiLoCoConfig.num_replicas", self.num_replicas)
        _positive_int("DiLoCoConfig.sync_every", self.sync_every)
        _choice("DiLoCoConfig.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _coerce(self, "outer", OuterConfig)

    def build(
        self,
        loss_fn: Callable[..., Any],
        inner: optax.GradientTransformation,
        model: Any,
        *,
        has_aux: bool = False,
        **kwargs: Any,
    ) -> Algorithm:
        """The `Algorithm`; extra keyword arguments go to `diloco` (e.g. `exchange`)."""
        del model
        return diloco(
            loss_fn,
            inner=inner,
            outer=self.outer.build(),
            num_replicas=self.num_replicas,
            sync_every=self.sync_every,
            nonfinite=self.nonfinite,
            has_aux=has_aux,
            **kwargs,
        )


@dataclasses.dataclass(frozen=True)
class StreamingConfig:
    """Streaming DiLoCo: fragments on a staggered schedule, overlap, compression."""

    kind: ClassVar[str] = "streaming"
    num_replicas: int = 2
    """M."""
    sync_every: int = 100
    """H."""
    layers_per_fragment: int = 3
    """Blocks per fragment (the non-block parameters are fragment 0)."""
    pattern: str = "strided"
    """"strided" or "sequential"."""
    overlap: int | tuple[int, ...] = 1
    """τ, one int or one per replica."""
    alpha: float = 0.5
    """The mixing factor α."""
    quantizer: str | None = "e3m0"
    """Outer-gradient format (one of `FORMATS`) or None for float32."""
    granularity: str = "tensor"
    """Quantization scale per "tensor", "row" or "block"."""
    rounding: str = "nearest"
    """"nearest" or "stochastic"."""
    error_feedback: bool = False
    """Carry the compression residual to the fragment's next send."""
    sparsifier: str | None = None
    """A value-dropping compressor instead of a quantizer (one of `SPARSIFIERS`; set
    `quantizer=None`): FedDropout, DARE or Top-K (paper Fig. 11)."""
    drop_rate: float = 0.5
    """Fraction of the outer gradient's entries the `sparsifier` drops (Top-K keeps
    the largest `1 - drop_rate`)."""
    freeze_unsynced: bool = False
    """FedPart-style: train only the fragment synchronised next (paper §3.3.1)."""
    nonfinite: str = "skip"
    """Policy for a non-finite outer gradient: "skip", "apply" or "raise"."""
    outer: OuterConfig = dataclasses.field(default_factory=OuterConfig)

    def __post_init__(self):
        if isinstance(self.overlap, list):
            object.__setattr__(self, "overlap", tuple(self.overlap))
        _coerce(self, "outer", OuterConfig)
        _positive_int("StreamingConfig.num_replicas", self.num_replicas)
        _positive_int("StreamingConfig.layers_per_fragment", self.layers_per_fragment)
        _choice("StreamingConfig.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.quantizer is not None:
            _choice("StreamingConfig.quantizer", self.quantizer, FORMATS + (None,))
        if self.sparsifier is not None:
            _choice(
                "StreamingConfig.sparsifier", self.sparsifier, SPARSIFIERS + (None,)
            )
            if self.quantizer is not None:
                raise ValueError(
                    f"StreamingConfig.sparsifier={self.sparsifier!r} with quantizer="
                    f"{self.quantizer!r}; set quantizer=None to use a sparsifier."
                )
        _in_range("StreamingConfig.drop_rate", self.drop_rate, 0, 1, "[0, 1)", True)
        if self.error_feedback and self.compressor() is None:
            raise ValueError(
                "StreamingConfig.error_feedback=True needs a compressor; set a "
                "quantizer or a sparsifier."
            )
        # The schedule, merge and compressor knobs, checked by the factory itself.
        try:
            streaming_diloco(
                lambda p, b: 0.0,
                inner=optax.sgd(0.0),
                num_replicas=self.num_replicas,
                sync_every=self.sync_every,
                overlap=self.overlap,
                alpha=self.alpha,
                compressor=self.compressor(),
            )
        except ValueError as e:
            raise ValueError(f"StreamingConfig: {e}") from None

    def compressor(self) -> Compressor | None:
        """The outer-gradient compressor this config describes (None: float32)."""
        if self.sparsifier == "fed_dropout":
            return fed_dropout(self.drop_rate)
        if self.sparsifier == "dare":
            return dare(self.drop_rate)
        if self.sparsifier == "top_k":
            return top_k(1.0 - self.drop_rate)
        if self.quantizer is None:
            return None
        return quantizer(
            self.quantizer, granularity=self.granularity, rounding=self.rounding
        )

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
        """The `Algorithm` for `model`, whose `blocks` are stacked.

        Extra keyword arguments go to `streaming_diloco` (e.g. `exchange`).
        """
        fragments = self.fragments(model)
        if self.freeze_unsynced:
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
            overlap=self.overlap,
            alpha=self.alpha,
            compressor=self.compressor(),
            error_feedback=self.error_feedback,
            nonfinite=self.nonfinite,
            has_aux=has_aux,
            **kwargs,
        )


MethodConfig = DataParallelConfig | DiLoCoConfig | StreamingConfig
"""The config of any method."""

METHODS: dict[str, type] = {
    c.kind: c for c in (DataParallelConfig, DiLoCoConfig, StreamingConfig)
}
"""Method name (the `kind` in JSON) → its config class."""


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
                f"DataConfig.heldout_fraction={self.heldout_fraction!r}; must be in "
                "(0, 1)."
            )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; serialisable to JSON."""

    name: str = "run"
    model: str = "tiny-s"
    """A model preset name (`model.preset`)."""
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
        if isinstance(self.method, dict):
            object.__setattr__(self, "method", method_from_dict(self.method))
        _coerce(self, "inner", InnerConfig)
        _coerce(self, "data", DataConfig)
        if not isinstance(self.method, tuple(METHODS.values())):
            raise ValueError(
                f"RunConfig.method={self.method!r}; must be one of "
                f"{[c.__name__ for c in METHODS.values()]}."
            )
        if isinstance(self.eval_params, list):
            object.__setattr__(self, "eval_params", tuple(self.eval_params))
        model_lib.preset(self.model)  # raises ValueError on an unknown name
        for name in ("steps", "eval_every", "eval_batches", "log_every"):
            _positive_int(f"RunConfig.{name}", getattr(self, name))
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
        for name in ("method", "inner", "data"):
            if isinstance(changes.get(name), dict):
                changes[name] = replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The config as plain JSON-able data; the method carries its `kind`."""
        d = dataclasses.asdict(self)
        d["method"] = {"kind": self.method.kind, **d["method"]}
        return d

    def to_json(self) -> str:
        """The config as canonical JSON (keys the run cache and checkpoints)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        """Inverse of `to_json`."""
        return from_dict(cls, json.loads(text))


def replace(config: Any, **changes: Any) -> Any:
    """`dataclasses.replace` that names the config and its fields on a bad field.

    For a method config, `kind` switches to another method: the fields the two
    methods share are kept, the rest take the new method's defaults.
    """
    kind = changes.pop("kind", None)
    if kind is not None and kind != getattr(config, "kind", None):
        cls = _method_class(kind)
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in dataclasses.asdict(config).items() if k in names}
        return from_dict(cls, {**kept, **changes})
    _check_fields(type(config), changes)
    nested = {
        f.name: replace(getattr(config, f.name), **changes[f.name])
        for f in dataclasses.fields(config)
        if isinstance(changes.get(f.name), dict)
        and dataclasses.is_dataclass(getattr(config, f.name))
    }
    return dataclasses.replace(config, **{**changes, **nested})


def from_dict(cls: Any, data: dict) -> Any:
    """The one loader of configs from JSON-like data: nested configs from dicts
    (the method by its `kind`), tuples from lists, unknown fields refused.

    Raises:
        ValueError: naming the config, the unknown field and the allowed ones.
    """
    if cls in METHODS.values() or _is_method_union(cls):
        data = dict(data)
        kind = data.pop("kind", getattr(cls, "kind", None))
        cls = _method_class(kind)
    _check_fields(cls, data)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if isinstance(value, dict) and _is_method_union(hint):
            value = method_from_dict(value)
        elif isinstance(value, dict) and dataclasses.is_dataclass(hint):
            value = from_dict(hint, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def method_from_dict(data: dict) -> MethodConfig:
    """A method config from `{"kind": ..., **fields}` (default kind: "streaming")."""
    return from_dict(MethodConfig, {"kind": "streaming", **data})


# ----------------------------------------------------------------------------- presets


def _make(name: str, method: MethodConfig, changes: dict[str, Any]) -> RunConfig:
    """A `RunConfig` from a preset's method and user changes (dicts change sub-configs)."""
    changes = dict(changes)
    if isinstance(changes.get("method"), dict):
        method = replace(method, **changes.pop("method"))
    config = RunConfig(name=changes.pop("name", name), method=method)
    return config.replace(**changes)


def data_parallel_preset(**changes: Any) -> RunConfig:
    """Data-Parallel (the paper's baseline)."""
    return _make("data_parallel", DataParallelConfig(), changes)


def diloco_preset(sync_every: int = 30, **changes: Any) -> RunConfig:
    """DiLoCo (P = 1, τ = 0, α = 0, float32 outer gradients); the paper uses H = 30."""
    return _make(f"diloco_h{sync_every}", DiLoCoConfig(sync_every=sync_every), changes)


def streaming_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo without overlap (τ = 0, α = 0) or quantization."""
    method = StreamingConfig(
        sync_every=sync_every, overlap=0, alpha=0.0, quantizer=None
    )
    return _make(f"streaming_h{sync_every}", method, changes)


def streaming_overlap_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo with overlapped communication (τ = 1, α = 0.5), float32."""
    method = StreamingConfig(
        sync_every=sync_every, overlap=1, alpha=0.5, quantizer=None
    )
    return _make(f"streaming_overlap_h{sync_every}", method, changes)


def streaming_overlap_fp4_preset(sync_every: int = 100, **changes: Any) -> RunConfig:
    """Streaming DiLoCo with overlapped FP4 communication: the paper's final method."""
    method = StreamingConfig(
        sync_every=sync_every, overlap=1, alpha=0.5, quantizer="e3m0"
    )
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


def preset(name: str, **changes: Any) -> RunConfig:
    """The `RunConfig` of a named preset, with changes (see `RunConfig.replace`)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r}; allowed: {sorted(PRESETS)}.")
    if "sync_every" in changes and name == "data_parallel":
        raise ValueError(
            f"sync_every={changes['sync_every']!r} with preset 'data_parallel'; "
            "Data-Parallel synchronises every step and has no H."
        )
    return PRESETS[name](**changes)


# ----------------------------------------------------------------------------- checks


def _method_class(kind: Any) -> type:
    if kind not in METHODS:
        raise ValueError(f"method kind={kind!r}; allowed: {sorted(METHODS)}.")
    return METHODS[kind]


def _is_method_union(hint: Any) -> bool:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    return bool(args) and set(args) == set(METHODS.values())


def _check_fields(cls: type, changes: dict) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    for key in changes:
        if key not in names:
            raise ValueError(
                f"{cls.__name__} has no field {key!r}; its fields: {names}."
            )


def _coerce(config: Any, name: str, cls: type) -> None:
    value = getattr(config, name)
    if isinstance(value, dict):
        object.__setattr__(config, name, from_dict(cls, value))


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}={value!r}; must be a number > 0.")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; must be an integer >= 1.")


def _nonnegative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r}; must be an integer >= 0.")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {allowed}.")


def _in_range(name, value, low, high, allowed: str, open_high: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and value >= low
    if ok and high is not None:
        ok = value < high if open_high else value <= high
    if not ok:
        raise ValueError(f"{name}={value!r}; must be in {allowed}.")
