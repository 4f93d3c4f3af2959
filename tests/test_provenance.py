"""Records tied to the code: a numerics fingerprint, and retraining a record."""

import json

import jax
import pytest

from sdiloco.paper import experiments as ex, provenance


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.integration
def test_a_record_carries_the_fingerprint_and_retrains_bitwise(tmp_path, monkeypatch):
    monkeypatch.setenv("SDILOCO_RUN_CACHE", str(tmp_path))
    monkeypatch.setattr(ex, "FAST", False)  # FAST mode writes no records
    config = provenance._probes()[1]  # a 4-step Data-Parallel run of tiny-xxxs
    ex.run_one("probe", config, seed=3)
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["code"]["fingerprint"] == provenance.fingerprint()
    assert len(provenance.fingerprint()) == 16
    assert provenance.is_current(record)
    assert not provenance.is_current({k: v for k, v in record.items() if k != "code"})
    (row,) = provenance.verify(tmp_path, 1)
    assert row["same_fingerprint"] and row["equal"] and row["passed"]
    # a record whose numbers were changed is caught
    record["evals"][-1]["eval/global"] *= 1.5
    path.write_text(json.dumps(record))
    (row,) = provenance.verify(tmp_path, 1)
    assert not row["equal"] and not row["passed"]
    assert row["max_rel_gap"] == pytest.approx(1 / 3)
