"""Records tied to the code and machine: stamps, the fingerprint, and `--verify`."""

import json

import jax
import pytest

from sdiloco.paper import experiments as ex, figures, provenance, verify


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def _tiny(steps=4, **changes):
    """A Data-Parallel probe-sized run (tiny-xxxs, a few steps)."""
    return provenance._lab_probes()["data_parallel"].replace(steps=steps, **changes)


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setenv("SDILOCO_RUN_CACHE", str(tmp_path))
    monkeypatch.setattr(ex, "FAST", False)  # FAST mode writes no records
    return tmp_path


@pytest.mark.integration
def test_a_record_is_fully_stamped_and_retrains_bitwise(records):
    ex.run_one("probe", _tiny(), seed=3)
    (path,) = records.glob("*.json")
    record = json.loads(path.read_text())
    code = record["code"]
    assert provenance.is_stamped(record) and set(provenance.STAMP) <= set(code)
    assert code["fingerprint"] == provenance.fingerprint()
    assert len(provenance.fingerprint()) == 16
    assert set(code["probes"]) == set(provenance.PROBES)
    assert code["machine"]["jax"] == jax.__version__
    assert {"cpu", "isa", "cpus", "jaxlib", "xla_flags"} <= set(code["machine"])
    assert provenance.is_current(record)
    assert not provenance.is_current({k: v for k, v in record.items() if k != "code"})
    # one probe of another machine type makes the record stale, fingerprint or not
    other = {**code, "probes": {**code["probes"], "compressors": "0" * 16}}
    assert not provenance.is_current({**record, "code": other})
    # a record made before the extra probes (fingerprint only) compares on it
    legacy = {k: code[k] for k in ("version", "commit", "fingerprint")}
    assert provenance.is_current({**record, "code": legacy})
    assert not provenance.is_stamped({**record, "code": legacy})

    index = {"a_notebook": [path.stem]}
    (row,) = verify.verify(records, index, 1, seed=0)
    assert row["equal"] and row["passed"] and row["notebook"] == "a_notebook"
    # a record whose numbers were changed is caught
    record["evals"][-1]["eval/global"] *= 1.5
    path.write_text(json.dumps(record))
    (row,) = verify.verify(records, index, 1, seed=0)
    assert not row["equal"] and not row["passed"]
    assert row["max_rel_gap"] == pytest.approx(1 / 3)


@pytest.mark.integration
def test_restamp_trains_again_only_what_this_machine_cannot_vouch_for(
    records, monkeypatch, tmp_path_factory
):
    log = tmp_path_factory.mktemp("log") / "runs.jsonl"
    monkeypatch.setenv(ex.RUN_LOG, str(log))
    config = _tiny()
    ex.run_one("probe", config, seed=1)
    (path,) = records.glob("*.json")
    record = json.loads(path.read_text())
    assert "replaced" not in record  # trained afresh
    monkeypatch.setenv("SDILOCO_RETRAIN", "unstamped")
    assert not ex.retrain(record) and ex.retrain(None)
    log.write_text("")
    ex.run_one("probe", config, seed=1)  # current and stamped: read, not trained
    assert [json.loads(x)["trained"] for x in log.read_text().splitlines()] == [False]

    # made elsewhere (another fingerprint, no machine): trained again and replaced
    legacy = {"version": "0", "commit": "abc", "fingerprint": "f" * 16}
    moved = [{**e, "eval/global": e["eval/global"] + 0.5} for e in record["evals"]]
    path.write_text(json.dumps({**record, "evals": moved, "code": legacy}))
    assert ex.retrain(json.loads(path.read_text()))
    log.write_text("")
    again = ex.run_one("probe", config, seed=1)
    assert [json.loads(x)["trained"] for x in log.read_text().splitlines()] == [True]
    restamped = json.loads(path.read_text())
    assert provenance.is_stamped(restamped) and provenance.is_current(restamped)
    assert restamped["evals"] == record["evals"]
    assert again.final() == record["evals"][-1]["eval/global"]
    assert restamped["replaced"] == {
        "fingerprint": "f" * 16,
        "cpu": None,
        "final_eval": moved[-1]["eval/global"],
        "bitwise": False,
    }

    # this numerics, stamped before records carried their machine: re-stamped, and it
    # comes back bitwise
    current = {**legacy, "fingerprint": provenance.fingerprint()}
    path.write_text(json.dumps({**record, "code": current}))
    ex.run_one("probe", config, seed=1)
    restamped = json.loads(path.read_text())
    assert provenance.is_stamped(restamped) and restamped["replaced"]["bitwise"]


@pytest.mark.integration
def test_restamp_shards_split_the_records_and_each_is_trained_once(
    records, monkeypatch, tmp_path_factory, capsys
):
    # Three records made elsewhere: two Data-Parallel runs (the cheaper) and one
    # Streaming run with the cosine callback, all read by one notebook.
    out = tmp_path_factory.mktemp("figures")
    streaming = provenance._lab_probes()["streaming_fp4"]
    made = [
        ex.run_one("dp", _tiny(), seed=1),
        ex.run_one("dp", _tiny(), seed=2),
        ex.run_one("s", streaming, seed=1, callback_factory=ex.cosine_callback),
    ]
    keys = sorted(p.stem for p in records.glob("*.json"))
    assert len(keys) == 3 and sum(k.endswith("-cosine_callback") for k in keys) == 1
    legacy = {"version": "0", "commit": "abc", "fingerprint": "f" * 16}
    for key in keys:
        path = records / f"{key}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "code": legacy}))
    verify.index_path(out).write_text(json.dumps({"nb": keys}))
    monkeypatch.setenv("SDILOCO_RETRAIN", "unstamped")
    paths = [out / "nb.py"]  # only the stem is read

    def current():
        return {
            k: provenance.is_current(json.loads((records / f"{k}.json").read_text()))
            for k in keys
        }

    cheapest_first = sorted(keys, key=lambda k: (k.endswith("-cosine_callback"), k))
    assert figures._restamp_shard(paths, (2, 2), out) == 0
    assert current() == {k: k == cheapest_first[1] for k in keys}
    assert figures._restamp_shard(paths, (1, 2), out) == 0
    assert all(current().values())
    for result in made:  # the same runs again, callback's collection included
        key = ex.record_key(result.config)
        key += "-cosine_callback" if result.extra else ""
        again = json.loads((records / f"{key}.json").read_text())
        assert again["evals"] == result.evals and again["replaced"]["bitwise"]
        assert again.get("extra", {}) == json.loads(json.dumps(result.extra))
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0]
        == "shard 2/2: 1 of its 1 records to re-stamp (3 read by 1 notebooks, 0 missing)"
    )
    assert lines[1].startswith(f"1/1 {cheapest_first[1]}: ") and "(bitwise)" in lines[1]
    assert lines[2].startswith("shard 1/2: 2 of its 2 records")
    assert figures._restamp_shard(paths, (1, 2), out) == 0  # nothing left
    assert capsys.readouterr().out.startswith("shard 1/2: 0 of its 2 records")


@pytest.mark.parametrize("shard", ["3/2", "0/2", "1-2", "x/2"])
def test_a_shard_that_cannot_be_is_one_line(shard, capsys):
    assert figures.main(["fig08", "--restamp", f"--shard={shard}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --shard={shard}; allowed: I/N, 1 <= I <= N (e.g. 1/2).\n"
    assert figures.main(["fig08", "--shard=1/2"]) == 2  # without --restamp
    assert "with --restamp only" in capsys.readouterr().err


def test_a_record_whose_config_is_not_its_name_is_not_trained_again(
    records, monkeypatch
):
    monkeypatch.setenv("SDILOCO_RETRAIN", "unstamped")
    key = _fake_record(records, _tiny(), {"fingerprint": "f" * 16})
    (records / f"{key}.json").rename(records / "0123456789abcdef0123.json")
    with pytest.raises(ValueError, match="hashes to"):
        ex.restamp_record("0123456789abcdef0123")
    with pytest.raises(ValueError, match="no "):
        ex.restamp_record("missing")


def test_compare_fails_on_a_different_number_of_evaluations():
    a = [{"step": 2, "eval/global": 3.0}, {"step": 4, "eval/global": 2.0}]
    assert verify.compare(a, a) == {"equal": True, "max_rel_gap": 0.0, "why": ""}
    # a prefix agrees bitwise, yet the lists are not the same run
    short = verify.compare(a[:1], a)
    assert not short["equal"] and "1 evaluations retrained vs 2" in short["why"]
    assert not verify.compare(a, a[:1])["equal"]
    moved = verify.compare([a[0], {"step": 4, "eval/global": 2.5}], a)
    assert not moved["equal"] and moved["max_rel_gap"] == pytest.approx(0.25)


def _fake_record(records, config, fingerprint):
    d = {"config": json.loads(config.to_json()), "evals": [], "code": fingerprint}
    key = ex.record_key(config)
    (records / f"{key}.json").write_text(json.dumps(d))
    return key


def test_sample_takes_a_headline_record_and_rotates_with_the_seed(records, monkeypatch):
    mine = {"fingerprint": "a" * 16, "probes": {"p": "b" * 16}}
    monkeypatch.setattr(provenance, "_measure", lambda: ("a" * 16, {"p": "b" * 16}))
    index, headline = {}, set()
    for n in range(6):  # six notebooks of five cheap records each
        index[f"nb{n}"] = [
            _fake_record(records, _tiny(steps=4 + 2 * i, seed=10 * n + i), mine)
            for i in range(5)
        ]
    for s in range(2):  # two current headline records, one stale one
        c = ex.setup("streaming_overlap_fp4", regime=ex.REGIME).replace(seed=s)
        headline.add(_fake_record(records, c, mine))
    stale = {"fingerprint": "c" * 16}
    c = ex.setup("data_parallel", regime=ex.REGIME)
    index["headline"] = sorted(headline) + [_fake_record(records, c, stale)]

    samples = [verify.sample(records, index, 4, seed) for seed in range(8)]
    for chosen in samples:
        assert len(chosen) == 4
        assert chosen[0][1] in headline  # a current headline record, first
        notebooks = [nb for nb, *_ in chosen[1:]]
        assert len(set(notebooks)) == 3  # one per notebook
        assert all(key in index[nb] for nb, key, *_ in chosen[1:])
    assert len({tuple(k for _, k, *_ in chosen) for chosen in samples}) > 1
    # across seeds, the dearest records are drawn too (not only the cheapest four)
    steps = {config.steps for chosen in samples for _, _, config, _ in chosen[1:]}
    assert 12 in steps
    # nothing current: nothing sampled (--verify re-trains a headline cell)
    monkeypatch.setattr(provenance, "_measure", lambda: ("d" * 16, {}))
    assert verify.sample(records, index, 4, 0) == []


def test_prefix_steps_fit_the_budget_in_whole_logging_periods():
    c = _tiny(steps=40, log_every=3)
    assert verify.prefix_steps(c, params=10, budget=400) == 40  # the whole run fits
    assert verify.prefix_steps(c, params=10, budget=100) == 9  # 3 periods of 3
    assert verify.prefix_steps(c, params=10, budget=5) == 3  # at least one period
    headline = ex.setup("streaming_overlap_fp4", regime=ex.REGIME)
    params = verify._params(headline)
    assert verify.prefix_steps(headline, params) == headline.steps  # within BUDGET
    tiny_s = ex.setup("streaming_overlap_fp4", regime=ex.REGIME, model="tiny-s")
    checked = verify.prefix_steps(tiny_s, verify._params(tiny_s))
    assert 0 < checked < tiny_s.steps and checked % tiny_s.log_every == 0


@pytest.mark.integration
def test_a_dear_record_is_checked_on_its_first_steps_within_the_budget(records):
    # A record dearer than the budget: the prefix that fits is retrained and every
    # metric row and evaluation recorded up to there compared bitwise.
    config = _tiny(steps=12, eval_every=4, log_every=2)
    ex.run_one("probe", config, seed=2)
    (path,) = records.glob("*.json")
    record = json.loads(path.read_text())
    index = {"nb": [path.stem]}
    budget = 7 * verify._params(ex.with_seed(config, 2))  # 3 periods: 6 steps
    (row,) = verify.verify(records, index, 1, seed=0, budget=budget)
    assert row["passed"] and row["checked_steps"] == 6 and row["steps"] == 12
    changed = json.loads(json.dumps(record))
    changed["rows"][1]["loss/train"] += 1e-7  # step 4: inside the prefix
    path.write_text(json.dumps(changed))
    (row,) = verify.verify(records, index, 1, seed=0, budget=budget)
    assert not row["passed"] and row["why"] == "training metrics differ from step 4"
    changed = json.loads(json.dumps(record))
    changed["rows"][-1]["loss/train"] += 1e-7  # step 12: beyond it, not checked
    path.write_text(json.dumps(changed))
    (row,) = verify.verify(records, index, 1, seed=0, budget=budget)
    assert row["passed"]


@pytest.mark.integration
def test_verify_cell_checks_the_retrained_gap_against_the_published_interval(
    records,
):
    cell = {"base": _tiny(), "method": _tiny(inner={"lr": 2e-3})}
    for config in cell.values():
        for s in (0, 1):
            ex.run_one("cell", config, s)
    result = verify.verify_cell(cell, seeds=(0, 1), records=records)
    assert result["passed"]  # same machine: the same gap, inside its interval
    assert result["retrained"]["mean"] == pytest.approx(result["published"]["mean"])
    # a published gap far from what the code gives is caught
    for s in (0, 1):
        path = records / f"{ex.record_key(ex.with_seed(cell['method'], s))}.json"
        d = json.loads(path.read_text())
        d["evals"][-1]["eval/global"] += 2.0 + 0.01 * s
        path.write_text(json.dumps(d))
    assert not verify.verify_cell(cell, seeds=(0, 1), records=records)["passed"]
    with pytest.raises(ValueError, match="no record"):
        verify.verify_cell(cell, seeds=(0, 5), records=records)


def test_verify_cli_rejects_k_below_one_and_a_missing_index(tmp_path, capsys):
    from sdiloco.paper import figures

    assert figures.main(["--verify", "0"]) == 2
    assert "--verify=0; must be >= 1" in capsys.readouterr().err
    assert figures.main(["--verify", "1", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "records.json" in err and "render the notebooks first" in err


def test_verify_says_when_it_checked_fewer_records_than_asked(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "records.json").write_text("{}")
    monkeypatch.setattr(provenance, "_measure", lambda: ("a" * 16, {}))
    row = {"notebook": "nb", "key": "k", "model": "tiny-s", "steps": 4000}
    row |= {"checked_steps": 400, "equal": True, "max_rel_gap": 0.0, "why": ""}
    row["passed"] = True
    monkeypatch.setattr(verify, "verify", lambda records, index, k, seed: [row])
    assert figures.main(["--verify", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == (
        "nb: k (tiny-s, 4000 steps, the first 400 within the budget): bitwise equal "
        "(largest relative gap 0)"
    )
    assert out[-1] == (
        "checked 1 of the 3 records asked for: no more notebooks have records "
        "current on this machine"
    )
    assert figures.main(["--verify", "1", "--out", str(tmp_path)]) == 0
    assert "records asked for" not in capsys.readouterr().out
