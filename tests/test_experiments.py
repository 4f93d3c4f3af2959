"""The learning notebooks' standard run: tuned preset, then changes, then the budget."""

import json
import math
import pathlib

import jax
import pytest
from hypothesis import assume, given, settings, strategies as st

from sdiloco.lab import config as config_lib, model as model_lib
from sdiloco.paper import experiments as ex


TUNED_JSON = pathlib.Path(ex.__file__).parents[1] / "lab" / "tuned.json"


def _tuned_table():
    """The tuned table as the file holds it (read here, not through `config`)."""
    table = json.loads(TUNED_JSON.read_text())
    return {k: v for k, v in table.items() if not k.startswith("_")}


def _get(config, path):
    for part in path.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("name", ["data_parallel", "diloco", "streaming_overlap_fp4"])
@pytest.mark.parametrize("model", ["tiny-xxs", "tiny-xs"])
def test_setup_runs_the_tuned_values_at_the_standard_budget(name, model):
    regime = ex.Regime(20.0, 50)
    config = ex.setup(name, model=model, regime=regime)
    for path, value in _tuned_table()[name][model].items():
        assert _get(config, path) == value, path
    mc = model_lib.preset(model)
    batch = _tuned_table()[name][model]["data.global_batch_size"]
    assert config.steps == math.ceil(20.0 * mc.num_params() / (batch * mc.seq_len))
    if name != "data_parallel":
        assert config.method.sync_every == config.steps // 50
    assert not config.data.validation  # the tables report the held-out split


def test_setup_applies_the_budget_after_the_changes():
    """A change of batch keeps the tokens and the rounds (fewer steps, smaller H)."""
    regime = ex.Regime(20.0, 50)
    base = ex.setup("streaming_overlap_fp4", regime=regime)
    double = ex.setup(
        "streaming_overlap_fp4",
        regime=regime,
        data={"global_batch_size": 2 * base.data.global_batch_size},
        method={"num_replicas": 4, "sync_every": 1000},  # H: the regime's
    )
    assert double.method.num_replicas == 4
    assert abs(2 * double.steps - base.steps) <= 1
    assert double.method.sync_every == double.steps // 50
    fixed = ex.setup(
        "streaming_overlap_fp4",
        regime=ex.Regime(20.0, None),
        method={"sync_every": 7},
    )
    assert fixed.method.sync_every == 7  # rounds=None: H is the caller's


@settings(max_examples=30, deadline=None)
@given(
    model=st.sampled_from(["tiny-xxs", "tiny-xs", "tiny-s"]),
    name=st.sampled_from(["diloco", "streaming_overlap_fp4"]),
    factor=st.sampled_from([1, 2, 4, 10]),
)
def test_scaled_regime_keeps_h_and_multiplies_tokens_and_rounds(model, name, factor):
    regime = ex.Regime(20.0, 50)
    base = ex.setup(name, model=model, regime=regime)
    longer = ex.setup(name, model=model, regime=regime.scaled(factor))
    assert regime.scaled(factor).tokens_per_param == 20.0 * factor
    assert longer.steps // longer.method.sync_every >= 50 * factor
    assert abs(longer.method.sync_every - base.method.sync_every) <= 1
    assert abs(longer.steps - factor * base.steps) <= factor


def test_gap_text_is_the_relative_mean_and_the_t_interval_of_the_differences():
    # differences 0.1, 0.3, 0.2: mean 0.2, sd 0.1, half-width t(2, 0.975) = 4.303
    # x 0.1 / sqrt(3) = 0.2484; relative 0.2 / mean(1, 2, 3) = 10 %
    assert ex.gap_text([1.0, 2.0, 3.0], [1.1, 2.3, 3.2]) == "+10.0 % [-0.048, +0.448]"
    assert ex.gap_text([2.0], [2.05]) == "+2.5 % (one seed)"
    with pytest.raises(ValueError, match="equal, non-empty"):
        ex.gap_text([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="equal, non-empty"):
        ex.gap_text([], [])


def test_finals_are_the_last_evaluation_of_each_seed_in_seed_order():
    config = ex.setup("data_parallel")

    def result(name, seed, losses):
        evals = [
            {"step": i, "eval/global": v, "eval/other": -v}
            for i, v in enumerate(losses)
        ]
        return ex.Result(name, seed, config, evals, [], {})

    # out of seed order, interleaved with another name
    results = [
        result("a", 2, [3.0, 2.2]),
        result("b", 0, [9.0, 8.0]),
        result("a", 0, [3.0, 2.0]),
        result("a", 1, [3.0, 2.1]),
    ]
    assert ex.finals(results, "a") == [2.0, 2.1, 2.2]
    assert ex.finals(results, "a", "eval/other") == [-2.0, -2.1, -2.2]
    assert ex.finals(results, "b") == [8.0]
    with pytest.raises(ValueError, match="no results named 'c'"):
        ex.finals(results, "c")


def _finals_of(losses_by_name_and_seed):
    """`{name: {seed: loss}}` as results in the given order, then `finals` per name."""
    config = ex.setup("data_parallel")
    results = [
        ex.Result(name, seed, config, [{"step": 0, "eval/global": loss}], [], {})
        for name, by_seed in losses_by_name_and_seed.items()
        for seed, loss in by_seed.items()
    ]
    return {name: ex.finals(results, name) for name in losses_by_name_and_seed}


def test_seed_paired_gaps_match_by_seed_id_not_by_position():
    # differences by seed: 0.1, 0.3, 0.2 (the gap_text example above)
    base = {0: 1.0, 1: 2.0, 2: 3.0}
    other = {2: 3.2, 0: 1.1, 1: 2.3}  # recorded out of seed order
    f = _finals_of({"a": base, "b": other})
    expected = ex.paired_gap([1.0, 2.0, 3.0], [1.1, 2.3, 3.2])
    assert ex.paired_gap(f["a"], f["b"]) == expected
    assert ex.gap_text(f["a"], f["b"]) == "+10.0 % [-0.048, +0.448]"
    assert f["b"].seeds == (0, 1, 2) and f["b"] == [1.1, 2.3, 3.2]
    # the same values listed in another seed order pair by seed id, not position
    shuffled = ex.Finals([3.2, 1.1, 2.3], seeds=[2, 0, 1], name="b")
    assert ex.paired_gap(f["a"], shuffled) == expected
    assert ex.gap_text(f["a"], shuffled) == "+10.0 % [-0.048, +0.448]"
    b, o = ex.paired(f["a"], shuffled)
    assert b.tolist() == [1.0, 2.0, 3.0] and o.tolist() == [1.1, 2.3, 3.2]
    backwards = ex.Finals([3.0, 1.0, 2.0], seeds=[2, 0, 1], name="a")
    assert ex.paired_gap(backwards, f["b"])["mean"] == pytest.approx(0.2)
    one = _finals_of({"a": {3: 2.0}, "b": {3: 2.05}})
    assert ex.gap_text(one["a"], one["b"]) == "+2.5 % (one seed)"


def test_a_seed_missing_from_one_side_fails_loudly_naming_it():
    # the same number of seeds, one different: by position they would pair 1 with 2
    f = _finals_of({"a": {0: 1.0, 1: 2.0, 2: 3.0}, "b": {0: 1.1, 2: 3.2, 3: 2.3}})
    for gap in ("paired_gap", "gap_text", "paired"):
        with pytest.raises(ValueError) as error:
            getattr(ex, gap)(f["a"], f["b"])
        message = str(error.value)
        assert "'b' lacks seed(s) [1] that 'a' has" in message
        assert "'a' lacks seed(s) [3] that 'b' has" in message
    # one seed fewer on one side
    f = _finals_of({"dp": {0: 1.0, 1: 2.0, 2: 3.0}, "ours": {0: 1.1, 2: 3.2}})
    for gap in ("paired_gap", "gap_text", "paired"):
        with pytest.raises(ValueError, match=r"'ours' lacks seed\(s\) \[1\] that 'dp'"):
            getattr(ex, gap)(f["dp"], f["ours"])
    with pytest.raises(ValueError, match="a seed repeats"):
        ex.Finals([1.0, 2.0], seeds=[0, 0], name="a")
    # plain lists (paired by how they were built) still pair by position
    with pytest.raises(ValueError, match="equal lengths"):
        ex.paired_gap([1.0, 2.0, 3.0], [1.0, 2.0])


def test_run_one_logs_the_training_time_of_a_recorded_run(tmp_path, monkeypatch):
    """A run read from its record is logged with the record's training time, not
    trained: what `sdiloco.paper` sums into `runtimes.json`."""
    monkeypatch.setattr(ex, "FAST", False)
    monkeypatch.setenv("SDILOCO_RUN_CACHE", str(tmp_path / "runs"))
    monkeypatch.setenv(ex.RUN_LOG, str(tmp_path / "log.jsonl"))
    monkeypatch.delenv("SDILOCO_RETRAIN", raising=False)
    config = ex.setup("data_parallel", model="tiny-xxxs")
    key = ex.record_key(ex.with_seed(config, 3))
    (tmp_path / "runs").mkdir()
    record = {"config": {}, "evals": [], "rows": [], "summary": {"wall_s": 12.5}}
    (tmp_path / "runs" / f"{key}.json").write_text(json.dumps(record))
    for _ in range(2):  # asked twice (two tables of one notebook)
        result = ex.run_one("dp", config, 3)
    assert result.summary == {"wall_s": 12.5}
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    # The record carries no code provenance, so it is read as stale.
    assert [json.loads(x) for x in lines] == [
        {"key": key, "trained": False, "wall_s": 12.5, "stale": True}
    ] * 2
    from sdiloco.paper import figures

    assert figures.run_times(lines) == {
        "runs": 1,
        "trained": 0,
        "train_s": 12.5,
        "trained_now_s": 0.0,
        "stale": 1,
        "keys": [key],  # once, though asked twice
    }


def test_run_times_count_each_run_once_and_sum_their_training():
    from sdiloco.paper import figures

    lines = [
        json.dumps({"key": "a", "trained": False, "wall_s": 100.0}),
        json.dumps({"key": "b", "trained": True, "wall_s": 20.25}),
        json.dumps({"key": "a", "trained": False, "wall_s": 100.0}),
        json.dumps({"key": "c", "trained": False, "wall_s": None, "stale": True}),
    ]
    assert figures.run_times(lines) == {
        "runs": 3,
        "trained": 1,
        "train_s": 120.2,  # every run's recorded training time
        "trained_now_s": 20.2,  # of which spent in this execution
        "stale": 1,
        "keys": ["a", "b", "c"],  # what --verify samples from, each once
    }
    assert figures.run_times([]) == {
        "runs": 0,
        "trained": 0,
        "train_s": 0.0,
        "trained_now_s": 0.0,
        "stale": 0,
        "keys": [],
    }


@pytest.mark.parametrize("name", ["data_parallel", "diloco", "streaming_overlap_fp4"])
def test_standard_regime_scores_every_method_on_one_set_with_a_relative_warmup(name):
    config = ex.setup(name, regime=ex.Regime(20.0, 50))
    assert config.eval_windows is None  # every held-out window, whatever the batch
    fraction = _tuned_table()[name][ex.MODEL].get(
        "inner.warmup_fraction", config_lib.DEFAULT_WARMUP_FRACTION
    )
    assert config.inner.warmup_fraction == fraction
    assert config.inner.warmup(config.steps) == max(1, round(fraction * config.steps))


@pytest.mark.parametrize("name", ["data_parallel", "streaming_overlap_fp4"])
def test_per_batch_regime_rebuilds_the_configs_of_the_old_records(name):
    """The old evaluation (16 of the run's batches) and warmup (a sixth, in steps)."""
    config = ex.setup(
        name,
        regime=ex.Regime(20.0, 50, eval_windows=ex.PerBatch(16), warmup_fraction=1 / 6),
    )
    assert config.eval_windows == 16 * config.data.global_batch_size
    assert config.inner.warmup_fraction is None
    assert config.inner.warmup_steps == round(config.steps / 6)


def test_cli_budget_trains_the_notebooks_config():
    """`--tokens-per-param/--rounds/--seed` give the config `setup` + `with_seed` give."""
    from sdiloco.lab import cli

    for preset in ("data_parallel", "streaming_overlap_fp4"):
        args = cli._parser().parse_args(
            [
                "train",
                "--preset",
                preset,
                "--model",
                "tiny-xs",
                "--tokens-per-param",
                "20",
                "--rounds",
                "50",
                "--seed",
                "3",
            ]
        )
        regime = config_lib.Regime(20.0, 50)
        want = ex.with_seed(ex.setup(preset, model="tiny-xs", regime=regime), 3)
        assert cli._config(args).replace(name="") == want.replace(name="")


@pytest.mark.parametrize("preset", ["data_parallel", "streaming_overlap_fp4"])
def test_the_cli_budget_trains_a_recorded_headline_run(preset):
    """`python -m sdiloco train --model tiny-xs --tokens-per-param 20 --rounds 50
    --seed 0` builds exactly the config of a committed headline record (found by the
    hash of its config), so the CLI and the notebooks train one regime."""
    from sdiloco.lab import cli

    argv = [
        "train",
        "--preset",
        preset,
        "--model",
        "tiny-xs",
        "--tokens-per-param",
        "20",
        "--rounds",
        "50",
        "--seed",
        "0",
    ]
    config = cli._config(cli._parser().parse_args(argv))
    path = ex.records_dir() / f"{ex.record_key(config)}.json"
    assert path.exists(), f"no headline record {path.name} for {preset}"
    record = json.loads(path.read_text())
    assert record["config"]["eval_windows"] is None
    assert record["config"]["inner"]["warmup_fraction"] == config.inner.warmup_fraction


def test_a_run_with_a_callback_is_recorded_with_what_it_collected(
    tmp_path, monkeypatch
):
    """A callback's collection (e.g. Figs. 17-18's cosines) is recorded with the run
    under its own key, and a second call reads it back without training."""
    monkeypatch.setattr(ex, "FAST", False)
    monkeypatch.setenv("SDILOCO_RUN_CACHE", str(tmp_path / "runs"))
    monkeypatch.delenv("SDILOCO_RETRAIN", raising=False)
    regime = ex.Regime(0.2, 2, evals=1, eval_windows=8)
    config = ex.setup("data_parallel", model="tiny-xxxs", regime=regime)
    calls = []

    def counting(run):
        steps: list[int] = []
        calls.append(1)
        return (lambda step, state, metrics: steps.append(step)), lambda: {
            "steps": list(steps)
        }

    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW: `b1 ** count`
        first = ex.run_one("dp", config, 0, callback_factory=counting)
    assert first.extra == {"steps": list(range(1, config.steps + 1))}
    again = ex.run_one("dp", config, 0, callback_factory=counting)
    assert calls == [1]  # read from its record: the factory was not called again
    assert again.extra == first.extra and again.evals == first.evals
    keys = sorted(p.stem for p in (tmp_path / "runs").glob("*.json"))
    assert keys == [f"{ex.record_key(ex.with_seed(config, 0))}-counting"]


def test_describe_and_t_half_width_are_the_textbook_statistics():
    values = [1.0, 2.0, 4.0]
    d = ex.describe(values)
    assert d == {
        "mean": 7 / 3,
        "std": pytest.approx(1.5275252),
        "min": 1.0,
        "max": 4.0,
        "n": 3,
    }
    # t(0.975, 2 degrees of freedom) = 4.303: the half-width of a 95 % interval.
    assert ex.t_half_width(values) == pytest.approx(4.303 * 1.5275252 / math.sqrt(3))
    assert ex.t_half_width([2.5]) == 0.0 and ex.describe([2.5])["std"] == 0.0


@pytest.mark.parametrize(
    "df, printed",  # Student's t at 97.5 %, from a printed table (4 decimals)
    [
        (1, 12.7062),
        (2, 4.3027),
        (9, 2.2622),
        (13, 2.1604),
        (30, 2.0423),
        (31, 2.0395),
        (40, 2.0211),
        (60, 2.0003),
        (120, 1.9799),
        (1000, 1.9623),
    ],
)
def test_t975_matches_the_printed_table(df, printed):
    assert ex.t975(df) == pytest.approx(printed, abs=6e-4)


def test_t_half_width_uses_t_beyond_eight_values():
    values = [float(v) for v in range(15)]  # 14 degrees of freedom: t = 2.145
    expected = 2.1448 * ex.describe(values)["std"] / math.sqrt(15)
    assert ex.t_half_width(values) == pytest.approx(expected, rel=1e-3)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-3, 3), min_size=3, max_size=20),
    st.floats(-2, 2),
    st.integers(0, 2**31 - 1),
)
def test_trend_is_the_least_squares_slope_with_its_t_interval(xs, slope, seed):
    """Against numpy's own fit: `polyfit`'s slope and its covariance (scaled by the
    residuals over n − 2), times t at n − 2 degrees of freedom."""
    import numpy as np

    x = np.asarray(xs)
    assume(np.ptp(x) >= 1e-3)  # a constant x is rejected (test below)
    y = slope * x + np.random.default_rng(seed).normal(0, 0.1, x.size)
    t = ex.trend(x, y)
    coef, cov = np.polyfit(x, y, 1, cov="unscaled")
    residual = y - np.polyval(coef, x)
    se = math.sqrt(cov[0, 0] * (residual @ residual) / (x.size - 2))
    assert t["slope"] == pytest.approx(coef[0], rel=1e-6, abs=1e-9)
    half = ex.t975(x.size - 2) * se
    assert t["high"] - t["slope"] == pytest.approx(half, rel=1e-6, abs=1e-9)
    assert t["slope"] - t["low"] == pytest.approx(half, rel=1e-6, abs=1e-9)


def test_trend_rejects_too_few_points_and_a_constant_x():
    with pytest.raises(ValueError, match=">= 3 points"):
        ex.trend([0.0, 1.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="varying x"):
        ex.trend([2.0, 2.0, 2.0], [0.0, 1.0, 2.0])


@settings(max_examples=30, deadline=None)
@given(
    xs=st.lists(st.floats(-5, 5), min_size=2, max_size=6),
    seeds=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_seed_slopes_fit_each_seed_then_average_with_a_t_interval(xs, seeds, seed):
    """Against numpy: `polyfit` per seed, then the mean of those slopes with the t
    interval of seeds − 1 degrees of freedom; the points' count does not enter."""
    import numpy as np

    x = np.asarray(xs)
    assume(np.ptp(x) >= 1e-3)
    rng = np.random.default_rng(seed)
    ys = rng.normal(0, 1, (seeds, 1)) + rng.normal(0.3, 0.2, (seeds, 1)) * x
    ys = ys + rng.normal(0, 0.05, ys.shape)
    fit = ex.seed_slopes(x, ys)
    per_seed = np.asarray([np.polyfit(x, y, 1)[0] for y in ys])
    assert fit["slope"] == pytest.approx(per_seed.mean(), rel=1e-6, abs=1e-9)
    half = ex.t975(seeds - 1) * per_seed.std(ddof=1) / math.sqrt(seeds)
    assert fit["high"] - fit["slope"] == pytest.approx(half, rel=1e-6, abs=1e-9)
    assert fit["slope"] - fit["low"] == pytest.approx(half, rel=1e-6, abs=1e-9)
    assert fit["n"] == seeds


def test_seed_slopes_rejects_one_seed_and_a_constant_x():
    with pytest.raises(ValueError, match="seeds >= 2"):
        ex.seed_slopes([0.0, 1.0], [[0.0, 1.0]])
    with pytest.raises(ValueError, match="varying x"):
        ex.seed_slopes([2.0, 2.0], [[0.0, 1.0], [1.0, 2.0]])


def test_a_frontier_recipe_that_changes_the_inner_optimizer_keeps_its_tuned_lr():
    from sdiloco.paper import frontier, tuning

    class Chosen(tuning.Search):  # the values a search chose, without training
        def best_values(self, axes):
            return {"inner.lr": 0.012, "method.outer.lr": 0.6}

    c = frontier.tuned_config(
        "E3M0 + Muon",
        object.__new__(Chosen),
        model=ex.MODEL,
        regime=ex.REGIME,
        num_replicas=4,
    )
    assert c.inner.kind == "muon" and c.inner.lr == 0.012
    assert c.method.outer.lr == 0.6 and c.method.num_replicas == 4


def test_the_size_check_carries_the_tuning_over_as_a_multiple():
    """`transferred_config`: at another size the inner lr is the chosen multiple of
    the final method's tuned value there (half of it here), the outer lr as chosen."""
    from sdiloco.lab.config import preset
    from sdiloco.paper import frontier, tuning

    centre = preset("streaming_overlap_fp4", model=ex.MODEL).inner.lr

    class Chosen(tuning.Search):  # the values a search chose, without training
        def best_values(self, axes):
            return {"inner.lr": centre / 2, "method.outer.lr": 0.6}

    there = preset("streaming_overlap_fp4", model="tiny-s").inner.lr
    assert there != centre  # the sizes are tuned apart, so the test can fail
    c = frontier.transferred_config(
        "E4M3", object.__new__(Chosen), model="tiny-s", regime=ex.REGIME
    )
    assert c.model == "tiny-s" and c.inner.lr == pytest.approx(there / 2)
    assert c.method.outer.lr == 0.6 and c.method.num_replicas == 2
    assert c.method.quantizer == "e4m3"


def test_a_frontier_tune_searches_the_axes_it_is_given(monkeypatch):
    """`frontier.tune(swept=...)`: the search runs over those axes alone, from the
    recipe's starting config (default: both of `frontier.axes`)."""
    from sdiloco.paper import frontier, tuning

    searched, done = [], object.__new__(tuning.Search)  # a search, without training

    def search(base, axes, **kwargs):
        searched.append((base, tuple(axes)))
        return done

    monkeypatch.setattr(frontier, "coordinate_search", search)
    inner, outer = frontier.axes(frontier.PAPER, ex.MODEL)
    assert frontier.tune(frontier.PAPER, ex.MODEL, regime=ex.REGIME) is done
    assert (
        frontier.tune(frontier.PAPER, ex.MODEL, regime=ex.REGIME, swept=(outer,))
        is done
    )
    (base, default), (base_again, only_outer) = searched
    assert [(a.field, a.values) for a in default] == [
        (inner.field, inner.values),
        (outer.field, outer.values),
    ]
    assert only_outer == (outer,)
    assert base == base_again and base.data.validation
    assert base.inner.lr == inner.values[1]  # the starting value an unswept axis keeps


def test_fast_runs_are_shared_through_their_folder_and_never_recorded(
    tmp_path, monkeypatch
):
    """FAST mode with `$SDILOCO_FAST_RUNS`: a run trained once is kept there (JSON, no
    `code`: not a record) and another process (here: an emptied memory) reads it
    back without training; the records' folder stays untouched. Unset, nothing is
    written anywhere."""
    monkeypatch.setattr(ex, "FAST", True)
    monkeypatch.setattr(ex, "_FAST_RUNS", {})
    monkeypatch.setenv("SDILOCO_RUN_CACHE", str(tmp_path / "runs"))
    monkeypatch.setenv(ex.FAST_RUNS, str(tmp_path / "fast"))
    regime = ex.Regime(0.2, 2, evals=1, eval_windows=8)
    config = ex.setup("data_parallel", model="tiny-xxxs", regime=regime)
    trained = []
    real = ex.train.run

    def counting(*args, **kwargs):
        trained.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ex.train, "run", counting)
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW: `b1 ** count`
        first = ex.run_one("dp", config, 0)
    key = ex.record_key(ex.with_seed(config, 0))
    kept = json.loads((tmp_path / "fast" / f"{key}.json").read_text())
    assert "code" not in kept and kept["evals"] == first.evals
    assert [p.name for p in (tmp_path / "fast").iterdir()] == [f"{key}.json"]
    monkeypatch.setattr(ex, "_FAST_RUNS", {})  # another process of the session
    again = ex.run_one("dp", config, 0)
    assert trained == [1]
    assert (again.evals, again.rows) == (first.evals, first.rows)
    assert not (tmp_path / "runs").exists()

    monkeypatch.delenv(ex.FAST_RUNS)
    monkeypatch.setattr(ex, "_FAST_RUNS", {})
    with jax.numpy_dtype_promotion("standard"):
        alone = ex.run_one("dp", config, 0)
    assert trained == [1, 1] and alone.evals == first.evals  # trained again, bitwise
    assert [p.name for p in (tmp_path / "fast").iterdir()] == [f"{key}.json"]
    assert not (tmp_path / "runs").exists()
