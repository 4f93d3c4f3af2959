"""The suite's own scheduling (`conftest.py`): the heavy tiers first, the
multi-process files as one unit of work, a multi-process test outside them refused at
collection, and a test marked `two_programs` run in a child process compiled
without the emitter flag."""

import os
import types

import conftest
import pytest


def _item(nodeid, *markers):
    return types.SimpleNamespace(nodeid=nodeid, keywords={*markers, nodeid})


def test_the_heavy_tiers_come_first_in_their_collected_order():
    items = [
        _item("tests/test_a.py::unit"),
        _item("tests/test_train.py::run", "integration"),
        _item("tests/test_notebooks.py::sweep", "notebook"),
        _item("tests/test_elastic.py::sigkill", "multiprocess"),
        _item("tests/test_b.py::unit"),
        _item("tests/test_notebooks.py::chaos", "notebook"),
    ]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "tests/test_notebooks.py::sweep",
        "tests/test_notebooks.py::chaos",
        "tests/test_elastic.py::sigkill",
        "tests/test_train.py::run",
        "tests/test_a.py::unit",
        "tests/test_b.py::unit",
    ]


def test_the_multiprocess_files_are_one_unit_and_every_other_test_its_own():
    for path in conftest.MULTIPROCESS_FILES:
        assert conftest.scope(f"{path}::test_x[1]") == "multiprocess"
    other = "tests/test_train.py::test_x[tests/test_elastic.py]"
    assert conftest.scope(other) == other


def test_a_multiprocess_test_in_another_file_is_refused_at_collection():
    items = [_item("tests/test_new.py::job", "multiprocess")]
    with pytest.raises(pytest.UsageError, match=r"\['tests/test_new.py'\]"):
        conftest.pytest_collection_modifyitems(None, items)


@pytest.mark.two_programs
def test_a_two_programs_test_runs_in_a_child_without_the_emitter_flag():
    flags = os.environ["XLA_FLAGS"].split()
    assert os.environ.get(conftest.CHILD) == "1"
    assert conftest.EMITTER_FLAG not in flags
    assert conftest.LEVEL_FLAG in flags


def test_fails_when_asked():
    """Passes, unless the test below asks it to fail (in a child process)."""
    assert not os.environ.get("SDILOCO_CONFTEST_FAIL")


def test_a_failure_in_the_child_fails_the_test(monkeypatch, pytestconfig):
    monkeypatch.setenv("SDILOCO_CONFTEST_FAIL", "1")
    item = types.SimpleNamespace(
        keywords={"two_programs"},
        nodeid="tests/test_conftest.py::test_fails_when_asked",
        config=pytestconfig,
    )
    with pytest.raises(pytest.fail.Exception, match="(?s)child process.*1 failed"):
        conftest.pytest_pyfunc_call(item)
