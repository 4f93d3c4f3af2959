"""Checkpoints: a checkpoint of another model or state is refused, naming what differs."""

import sys

import jax
import jax.numpy as jnp
import pytest

from sdiloco.lab import config as config_lib
from sdiloco.lab.checkpoint import Checkpointer, CheckpointError
from sdiloco.lab.train import build, run


pytestmark = pytest.mark.integration  # every test here trains a run


@pytest.fixture(autouse=True)
def standard_promotion():
    """Runs use optax's AdamW, whose `b1 ** count` strict promotion rejects."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _cfg(model):
    return config_lib.preset(
        "streaming_overlap_fp4",
        model=model,
        steps=4,
        data={"global_batch_size": 4},
        method={"sync_every": 4, "overlap": 1},
    )


def _save_init(directory, cfg):
    """Write the initial state of `cfg` as a checkpoint at step 0 (no training)."""
    r = build(cfg)
    ckpt = Checkpointer(directory, cfg.to_json())
    ckpt.save(0, r.init_state(), {"rows": [], "evals": []})
    ckpt.close()


def test_restore_into_other_model_config_is_refused(tmp_path):
    # A run whose config names another model shape refuses the checkpoint before
    # compiling anything, naming the differing field.
    _save_init(tmp_path / "checkpoints", _cfg("tiny-xs"))
    with pytest.raises(CheckpointError, match="another config.*model.*tiny-xs"):
        run(_cfg("tiny-xxs"), tmp_path, progress=False)


def test_restore_into_other_model_shape_names_the_leaf(tmp_path):
    # Same config JSON, but a template of another model shape: the state check names
    # the first differing array and both shapes, before any array is read.
    small, big = _cfg("tiny-xxs"), _cfg("tiny-xs")
    _save_init(tmp_path, small)
    ckpt = Checkpointer(tmp_path, small.to_json())
    want = r"does not match.*blocks\.attn\.w_k: float32\[6,16,1,16\] vs float32\[6,32,2,16\]"
    with pytest.raises(CheckpointError, match=want):
        ckpt.restore(build(big).init_state())
    ckpt.close()


def test_restore_with_other_dtype_is_refused(tmp_path):
    # orbax would silently cast float32 to bfloat16; the check refuses it instead.
    saved = {"w": jnp.zeros((3,), jnp.float32), "n": jnp.zeros((), jnp.int32)}
    ckpt = Checkpointer(tmp_path, "{}")
    ckpt.save(1, saved, {})
    with pytest.raises(CheckpointError, match=r"w: float32\[3\] vs bfloat16\[3\]"):
        ckpt.restore({**saved, "w": saved["w"].astype(jnp.bfloat16)})
    with pytest.raises(CheckpointError, match=r"w: float32\[3\] vs float32\[4\]"):
        ckpt.restore({**saved, "w": jnp.zeros((4,), jnp.float32)})
    with pytest.raises(CheckpointError, match=r"only in the checkpoint: \['n'\]"):
        ckpt.restore({"w": saved["w"]})
    extra = {**saved, "v": saved["w"]}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['v'\]"):
        ckpt.restore(extra)
    state, meta = ckpt.restore(saved)
    assert state["w"].dtype == jnp.float32 and meta == {}
    ckpt.close()


def test_orbax_echoes_of_a_failed_read_are_dropped_and_nothing_else(monkeypatch):
    # A truncated checkpoint's failed read left every other pending read coroutine
    # to fail again when collected, each printed through sys.unraisablehook with a
    # TensorStore spec (thousands of lines when it happens: timing decides). The
    # hook drops exactly those and tensorstore's closed-loop callbacks.
    import inspect
    import types

    from orbax.checkpoint._src.serialization import serialization

    from sdiloco.lab import checkpoint

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    checkpoint._quiet_failed_reads()
    assert sys.unraisablehook is not seen.append  # installed over the previous one
    read = serialization._read_array_index_and_device_put
    params = inspect.signature(read).parameters.values()  # a coroutine, not started
    orbax_coro = read(
        *[None for p in params if p.kind != p.KEYWORD_ONLY],
        **{p.name: None for p in params if p.kind == p.KEYWORD_ONLY},
    )

    async def own():
        pass

    own_coro = own()
    error = Exception("Encountered error while reading array index: (slice(0, 2, 1),)")

    def unraisable(exc, obj):
        return types.SimpleNamespace(exc_value=exc, object=obj)

    echoes = [
        unraisable(error, orbax_coro),
        unraisable(RuntimeError("Event loop is closed"), None),
    ]
    others = [
        unraisable(error, own_coro),  # the same error from a coroutine of our own
        unraisable(RuntimeError("something else"), None),
        unraisable(ValueError("x"), object()),
    ]
    for u in echoes + others:
        sys.unraisablehook(u)
    assert seen == others
    orbax_coro.close()
    own_coro.close()


def test_a_checkpoint_under_another_name_restores_and_another_config_says_what_to_do(
    tmp_path,
):
    # The name is a label (record keys leave it out too); any other field refuses,
    # saying how to go on: --no-resume, another --out, or the old config.
    saved = {"w": jnp.arange(3.0)}
    ckpt = Checkpointer(tmp_path, '{"name": "muloco_h100", "steps": 8}')
    ckpt.save(8, saved, {})
    ckpt.close()
    renamed = Checkpointer(tmp_path, '{"name": "muloco", "steps": 8}')
    state, _ = renamed.restore(saved)
    assert state["w"].tolist() == [0.0, 1.0, 2.0]
    renamed.close()
    other = Checkpointer(tmp_path, '{"name": "muloco", "steps": 9}')
    with pytest.raises(CheckpointError) as e:
        other.restore(saved)
    for said in ("steps: 8 vs 9", "--no-resume", "another --out", "config.json"):
        assert said in str(e.value), str(e.value)
    assert "name" not in str(e.value).split("differing fields")[1].split(".")[0]
    other.close()


def test_asyncio_reports_of_a_failed_read_are_dropped_and_nothing_else():
    # The same echoes, when asyncio collects the futures instead: "Future exception
    # was never retrieved" of orbax's errors and of tensorstore's (set from C++, no
    # Python frame). Other asyncio errors still reach its handlers.
    import logging
    import os

    from sdiloco.lab import checkpoint

    checkpoint._quiet_failed_reads()
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    log = logging.getLogger("asyncio")
    log.addHandler(handler)
    path = os.path.join(os.sep, "x", "orbax", "checkpoint", "_src", "read.py")
    try:
        exec(compile("raise Exception('Encountered error')", path, "exec"))
    except Exception as e:
        in_orbax = e
    try:
        exec(compile("raise Exception('Encountered error')", "mine.py", "exec"))
    except Exception as e:
        in_mine = e
    store = ValueError('OUT_OF_RANGE: Error reading "w" in OCDBT database at ...')
    cases = {
        "orbax": (in_orbax, "_GatheringFuture exception was never retrieved"),
        "tensorstore": (store, "Future exception was never retrieved"),
        "own": (in_mine, "Future exception was never retrieved"),
        "frameless": (ValueError("other"), "Future exception was never retrieved"),
        "other message": (in_orbax, "Task was destroyed but it is pending!"),
    }
    try:
        for name, (error, message) in cases.items():
            log.error(message, exc_info=(type(error), error, error.__traceback__))
    finally:
        log.removeHandler(handler)
    kept = [r.exc_info[1] for r in seen]
    assert kept == [in_mine, kept[1], in_orbax] and str(kept[1]) == "other"
