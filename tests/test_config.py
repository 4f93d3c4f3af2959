"""Configs: one per method, holding only the fields that method uses; one JSON loader."""

import dataclasses
import hashlib
import json
import math
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import optax.contrib
import pytest
from hypothesis import given, settings, strategies as st

import sdiloco
from sdiloco.lab import config as config_lib, model as model_lib


ROOT = pathlib.Path(__file__).resolve().parents[1]

METHOD_FIELDS = {
    "data_parallel": {"num_replicas"},
    "diloco": {"num_replicas", "sync_every", "outer", "nonfinite"},
}


@pytest.mark.parametrize("name", sorted(config_lib.PRESETS))
def test_presets_round_trip_through_json(name):
    c = config_lib.preset(name)
    again = config_lib.RunConfig.from_json(c.to_json())
    assert again == c
    method = json.loads(c.to_json())["method"]
    assert method["kind"] == c.method.kind
    if c.method.kind in METHOD_FIELDS:  # nothing the method ignores is recorded
        assert set(method) - {"kind"} == METHOD_FIELDS[c.method.kind]


@settings(max_examples=25)
@given(
    m=st.sampled_from([1, 2, 4]),
    h=st.integers(2, 50),
    tau=st.integers(0, 1),
    alpha=st.floats(0, 1),
    quantizer=st.sampled_from([None, "e3m0", "e2m1", "bf16"]),
    granularity=st.sampled_from(["tensor", "row"]),
    outer_lr=st.sampled_from([0.2, 0.7, 1.0]),
    momentum=st.sampled_from([0.0, 0.8, 0.9]),
    per_replica=st.booleans(),
)
def test_streaming_config_round_trips(
    m, h, tau, alpha, quantizer, granularity, outer_lr, momentum, per_replica
):
    overlap = tuple(range(m)) if per_replica and m < h else tau
    c = config_lib.preset(
        "streaming_overlap_fp4",
        sync_every=h,
        method={
            "num_replicas": m,
            "overlap": overlap,
            "alpha": alpha,
            "quantizer": quantizer,
            "granularity": granularity,
            "outer": {"lr": outer_lr, "momentum": momentum},
        },
        data={"global_batch_size": 4 * m},
    )
    text = c.to_json()
    assert config_lib.RunConfig.from_json(text) == c
    assert config_lib.RunConfig.from_json(text).to_json() == text


def test_replace_switches_the_method_keeping_shared_fields():
    c = config_lib.preset("streaming_overlap_fp4", sync_every=20)
    d = c.replace(method={"kind": "diloco"})
    assert isinstance(d.method, config_lib.DiLoCoConfig)
    assert d.method.sync_every == 20
    assert d.method.outer == c.method.outer
    dp = c.replace(method={"kind": "data_parallel"})
    assert dataclasses.asdict(dp.method) == {"num_replicas": 2}


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: config_lib.preset("diloco", method={"alpha": 0.5}), "alpha"),
        (
            lambda: config_lib.preset("diloco", method={"quantizer": "e3m0"}),
            "quantizer",
        ),
        (lambda: config_lib.preset("data_parallel", sync_every=10), "sync_every"),
        (lambda: config_lib.preset("nope"), "preset"),
        (lambda: config_lib.method_from_dict({"kind": "fedavg"}), "kind"),
        (lambda: config_lib.preset("streaming", inner={"b2": 1.5}), "b2"),
        (lambda: config_lib.preset("streaming", inner={"learning_rate": 1}), "lr"),
        (
            lambda: config_lib.preset("diloco", method={"outer": {"momentum": 1.0}}),
            "momentum",
        ),
        (
            lambda: config_lib.RunConfig.from_json('{"model": "tiny-s", "nope": 1}'),
            "nope",
        ),
        (
            lambda: config_lib.preset("streaming", inner={"warmup_fraction": 1.0}),
            r"InnerConfig.warmup_fraction=1.0; must be in \(0, 1\)",
        ),
        (
            lambda: config_lib.preset("streaming", inner={"warmup_fraction": 0.0}),
            "InnerConfig.warmup_fraction=0.0",
        ),
        (lambda: config_lib.Regime(0.0), "Regime.tokens_per_param=0.0"),
        (lambda: config_lib.Regime(20.0, 0), "Regime.rounds=0"),
        (
            lambda: config_lib.preset("decoupled", quorum=3),
            r"DecoupledAggregator.k=3 \(the minimum quorum K\) with num_replicas=2; "
            r"allowed: an int in \[1, 2\], or None for ⌈M/2⌉ = 1\.$",
        ),
        (
            lambda: config_lib.preset(
                "decoupled", quorum=5, method={"num_replicas": 4}
            ),
            r"DecoupledAggregator.k=5 .* allowed: an int in \[1, 4\]",
        ),
        (
            lambda: config_lib.preset("decoupled", quorum=0),
            "DecoupledAggregator.k=0; allowed: an int >= 1",
        ),
        (
            lambda: config_lib.DecoupledAggregator().for_model(object()),
            "DecoupledAggregator: object has no `embedding` leaf",
        ),
        (  # before `StreamingConfig.build` has read the model
            lambda: config_lib.DecoupledAggregator().resolve(2),
            "DecoupledAggregator.plain_shapes=None",
        ),
        (  # a later change of M below an explicit K: refused where it aggregates
            lambda: config_lib.DecoupledAggregator(3, plain_shapes=((4, 4),)).resolve(
                2
            ),
            r"DecoupledAggregator.k=3 .* with num_replicas=2",
        ),
        (
            lambda: config_lib.preset("eager", quorum=2),
            "quorum=2 with preset 'eager'; allowed: preset 'decoupled'",
        ),
        (
            lambda: config_lib.preset("decoupled", method={"nonfinite": "raise"}),
            "StreamingConfig.nonfinite='raise' with a DecoupledAggregator; allowed: "
            "'skip'",
        ),
    ],
)
def test_bad_fields_are_named(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_every_method_config_builds_its_factory():
    model = model_lib.Transformer(model_lib.preset("tiny-xs"), key=jr.key(0))
    for name in config_lib.PRESETS:
        changes = {} if name == "data_parallel" else {"sync_every": 6}
        c = config_lib.preset(name, model="tiny-xs", **changes)
        alg = c.method.build(model_lib.loss_fn, optax.sgd(0.1), model)
        assert alg.num_replicas == c.method.num_replicas
        streaming = isinstance(c.method, config_lib.StreamingConfig)
        num_fragments = c.method.fragments(model).num_fragments if streaming else 1
        assert len(alg.bits_per_fragment(model)) == num_fragments


def test_presets_start_from_the_tuned_values_of_a_swept_size(monkeypatch):
    table = {
        "streaming_overlap_fp4": {
            "tiny-xs": {
                "inner.lr": 0.024,
                "method.outer.lr": 0.6,
                "method.outer.momentum": 0.5,
                "data.global_batch_size": 8,
            }
        }
    }
    monkeypatch.setattr(config_lib, "TUNED", table)
    c = config_lib.preset("streaming_overlap_fp4", model="tiny-xs")
    assert c.inner.lr == 0.024 and c.data.global_batch_size == 8
    assert (c.method.outer.lr, c.method.outer.momentum) == (0.6, 0.5)
    # What the caller gives wins; the rest stays tuned.
    c = config_lib.preset(
        "streaming_overlap_fp4",
        model="tiny-xs",
        inner={"lr": 1e-3},
        method={"outer": {"lr": 0.3}},
    )
    assert (c.inner.lr, c.method.outer.lr, c.method.outer.momentum) == (1e-3, 0.3, 0.5)
    assert c.data.global_batch_size == 8
    # Untuned: another size, another method, or tuned=False.
    default = config_lib.preset("streaming_overlap_fp4", tuned=False, model="tiny-xs")
    assert default.inner.lr == config_lib.InnerConfig().lr
    assert default.method.outer.lr == 0.4 and default.data.global_batch_size == 16
    assert config_lib.preset("streaming_overlap_fp4", model="tiny-s") == (
        config_lib.preset("streaming_overlap_fp4", tuned=False, model="tiny-s")
    )
    assert config_lib.preset("diloco", model="tiny-xs") == config_lib.preset(
        "diloco", tuned=False, model="tiny-xs"
    )


def test_shipped_tuned_table_names_real_presets_sizes_and_fields():
    base = {}
    for name, sizes in config_lib.TUNED.items():
        assert name in config_lib.PRESETS
        for size, values in sizes.items():
            model_lib.preset(size)  # a real size
            c = config_lib.preset(name, model=size)
            base = config_lib.preset(name, tuned=False, model=size)
            for path, value in values.items():
                obj = c
                for part in path.split("."):
                    obj = getattr(obj, part)
                assert obj == value, (name, size, path)
    assert base  # the table is not empty


# ------------------------------------------------ optimizers, compressor specs, merges


def _updates(opt, params, steps=3):
    """The updates of `opt` over `steps` steps on the gradients `_grads`."""
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam: `b1 ** count`
        state, out = opt.init(params), []
        for t in range(steps):
            updates, state = opt.update(_grads(params, t), state, params)
            params = optax.apply_updates(params, updates)
            out.append(updates)
    return out


def _grads(params, t):
    """Random gradients like `params`, drawn for step `t`."""
    keys = jr.split(jr.fold_in(jr.key(0), t), len(jax.tree.leaves(params)))
    leaves = [jr.normal(k, x.shape) for k, x in zip(keys, jax.tree.leaves(params))]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _equal(a, b):
    return all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


_TREE = {"w": jnp.ones((4, 3)), "b": jnp.full((3,), 0.5)}


def test_default_optimizers_are_todays_transformations_bitwise():
    # The records are verified bitwise: the defaults must build exactly these.
    inner = config_lib.InnerConfig()
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 19, 20, 0.05 * 3e-3)
    today = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1),
    )
    assert _equal(_updates(inner.build(20), _TREE), _updates(today, _TREE))
    today = optax.sgd(0.4, momentum=0.9, nesterov=True)
    assert _equal(
        _updates(config_lib.OuterConfig().build(), _TREE), _updates(today, _TREE)
    )


def _jitted_updates(opt, params, steps):
    """`steps` updates of `opt` in one jitted scan (as the training step runs
    them: compiled, the hyperparameters constants or values of the state)."""

    def body(carry, t):
        params, state = carry
        updates, state = opt.update(_grads(params, t), state, params)
        return (optax.apply_updates(params, updates), state), updates

    with jax.numpy_dtype_promotion("standard"):
        run = jax.jit(lambda p: jax.lax.scan(body, (p, opt.init(p)), jnp.arange(steps)))
        return run(params)[1]


def _model_params():
    """The tiny lab Transformer's arrays (Muon needs its stacked matrices)."""
    model = model_lib.Transformer(model_lib.preset("tiny-xxxs"), key=jr.key(0))
    return eqx.filter(model, eqx.is_array)


def _muon(schedule):
    return optax.contrib.muon(
        schedule,
        eps=1e-8,
        weight_decay=0.1,
        adam_b1=0.9,
        adam_b2=0.99,
        adam_weight_decay=0.1,
        muon_weight_dimension_numbers=config_lib.muon_dimensions,
        consistent_rms=0.2,
    )


@pytest.mark.two_programs  # XLA's defaults round both formulations alike
def test_learning_rates_and_momentum_as_values_compute_optax_numbers_bitwise():
    # The inner peak learning rate, the outer learning rate and momentum are values
    # of the optimizer state (one program for every trial of a sweep); the numbers
    # stay those of optax's transforms with constants, through warmup and decay.
    # One test (one child process): AdamW and Muon, two learning rates ((0.05 lr)
    # / lr is not 0.05 in float64 for 1.7e-3), and the outer kinds.
    params = _model_params()
    for kind, lr in [("adamw", 3e-3), ("adamw", 1.7e-3), ("muon", 1.7e-3)]:
        schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 4, 10, 0.05 * lr)
        plain = (
            optax.adamw(schedule, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)
            if kind == "adamw"
            else _muon(schedule)
        )
        reference = optax.chain(optax.clip_by_global_norm(1.0), plain)
        inner = config_lib.InnerConfig(lr=lr, warmup_steps=4, kind=kind).build(10)
        got = _jitted_updates(inner, params, 12)
        assert _equal(got, _jitted_updates(reference, params, 12)), (kind, lr)
    for outer, reference in [
        (dict(lr=0.7, momentum=0.6), optax.sgd(0.7, momentum=0.6, nesterov=True)),
        (dict(kind="sgd", lr=0.9), optax.sgd(0.9)),
        (dict(kind="adam", lr=0.01), optax.adam(0.01)),
    ]:
        built = config_lib.OuterConfig(**outer).build()
        got = _jitted_updates(built, _TREE, 5)
        assert _equal(got, _jitted_updates(reference, _TREE, 5)), outer


def test_trials_of_other_learning_rates_share_one_compiled_step():
    # A sweep's trials that differ in the inner or outer learning rate, the outer
    # momentum, the warmup or the run's length lower to the same program (so XLA
    # compiles it once: its cache is keyed by the program); another model is another
    # program.
    from sdiloco.lab import train
    from sdiloco.lab.cluster import Placement

    base = config_lib.preset(
        "streaming_overlap_fp4", model="tiny-xxxs", steps=20
    ).replace(inner={"warmup_fraction": 0.25})

    def program(**changes):
        c = base.replace(**changes)
        r = train.build(c)
        inputs = [r.init_state()]
        inputs.append(Placement.of(c.method.num_replicas).batch(r.iterators()))
        if c.failures is not None:  # a failure trace: its row is the step's input
            inputs.append(train._participation(train._trace(c), 5))
        with jax.numpy_dtype_promotion("standard"):
            return jax.jit(r.algorithm.step).lower(*inputs).as_text()

    first = program(inner={"lr": 1e-3})
    for trial in (
        dict(inner={"lr": 4e-3}),
        dict(method={"outer": {"lr": 0.8, "momentum": 0.5}}),
        dict(inner={"lr": 1e-3, "warmup_fraction": 0.5}),
        dict(inner={"lr": 1e-3, "warmup_fraction": None, "warmup_steps": 0}),
        dict(inner={"lr": 1e-3}, steps=60),
    ):
        assert program(**trial) == first, trial
    assert program(inner={"lr": 1e-3}, model="tiny-xxs") != first
    # A failure trace is the step's input: another trace is the same program (a
    # replica's reset optimizer state, built in the step, holds the initial lr).
    chaos = program(inner={"lr": 1e-3}, failures={"failures": 1.0, "seed": 1})
    other = program(inner={"lr": 1e-3}, failures={"failures": 5.0, "seed": 2})
    assert chaos == other != first


@pytest.mark.two_programs  # the numbers of optax's schedule as XLA compiles it
@given(
    lr=st.floats(1e-5, 0.5),
    warmup=st.integers(0, 400),
    steps=st.integers(1, 3000),
    ratio=st.sampled_from([0.0, 0.05, 0.1]),
)
@settings(max_examples=25)
@jax.numpy_dtype_promotion("standard")  # optax's schedules: float * int32 count
def test_warmup_cosine_with_traced_lengths_is_optax_schedule_bitwise(
    lr, warmup, steps, ratio
):
    # `InnerConfig.build`'s schedule takes the warmup and the length as values of
    # the optimizer state: at every step of a run it gives the learning rate that
    # optax's schedule with constant lengths gives, to the last bit. Each runs
    # jitted on a scalar step count, as the optimizer calls it.
    inner = config_lib.InnerConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=ratio)
    w, d = inner.lengths(steps)
    alpha = ratio * lr / lr  # optax's end / peak

    def reference(peak):  # the schedule `build` used before: constant lengths
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, peak, w),
                optax.cosine_decay_schedule(peak, d - w, alpha=alpha),
            ],
            [w],
        )

    def each(schedule):  # jitted on one scalar step count at a time
        return lambda counts, *args: jax.lax.map(schedule(*args), counts)

    counts, peak = jnp.arange(0, steps + 2, dtype=jnp.int32), jnp.float32(lr)
    expected = jax.jit(each(reference))(counts, peak)
    got = jax.jit(each(lambda *a: config_lib.warmup_cosine(*a, alpha)))(
        counts, peak, jnp.asarray(w), jnp.asarray(d)
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize(
    "outer, reference",
    [
        (dict(kind="sgd", lr=0.7), optax.sgd(0.7)),
        (
            dict(kind="adam", lr=0.01, b1=0.8, b2=0.95, eps=1e-6),
            optax.adam(0.01, b1=0.8, b2=0.95, eps=1e-6),
        ),
        (dict(momentum=0.0), optax.sgd(0.4)),
    ],
    ids=["sgd", "adam", "nesterov-no-momentum"],
)
def test_outer_kinds_build_their_optax_optimizer(outer, reference):
    built = config_lib.OuterConfig(**outer).build()
    assert _equal(_updates(built, _TREE), _updates(reference, _TREE))


@jax.numpy_dtype_promotion("standard")  # optax's schedules: float * int32 count
def test_outer_momentum_warmup_matches_a_float64_nesterov_reference():
    # Pier's warmup: momentum 0.9 * min(k, K) / K at a fragment's k-th sync (k = 0..).
    lr, mu, warmup, rounds = 0.7, 0.9, 3, 6
    opt = config_lib.OuterConfig(lr=lr, momentum=mu, momentum_warmup=warmup).build()
    params = {"w": jnp.zeros((5,))}
    grads = np.asarray(jr.normal(jr.key(1), (rounds, 5)), np.float64)
    state, trace = opt.init(params), np.zeros(5)
    for k in range(rounds):
        updates, state = opt.update({"w": jnp.asarray(grads[k], jnp.float32)}, state)
        mu_k = mu * min(k, warmup) / warmup
        trace = grads[k] + mu_k * trace
        expected = -lr * (grads[k] + mu_k * trace)  # Nesterov
        np.testing.assert_allclose(updates["w"], expected, rtol=1e-5, atol=1e-6)
    assert int(state.count) == rounds  # the count the core keeps per fragment


@jax.numpy_dtype_promotion("standard")  # optax's Adam and Muon: `b1 ** count`
def test_muon_takes_the_stacked_weight_matrices_and_adam_the_rest():
    # Checked on the updates themselves: each layer's slice of a block weight matrix
    # is optax's Muon on that one 2-D matrix; the embedding and the stacked norm
    # scales (2-D, which optax's default rule would give to Muon) are Adam's.
    inner = config_lib.InnerConfig(kind="muon", clip_norm=None, warmup_steps=0)
    model = model_lib.Transformer(model_lib.preset("tiny-xxxs"), key=jr.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    (updates,), grads = _updates(inner.build(10), params, steps=1), _grads(params, 0)
    kw = dict(eps=inner.eps, weight_decay=inner.weight_decay)
    muon = optax.contrib.muon(
        inner.schedule(10), **kw, adam_b1=inner.b1, adam_b2=inner.b2, consistent_rms=0.2
    )
    layers = model.config.num_layers
    for name, (rows, _) in config_lib.MUON_MATRICES.items():
        part = "mlp" if name in ("w_up", "w_down") else "attn"
        u, g, p = (
            getattr(getattr(t.blocks, part), name) for t in (updates, grads, params)
        )
        n_in = math.prod(np.take(u.shape, np.atleast_1d(rows)))
        for layer in (0, layers - 1):
            m = lambda x: {"m": x[layer].reshape(n_in, -1)}  # noqa: E731
            ref, _ = muon.update(m(g), muon.init(m(p)), m(p))
            np.testing.assert_allclose(m(u)["m"], ref["m"], rtol=1e-4, atol=1e-7)
    adam = optax.adamw(
        inner.schedule(10), b1=inner.b1, b2=inner.b2, nesterov=True, **kw
    )
    for get in (
        lambda t: t.embedding,
        lambda t: t.final_norm.scale,
        lambda t: t.blocks.attn_norm.scale,
        lambda t: t.blocks.mlp_norm.scale,
        lambda t: t.blocks.attn.q_norm.scale,
    ):
        ref, _ = adam.update(get(grads), adam.init(get(params)), get(params))
        np.testing.assert_allclose(get(updates), ref, rtol=1e-6, atol=1e-9)


def test_muon_refuses_a_model_without_the_transformer_matrices():
    inner = config_lib.InnerConfig(kind="muon").build(10)
    with pytest.raises(ValueError, match="InnerConfig.kind='muon'"):
        inner.init({"w": jnp.ones((3, 4, 5))})


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: config_lib.InnerConfig(kind="sgd"), "InnerConfig.kind='sgd'"),
        (lambda: config_lib.OuterConfig(kind="lion"), "OuterConfig.kind='lion'"),
        (
            lambda: config_lib.OuterConfig(kind="adam", momentum_warmup=5),
            "OuterConfig.momentum_warmup=5 with kind='adam'",
        ),
        (
            lambda: config_lib.OuterConfig(momentum_warmup=-1),
            "OuterConfig.momentum_warmup=-1",
        ),
        (
            lambda: config_lib.preset(
                "streaming_overlap_fp4", method={"compressor": "int2"}
            ),
            "StreamingConfig.compressor='int2' with quantizer='e3m0'",
        ),
        (
            lambda: config_lib.StreamingConfig(
                quantizer=None, sparsifier="dare", compressor="int2"
            ),
            "compressor='int2' with sparsifier='dare'",
        ),
        (
            lambda: config_lib.StreamingConfig(quantizer=None, compressor="int3,ef"),
            "StreamingConfig.compressor spec='int3,ef': stage 0 'int3'",
        ),
        (
            lambda: config_lib.StreamingConfig(merge="lazy"),
            "StreamingConfig.merge='lazy'",
        ),
        (lambda: config_lib.preset("diloco", method={"merge": "eager"}), "merge"),
        (
            lambda: config_lib.StreamingConfig(merge="eager", alpha=0.3),
            "StreamingConfig.alpha=0.3 with merge='eager'",
        ),
        (
            lambda: config_lib.StreamingConfig(
                quantizer=None, compressor="int2,ef", error_feedback=True
            ).build_plugins(),
            "StreamingConfig.error_feedback=True with compressor='int2,ef'",
        ),
    ],
)
def test_bad_optimizer_compressor_and_merge_values_are_one_line(build, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        build()
    assert "\n" not in str(e.value)


def test_compressor_spec_and_merge_reach_the_algorithm():
    from sdiloco.compression import parse_with_feedback

    spec = "topk:0.03/64,int2,ef:0.9"
    c = config_lib.StreamingConfig(quantizer=None, compressor=spec)
    compressor, feedback = parse_with_feedback(spec)
    assert c.build_compressor() == compressor
    assert c.build_plugins() == (feedback,) and feedback == sdiloco.error_feedback(0.9)
    flag = config_lib.StreamingConfig(error_feedback=True)
    assert flag.build_plugins() == (sdiloco.error_feedback(1.0),)
    model = model_lib.Transformer(model_lib.preset("tiny-xxxs"), key=jr.key(0))
    for merge in ("alpha", "eager"):
        method = config_lib.StreamingConfig(sync_every=4, merge=merge)
        alg = method.build(model_lib.loss_fn, optax.sgd(0.1), model)
        merging = (
            sdiloco.alpha_merge(method.alpha) if merge == "alpha" else sdiloco.eager()
        )
        assert alg.spec.plugin.plugins == (merging,)
        state = alg.init(model, jr.key(1))
        # Eager's stand-ins are state, one per replica; the α-merge keeps none.
        stand_ins = jax.tree.leaves(state.plugin_state)
        assert bool(stand_ins) == (merge == "eager")
        assert all(x.shape[0] == method.num_replicas for x in stand_ins)


@pytest.mark.parametrize("name", ["muloco", "sparseloco", "eager", "decoupled"])
def test_new_presets_change_only_what_their_method_changes(name):
    # Each is the paper's final method (its tuned values included) but for what the
    # method itself changes.
    changed = {
        "muloco": {"inner.kind", "method.quantizer", "method.compressor"},
        "sparseloco": {
            "method.quantizer",
            "method.compressor",
            "method.outer.kind",
            "method.outer.lr",
            "method.outer.momentum",
        },
        "eager": {"method.merge"},
        # with k and plain_shapes null: read off the run (M, the model) when built
        "decoupled": {"method.aggregator.object", "method.aggregator.args.power"},
    }[name]
    for model in ("tiny-xxs", "tiny-s", "tiny-m"):
        new = _flat(config_lib.preset(name, model=model).replace(name="x").to_dict())
        base = config_lib.preset("streaming_overlap_fp4", model=model)
        old = _flat(base.replace(name="x").to_dict())
        differ = {k for k in new.keys() | old.keys() if new.get(k) != old.get(k)}
        assert differ == changed, (model, differ)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_new_fields_at_their_default_leave_the_json_and_records_as_they_were():
    # An old preset's JSON, byte for byte as before the new fields (its sha256).
    # The name, a label left out of record keys, was the preset's with "_h100".
    text = (
        config_lib.preset("streaming_overlap_fp4", model="tiny-s", tuned=False)
        .replace(name="streaming_overlap_fp4_h100")
        .to_json()
    )
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "d6c02ce7f617bfc3472d81e30d365f14a2142c6b0c7e01c34ff079138415e98b"
    )
    for key in ("kind", "momentum_warmup", "compressor", "merge"):
        assert f'"{key}": "' not in text.replace('"kind": "streaming"', "")
    # Every committed record's config still hashes to its file name.
    from sdiloco.paper.experiments import record_key

    files = sorted((ROOT / "paper_figures" / "runs").glob("*.json"))
    assert len(files) > 900
    for f in files:
        config = json.loads(f.read_text())["config"]
        key = record_key(config_lib.RunConfig.from_json(json.dumps(config)))
        assert key == f.stem.split("-")[0], f.name


@pytest.mark.integration
@pytest.mark.parametrize("name", ["muloco", "sparseloco", "eager", "decoupled"])
@jax.numpy_dtype_promotion("standard")  # optax's Adam and Muon: `b1 ** count`
def test_the_new_presets_train_from_python(name):
    from sdiloco.lab import train

    c = config_lib.preset(
        name, model="tiny-xxxs", steps=8, sync_every=4, eval_every=8, eval_windows=64
    )
    loss = train.run(c, progress=False).evals[-1]["eval/global"]
    assert 0 < loss < 6  # finite, about ln(256) or below


# ------------------------------------------------------ the decoupled preset (issue 71)


def _decoupled_aggregator(config):
    """The aggregator the config's algorithm runs, and the lab model's config."""
    mc = config.model_config()
    model = model_lib.Transformer(mc, key=jr.key(0))
    alg = config.method.build(model_lib.loss_fn, optax.sgd(0.1), model)
    return alg.spec.aggregator, mc


@pytest.mark.parametrize(
    "changes, k",
    [
        ({"model": "tiny-xxs"}, 1),
        ({"model": "tiny-xs", "method": {"num_replicas": 4}}, 2),
        ({"model": "tiny-xxs", "vocab_size": 300, "method": {"num_replicas": 5}}, 3),
        ({"model": "tiny-xxs", "quorum": 4, "method": {"num_replicas": 4}}, 4),
    ],
    ids=["M=2", "tiny-xs M=4", "vocab M=5", "K=M"],
)
def test_decoupled_is_a_quorum_of_the_radial_directional_mean_of_the_model(changes, k):
    m = changes.get("method", {}).get("num_replicas", 2)
    c = config_lib.preset("decoupled", data={"global_batch_size": 4 * m}, **changes)
    assert (c.method.overlap, c.method.alpha, c.method.quantizer) == (1, 0.5, "e3m0")
    aggregator, mc = _decoupled_aggregator(c)
    embedding = (mc.vocab_size, mc.width)  # the tied head is the same leaf
    expect = sdiloco.aggregation.quorum(
        k, sdiloco.aggregation.radial_directional(1.0, plain_shapes=[embedding])
    )
    assert aggregator.resolve(m) == expect
    # In numbers: the embedding by the steps-weighted mean, the rest radially;
    # fewer than K senders (but some) fail the round: NaN, a skipped round.
    rows = [jr.normal(jr.key(1), (m, *embedding)), jr.normal(jr.key(2), (m, 3, 4))]
    steps = jnp.arange(1, m + 1, dtype=jnp.int32)
    everyone, short = jnp.ones(m, bool), jnp.arange(m) < k - 1
    for sent in (everyone, short):
        got, want = aggregator(rows, sent, steps), expect(rows, sent, steps)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    missed = aggregator(rows, short, steps)[0]
    assert bool(jnp.all(jnp.isnan(missed))) == (k > 1)
    got = aggregator(rows, everyone, steps)
    weighted = sdiloco.aggregation.steps_weighted_mean(1.0)(rows, everyone, steps)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(weighted[0]), rtol=1e-6)
    assert not np.allclose(np.asarray(got[1]), np.asarray(weighted[1]))


def test_decoupled_follows_a_later_model_and_m_and_round_trips():
    # Built at tiny-xxs with M = 2, then changed as a notebook's `setup` would.
    c = config_lib.preset("decoupled", model="tiny-xxs").replace(
        model="tiny-xs", method={"num_replicas": 4}, data={"global_batch_size": 8}
    )
    aggregator, mc = _decoupled_aggregator(c)
    assert aggregator.resolve(4) == sdiloco.aggregation.quorum(
        2, sdiloco.aggregation.radial_directional(1.0, plain_shapes=[(256, 32)])
    )
    assert mc.width == 32
    # config.json records the unresolved aggregator (K and shape are the run's).
    for config in (
        c,
        config_lib.preset("decoupled", quorum=3, method={"num_replicas": 4}),
    ):
        text = config.to_json()
        assert config_lib.RunConfig.from_json(text) == config
        assert config_lib.RunConfig.from_json(text).to_json() == text
        recorded = json.loads(text)["method"]["aggregator"]
        assert recorded["object"] == "sdiloco.lab.methods.DecoupledAggregator"
        assert recorded["args"]["k"] == config.method.aggregator.k


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_decoupled_adopts_by_overwrite_or_by_the_alpha_blend(alpha):
    c = config_lib.preset("decoupled", model="tiny-xxs", method={"alpha": alpha})
    model = model_lib.Transformer(c.model_config(), key=jr.key(0))
    alg = c.method.build(model_lib.loss_fn, optax.sgd(0.1), model)
    assert alg.spec.plugin.plugins == (sdiloco.alpha_merge(alpha),)
