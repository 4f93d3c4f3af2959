"""One config per method, each holding only the fields that method uses.

* `DataParallelConfig` builds `sdiloco.data_parallel`;
* `DiLoCoConfig` builds `sdiloco.diloco` (P = 1, τ = 0, α = 0, float32);
* `StreamingConfig` builds `sdiloco.streaming_diloco` (fragments, overlap,
  compression).

`DecoupledAggregator` is Decoupled DiLoCo's aggregation as a `StreamingConfig` holds
it: a quorum around the radial-directional average whose K and embedding shape are
read from the run when it is built, not written in the config.

Each names itself by a `kind` ("data_parallel", "diloco", "streaming"), which is how
its JSON says which method it is.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import optax
from jaxtyping import Array, Bool, Int

from ..aggregation import Quorum, quorum, radial_directional
from ..base import Algorithm
from ..compression import (
    FORMATS,
    Compressor,
    dare,
    fed_dropout,
    parse_with_feedback,
    quantizer,
    top_k,
)
from ..data_parallel import data_parallel
from ..fedpart import freeze_unsynced
from ..fragments import Fragments, fragments_by_layer
from ..merging import eager
from ..plugins import Plugin, error_feedback
from ..schedule import make_schedule
from ..streaming import (
    NONFINITE_POLICIES,
    diloco,
    offload as offload_state,
    streaming_diloco,
)
from . import fields, objects


SPARSIFIERS = ("fed_dropout", "dare", "top_k")
MERGES = ("alpha", "eager")
"""The merge policies a config names (`StreamingConfig.merge`)."""


OUTER_KINDS = ("nesterov", "sgd", "adam")
"""The outer optimizers (`OuterConfig.kind`)."""


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer, constant learning rate: SGD with (Nesterov) momentum, the
    paper's; plain SGD; or Adam. The core keeps its state per fragment, so its step
    count, and the momentum warmup's clock, is that fragment's syncs."""

    lr: float = 0.4
    momentum: float = 0.9
    """"nesterov" only; 0 gives plain SGD (with lr 1: periodic averaging)."""
    nesterov: bool = True
    """"nesterov" only: False gives heavy-ball momentum."""
    kind: str = fields.new_field("nesterov")
    """"nesterov" (`optax.sgd(lr, momentum, nesterov)`, the paper's), "sgd"
    (`optax.sgd(lr)`, no momentum: SparseLoCo's, where error feedback takes its
    place) or "adam" (`optax.adam(lr, b1, b2, eps)`)."""
    momentum_warmup: int = fields.new_field(0)
    """"nesterov" only: ramp the momentum linearly from 0 to `momentum` over a
    fragment's first K syncs (Pier, arXiv 2511.17849); the first sync uses 0, sync
    K + 1 and later `momentum`. 0: no warmup."""
    b1: float = fields.new_field(0.9)
    """"adam" only: decay of the first moment."""
    b2: float = fields.new_field(0.999)
    """"adam" only: decay of the second moment."""
    eps: float = fields.new_field(1e-8)
    """"adam" only: added to the denominator."""
    transform: Any = fields.object_field(None)
    """An optax transformation to use as it is, instead of the one the fields above
    describe (see `InnerConfig.transform`)."""

    def __post_init__(self):
        fields.choice("OuterConfig.kind", self.kind, OUTER_KINDS)
        fields.positive("OuterConfig.lr", self.lr)
        fields.in_range(
            "OuterConfig.momentum", self.momentum, 0, 1, "[0, 1)", open_high=True
        )
        fields.nonnegative_int("OuterConfig.momentum_warmup", self.momentum_warmup)
        if self.momentum_warmup and (self.kind != "nesterov" or not self.momentum):
            raise ValueError(
                f"OuterConfig.momentum_warmup={self.momentum_warmup} with kind="
                f"{self.kind!r}, momentum={self.momentum}; allowed: kind='nesterov' "
                "with momentum > 0 (or momentum_warmup=0)."
            )
        fields.in_range("OuterConfig.b1", self.b1, 0, 1, "[0, 1)", open_high=True)
        fields.in_range("OuterConfig.b2", self.b2, 0, 1, "[0, 1)", open_high=True)
        fields.positive("OuterConfig.eps", self.eps)

    def build(self) -> optax.GradientTransformation:
        """The optax transformation: `optax.sgd(lr, momentum, nesterov)` ("nesterov"),
        `optax.sgd(lr)` or `optax.adam(lr, b1, b2, eps)`, with the learning rate and
        the momentum (not Adam's decays) values of its state (`optax.inject_hyperparams`), not constants
        of the program: runs that differ only in them (the trials of a sweep)
        compile one program. The numbers are those of the plain transforms. A
        `transform` is returned as it is."""
        if self.transform is not None:
            return objects.build(self.transform)
        if self.kind == "adam":
            static = ("b1", "b2", "eps")
            return optax.inject_hyperparams(optax.adam, static_args=static)(
                learning_rate=self.lr, b1=self.b1, b2=self.b2, eps=self.eps
            )
        if self.kind == "sgd" or not self.momentum:
            return optax.inject_hyperparams(optax.sgd)(learning_rate=self.lr)
        momentum: Any = self.momentum
        if self.momentum_warmup:
            momentum = optax.linear_schedule(0.0, self.momentum, self.momentum_warmup)
        return optax.inject_hyperparams(optax.sgd, static_args=("nesterov",))(
            learning_rate=self.lr, momentum=momentum, nesterov=self.nesterov
        )


class DecoupledAggregator(eqx.Module):
    """Decoupled DiLoCo's aggregation (arXiv 2604.21428) with K and the embedding's
    shape taken from the run: `quorum(K, radial_directional(power, plain_shapes=
    plain_shapes))` (`sdiloco.aggregation`), resolved each time it aggregates.

    - K is `k`, or ⌈M/2⌉ where `k` is None (the default), M the rows it receives:
      the run's replicas in the simulation and on a mesh, and every island's on an
      elastic island (built with `num_replicas=1`, it receives a row per island).
      ⌈M/2⌉: a round merges once at least half of the learners' work is in, so a
      few fast learners do not steer θ_g alone while the rest are down or late,
      and one missing learner does not cost the round (K = M would skip every
      round anyone misses; K = 1 merges whatever came first). It is the middle of
      the issue's ablation K ∈ {1, M/2, M}, which the chaos simulator compares
      too (`sdiloco.sim.goodput.standard_policies`). At M = 2 it is 1: no
      quorum, as today.
    - `plain_shapes` None is the model's embedding's, filled in by
      `StreamingConfig.build` (`for_model`): the `[vocab_size, width]` leaf
      `embedding` of the lab Transformer (`RunConfig.model_config()`, with
      `vocab_size` if set). Its output head is that same leaf (tied), so the head
      is averaged plainly with it, once; any other piece of that shape would be
      too, and none of the Transformer's is (a block's pieces keep their layer
      axis).

    So a config holding it follows a later change of the model or of M. A round with
    fewer than K senders is non-finite, which `nonfinite="skip"` (required by
    `StreamingConfig`) turns into a round nobody sent.

    Attributes:
        k: the minimum quorum, an int >= 1, or None for ⌈M/2⌉ (`quorum_size`).
        power: the weights' exponent (1: tokens² / steps with equal batches).
        plain_shapes: the piece shapes averaged plainly; None: the embedding's.
    """

    k: int | None = eqx.field(default=None, static=True)
    power: float = eqx.field(default=1.0, static=True)
    plain_shapes: tuple[tuple[int, ...], ...] | None = eqx.field(
        default=None, static=True
    )

    def __check_init__(self):
        if self.k is not None and (
            isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1
        ):
            raise ValueError(
                f"DecoupledAggregator.k={self.k!r}; allowed: an int >= 1, or None "
                "for ⌈M/2⌉."
            )
        try:
            radial_directional(self.power, plain_shapes=self.plain_shapes or ())
        except ValueError as e:
            raise ValueError(f"DecoupledAggregator: {e}") from None

    def for_model(self, model: Any) -> "DecoupledAggregator":
        """This aggregator with `plain_shapes` the shape of `model.embedding`
        (kept where given).

        Raises:
            ValueError: if `model` has no `embedding` leaf (not the lab Transformer).
        """
        if self.plain_shapes is not None:
            return self
        embedding: Any = getattr(model, "embedding", None)
        if not hasattr(embedding, "shape"):
            raise ValueError(
                f"DecoupledAggregator: {type(model).__name__} has no `embedding` "
                "leaf; allowed: the lab Transformer, or give plain_shapes."
            )
        shape = tuple(int(d) for d in embedding.shape)
        return DecoupledAggregator(self.k, self.power, (shape,))

    def resolve(self, num_replicas: int) -> Quorum:
        """The core aggregator for rows of `num_replicas` replicas.

        Raises:
            ValueError: on `k > num_replicas`, or before `for_model`.
        """
        k = quorum_size(self.k, num_replicas)
        if self.plain_shapes is None:
            raise ValueError(
                "DecoupledAggregator.plain_shapes=None: the embedding's shape is "
                "not known yet; allowed: StreamingConfig.build, which reads it off "
                "the model (for_model)."
            )
        return quorum(k, radial_directional(self.power, plain_shapes=self.plain_shapes))

    def __call__(
        self,
        rows: list[Array],
        sent: Bool[Array, " M"],
        steps: Int[Array, " M"] | None,
    ) -> list[Array]:
        return self.resolve(sent.shape[0])(rows, sent, steps)


def quorum_size(k: int | None, num_replicas: int) -> int:
    """K of `DecoupledAggregator`: `k`, or ⌈M/2⌉ where it is None.

    Raises:
        ValueError: naming `k`, M and what is allowed, where `k > M` (that quorum
            never merges).
    """
    default = math.ceil(num_replicas / 2)
    if k is not None and k > num_replicas:
        raise ValueError(
            f"DecoupledAggregator.k={k} (the minimum quorum K) with num_replicas="
            f"{num_replicas}; allowed: an int in [1, {num_replicas}], or None for "
            f"⌈M/2⌉ = {default}."
        )
    return default if k is None else k


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    """Data-Parallel, the paper's baseline: gradients averaged every step."""

    kind: ClassVar[str] = "data_parallel"
    num_replicas: int = 2
    """M."""

    def __post_init__(self):
        fields.positive_int("DataParallelConfig.num_replicas", self.num_replicas)

    def build(
        self,
        loss_fn: Callable[..., Any],
        inner: optax.GradientTransformation,
        model: Any,
    ) -> Algorithm:
        """The `Algorithm` (`model` is unused: Data-Parallel has no fragments)."""
        del model
        return data_parallel(loss_fn, inner=inner, num_replicas=self.num_replicas)


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
        fields.positive_int("DiLoCoConfig.num_replicas", self.num_replicas)
        fields.positive_int("DiLoCoConfig.sync_every", self.sync_every)
        fields.choice("DiLoCoConfig.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        fields.coerce(self, "outer", OuterConfig)

    def build(
        self,
        loss_fn: Callable[..., Any],
        inner: optax.GradientTransformation,
        model: Any,
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
    compressor: Any = fields.object_field(None)
    """A compressor spec (`sdiloco.compression.parse_with_feedback`), e.g. "int2,ef" or
    "topk:0.03/64,int2,ef:0.9" (chunked top-k, 2-bit, error feedback with decay), or
    a `Compressor` object, in place of `quantizer`/`sparsifier` (set those to None);
    None: those fields say."""
    merge: str = fields.new_field("alpha")
    """How a replica takes in a fragment's outer step (`sdiloco.merging`): "alpha"
    (the paper's α-merge) or "eager" (its own outer gradient's step as a stand-in
    during the overlap, corrected on arrival; Kale et al., arXiv 2502.12996)."""
    plugins: tuple = fields.object_field(())
    """Plug-ins as objects (`sdiloco.plugins.Plugin`), after the error feedback and
    the merge the fields above describe. A merging one replaces `merge` and `alpha`
    (leave those at their defaults)."""
    aggregator: Any = fields.object_field(None)
    """How the senders' outer gradients become one, as an object
    (`sdiloco.aggregation`, e.g. `median()`, or a `DecoupledAggregator`, resolved
    against the model in `build`); None: the plain mean."""

    def __post_init__(self):
        if isinstance(self.overlap, list):
            object.__setattr__(self, "overlap", tuple(self.overlap))
        fields.coerce(self, "outer", OuterConfig)
        fields.positive_int("StreamingConfig.num_replicas", self.num_replicas)
        fields.positive_int(
            "StreamingConfig.layers_per_fragment", self.layers_per_fragment
        )
        fields.choice("StreamingConfig.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.quantizer is not None:
            fields.choice(
                "StreamingConfig.quantizer", self.quantizer, FORMATS + (None,)
            )
        if self.sparsifier is not None:
            fields.choice(
                "StreamingConfig.sparsifier", self.sparsifier, SPARSIFIERS + (None,)
            )
            if self.quantizer is not None:
                raise ValueError(
                    f"StreamingConfig.sparsifier={self.sparsifier!r} with quantizer="
                    f"{self.quantizer!r}; set quantizer=None to use a sparsifier."
                )
        fields.in_range(
            "StreamingConfig.drop_rate", self.drop_rate, 0, 1, "[0, 1)", True
        )
        self._check_merge_and_stages()
        compressor = self.build_compressor()
        if self.error_feedback and compressor is None:
            raise ValueError(
                "StreamingConfig.error_feedback=True needs a compressor; set a "
                "quantizer, a sparsifier or a compressor."
            )
        # The schedule, merge and compressor knobs, checked by the factory itself.
        try:
            streaming_diloco(
                lambda p, b: 0.0,
                inner=optax.sgd(0.0),
                num_replicas=self.num_replicas,
                sync_every=self.sync_every,
                overlap=self.overlap,
                alpha=self._alpha(),
                compressor=compressor,
                plugins=self.build_plugins(),
                **self._aggregator(),
            )
        except ValueError as e:
            raise ValueError(f"StreamingConfig: {e}") from None

    def _check_merge_and_stages(self) -> None:
        """One merge (the `merge` name, `alpha`, or a plug-in), and one way to say
        the compressor (`compressor`, or `quantizer`/`sparsifier`)."""
        fields.choice("StreamingConfig.merge", self.merge, MERGES)
        if isinstance(self.plugins, list):
            object.__setattr__(self, "plugins", tuple(self.plugins))
        if not isinstance(self.plugins, tuple):
            object.__setattr__(self, "plugins", (self.plugins,))
        if any(getattr(p, "merges", False) for p in self.plugins) and (
            self.merge != "alpha" or self.alpha != 0.5
        ):
            raise ValueError(
                f"StreamingConfig.plugins={self.plugins!r} hold a merge, with merge="
                f"{self.merge!r}, alpha={self.alpha!r}; allowed: one merge (leave "
                "merge and alpha at their defaults)."
            )
        if (
            isinstance(self.aggregator, DecoupledAggregator)
            and self.nonfinite != "skip"
        ):
            raise ValueError(
                f"StreamingConfig.nonfinite={self.nonfinite!r} with a "
                "DecoupledAggregator; allowed: 'skip' (a missed quorum is a "
                "non-finite round, which 'skip' leaves as a round nobody sent)."
            )
        if self.merge != "alpha" and self.alpha != 0.5:
            raise ValueError(
                f"StreamingConfig.alpha={self.alpha!r} with merge={self.merge!r}, "
                "which does not mix with α; allowed: merge='alpha', or alpha at its "
                "default 0.5 (unused)."
            )
        if self.compressor is not None:
            if not isinstance(self.compressor, str | Compressor):
                raise ValueError(
                    f"StreamingConfig.compressor={self.compressor!r}; allowed: a "
                    "spec string such as 'int2,ef' (sdiloco.compression."
                    "parse_with_feedback) or a Compressor."
                )
            for old in ("quantizer", "sparsifier"):
                if getattr(self, old) is not None:
                    raise ValueError(
                        f"StreamingConfig.compressor={self.compressor!r} with "
                        f"{old}={getattr(self, old)!r}; allowed: one of the two (set "
                        f"{old}=None to use compressor)."
                    )

    def _alpha(self) -> float | None:
        """α for the α-merge (None with another merge)."""
        if any(getattr(p, "merges", False) for p in self.plugins):
            return None
        return self.alpha if self.merge == "alpha" else None

    def _aggregator(self, model: Any = None) -> dict[str, Any]:
        """`aggregator=` for `streaming_diloco` (nothing: its default mean); a
        `DecoupledAggregator` reads its embedding's shape off `model` where given."""
        if self.aggregator is None:
            return {}
        if model is not None and isinstance(self.aggregator, DecoupledAggregator):
            return {"aggregator": self.aggregator.for_model(model)}
        return {"aggregator": self.aggregator}

    def build_plugins(self) -> tuple[Plugin, ...]:
        """The plug-ins this config describes: error feedback (the flag, or a
        compressor spec's closing `ef`) and a merge other than the α-merge.

        Raises:
            ValueError: on error feedback given twice, naming both.
        """
        plugins: list[Plugin] = []
        feedback = None
        if isinstance(self.compressor, str):
            try:
                feedback = parse_with_feedback(self.compressor)[1]
            except ValueError as e:
                raise ValueError(f"StreamingConfig.{e}") from None
        if self.error_feedback and feedback is not None:
            raise ValueError(
                f"StreamingConfig.error_feedback=True with compressor="
                f"{self.compressor!r}, which ends in error feedback; allowed: one of "
                "the two."
            )
        if self.error_feedback:
            plugins.append(error_feedback(1.0))
        if feedback is not None:
            plugins.append(feedback)
        if self.merge == "eager":
            plugins.append(eager())
        return tuple(plugins) + tuple(self.plugins)

    def build_compressor(self) -> Compressor | None:
        """The outer-gradient compressor this config describes (None: float32).

        Raises:
            ValueError: on a bad `compressor` spec, naming it and what is allowed.
        """
        if isinstance(self.compressor, Compressor):
            return self.compressor
        if self.compressor is not None:
            try:
                return parse_with_feedback(self.compressor)[0]
            except ValueError as e:
                raise ValueError(f"StreamingConfig.{e}") from None
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
        offload: bool = False,
        **kwargs: Any,
    ) -> Algorithm:
        """The `Algorithm` for `model`, whose `blocks` are stacked (`offload`:
        `sdiloco.offload` of it).

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
        alg = streaming_diloco(
            loss_fn,
            inner=inner,
            outer=self.outer.build(),
            num_replicas=self.num_replicas,
            sync_every=self.sync_every,
            fragments=fragments,
            overlap=self.overlap,
            alpha=self._alpha(),
            compressor=self.build_compressor(),
            plugins=self.build_plugins(),
            nonfinite=self.nonfinite,
            **self._aggregator(model),
            **kwargs,
        )
        return offload_state(alg) if offload else alg


MethodConfig = DataParallelConfig | DiLoCoConfig | StreamingConfig
"""The config of any method."""

METHODS: dict[str, type] = {
    c.kind: c for c in (DataParallelConfig, DiLoCoConfig, StreamingConfig)
}
"""Method name (the `kind` in JSON) → its config class."""


def method_from_dict(data: dict) -> MethodConfig:
    """A method config from `{"kind": ..., **fields}` (default kind: "streaming")."""
    return fields.from_dict(MethodConfig, {"kind": "streaming", **data})


def replace_method(method: MethodConfig, **changes: Any) -> MethodConfig:
    """`method` with fields changed; a `kind` other than its own switches the method,
    keeping the fields the two share (the rest take the new method's defaults)."""
    kind = changes.pop("kind", method.kind)
    if kind == method.kind:
        return fields.replace(method, **changes)
    cls = METHODS.get(kind)
    if cls is None:
        raise ValueError(f"method kind={kind!r}; allowed: {sorted(METHODS)}.")
    names = {f.name for f in dataclasses.fields(cls)}
    kept = {k: v for k, v in dataclasses.asdict(method).items() if k in names}
    return fields.from_dict(cls, {**kept, **changes})
