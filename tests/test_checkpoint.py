"""Checkpoints: a checkpoint of another model or state is refused, naming what differs."""

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
