"""Configs: one per method, holding only the fields that method uses; one JSON loader."""

import dataclasses
import json

import jax.random as jr
import optax
import pytest
from hypothesis import given, settings, strategies as st

from sdiloco.lab import config as config_lib, model as model_lib


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
