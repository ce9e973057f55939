"""Timing candidates: interleaved rounds, a warm-up, the median."""
from numba_sc.core import measure


def test_size_class():
    assert measure.size_class(1) == 0 and measure.size_class(0) == 0
    assert measure.size_class(1000) == measure.size_class(1100) == 10
    assert measure.size_class(1 << 17) == 17


def test_choice_defaults():
    c = measure.Choice("gmas", "rule")
    assert c.timings == {} and measure.Choice("x", "rule").timings is not c.timings


def test_measure_warms_interleaves_and_takes_the_median():
    order = []
    candidates = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    fake = {"a": iter([5.0, 1.0, 1.0] * 3), "b": iter([2.0, 2.0, 9.0] * 3)}

    def timer(fn):
        fn()
        return next(fake[order[-1]])

    got = measure.measure(candidates, timer, rounds=3, block=3)
    assert got == {"a": 1.0, "b": 2.0}
    assert order[:2] == ["a", "b"]  # every candidate warmed first
    # round 0 runs a then b, round 1 b then a (each: one untimed call, then 3 timed)
    assert order[2:10] == ["a"] * 4 + ["b"] * 4 and order[10:18] == ["b"] * 4 + ["a"] * 4
