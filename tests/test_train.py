"""The training loop: it learns, resumes bitwise, and rejects bad checkpoints and configs."""

import json
import os
import shutil

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import assert_trees_equal, tree_equal

import sdiloco
from sdiloco.__main__ import main
from sdiloco.lab import config as config_lib, data as data_lib, model as model_lib
from sdiloco.lab.checkpoint import CheckpointError
from sdiloco.lab.train import build, enable_compile_cache, run


@pytest.fixture(autouse=True)
def standard_promotion():
    """Runs use optax's AdamW, whose `b1 ** count` strict promotion rejects."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _tiny(preset="streaming_overlap_fp4", **changes):
    base = dict(
        model="tiny-xs",
        steps=12,
        eval_every=100,
        eval_windows=8,
        log_every=4,
        data={"global_batch_size": 4},
        inner={"lr": 3e-3, "warmup_steps": 2},
    )
    method = {"sync_every": 4, "overlap": 2}
    if preset == "diloco":
        method = {"sync_every": 4}
    if preset == "data_parallel":
        method = {}
    method.update(changes.pop("method", {}))
    return config_lib.preset(preset, method=method, **{**base, **changes})


@pytest.mark.integration
def test_learns_below_unigram_entropy():
    # A real learning check: the held-out cross-entropy of theta_g falls well below the
    # corpus's unigram entropy (3.31 nats/byte), which a model ignoring context cannot.
    # (tiny-xxs reaches 0.71x of it in 500 steps, as tiny-s did in 250, in half the
    # CPU time.)
    cfg = _tiny(
        model="tiny-xxs",
        steps=500,
        eval_every=500,
        eval_windows=64,
        log_every=50,
        method={"sync_every": 20, "overlap": 1},
        data={"global_batch_size": 16},
        inner={"lr": 1e-2, "warmup_steps": 20},
    )
    history = run(cfg, progress=False)
    entropy = history.summary["unigram_entropy_heldout"]
    assert 3.2 < entropy < 3.4
    assert history.final_eval("global") < 0.8 * entropy
    assert history.summary["bits_total"] > 0


@pytest.mark.integration
def test_resume_mid_flight_is_bitwise_identical(tmp_path):
    cfg = _tiny(checkpoint_every=0)
    full = run(cfg, progress=False)
    # Stop after step 7: fragments sent at steps 6 and 7 are in flight (tau = 2).
    part = run(cfg, tmp_path, stop_after=7, progress=False)
    state = part.state
    in_flight = (np.asarray(state.sent_at) > 0) & (7 - np.asarray(state.sent_at) < 2)
    assert in_flight.any()
    assert not tree_equal(jax.device_get(state), jax.device_get(full.state))
    resumed = run(cfg, tmp_path, progress=False)
    assert int(resumed.state.step) == 12
    assert_trees_equal(jax.device_get(resumed.state), jax.device_get(full.state))
    assert resumed.summary["bits_total"] == full.summary["bits_total"]
    # The resumed history holds every row of the uninterrupted one (plus one at the stop).
    assert {r["step"] for r in full.rows} <= {r["step"] for r in resumed.rows}
    with open(tmp_path / "history.json") as f:
        assert json.load(f)["summary"]["steps"] == 12


@pytest.mark.integration
def test_bad_checkpoints(tmp_path):
    cfg = _tiny(steps=4)
    run(cfg, tmp_path, progress=False)
    ckpt = tmp_path / "checkpoints"
    # Another config: refused, naming the differing field.
    with pytest.raises(CheckpointError, match="another config.*seed"):
        run(cfg.replace(seed=1), tmp_path, progress=False)
    assert (tmp_path / "config.json").read_text() == cfg.to_json()  # left as it was
    # A partial checkpoint: refused, naming the missing item.
    shutil.rmtree(ckpt / "4" / "meta")
    with pytest.raises(CheckpointError, match="partial.*meta"):
        run(cfg, tmp_path, progress=False)
    # No checkpoint at all where one is asked for.
    checkpointer = sdiloco.lab.checkpoint.Checkpointer(
        tmp_path / "empty", cfg.to_json()
    )
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpointer.restore(None)


@pytest.mark.integration
def test_data_parallel_and_diloco_run(tmp_path):
    for name in ("data_parallel", "diloco"):
        history = run(_tiny(name, steps=4), tmp_path / name, progress=False)
        assert np.isfinite(history.final_eval())
        assert os.path.exists(tmp_path / name / "history.csv")


@pytest.mark.integration
def test_cli(tmp_path, capsys):
    tokens = np.random.default_rng(0).integers(0, 256, 100_000).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    argv = [
        "train",
        "--preset",
        "streaming_overlap_fp4",
        "--model",
        "tiny-xs",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--tokens",
        str(tmp_path / "tokens.npy"),
        "--out",
        str(tmp_path / "out"),
        "--no-progress",
        "--sync-every",
        "2",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["steps"] == 3
    assert os.path.exists(tmp_path / "out" / "checkpoints" / "3")


@pytest.mark.parametrize("name", sorted(config_lib.PRESETS))
def test_every_preset_builds(name):
    cfg = config_lib.preset(name)
    assert config_lib.RunConfig.from_json(cfg.to_json()) == cfg
    r = sdiloco.lab.train.build(cfg.replace(model="tiny-xs"))
    assert r.algorithm.num_replicas == cfg.method.num_replicas


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(model="tiny-xxl"), "tiny-xxl"),
        (dict(steps=0), "steps"),
        (dict(data={"global_batch_size": 5}), "divisible"),
        (dict(method={"sync_every": 0}), "sync_every"),
        (dict(method={"overlap": 100}), "tau"),
        (dict(method={"alpha": 2.0}), "alpha"),
        (dict(method={"quantizer": "e9m9"}), "quantizer"),
        (dict(method={"layers_per_fragment": 4}), "layers_per_fragment"),
        (dict(method={"kind": "fedavg"}), "kind"),
        (dict(method={"kind": "diloco", "alpha": 0.5}), "alpha"),
        (dict(eval_params=("best",)), "eval_params"),
        (dict(inner={"lr": -1.0}), "lr"),
    ],
)
def test_bad_config(changes, match):
    with pytest.raises(ValueError, match=match):
        config_lib.preset("streaming_overlap_fp4", **changes)


def _evaluate(cfg):
    """The run's evaluator applied to its initial global parameters."""
    from sdiloco.lab.cluster import Placement
    from sdiloco.lab.train import evaluator

    r = build(cfg)
    place = Placement.of(cfg.method.num_replicas)
    state = r.algorithm.init(r.model)
    return evaluator(r, cfg, place)(state), r


def test_evaluation_set_is_the_same_for_every_method_and_batch():
    """Scored on the same windows whatever the batch or method: the initial model
    (same seed) gets the same loss from Data-Parallel at batch 4 and Streaming at 16."""
    a, _ = _evaluate(_tiny("data_parallel", eval_windows=300))
    b, _ = _evaluate(_tiny(eval_windows=300, data={"global_batch_size": 16}))
    assert a["eval/global"] == b["eval/global"]
    assert a["eval_se/global"] == b["eval_se/global"]


def test_evaluation_is_the_mean_over_windows_with_its_standard_error():
    """Against a float64 NumPy reduction of each window scored alone (batch of one,
    through `loss_with_aux`, not the evaluator's chunked path)."""
    cfg = _tiny(eval_windows=300)  # 300 windows: one full chunk of 256 and a padded one
    out, r = _evaluate(cfg)
    windows = data_lib.evaluation_windows(
        r.heldout_tokens, seq_len=r.model_config.seq_len, num_windows=300
    )
    ce = eqx.filter_jit(lambda m, b: model_lib.loss_with_aux(m, b)[1]["ce"])
    per = np.asarray(
        [
            float(ce(r.model, {k: v[i : i + 1] for k, v in windows.items()}))
            for i in range(300)
        ],
        np.float64,
    )
    np.testing.assert_allclose(out["eval/global"], per.mean(), rtol=1e-6)
    np.testing.assert_allclose(
        out["eval_se/global"], per.std(ddof=1) / np.sqrt(300), rtol=1e-4
    )
    assert out["bpb/global"] == pytest.approx(out["eval/global"] / np.log(2))


def test_too_many_evaluation_windows_is_an_error_before_training():
    with pytest.raises(
        ValueError, match=r"RunConfig.eval_windows=100000000; .*allowed"
    ):
        build(_tiny(eval_windows=10**8))
    with pytest.raises(ValueError, match="RunConfig.eval_windows=0"):
        _tiny(eval_windows=0)


@pytest.mark.parametrize("preset", ["data_parallel", "streaming_overlap_fp4"])
def test_a_run_with_failures_feeds_its_seeded_trace_to_every_step(preset):
    """A trace without failures trains the run without one; with failures the run
    stays finite and reports what the trace held.

    (The step with a participation input is another XLA program than the step
    without: on the transformer XLA:CPU may round its fusions differently, so the
    two agree to float32 rounding; `test_participation.py` checks the arithmetic
    bitwise where the programs round alike.)"""
    cfg = _tiny(preset, method={"num_replicas": 4}, data={"global_batch_size": 8})
    plain = run(cfg, progress=False)
    calm = run(cfg.replace(failures={}), progress=False)
    assert calm.final_eval() == pytest.approx(plain.final_eval(), rel=1e-6)
    rough = run(
        cfg.replace(failures={"failures": 4.0, "repair": 0.2, "seed": 5}),
        progress=False,
    )
    assert np.isfinite(rough.final_eval())
    assert rough.summary["participation"]["failures"] > 0


def test_failures_need_the_one_device_simulation():
    cfg = _tiny(failures={"failures": 1.0})
    with pytest.raises(ValueError, match=r"RunConfig.failures=.* courier"):
        run(cfg, progress=False, courier=True)


def test_compile_cache_honours_the_users_own_directory(monkeypatch, tmp_path):
    """`enable_compile_cache` keeps a cache directory set through JAX's own setting;
    `$SDILOCO_JAX_CACHE` and an explicit path still come first."""
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("SDILOCO_JAX_CACHE", raising=False)
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "own"))
        enable_compile_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "own")
        monkeypatch.setenv("SDILOCO_JAX_CACHE", str(tmp_path / "env"))
        enable_compile_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "env")
        enable_compile_cache(tmp_path / "given")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "given")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def _damage(step_dir, how):
    """Damage a checkpoint as a crash or a bad disk would."""
    if how == "json":
        (step_dir / "meta" / "metadata").write_bytes(b'{"rows": "\x01')
    else:
        for f in (step_dir / "state" / "d").iterdir():
            f.write_bytes(b"garbage" * 10)


@pytest.mark.integration
@pytest.mark.parametrize("how", ["json", "state"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_intact_one(
    tmp_path, capsys, how
):
    cfg = _tiny(model="tiny-xxxs", steps=12, checkpoint_every=4)
    full = run(cfg, progress=False)
    run(cfg, tmp_path, stop_after=8, progress=False)  # checkpoints 4 and 8
    capsys.readouterr()
    _damage(tmp_path / "checkpoints" / "8", how)
    resumed = run(cfg, tmp_path, progress=False)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: checkpoint step 8") and "step 4" in line, line
    assert "Traceback" not in line
    assert_trees_equal(jax.device_get(resumed.state), jax.device_get(full.state))
    # Nothing intact: one error, suggesting to start afresh.
    for step in ("8", "12"):
        _damage(tmp_path / "checkpoints" / step, how)
    with pytest.raises(CheckpointError, match="no intact checkpoint.*--no-resume"):
        run(cfg, tmp_path, progress=False)
    assert "Traceback" not in capsys.readouterr().err
    assert int(run(cfg, tmp_path, resume=False, progress=False).state.step) == 12


@pytest.mark.integration
def test_a_nonfinite_loss_stops_the_run_when_asked(tmp_path):
    from sdiloco.lab.train import NonFiniteLoss

    cfg = _tiny(model="tiny-xxxs", steps=12, inner={"lr": 1e4, "warmup_steps": 1})
    with pytest.raises(NonFiniteLoss, match="loss is nan at step"):
        run(cfg, progress=False, nonfinite_loss="stop")
    assert not np.isfinite(run(cfg, progress=False).rows[-1]["loss/train"])


@pytest.mark.parametrize(
    "steps, expected",
    [(20, "no fragment is ever synchronised"), (120, "2 of 3 fragments"), (200, None)],
)
def test_a_run_shorter_than_its_syncs_is_warned_about(steps, expected):
    from sdiloco.lab.train import sync_warning

    cfg = config_lib.preset("streaming_overlap_fp4", model="tiny-xxs", steps=steps)
    warning = sync_warning(cfg)  # H = 100, P = 3, tau = 1: first arrivals 101..168
    if expected is None:
        assert warning is None
    else:
        assert warning is not None and expected in warning and "\n" not in warning
        assert "--steps >= 168" in warning
    assert sync_warning(config_lib.preset("data_parallel", steps=5)) is None


@pytest.mark.two_programs
@pytest.mark.parametrize("preset", ["streaming_overlap_fp4", "diloco"])
def test_a_transport_of_your_own_moves_the_exchange_and_changes_no_number(preset):
    # The seam a user extends: a plain function on NumPy arrays moves every
    # fragment's messages between steps (here it hands them on, counting them);
    # the run is bitwise the one with the exchange inside the step, for τ >= 1 and
    # τ = 0 (DiLoCo), and the function sees each send once.
    cfg = _tiny(preset)
    moved = []

    def move(messages, fragment, sent):
        moved.append((fragment, sent, messages.shape))
        return messages

    plain = run(cfg, progress=False)
    posted = run(cfg, progress=False, transport=move)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(plain.state.global_params, eqx.is_array)),
        jax.tree.leaves(eqx.filter(posted.state.global_params, eqx.is_array)),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    timeless = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in plain.rows]
    assert timeless == [
        {k: v for k, v in r.items() if k != "tokens_per_s"} for r in posted.rows
    ]
    sent = [(f, s) for f, s, _ in moved]
    assert len(sent) == len(set(sent)) > 0  # each (fragment, step) once
    assert all(shape[0] == cfg.method.num_replicas for _, _, shape in moved)


def test_step_batches_are_the_replicas_batches_by_step():
    tokens = np.arange(5000, dtype=np.int32) % 251
    kw = dict(num_replicas=3, global_batch_size=6, seq_len=16, seed=4)
    batches = data_lib.replica_batches(tokens, replica=1, **kw)
    reference = data_lib.make_replica_iterators(tokens, **kw)[1]
    it = data_lib.StepBatches(batches)
    first = [next(it) for _ in range(5)]
    for got in first:
        want = next(reference)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
    it.seek(2)  # an island healed at step 2 reads step 3's batch next
    np.testing.assert_array_equal(next(it)["inputs"], first[2]["inputs"])
    state = it.get_state()
    after = next(it)
    it.set_state(state)
    np.testing.assert_array_equal(next(it)["inputs"], after["inputs"])
