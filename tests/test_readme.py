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


def test_readme_fragments_of_an_equinox_model_run_as_written():
    # "Bring your own model": fragments of a model whose layers are a list. The block
    # runs after the one before it (its imports and names).
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "fragments_from_path" in b]
    setup = next(b for b in blocks if "class Net(eqx.Module)" in b)
    namespace: dict = {}
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(setup, str(README), "exec"), namespace)
    exec(compile(block, str(README), "exec"), namespace)  # asserts its own counts
    assert namespace["per_layer"].num_fragments == 3


def test_readme_layout_names_every_module_and_every_design_note():
    text = README.read_text()
    layout = text[text.index("## Layout") :].split("```")[1]
    root = README.parent
    modules = {
        p.stem
        for p in (root / "sdiloco").rglob("*.py")
        if not p.stem.startswith("_") and "corpus" not in p.parts
    }
    notes = {p.stem for p in (root / "docs").glob("*.md") if p.stem != "README"}
    missing = sorted(n for n in modules | notes if not re.search(rf"\b{n}\b", layout))
    assert not missing, f"README's Layout does not name {missing}"
