"""Data-parallel training: one process per GPU, each on its share of the batch, gradients summed.

Every GPU holds the whole network. A global batch of ``B`` scans is cut into
``N`` shares, one per GPU (the *ranks* ``0 .. N - 1``); each rank runs the forward
and backward pass on its share, and before the optimizer step the ranks add
their gradients up, so that every rank applies the same update and the ``N``
copies of the weights stay identical. Nothing else is exchanged: no features,
no maps (the scans of a batch never share a kernel-map pair, their batch
indices differ, so cutting a batch between scans cuts no convolution).

**The same weights as one GPU.** Done naively, ``N`` GPUs train another network
than one GPU on the same global batch. Three sums must span the whole batch:

1. *The loss's normalization.* The loss is the mean over the labelled points of
   the batch. A rank that averaged over its own points would weigh a point of a
   sparsely labelled share more than one of a dense share. So the ranks first
   sum their counts of labelled points (one all-reduce of two numbers: the
   count and the number of scans), and each divides its sum of losses by the
   *global* count; the gradients then add up to the one-GPU gradient exactly.
2. *BatchNorm's statistics.* In training mode a BatchNorm normalizes with the
   mean and variance of the batch, and its backward pass uses two per-channel
   sums of the gradient over the batch. Each rank sums its own rows, the sums
   are all-reduced, and every rank normalizes with the whole batch's numbers
   (synced BatchNorm, :func:`sync_batchnorm`; the arithmetic is in
   :class:`numba_sc.nn.BatchNorm`).
3. *The parameter gradients*, summed over the ranks (:class:`GradientBuckets`).

Each of these is a sum of the same terms in another order, so the weights agree
with one GPU's up to the rounding of that order: they differ from one GPU's as
much as one GPU's own differ when the batch's scans are given in another order
(``benchmarks/data_parallel.py`` measures both on two GPUs, where BatchNorm's
cancelling sums make that floor far larger than float32's unit roundoff;
``tests/train/test_parallel.py`` checks the equality with ranks as threads).

**Buckets.** A MinkUNet42 has ~150 parameter arrays, many of a few hundred
values. One all-reduce each would pay a collective's fixed cost 150 times;
instead the gradients are copied, in a fixed order, into a few contiguous
float32 buffers of at most ``bucket_bytes`` (25 MiB by default, PyTorch DDP's
choice), each all-reduced once, and read back as views. (PyTorch also overlaps
each bucket's all-reduce with the rest of the backward pass; here the tape
hands the gradients over at its end, so the buckets are reduced after it.)

**The communicator** is anything with ``rank``, ``size`` and
``all_reduce(array)`` (sum over the ranks, in place). Three are here:
:class:`Solo` (one process: nothing to do), :class:`NcclCommunicator`
(CuPy's NCCL binding, ``cupyx.distributed``: NCCL's ring all-reduce over NVLink
or the network, never hand-written communication) and :class:`ThreadGroup`
(ranks as Python threads of one process, for tests without a GPU).

**Launching.** ``numba-sc train fit --gpus N ...`` starts ``N`` copies of itself
(:func:`spawn`), one per GPU of this machine, and each learns who it is from
the environment variables that ``torchrun``, SLURM scripts and most cluster
launchers set (:func:`placement_from_environment`):

===============  =======================================================
``WORLD_SIZE``   number of processes (GPUs) in the whole run
``RANK``         this process's rank, ``0 .. WORLD_SIZE - 1``
``LOCAL_RANK``   its GPU on this machine (default: ``RANK``)
``MASTER_ADDR``  the address of rank 0's machine (default 127.0.0.1)
``MASTER_PORT``  a free TCP port there (default 29500)
===============  =======================================================

Rank 0 opens a small TCP store at ``MASTER_ADDR:MASTER_PORT`` through which
the ranks exchange NCCL's unique id; NCCL then connects them itself. Only rank
0 prints, evaluates and writes checkpoints and logs.

**Several machines** run the same code: start one process per GPU on every
machine (without ``--gpus``), each with these variables set, e.g. on two
machines of 8 GPUs each::

    # on node0 (10.0.0.1), for r in 0..7; on node1 RANK=8+r
    WORLD_SIZE=16 RANK=$r LOCAL_RANK=$r MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\
        numba-sc train fit --data KITTI --split train --epochs 10 --batch-size 32 --save run.npz

(NCCL's own variables, e.g. ``NCCL_SOCKET_IFNAME`` to choose the network
interface, apply as usual.) ``--batch-size`` is the global batch: each rank
takes its share (:class:`ShardedLoader`), so a run gives the same weights on
any number of GPUs. A batch with fewer scans than ranks is dropped (a rank
without a scan has nothing to run BatchNorm on).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import numpy as np

from .data import Loader
from ..core.device import array_module, gpu_present, is_cupy, simulating

log = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 2 ** 20  # PyTorch DDP's default bucket size
DEFAULT_PORT = 29500  # torch.distributed's default MASTER_PORT


# ------------------------------------------------------------------ communicators
class Solo:
    """The communicator of a run on one GPU: one rank, and a sum over one rank is itself."""

    rank, size = 0, 1

    def all_reduce(self, array):
        return None


class ThreadGroup:
    """``size`` ranks as Python threads of one process, for tests without GPUs.

    ``ThreadGroup(2).run(fn)`` calls ``fn(comm)`` in two threads, ``comm.rank`` 0 and 1,
    and returns their results in rank order. The ranks take turns: only one runs
    at a time, and the turn passes at every :meth:`all_reduce`, where a rank waits
    until all have arrived; the last one to arrive adds the arrays up (in rank
    order, in the arrays' dtype, as a ring all-reduce adds them) and writes the
    sum into each. Taking turns keeps the ranks from launching kernels under
    Numba's CUDA simulator at the same time (it is not made for that) and makes
    every run the same. A rank that raises ends the group: the others raise too,
    and :meth:`run` re-raises the first error.
    """

    def __init__(self, size):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size must be an integer >= 1 (the number of ranks), got {size!r}")
        self.size = int(size)
        self._turn = threading.Condition()  # its lock is the turn: held by the rank that runs
        self._arrays = [None] * self.size
        self._arrived = 0
        self._generation = 0
        self._failed = None

    class _Rank:
        def __init__(self, group, rank):
            self.group, self.rank, self.size = group, rank, group.size

        def all_reduce(self, array):
            self.group._all_reduce(self.rank, array)

    def _all_reduce(self, rank, array):
        if self._failed is not None:
            raise RuntimeError(f"rank {self._failed} failed") from None
        self._arrays[rank] = array
        self._arrived += 1
        generation = self._generation
        if self._arrived == self.size:
            shapes = {tuple(a.shape) for a in self._arrays}
            if len(shapes) != 1:
                self._failed = rank
                self._turn.notify_all()
                raise ValueError(f"all_reduce: the ranks passed arrays of different shapes {sorted(shapes)}")
            total = self._arrays[0].copy()
            for a in self._arrays[1:]:
                total += a
            for a in self._arrays:
                a[...] = total
            self._arrays = [None] * self.size
            self._arrived = 0
            self._generation += 1
            self._turn.notify_all()
            return
        while self._generation == generation and self._failed is None:
            self._turn.wait()  # gives the turn away until the last rank arrives
        if self._generation == generation:
            raise RuntimeError(f"rank {self._failed} failed while rank {rank} waited in all_reduce")

    def run(self, fn):
        """``[fn(comm_0), ..., fn(comm_{size-1})]``, each in its own thread."""
        results, errors = [None] * self.size, [None] * self.size

        def body(rank):
            with self._turn:
                try:
                    results[rank] = fn(self._Rank(self, rank))
                except BaseException as e:  # noqa: BLE001 - handed to run()'s caller
                    errors[rank] = e
                    if self._failed is None:
                        self._failed = rank
                    self._turn.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"numba-sc-rank-{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, RuntimeError)), None) \
            or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


class NcclCommunicator:
    """One rank of a run over NCCL, through CuPy (``cupyx.distributed``).

    ``cupyx.distributed.init_process_group`` does the rendezvous: rank 0 opens a
    TCP store at ``host:port``, makes NCCL's unique id and puts it there; the
    others fetch it; each then joins the NCCL communicator on its current GPU
    (select it first: :func:`use_device`). :meth:`all_reduce` sums a CuPy array
    over the ranks in place, queued on CuPy's current stream behind the kernels
    that made it. :meth:`close` ends the run: a last all-reduce (so that no rank
    is still starting) and rank 0's store shut.
    """

    def __init__(self, rank, size, host="127.0.0.1", port=DEFAULT_PORT):
        import cupyx.distributed

        self.rank, self.size = int(rank), int(size)
        self._nccl = cupyx.distributed.init_process_group(self.size, self.rank, backend="nccl", host=host,
                                                          port=int(port))
        # Rank 0's store is a child process that Python waits for at exit: stop it then, also
        # after an error (atexit runs this before multiprocessing's own exit handler joins it)
        atexit.register(self._stop_store)

    def all_reduce(self, array):
        if not is_cupy(array):
            raise TypeError(f"NCCL sums GPU arrays; got a {type(array).__module__} array (move it with "
                            "numba_sc.core.backend.to_device)")
        self._nccl.all_reduce(array, array, "sum")

    def close(self):
        import cupy

        done = cupy.ones(1, np.float32)
        self.all_reduce(done)
        cupy.cuda.runtime.deviceSynchronize()
        self._stop_store()

    def _stop_store(self):
        store = getattr(self._nccl, "_store", None)  # rank 0's TCP store (a child process)
        if store is not None and getattr(store, "_process", None) is not None:
            try:
                store.stop()
            finally:
                store._process = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        return False


# ------------------------------------------------------------------ placement
@dataclass(frozen=True)
class Placement:
    """Where this process stands in a run: ``rank`` of ``size``, GPU ``local_rank`` of
    its machine, and rank 0's store at ``host:port``."""

    rank: int
    size: int
    local_rank: int
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT


def _env_int(env, name, low, high=None, default=None):
    text = env.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"{name} is not set: a data-parallel process needs WORLD_SIZE, RANK (and LOCAL_RANK, "
                             "MASTER_ADDR, MASTER_PORT on several machines); see numba_sc.train.parallel")
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value} is out of range: it must be in {low}..{'' if high is None else high}")
    return value


def placement_from_environment(environ=None):
    """This process's :class:`Placement` from ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (module docstring), or None when ``WORLD_SIZE``
    is not set (a run on one GPU). A bad or missing value raises ``ValueError`` naming it."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0, size - 1, default=0 if size == 1 else None)
    local_rank = _env_int(env, "LOCAL_RANK", 0, default=rank)
    port = _env_int(env, "MASTER_PORT", 1, 65535, default=DEFAULT_PORT)
    return Placement(rank, size, local_rank, env.get("MASTER_ADDR") or "127.0.0.1", port)


def use_device(local_rank):
    """Make GPU ``local_rank`` this thread's device, for CuPy and for Numba's kernels
    (both follow the CUDA runtime's current device; a thread starts on GPU 0, so
    every thread that makes device arrays calls this: :class:`ShardedLoader` does)."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= local_rank < count:
        raise ValueError(f"LOCAL_RANK={local_rank}, but this process sees {count} GPU(s) (0..{count - 1}): give each "
                         "process of a machine its own LOCAL_RANK below the number of GPUs")
    cupy.cuda.Device(local_rank).use()


def current_device():
    """The CUDA device of the calling thread (None without a GPU, or under the simulator)."""
    if simulating() or not gpu_present():
        return None
    import cupy

    return cupy.cuda.runtime.getDevice()


def connect(placement):
    """The communicator of ``placement``: :class:`Solo` for one process, else this
    process's GPU selected (:func:`use_device`) and an :class:`NcclCommunicator`."""
    if placement is None or placement.size == 1:
        return Solo()
    use_device(placement.local_rank)
    return NcclCommunicator(placement.rank, placement.size, placement.host, placement.port)


# ------------------------------------------------------------------ the model
def sync_batchnorm(model, comm):
    """Make every BatchNorm of ``model`` take its batch statistics over all of ``comm``'s
    ranks (:class:`numba_sc.nn.BatchNorm`, "Synced"). Returns the model."""
    from ..nn.layers import BatchNorm

    for bn in model.modules(BatchNorm):
        bn.comm = comm if comm.size > 1 else None
    return model


def broadcast_parameters(model, comm):
    """Give every rank rank 0's parameters and BatchNorm statistics, so that all start
    from the same model whatever each built (as PyTorch's DDP does at its start).
    A broadcast made of an all-reduce: the other ranks contribute zeros, and
    ``x + 0 + ... + 0`` is ``x`` exactly."""
    if comm.size == 1:
        return model
    for _, p in model.named_parameters():
        if comm.rank != 0:
            p[...] = 0
        comm.all_reduce(p)
    return model


class GradientBuckets:
    """Parameter gradients packed into a few contiguous float32 buffers, summed over the ranks.

    Built from ``layout``, ``(name, shape)`` pairs in a fixed order (every rank must
    give the same). Parameters are laid end to end, a new bucket begun when the next
    would pass ``bucket_bytes``; a parameter larger than that gets a bucket of its
    own. Worked example, ``bucket_bytes=16`` (4 float32 values), parameters a (3),
    b (2), c (6)::

        bucket 0: a a a        (a + b would be 5 values > 4)
        bucket 1: b b          (b + c would be 8)
        bucket 2: c c c c c c  (alone, larger than a bucket)

    :meth:`pack` copies gradients in (float16 ones widened), :meth:`all_reduce` sums
    each bucket over the ranks, :meth:`views` reads them back by name (views into
    the buffers: valid until the next :meth:`pack`).
    """

    def __init__(self, layout, xp=np, bucket_bytes=BUCKET_BYTES):
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 4:
            raise ValueError(f"bucket_bytes must be an integer >= 4 (one float32 value), got {bucket_bytes!r}")
        per_bucket = int(bucket_bytes) // 4
        self.buckets = []  # lists of (name, start, size, shape)
        sizes = []
        for name, shape in layout:
            size = int(np.prod(shape, dtype=np.int64))
            if not self.buckets or sizes[-1] + size > per_bucket:
                self.buckets.append([])
                sizes.append(0)
            self.buckets[-1].append((name, sizes[-1], size, tuple(shape)))
            sizes[-1] += size
        self.buffers = [xp.empty(n, np.float32) for n in sizes]

    @classmethod
    def for_gradients(cls, names, grads, bucket_bytes=BUCKET_BYTES):
        """Buckets for ``grads`` (name -> array), the parameters in the order of ``names``."""
        first = grads[names[0]]
        return cls([(n, grads[n].shape) for n in names], array_module(first), bucket_bytes)

    def pack(self, grads):
        for buffer, bucket in zip(self.buffers, self.buckets):
            array_module(buffer).concatenate([grads[name].reshape(-1) for name, _, _, _ in bucket], out=buffer)

    def all_reduce(self, comm):
        if comm.size > 1:
            for buffer in self.buffers:
                comm.all_reduce(buffer)

    def views(self) -> dict:
        return {name: buffer[start:start + size].reshape(shape)
                for buffer, bucket in zip(self.buffers, self.buckets) for name, start, size, shape in bucket}


# ------------------------------------------------------------------ the data
class ShardedLoader(Loader):
    """A :class:`numba_sc.train.data.Loader` that yields rank ``rank``'s share of each batch.

    ``batch_size`` is the *global* batch. Every rank plans the same global batches
    (the same seed, the same order) and takes its contiguous share of each
    (``np.array_split``: sizes differing by at most one), so the ranks' shares,
    joined in rank order, are the batch one process would have made, each scan
    augmented by its own generator, ``[seed, epoch, index]``, on whichever rank.
    A global batch with fewer scans than ranks (the last of an epoch) is dropped
    on every rank. Worker threads make their device arrays on the GPU of the
    thread that built the loader (``device``), not on GPU 0.
    """

    def __init__(self, dataset, batch_size, prepare, rank=0, size=1, device="current", **kwargs):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size must be the number of ranks (an integer >= 1), got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < size:
            raise ValueError(f"rank must be in 0..{size - 1}, got {rank!r}")
        if isinstance(batch_size, (int, np.integer)) and not isinstance(batch_size, bool) and batch_size < size:
            raise ValueError(f"batch_size={batch_size} is the global batch, cut into {size} shares: give each rank "
                             f"at least one scan (batch_size >= {size})")
        super().__init__(dataset, batch_size, prepare, **kwargs)
        self.rank, self.size = int(rank), int(size)
        self.device = current_device() if device == "current" else device

    def __len__(self):
        n, b = len(self.dataset), self.batch_size
        rest = n % b
        return n // b + (1 if rest >= self.size and not self.drop_last else 0)

    def global_plan(self, epoch):
        """The global batches of ``epoch`` (what one process would train on)."""
        return super().plan(epoch)

    def plan(self, epoch):
        return [np.array_split(b, self.size)[self.rank] for b in self.global_plan(epoch)]

    def prepare_item(self, epoch, index):
        if self.device is not None:
            use_device(self.device)
        return super().prepare_item(epoch, index)

    def make_batch(self, items, indices):
        if self.device is not None:
            use_device(self.device)
        return super().make_batch(items, indices)


# ------------------------------------------------------------------ launching
def free_port(host="127.0.0.1"):
    """A TCP port free on ``host`` now (the operating system's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(n, command, master_addr="127.0.0.1", master_port=None, poll=0.2):
    """Run ``command`` (an argv list) as ``n`` processes, ranks ``0 .. n - 1`` of one
    machine, with ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set (a free port unless given); wait for them all. When one
    fails, the others are stopped (they would wait for it forever in NCCL). Returns
    the first non-zero exit status, else 0."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be the number of processes (an integer >= 1), got {n!r}")
    port = free_port(master_addr) if master_port is None else int(master_port)
    procs = []
    for rank in range(n):
        env = dict(os.environ, WORLD_SIZE=str(n), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR=master_addr, MASTER_PORT=str(port))
        # its own process group: stopping a rank also stops what it started (rank 0's TCP store)
        procs.append(subprocess.Popen(command, env=env, start_new_session=True))
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0].returncode
                log.error("rank %d exited with status %d: stopping the others", procs.index(failed[0]), status)
                break
            time.sleep(poll)
    finally:
        for p in procs:
            if p.poll() is None:
                _stop_group(p.pid)
        for p in procs:
            p.wait()
            _stop_group(p.pid)  # what a rank left behind in its group (a store it did not close)
    return status or next((p.returncode for p in procs if p.returncode), 0)


def _stop_group(pgid):
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["BUCKET_BYTES", "GradientBuckets", "NcclCommunicator", "Placement", "ShardedLoader", "Solo",
           "ThreadGroup", "broadcast_parameters", "connect", "current_device", "free_port",
           "placement_from_environment", "spawn", "sync_batchnorm", "use_device"]
