"""Tests of the shipped corpus, token files and the per-replica grain pipelines."""

import hashlib
import json
import math
import socket

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest

from sdiloco.lab import data
from sdiloco.lab.data import (
    corpus_index,
    load_corpus,
    load_tokens,
    make_eval_iterator,
    make_replica_iterators,
    stack_batches,
    unigram_entropy,
)


def _arange_tokens(num_windows: int, seq_len: int) -> np.ndarray:
    """Tokens 0, 1, 2, …: window i starts with token i·seq_len, so ids are readable."""
    return np.arange(num_windows * seq_len + 1, dtype=np.uint32)


def _window_ids(batch: dict[str, np.ndarray], seq_len: int) -> list[int]:
    return [int(i) for i in batch["inputs"][:, 0] // seq_len]


def _take(iterators, steps: int) -> list[list[dict[str, np.ndarray]]]:
    """`steps` batches from each iterator: result[m][t]."""
    return [[next(it) for _ in range(steps)] for it in iterators]


# Corpus ---------------------------------------------------------------------------


def test_corpus_loads_without_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    data._corpus_bytes.cache_clear()
    every = load_corpus("all")
    index = corpus_index()
    assert every.dtype == np.uint8 and every.ndim == 1
    assert len(every) == index["num_bytes"] > 4_000_000
    assert hashlib.sha256(every.tobytes()).hexdigest() == index["sha256"]


def test_splits_are_whole_plays_and_cover_the_corpus():
    index, every = corpus_index(), load_corpus("all")
    plays = index["plays"]
    assert len(plays) == 38 and len({p["name"] for p in plays}) == 38
    assert plays[0]["start"] == 0 and plays[-1]["end"] == len(every)
    assert all(a["end"] == b["start"] for a, b in zip(plays, plays[1:]))
    held = [p for p in plays if p["heldout"]]
    assert sorted(p["name"] for p in held) == sorted(index["heldout"])
    assert 3 <= len(held) <= 5  # about 10 % of the plays
    for split, chosen in [
        ("heldout", held),
        ("train", [p for p in plays if p not in held]),
    ]:
        expected = np.concatenate([every[p["start"] : p["end"]] for p in chosen])
        np.testing.assert_array_equal(load_corpus(split), expected)
    assert len(load_corpus("train")) + len(load_corpus("heldout")) == len(every)
    assert 0.05 < len(load_corpus("heldout")) / len(every) < 0.15


def test_corpus_is_tiny_shakespeare_style_ascii():
    text = load_corpus("all").tobytes().decode("ascii")
    assert text.startswith("THESEUS:\nNow, fair Hippolyta")
    assert not set("*_#[]\\`") & set(text)  # no Markdown left
    assert "\n\n\n" not in text
    speakers = [line for line in text.split("\n") if line.endswith(":")]
    assert len(speakers) > 20_000


def test_corpus_unigram_entropy():
    h = unigram_entropy(load_corpus("all"))
    assert 3.2 < h < 3.4  # nats per byte, i.e. about 4.8 bits


def test_load_corpus_rejects_unknown_split():
    with pytest.raises(ValueError, match="split"):
        load_corpus("test")


# Entropy --------------------------------------------------------------------------


@hypothesis.given(k=st.integers(1, 50), repeats=st.integers(1, 5))
def test_unigram_entropy_of_uniform_is_log_k(k, repeats):
    tokens = np.tile(np.arange(k, dtype=np.uint16), repeats)
    assert unigram_entropy(tokens) == pytest.approx(math.log(k), abs=1e-12)


@hypothesis.given(
    tokens=hnp.arrays(np.uint8, st.integers(1, 200), elements=st.integers(0, 20)),
    seed=st.integers(0, 2**16),
)
def test_unigram_entropy_ignores_order_and_labels(tokens, seed):
    rng = np.random.default_rng(seed)
    relabel = rng.permutation(256).astype(np.uint8)
    h = unigram_entropy(tokens)
    assert 0.0 <= h <= math.log(len(tokens)) + 1e-12
    assert unigram_entropy(rng.permutation(tokens)) == pytest.approx(h)
    assert unigram_entropy(relabel[tokens]) == pytest.approx(h)


def test_unigram_entropy_rejects_empty():
    with pytest.raises(ValueError):
        unigram_entropy(np.array([], dtype=np.uint8))


# Replica pipelines ----------------------------------------------------------------


@hypothesis.given(
    num_replicas=st.sampled_from([1, 2, 3, 4]),
    per_replica=st.sampled_from([1, 2, 5]),
    num_windows=st.sampled_from([60, 64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_replica_shards_are_disjoint_within_an_epoch(
    num_replicas, per_replica, num_windows, seed
):
    seq_len = 4
    iterators = make_replica_iterators(
        _arange_tokens(num_windows, seq_len),
        num_replicas=num_replicas,
        global_batch_size=num_replicas * per_replica,
        seq_len=seq_len,
        seed=seed,
    )
    global_batch = num_replicas * per_replica
    steps = 2 * num_windows // global_batch  # about two epochs
    batches = _take(iterators, steps)
    # Step t of replica m holds global positions t·B + m + j·M: rebuild the stream.
    stream = np.zeros(steps * global_batch, dtype=np.int64)
    for m in range(num_replicas):
        for t in range(steps):
            ids = _window_ids(batches[m][t], seq_len)
            stream[t * global_batch + m + num_replicas * np.arange(per_replica)] = ids
    for epoch in range(len(stream) // num_windows):
        seen = stream[epoch * num_windows : (epoch + 1) * num_windows]
        assert sorted(seen) == list(range(num_windows))  # each window exactly once
    # Within one epoch the replicas' windows are pairwise disjoint.
    first = num_windows // global_batch
    shards = [
        {i for t in range(first) for i in _window_ids(batches[m][t], seq_len)}
        for m in range(num_replicas)
    ]
    assert sum(len(s) for s in shards) == len(set().union(*shards))


def test_replicas_split_the_single_replica_stream():
    """M replicas see exactly the global batch a single worker would see, split up."""
    tokens, seq_len = _arange_tokens(64, 4), 4
    (single,) = make_replica_iterators(
        tokens, num_replicas=1, global_batch_size=8, seq_len=seq_len, seed=3
    )
    replicas = make_replica_iterators(
        tokens, num_replicas=4, global_batch_size=8, seq_len=seq_len, seed=3
    )
    for _ in range(12):
        stacked = stack_batches([next(it) for it in replicas])
        assert stacked["inputs"].shape == (4, 2, seq_len)
        interleaved = np.swapaxes(stacked["inputs"], 0, 1).reshape(8, seq_len)
        np.testing.assert_array_equal(interleaved, next(single)["inputs"])


def test_batches_are_int32_windows_with_shifted_targets():
    tokens = load_corpus("train")
    iterators = make_replica_iterators(
        tokens, num_replicas=2, global_batch_size=8, seq_len=32, seed=0
    )
    batch = next(iterators[1])
    assert set(batch) == {"inputs", "targets"}
    assert batch["inputs"].shape == batch["targets"].shape == (4, 32)
    assert batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    for row_in, row_out in zip(batch["inputs"], batch["targets"]):
        start = int(np.flatnonzero(_windows_equal(tokens, row_in, 32))[0])
        np.testing.assert_array_equal(row_out, tokens[start * 32 + 1 : start * 32 + 33])


def _windows_equal(tokens, row, seq_len):
    n = (len(tokens) - 1) // seq_len
    windows = tokens[: n * seq_len].reshape(n, seq_len)
    return np.all(windows == row[None, :], axis=1)


def test_deterministic_given_seed():
    tokens = _arange_tokens(100, 8)

    def run(seed):
        its = make_replica_iterators(
            tokens, num_replicas=2, global_batch_size=4, seq_len=8, seed=seed
        )
        return np.stack(
            [stack_batches([next(i) for i in its])["inputs"] for _ in range(30)]
        )

    np.testing.assert_array_equal(run(7), run(7))
    assert not np.array_equal(run(7), run(8))


@pytest.mark.parametrize("skip", [0, 5, 7, 13])
def test_iterator_state_restores_bitwise(skip):
    # 48 windows, 6 per step: an epoch is 8 steps, so 25 steps cross epoch boundaries.
    tokens = _arange_tokens(48, 16)
    kwargs = dict(num_replicas=3, global_batch_size=6, seq_len=16, seed=11)
    iterators = make_replica_iterators(tokens, **kwargs)
    _take(iterators, skip)
    states = [json.loads(json.dumps(it.get_state())) for it in iterators]  # JSON-safe
    expected = _take(iterators, 25)

    fresh = make_replica_iterators(tokens, **kwargs)
    if skip:
        first = [next(it)["inputs"] for it in fresh]
        assert not all(
            np.array_equal(a, b[0]["inputs"]) for a, b in zip(first, expected)
        )
    for it, state in zip(fresh, states):
        it.set_state(state)
    resumed = _take(fresh, 25)
    for m in range(3):
        for a, b in zip(expected[m], resumed[m]):
            np.testing.assert_array_equal(a["inputs"], b["inputs"])
            np.testing.assert_array_equal(a["targets"], b["targets"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_replicas=0), "num_replicas"),
        (dict(num_replicas=3, global_batch_size=8), "divisible"),
        (dict(global_batch_size=0), "global_batch_size"),
        (dict(seq_len=0), "seq_len"),
        (dict(seq_len=801), "seq_len"),  # not even one window of 802 tokens
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(global_batch_size=200), "fewer than"),  # only 100 windows
    ],
)
def test_bad_pipeline_arguments_raise(kwargs, match):
    args = dict(num_replicas=2, global_batch_size=4, seq_len=8, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        make_replica_iterators(_arange_tokens(100, 8), **args)


# Evaluation -----------------------------------------------------------------------


def test_eval_iterator_is_fixed_and_deterministic():
    tokens = load_corpus("heldout")
    a = list(make_eval_iterator(tokens, batch_size=8, seq_len=64, num_batches=5))
    b = list(make_eval_iterator(tokens, batch_size=8, seq_len=64, num_batches=5))
    assert len(a) == 5
    assert all(x["inputs"].shape == (8, 64) for x in a)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    starts = np.concatenate([x["inputs"][:, 0] for x in a])
    assert len(starts) == 40
    # Windows are spread over the whole split (so every held-out play is sampled).
    ids = _arange_tokens(len(tokens) // 64, 64)
    spread = np.concatenate(
        [
            x["inputs"][:, 0] // 64
            for x in make_eval_iterator(ids, batch_size=8, seq_len=64, num_batches=5)
        ]
    )
    assert spread.max() > 0.9 * (len(tokens) // 64) and len(set(spread)) == 40


def test_eval_iterator_all_batches_and_errors():
    tokens = _arange_tokens(20, 4)
    assert len(list(make_eval_iterator(tokens, batch_size=3, seq_len=4))) == 6
    with pytest.raises(ValueError, match="num_batches"):
        make_eval_iterator(tokens, batch_size=3, seq_len=4, num_batches=7)


def test_stack_batches():
    batches = [
        {"inputs": np.full((2, 3), m), "targets": np.zeros((2, 3))} for m in range(4)
    ]
    stacked = stack_batches(batches)
    assert stacked["inputs"].shape == (4, 2, 3)
    np.testing.assert_array_equal(stacked["inputs"][:, 0, 0], np.arange(4))
    with pytest.raises(ValueError):
        stack_batches([])
    with pytest.raises(ValueError):
        stack_batches([{"inputs": np.zeros((1, 1))}, {"targets": np.zeros((1, 1))}])


# User token files -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_load_user_npy_tokens(tmp_path, dtype):
    tokens = np.random.default_rng(0).integers(0, 50_000, 5_000).astype(dtype)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    loaded = load_tokens(path)
    assert isinstance(loaded, np.memmap) and loaded.dtype == dtype
    np.testing.assert_array_equal(loaded, tokens)
    np.testing.assert_array_equal(load_tokens(str(path), dtype), tokens)
    (it,) = make_replica_iterators(
        loaded, num_replicas=1, global_batch_size=4, seq_len=16, seed=0
    )
    batch = next(it)
    assert batch["inputs"].dtype == np.int32 and batch["inputs"].max() < 50_000


def test_load_user_raw_tokens(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    np.testing.assert_array_equal(load_tokens(path, "uint16"), tokens)
    np.testing.assert_array_equal(load_tokens(path, np.uint8)[:2], [0, 0])


def test_bad_token_files_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(tmp_path / "missing.npy")
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(tmp_path)  # a directory
    raw = tmp_path / "tokens.bin"
    np.arange(3, dtype=np.uint8).tofile(raw)
    with pytest.raises(ValueError, match="needs a dtype"):
        load_tokens(raw)
    with pytest.raises(ValueError, match="multiple"):
        load_tokens(raw, np.uint16)
    with pytest.raises(ValueError, match="dtype"):
        load_tokens(raw, np.float32)
    with pytest.raises(ValueError, match="dtype"):
        load_tokens(raw, "not-a-dtype")
    np.save(tmp_path / "matrix.npy", np.zeros((2, 2), np.uint16))
    with pytest.raises(ValueError, match="1-D"):
        load_tokens(tmp_path / "matrix.npy")
    np.save(tmp_path / "floats.npy", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="dtype"):
        load_tokens(tmp_path / "floats.npy")
    np.save(tmp_path / "u16.npy", np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="uint32"):
        load_tokens(tmp_path / "u16.npy", np.uint32)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="readable"):
        load_tokens(tmp_path / "junk.npy")


def test_evaluation_windows_do_not_depend_on_a_batch():
    """The fixed set is the windows the per-batch iterator reads for the same count,
    and `None` is every window, each evaluation token predicted once."""
    from sdiloco.lab.data import evaluation_windows

    tokens = np.arange(2000) % 251
    fixed = evaluation_windows(tokens, seq_len=8, num_windows=40)
    for batch in (4, 8, 20):
        batches = list(
            make_eval_iterator(
                tokens, batch_size=batch, seq_len=8, num_batches=40 // batch
            )
        )
        inputs = np.concatenate([b["inputs"] for b in batches])
        np.testing.assert_array_equal(inputs, fixed["inputs"])
    every = evaluation_windows(tokens, seq_len=8)
    assert every["inputs"].shape == ((2000 - 1) // 8, 8)
    np.testing.assert_array_equal(
        every["targets"].reshape(-1), tokens[1 : 1 + every["targets"].size]
    )
    with pytest.raises(ValueError, match="num_windows=250; only 249 windows"):
        evaluation_windows(tokens, seq_len=8, num_windows=250)
    with pytest.raises(ValueError, match="num_windows=0"):
        evaluation_windows(tokens, seq_len=8, num_windows=0)
