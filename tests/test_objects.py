"""Tests for sdiloco.lab.objects: objects in a config, and what config.json records.

Ours (plug-ins, aggregators, compressors) and recorded calls (`call(optax.lion,
...)`) round-trip through the JSON and build the same algorithm; a user's object is
recorded by name, marked not re-creatable, refused by `from_json` with one line
naming the field, and never counted as a reproducible record.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdiloco
from sdiloco import aggregation
from sdiloco.lab import objects
from sdiloco.lab.config import RunConfig, preset
from sdiloco.paper import provenance, verify
from sdiloco.sim.faults import bad_replica


class Halve(aggregation.Aggregator):
    """A user's aggregator (defined outside sdiloco: cannot be re-created)."""

    def __call__(self, rows, sent, steps):
        return [0.5 * r for r in aggregation.mean()(rows, sent, steps)]


def _config(**method):
    return preset("streaming_overlap_fp4").replace(model="tiny-xxs", method=method)


def test_our_objects_and_recorded_calls_round_trip_through_config_json():
    config = _config(
        aggregator=aggregation.trimmed_mean(0.2),
        plugins=(sdiloco.error_feedback(0.9), bad_replica("scale", 1, factor=3.0)),
        compressor=sdiloco.compression.chain(
            sdiloco.chunked_top_k(0.25, chunk=8), sdiloco.quantizer("int2")
        ),
        quantizer=None,
    ).replace(inner={"transform": objects.call(optax.lion, learning_rate=1e-4)})
    data = json.loads(config.to_json())
    assert data["method"]["aggregator"] == {
        "object": "sdiloco.aggregation.TrimmedMean",
        "args": {"trim": 0.2},
    }
    assert data["inner"]["transform"] == {
        "object": "optax.lion",
        "call": True,
        "args": {"learning_rate": 0.0001},
    }
    assert objects.recreatable(data)
    back = RunConfig.from_json(config.to_json())
    assert back == config
    assert back.to_json() == config.to_json()
    # the object fields at their defaults leave the JSON (record keys unchanged)
    assert "aggregator" not in json.loads(_config().to_json())["method"]


def test_the_lab_builds_the_objects_it_was_given():
    config = _config(
        aggregator=aggregation.median(), plugins=(sdiloco.error_feedback(0.5),)
    )
    alg = config.method.build(lambda p, b: 0.0, optax.sgd(0.1), _model(config))
    assert alg.spec.aggregator == aggregation.median()
    names = [type(p).__name__ for p in alg.spec.plugin.plugins]
    assert names == ["ErrorFeedback", "AlphaMerge"]
    inner = config.replace(
        inner={"transform": objects.call(optax.lion, learning_rate=1e-4)}
    ).inner.build(100)
    params = {"w": jnp.ones(3)}
    ours, _ = inner.update({"w": jnp.full(3, 2.0)}, inner.init(params), params)
    lion = optax.lion(1e-4)
    ref, _ = lion.update({"w": jnp.full(3, 2.0)}, lion.init(params), params)
    np.testing.assert_array_equal(np.asarray(ours["w"]), np.asarray(ref["w"]))


def _model(config):
    from sdiloco.lab import model as model_lib

    return model_lib.Transformer(config.model_config(), key=jax.random.key(0))


def test_a_users_object_is_recorded_by_name_and_never_re_created(monkeypatch):
    config = _config(aggregator=Halve())
    data = json.loads(config.to_json())
    assert data["method"]["aggregator"]["object"].endswith("Halve")
    assert data["method"]["aggregator"]["recreatable"] is False
    assert not objects.recreatable(data)
    with pytest.raises(
        ValueError, match=r"StreamingConfig.aggregator: .*Halve cannot be re-created"
    ):
        RunConfig.from_json(config.to_json())
    monkeypatch.setattr(provenance, "fingerprint", lambda: "f")
    monkeypatch.setattr(provenance, "probes", lambda: {})
    record = {"config": data, "code": {"fingerprint": "f", "probes": {}}}
    assert not provenance.is_current(record)
    assert provenance.is_current({**record, "config": json.loads(_config().to_json())})


def test_verify_skips_a_record_it_cannot_re_create(tmp_path):
    (tmp_path / "k.json").write_text(
        json.dumps({"config": json.loads(_config(aggregator=Halve()).to_json())})
    )
    assert verify._load(tmp_path, "k") is None
    (tmp_path / "j.json").write_text(
        json.dumps({"config": json.loads(_config().to_json())})
    )
    assert verify._load(tmp_path, "j") is not None


def test_a_merging_plugin_in_the_lab_replaces_merge_and_alpha():
    config = _config(plugins=(sdiloco.eager(),))
    assert config.method._alpha() is None
    with pytest.raises(ValueError, match="hold a merge, with merge='alpha', alpha=0.3"):
        _config(plugins=(sdiloco.eager(),), alpha=0.3)
    with pytest.raises(
        ValueError, match="alpha=0.3 with merge='eager', which does not mix"
    ):
        _config(merge="eager", alpha=0.3)
    with pytest.raises(
        ValueError, match="error_feedback=True with compressor='int2,ef'"
    ):
        _config(quantizer=None, compressor="int2,ef", error_feedback=True)
