"""The recorder of data races (numba_sc/tools/exercises/races.py): it finds the race the
simulator hides, on every run, and nothing where the accesses are ordered or atomic; it
says who wrote what; it leaves the simulator as it found it."""
import numpy as np
import pytest
from numba import cuda, int64

from numba_sc.core import fast_launch
from numba_sc.tools.exercises import races


@pytest.mark.parametrize("path, attribute", races.SIMULATOR_INTERNALS,
                         ids=[f"{p.rsplit('.', 1)[-1]}.{a}" for p, a in races.SIMULATOR_INTERNALS])
def test_the_simulator_still_has_what_the_recorder_uses(path, attribute):
    assert fast_launch.has_private(path, attribute), (
        f"numba-cuda {fast_launch.version('numba-cuda')} no longer has {path}.{attribute}: update "
        "numba_sc/tools/exercises/races.py")


@cuda.jit
def max_without_atomic(values, group, out):
    t = cuda.grid(1)
    if t < values.shape[0]:
        if values[t] > out[group[t]]:  # read, compare, write: three steps another thread can come between
            out[group[t]] = values[t]


@cuda.jit
def max_with_atomic(values, group, out):
    t = cuda.grid(1)
    if t < values.shape[0]:
        cuda.atomic.max(out, group[t], values[t])


@cuda.jit
def atomic_then_plain_read(values, group, out, seen):
    t = cuda.grid(1)
    if t < values.shape[0]:
        cuda.atomic.add(out, group[t], values[t])
        seen[t] = out[group[t]]  # a plain load of what other threads update atomically


@cuda.jit
def own_element(values, out):
    t = cuda.grid(1)
    if t < values.shape[0]:
        out[t] = out[t] + values[t]  # read-modify-write of its own element only
        row = out[t:t + 1]  # a view: its element is out[t]
        row[0] = row[0] * 2.0


@cuda.jit
def reverse_in_block(values, out, barrier):
    shared = cuda.shared.array(32, int64)
    t = cuda.threadIdx.x
    shared[t] = values[cuda.grid(1)]
    if barrier:
        cuda.syncthreads()
    out[cuda.grid(1)] = shared[31 - t]


@cuda.jit
def same_cell_from_two_blocks(out):
    cuda.syncthreads()  # a barrier orders the threads of one block only
    if cuda.threadIdx.x == 0:
        out[0] = cuda.blockIdx.x


def groups(n=64, m=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=n), rng.integers(0, m, n), np.full(m, -np.inf)


def test_a_plain_maximum_races_and_the_record_says_where_and_who():
    values, group, out = groups()
    rec = races.record(max_without_atomic, 2, 32, {"values": values, "group": group, "out": out}, watch=("out",))
    found = rec.races()
    assert {r.element for r in found} == {(g,) for g in set(group.tolist()) if (group == g).sum() > 1}
    race = found[0]
    assert race.array == "out" and "store" in race.first_did
    text = rec.explain(race)
    assert text.startswith(f"a data race on out[{race.element[0]}]: thread ")
    assert "plain accesses" in text and "Nothing orders these two threads" in text
    # the same elements race on every run, whatever the threads' timing
    for _ in range(2):
        values2, group2, out2 = groups()
        again = races.record(max_without_atomic, 2, 32, {"values": values2, "group": group2, "out": out2},
                             watch=("out",))
        assert [r.element for r in again.races()] == [r.element for r in found]


def test_atomics_do_not_race_and_are_recorded_as_atomics():
    values, group, out = groups()
    rec = races.record(max_with_atomic, 2, 32, {"values": values, "group": group, "out": out}, watch=("out",))
    assert rec.races() == []
    assert np.array_equal(out, [values[group == g].max() for g in range(len(out))])
    assert len(rec.atomics("out")) == len(values)  # one access per atomic, not a load and a store
    assert {a.kind for a in rec.atomics("out")} == {"atomic max"}


def test_a_plain_load_of_an_atomically_updated_element_races():
    values, group, out = groups()
    out[:] = 0
    rec = races.record(atomic_then_plain_read, 2, 32, {"values": values, "group": group, "out": out,
                                                       "seen": np.zeros_like(values)}, watch=("out",))
    race = rec.races()[0]
    assert "load" in race.first_did + race.second_did and any(
        k.startswith("atomic") for k in race.first_did + race.second_did)
    assert "updated it with an atomic add" in rec.explain(race)


def test_a_thread_on_its_own_elements_is_no_race_and_owns_them():
    values = np.arange(40.0)
    out = np.ones(40)
    rec = races.record(own_element, 2, 32, {"values": values, "out": out}, watch=("out",))
    assert rec.races() == []
    assert np.array_equal(out, (1 + values) * 2)
    writers = rec.writers("out")
    assert writers == {(t,): [t, t] for t in range(40)}  # each written twice, through the view too
    assert {a.element for a in rec.accesses("out")} == {(t,) for t in range(40)}


def test_a_barrier_orders_shared_memory_in_a_block():
    values = np.arange(64)
    for barrier, racing in ((True, False), (False, True)):
        out = np.zeros(64, np.int64)
        rec = races.record(reverse_in_block, 2, 32, {"values": values, "out": out, "barrier": barrier},
                           watch=("out",))
        found = rec.races()
        assert bool(found) == racing
        if barrier:
            assert np.array_equal(out, np.concatenate([values[31::-1], values[:31:-1]]))
        else:  # each block's shared array is its own: the races are within blocks
            assert all(r.array.startswith(races.SHARED) and r.first[0] == r.second[0] for r in found)
            assert "of the shared array" in rec.explain(found[0])


def test_no_barrier_orders_two_blocks():
    out = np.zeros(1, np.int64)
    rec = races.record(same_cell_from_two_blocks, 2, 4, {"out": out}, watch=("out",))
    (race,) = rec.races()
    assert race.first == ((0, 0, 0), (0, 0, 0)) and race.second == ((1, 0, 0), (0, 0, 0))
    assert rec.who(*race.second) == "thread 4 (block 1, thread 0)"


def test_refusals_name_the_fix():
    with pytest.raises(TypeError, match="@cuda.jit"):
        races.record(lambda out: None, 1, 1, {"out": np.zeros(1)}, watch=("out",))
    with pytest.raises(ValueError, match="not among the arguments"):
        races.record(own_element, 1, 1, {"values": np.zeros(1), "out": np.zeros(1)}, watch=("table",))


@cuda.jit
def fails(out):
    out[0] = 1.0
    raise ValueError("a kernel that stops")


def test_the_simulator_is_left_as_it_was():
    """The recorder wraps three of the simulator's functions for one launch only, even
    when the kernel raises."""
    from numba.cuda.simulator import kernel as sim_kernel, kernelapi

    before = (kernelapi.FakeCUDAAtomic.max, kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads)
    with pytest.raises(ValueError, match="a kernel that stops"):
        races.record(fails, 1, 1, {"out": np.zeros(1)}, watch=("out",))
    after = (kernelapi.FakeCUDAAtomic.max, kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads)
    assert after == before
    values, group, out = groups()
    max_with_atomic[2, 32](values, group, out)  # a plain launch works as before, unrecorded
    assert np.array_equal(out, [values[group == g].max() for g in range(len(out))])
