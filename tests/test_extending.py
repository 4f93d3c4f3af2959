"""docs/extending.md runs as written: its code blocks, in order, in one namespace."""

import pathlib
import re

import jax
import numpy as np


DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def test_extending_examples_run_and_train():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 12, (
        "the setting, three methods, a stage, a merge, an outer, a stage with state, "
        "an aggregator, aggregators composed, plug-ins composed, the lab"
    )
    namespace: dict = {}
    losses = []
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW is not strict-clean
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
            if "metrics" in namespace:
                losses.append(float(namespace.pop("metrics")["loss/train"]))
    assert len(losses) == 10  # every method and example trained
    assert all(np.isfinite(losses)), losses
    # each trained: the initial model's loss on such a batch is 0.64
    assert max(losses) < 0.45, losses
