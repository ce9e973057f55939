"""One training step with what a run on a dataset needs: empty batches, mixed precision, several GPUs.

:func:`numba_sc.train.loop.train_step` is the step in four calls (forward,
loss, backward, update). :class:`Trainer` is that step with three options, each
explained in its own module, and this module only puts them in order::

    step(x, target)                                       collectives (several GPUs)
      1. labelled points (and scans) of the whole batch    all-reduce of 2 numbers
         none at all: the step is skipped, on every rank
      2. forward: float16 features with amp                 2 per BatchNorm (synced)
      3. loss over this rank's rows / the batch's count,
         its gradient times the loss scale (amp)
      4. backward (the tape)                                1 per BatchNorm (synced)
      5. gradients into buckets, summed over the ranks,     1 per bucket
         divided by the loss scale
      6. amp: not finite? skip the step, halve the scale
         the optimizer's step (on the float32 weights);
         amp: round them into the float16 model
      7. the batch's loss, for the log                      1 number

* mixed precision (``amp=True``): :mod:`numba_sc.train.amp`;
* several GPUs (``comm``, a communicator): :mod:`numba_sc.train.parallel`.

Without either, :meth:`Trainer.step` is exactly ``loop.train_step`` (the same
arithmetic, so a run's losses do not change when it is driven through here).
With them, the step on ``N`` GPUs gives one GPU's weights up to float32
rounding: every sum over the batch is taken over the whole batch.
"""
from __future__ import annotations

import numpy as np

from .amp import HALF, LossScaler, MasterWeights, model_dtype
from .labels import IGNORE_INDEX
from .loop import train_step
from .loss import cross_entropy
from .parallel import BUCKET_BYTES, GradientBuckets, Solo, broadcast_parameters, sync_batchnorm
from ..nn.tape import Tape
from ..core.backend import like, to_host
from ..core.device import array_module


class Trainer:
    """``model`` trained by ``optimizer``, one :meth:`step` per batch.

    Parameters
    ----------
    model, optimizer
        The network (float32, on its device) and an optimizer built on its
        ``trainable_parameters()`` after the move (:mod:`numba_sc.train.optim`).
    comm
        A communicator (:mod:`numba_sc.train.parallel`: ``rank``, ``size``,
        ``all_reduce``); None for one process. With more than one rank, rank 0's
        weights are copied to every rank now and the BatchNorms are synced.
    amp : bool
        Mixed precision: the model becomes float16, the optimizer's arrays its
        float32 masters, the loss is scaled (``init_scale``, doubled after
        ``growth_interval`` good steps, halved on overflow).
    weight
        Class weights of the loss (:func:`numba_sc.train.loss.cross_entropy`).
    backend
        The layers' backend (None: the GPU, or the simulator).
    bucket_bytes
        The size bound of a gradient bucket (:class:`numba_sc.train.parallel.GradientBuckets`).

    After each step, ``scans`` counts the scans of the whole batches trained on so far,
    and (with amp or several ranks) ``last_gradients`` holds the step's gradients by
    name, summed over the ranks and unscaled: float32 views into the buckets, valid
    until the next step (for checks: ``benchmarks/data_parallel.py`` compares them
    with one GPU's).
    """

    def __init__(self, model, optimizer, comm=None, amp=False, init_scale=2.0 ** 16, growth_interval=2000,
                 weight=None, backend=None, bucket_bytes=BUCKET_BYTES):
        self.model, self.optimizer = model, optimizer
        self.comm = Solo() if comm is None else comm
        self.weight, self.backend, self.bucket_bytes = weight, backend, bucket_bytes
        arrays = dict(model.trainable_parameters())
        if not amp and self.comm.size > 1:  # amp's MasterWeights checks the same
            stale = [n for n, p in arrays.items() if optimizer.params.get(n) is not p]
            if stale or set(optimizer.params) != set(arrays):
                raise ValueError("the optimizer must hold the model's own trainable arrays (build it on "
                                 "model.trainable_parameters() after model.cuda()); it does not for "
                                 f"{(stale or sorted(set(optimizer.params) ^ set(arrays)))[:4]}")
        if self.comm.size > 1:
            broadcast_parameters(model, self.comm)
            sync_batchnorm(model, self.comm)
        self.masters = MasterWeights(model, optimizer) if amp else None
        self.scaler = LossScaler(init_scale, growth_interval) if amp else None
        self.scans = 0  # scans of the whole batch trained on so far (all ranks)
        self.last_gradients = None  # the last step's gradients, summed over the ranks, unscaled (not plain)
        self._buckets = None

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def dtype(self):
        """The dtype the model computes in (its input features must have it)."""
        return model_dtype(self.model)

    @property
    def plain(self) -> bool:
        """No option on: the step is :func:`numba_sc.train.loop.train_step`."""
        return self.masters is None and self.comm.size == 1

    # ------------------------------------------------------------------ the step
    def step(self, x, target, scans=1):
        """Train on one batch: ``x`` (this rank's share, a SparseTensor), ``target``
        (one class id per row, ignore index 255), ``scans`` (how many scans the share
        holds). Returns the loss of the whole batch (float), or None when no point of
        the whole batch is labelled (nothing changed)."""
        txp = array_module(target)
        labelled = target != IGNORE_INDEX
        if self.plain:
            if not bool(labelled.any()):  # (one small device read)
                return None
            self.scans += scans
            return float(train_step(self.model, x, target, self.optimizer, self.backend, self.weight))
        # 1. the whole batch's labelled weight (count without class weights) and scans
        if self.weight is None:
            mine = labelled.sum(dtype=np.float64)
        else:
            w = like(self.weight, target).astype(np.float64)
            cls = txp.where(labelled, txp.clip(target, 0, len(w) - 1), 0)
            mine = txp.where(labelled, w[cls], 0.0).sum()
        xp = array_module(next(iter(self.optimizer.params.values())))  # the model's side: what NCCL reduces
        counts = xp.zeros(2, np.float64)
        counts[0], counts[1] = mine, scans
        both = xp.concatenate([counts, counts])
        self.comm.all_reduce(both[2:])  # (a view: this rank's numbers stay in both[:2])
        local, _, total, batch_scans = to_host(both).tolist()
        if total <= 0:
            return None
        self.scans += int(batch_scans)
        # 2-4. forward, the loss over this rank's rows / the batch's total, backward
        self.model.train()
        if self.masters is not None:
            x = x.with_features(x.features.astype(HALF))
        with Tape() as tape:
            y = self.model(x, backend=self.backend)
        logits = y.features
        scale = 1.0 if self.scaler is None else self.scaler.scale
        if local > 0:
            mean, g = cross_entropy(logits.astype(np.float32, copy=False), target, weight=self.weight,
                                    backend=self.backend)
            g *= np.float32(local / total * scale)  # this rank's share of the batch's mean, scaled
            loss = mean * local
        else:  # a share without a labelled point: it still ran the forward (BatchNorm's statistics)
            g = array_module(logits).zeros(logits.shape, np.float32)
            loss = 0.0
        grads = tape.backward(y, g.astype(logits.dtype, copy=False))
        # 5. summed over the ranks, in buckets, and unscaled
        names = list(self.optimizer.params)
        missing = [n for n in names if n not in grads]
        if missing:
            raise KeyError(f"no gradient for parameter(s) {missing[:6]}: every parameter the optimizer holds "
                           "needs one (did the forward pass use it?)")
        if self._buckets is None:
            self._buckets = GradientBuckets.for_gradients(names, grads, self.bucket_bytes)
        self._buckets.pack(grads)
        self._buckets.all_reduce(self.comm)
        if self.scaler is not None:
            bxp = array_module(self._buckets.buffers[0])
            for b in self._buckets.buffers:
                b *= np.float32(1.0 / scale)  # a power of two: exact
            finite = bool(to_host(bxp.stack([bxp.isfinite(b).all() for b in self._buckets.buffers]).all()))
            self.scaler.update(finite)
        else:
            finite = True
        self.last_gradients = self._buckets.views()
        # 6. the update (skipped on overflow: nothing changes but the scale)
        if finite:
            self.optimizer.step(self.last_gradients)
            if self.masters is not None:
                self.masters.copy_to_model()
        # 7. the batch's loss
        if self.comm.size > 1:
            s = xp.full(1, loss, np.float64)
            self.comm.all_reduce(s)
            loss = float(to_host(s)[0])
        return loss / total

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict:
        """The model's state dict, full precision (the float32 masters with amp)."""
        return self.model.state_dict() if self.masters is None else self.masters.state_dict()

    def state_dict(self) -> dict:
        """``{"model", "optimizer"}`` and with amp ``"amp"`` (the loss scaler's state)."""
        state = {"model": self.model_state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["amp"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict):
        """Restore :meth:`state_dict` (a checkpoint of a run without amp starts amp with a
        fresh loss scale; one with amp loads into a run without it as any model)."""
        if self.masters is None:
            self.model.load_state_dict(state["model"])
        else:
            self.masters.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "amp" in state:
            self.scaler.load_state_dict(state["amp"])


__all__ = ["Trainer"]
