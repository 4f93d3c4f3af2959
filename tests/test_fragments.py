"""Fragments: partitions by layer, labels and masks; exactness and validation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import sdiloco
from sdiloco.fragments import check_matches, parameter_leaves


def _params(layers=6, extra=True):
    p = {"blocks": {"w": jnp.zeros((layers, 2, 3)), "b": jnp.zeros((layers, 3))}}
    if extra:
        p["embed"] = jnp.zeros((5, 2))
        p["norm"] = jnp.zeros(2)
    return p


def _element_labels(frags, params):
    """The fragment of every element, per leaf (NumPy, for checking)."""
    out = []
    for lab, x in zip(frags.labels, parameter_leaves(params)):
        out.append(
            np.broadcast_to(
                lab.reshape(lab.shape + (1,) * (x.ndim - lab.ndim)), x.shape
            )
        )
    return out


@given(
    layers=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 24]),
    k=st.sampled_from([1, 2, 3, 4, 6]),
    pattern=st.sampled_from(["strided", "sequential"]),
    extra=st.booleans(),
)
def test_by_layer_partitions_exactly(layers, k, pattern, extra):
    params = _params(layers, extra)
    if layers % k:
        with pytest.raises(ValueError, match="layers_per_fragment"):
            sdiloco.fragments_by_layer(
                params,
                blocks=lambda p: p["blocks"],
                layers_per_fragment=k,
                pattern=pattern,
            )
        return
    frags = sdiloco.fragments_by_layer(
        params, blocks=lambda p: p["blocks"], layers_per_fragment=k, pattern=pattern
    )
    num_block = layers // k
    assert frags.num_fragments == num_block + int(extra)
    # Every element has exactly one label in [0, P), and every fragment is non-empty.
    labels = np.concatenate([x.reshape(-1) for x in _element_labels(frags, params)])
    assert labels.min() == 0 and labels.max() == frags.num_fragments - 1
    sizes = frags.sizes()
    assert sizes.sum() == sum(x.size for x in jax.tree.leaves(params))
    assert all(s > 0 for s in sizes)
    # Each block fragment holds exactly k layers; the paper's patterns.
    block_labels = frags.labels[jax.tree.leaves(params).index(params["blocks"]["b"])]
    first = int(extra)
    for layer in range(layers):
        expected = layer % num_block if pattern == "strided" else layer // k
        assert block_labels[layer] == first + expected
    # Masks select exactly the elements of the chosen fragments.
    for p in range(frags.num_fragments):
        sel = jnp.arange(frags.num_fragments) == p
        for m, lab, x in zip(
            frags.mask(sel), _element_labels(frags, params), parameter_leaves(params)
        ):
            np.testing.assert_array_equal(
                np.broadcast_to(np.asarray(m), x.shape), lab == p
            )


def test_strided_example_24_layers():
    # docs/paper.md §1.4: with 24 layers and 3 layers per fragment, fragment 1 = layers
    # 1, 9, 17 (1-indexed), i.e. 0-based blocks 0, 8, 16; the non-block parameters are fragment 0.
    frags = sdiloco.fragments_by_layer(_params(24), blocks=lambda p: p["blocks"])
    block = frags.labels[0]
    assert frags.num_fragments == 9
    assert np.flatnonzero(block == 1).tolist() == [0, 8, 16]
    seq = sdiloco.fragments_by_layer(
        _params(24), blocks=lambda p: p["blocks"], pattern="sequential"
    )
    assert np.flatnonzero(seq.labels[0] == 1).tolist() == [0, 1, 2]


def test_equinox_module_and_batched_mask():
    class Model(eqx.Module):
        embed: jax.Array
        blocks: jax.Array
        act: object = jax.nn.relu
        steps: jax.Array = eqx.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    model = Model(jnp.zeros((4, 2)), jnp.zeros((6, 2, 2)))
    frags = sdiloco.fragments_by_layer(
        model, blocks=lambda m: m.blocks, layers_per_fragment=2
    )
    assert frags.num_fragments == 4 and len(frags.labels) == 2
    sel = jnp.array([[True, False, False, True], [False, True, True, False]])
    masks = frags.mask(sel)
    assert masks[0].shape == (2, 1, 1) and masks[1].shape == (2, 6, 1, 1)
    check_matches(frags, model)
    with pytest.raises(ValueError, match="shapes"):
        check_matches(frags, Model(jnp.zeros((4, 3)), jnp.zeros((6, 2, 2))))


def test_from_labels_and_masks():
    params = {"a": jnp.zeros(3), "b": jnp.zeros((4, 2)), "n": jnp.zeros((), jnp.int32)}
    frags = sdiloco.fragments_from_labels(params, {"a": 2, "b": [0, 1, 1, 0], "n": 0})
    assert frags.num_fragments == 3
    assert frags.sizes().tolist() == [4, 4, 3]
    masks = [
        {"a": False, "b": [True, False, False, True], "n": False},
        {"a": False, "b": [False, True, True, False], "n": False},
        {"a": True, "b": False, "n": False},
    ]
    frags2 = sdiloco.fragments_from_masks(params, masks)
    assert [x.tolist() for x in frags2.labels] == [x.tolist() for x in frags.labels]


def test_bad_fragments():
    params = {"a": jnp.zeros(3), "b": jnp.zeros((4, 2))}
    with pytest.raises(ValueError, match="gap"):
        sdiloco.fragments_from_labels(params, {"a": 0, "b": 2})
    with pytest.raises(ValueError, match=">= 0"):
        sdiloco.fragments_from_labels(params, {"a": -1, "b": 0})
    with pytest.raises(ValueError, match="shape"):
        sdiloco.fragments_from_labels(params, {"a": 0, "b": [0, 1]})
    with pytest.raises(ValueError, match="structure"):
        sdiloco.fragments_from_labels(params, {"a": 0})
    with pytest.raises(ValueError, match="overlap"):
        sdiloco.fragments_from_masks(
            params, [{"a": True, "b": True}, {"a": True, "b": False}]
        )
    with pytest.raises(ValueError, match="gap"):
        sdiloco.fragments_from_masks(
            params, [{"a": True, "b": [True, False, True, True]}]
        )
    with pytest.raises(ValueError, match="pattern"):
        sdiloco.fragments_by_layer(
            _params(), blocks=lambda p: p["blocks"], pattern="random"
        )
    with pytest.raises(ValueError, match="leading layer axis"):
        sdiloco.fragments_by_layer(
            {"blocks": {"a": jnp.zeros((3, 2)), "b": jnp.zeros((4, 2))}},
            blocks=lambda p: p["blocks"],
        )
    with pytest.raises(ValueError, match="layers_per_fragment"):
        sdiloco.fragments_by_layer(
            _params(6), blocks=lambda p: p["blocks"], layers_per_fragment=4
        )


@given(
    depth=st.sampled_from([1, 2, 3, 5]),
    k=st.sampled_from([1, 2, 3]),
    pattern=st.sampled_from(["strided", "sequential"]),
    head=st.booleans(),
)
def test_by_layer_over_a_list_of_layers_labels_each_layer_as_stacked(
    depth, k, pattern, head
):
    # An Equinox model whose layers are a list (eqx.nn.MLP): layer i gets the
    # fragment block i of a stacked model would get, the rest fragment 0.
    layers = depth + 1
    mlp = eqx.nn.MLP(3, 2, 4, depth=depth, key=jax.random.key(depth))
    model = {"mlp": mlp, **({"head": jnp.zeros(2)} if head else {})}
    if layers % k:
        with pytest.raises(ValueError, match="does not divide"):
            sdiloco.fragments_by_layer(
                model, blocks=lambda m: m["mlp"].layers, layers_per_fragment=k
            )
        return
    frags = sdiloco.fragments_by_layer(
        model, blocks=lambda m: m["mlp"].layers, layers_per_fragment=k, pattern=pattern
    )
    stacked = sdiloco.fragments_by_layer(
        {"blocks": jnp.zeros((layers, 1)), **({"head": jnp.zeros(2)} if head else {})},
        blocks=lambda p: p["blocks"],
        layers_per_fragment=k,
        pattern=pattern,
    )
    want = stacked.labels[0].tolist()  # the stacked model's label of each layer
    paths = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    for (path, _), lab in zip(paths, frags.labels):
        names = jax.tree_util.keystr(path)
        if names.startswith("['mlp']"):
            assert int(lab) == want[int(names.split(".layers[")[1].split("]")[0])]
        else:
            assert int(lab) == 0
    assert frags.num_fragments == stacked.num_fragments


def test_from_path_labels_by_a_function_of_the_key_path():
    mlp = eqx.nn.MLP(3, 2, 4, depth=2, key=jax.random.key(0))
    seen = []

    def label(path, leaf):
        seen.append(jax.tree_util.keystr(path))
        return 0 if path[1].idx == 0 else 1

    frags = sdiloco.fragments_from_path(mlp, label)
    assert seen == [f".layers[{i}].{n}" for i in range(3) for n in ("weight", "bias")]
    assert [int(x) for x in frags.labels] == [0, 0, 1, 1, 1, 1]
    rows = sdiloco.fragments_from_path(  # one label per row of a leaf
        {"w": jnp.zeros((4, 2))}, lambda path, leaf: np.array([0, 1, 1, 0])
    )
    assert rows.labels[0].tolist() == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="gap"):
        sdiloco.fragments_from_path(mlp, lambda path, leaf: 2 * path[1].idx)


def test_labels_of_the_wrong_structure_point_to_the_helpers():
    mlp = eqx.nn.MLP(3, 2, 4, depth=2, key=jax.random.key(0))
    with pytest.raises(ValueError) as e:
        sdiloco.fragments_from_labels(mlp, [0, 1, 1])
    message = str(e.value)
    assert "labels (a list)" in message and "\n" not in message
    assert "fragments_by_layer" in message and "fragments_from_path" in message
    assert len(message) < 400  # not a PyTreeDef dump
