"""The README's example runs as written."""

import pathlib
import re

import equinox as eqx
import jax


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW is not strict-clean
        exec(compile(blocks[0], str(README), "exec"), namespace)
    state = namespace["state"]
    assert int(state.step) == 40
    # Every fragment was sent, and theta_g moved away from the initial model.
    assert (state.sent_at > 0).all()
    assert not eqx.tree_equal(namespace["theta_g"], namespace["model"])
    assert capsys.readouterr().out.strip()
