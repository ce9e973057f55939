"""One object for what the library remembers: registered caches, switches, choices."""
import pytest

from numba_sc.core import state


def test_cached_memoizes_and_clear_caches_forgets():
    calls = []

    @state.cached
    def square(x):
        calls.append(x)
        return x * x

    assert square(3) == 9 and square(3) == 9 and calls == [3]
    state.clear_caches()
    assert square(3) == 9 and calls == [3, 3]


def test_cached_with_maxsize():
    @state.cached(maxsize=2)
    def ident(x):
        return x

    for x in range(5):
        ident(x)
    assert ident.cache_info().currsize == 2


def test_remember_registers_a_dict_and_refuses_the_unclearable():
    layouts = state.remember({"k": 1})
    assert any(c is layouts for c in state.STATE.caches)
    state.clear_caches()
    assert layouts == {}
    with pytest.raises(TypeError, match="cannot clear a tuple"):
        state.remember(())


def test_switch_reads_the_environment_once_until_a_reset(monkeypatch):
    monkeypatch.setenv("NUMBA_SC_TENSOR_CORES", "0")
    state.clear_caches()
    assert state.STATE.switch("tensor_cores") is False
    monkeypatch.setenv("NUMBA_SC_TENSOR_CORES", "1")
    assert state.STATE.switch("tensor_cores") is False  # read once
    state.clear_caches()
    assert state.STATE.switch("tensor_cores") is True
    monkeypatch.delenv("NUMBA_SC_TENSOR_CORES")
    state.clear_caches()


def test_clear_forgets_measured_choices():
    state.STATE.choices["dataflow"][("k", 1)] = "gmas"
    state.clear_caches()
    assert state.STATE.choices == {"dataflow": {}, "map_method": {}, "tile": {}}
