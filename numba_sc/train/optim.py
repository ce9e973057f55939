"""Optimizers: SGD and AdamW on NumPy or CuPy arrays, and a cosine learning-rate schedule.

Training is a loop of three steps: the forward pass gives a loss, the backward
pass gives the gradient of the loss with respect to every parameter, and the
optimizer moves every parameter a little against its gradient. This module is
the third step. It holds no model and stores no gradients: it is given the
parameter arrays once, by name, and each :meth:`~Optimizer.step` is handed a
dict of gradients by the same names, so there is nothing to zero between steps::

    opt = AdamW(weights, lr=1e-3)                       # weights: name -> the arrays to train
    for step in range(total):
        opt.lr = cosine_lr(step, total, base_lr=1e-3, warmup=100)
        loss, grads = forward_and_backward(model, batch)    # grads: name -> array
        opt.step(grads)                                     # the arrays change in place

The parameter arrays are updated **in place** (``p -= ...``), so a model that
holds them sees the new values without being told. They may be NumPy or CuPy
arrays; the arithmetic is done by that array library (element-wise updates are
not worth a kernel of our own: each is a handful of passes over the parameters,
and a sparse U-Net has a few million of them, against the hundreds of millions
of values its convolutions move).

The update rules are PyTorch's (``torch.optim.SGD`` and ``torch.optim.AdamW``),
written out in each class's docstring, so that a run can be compared with one
in PyTorch step for step.

Worked example, one parameter ``w = 1.0``, gradients ``g = 0.5`` then ``g = 0.5``,
SGD with ``lr = 0.1`` and ``momentum = 0.9``::

    step 1   b = g               = 0.5        w = 1.0  - 0.1 * 0.5   = 0.95
    step 2   b = 0.9 * 0.5 + 0.5 = 0.95       w = 0.95 - 0.1 * 0.95  = 0.855

and AdamW (``lr = 0.1``, ``betas = (0.9, 0.999)``, ``eps = 0``, no weight decay),
step 1: ``m = 0.1 * 0.5 = 0.05``, ``v = 0.001 * 0.25``; bias-corrected
``m / (1 - 0.9) = 0.5`` and ``v / (1 - 0.999) = 0.25``, so the step is
``0.1 * 0.5 / sqrt(0.25) = 0.1``: Adam's first step is ``lr`` times the sign of
the gradient, whatever the gradient's size. That is what the bias correction is
for: ``m`` and ``v`` start at zero and would otherwise make the first steps tiny.

**State in float32, and fp16 master weights.** The optimizer's state (momentum
buffers, Adam's two moments) is kept per parameter name in float32, also for
float16 parameters. A float16 parameter is updated through an fp32 copy of it
kept in the state (the *master weights*): each step updates the copy in float32
and writes it back into the float16 array, rounded. Why: float16 has 11
significant bits, so near 1.0 its values are ~0.001 apart, and an update of
1e-4 added to a float16 weight directly would round away to nothing, step after
step; added to the fp32 copy, a hundred of them move the weight by 0.01. If the
float16 array was changed from outside (a checkpoint loaded into the model), the
copy is taken afresh from it at the next step. float64 parameters keep float64
state.

**Checks.** A gradient must have its parameter's shape, dtype and array kind
(NumPy or CuPy); every parameter must get a gradient (to freeze a parameter,
leave it out of the optimizer), and a gradient for a name the optimizer does
not hold is refused too (usually a typo). A gradient with a NaN or an infinity
is refused, naming the parameter, before any parameter has changed: a diverged
step would otherwise write NaN into every weight. On a GPU these checks cost
one read of a few bytes to the host per step (and one per float16 parameter,
whose master copy is compared with it).
"""
from __future__ import annotations

import math

import numpy as np

from ..core.device import array_module, is_cupy
from ..core.backend import like, to_host
from ..core.conventions import is_int

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _state_dtype(dtype):
    """float32 for float16 and float32 parameters, float64 for float64 ones."""
    return np.promote_types(np.dtype(dtype), np.float32)


def _check_nonnegative(**values):
    for name, v in values.items():
        number = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        if not (number and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def _checked_step(v, name) -> int:
    """A saved step count: a whole number >= 0 (an int, a NumPy integer or a 0-d one)."""
    if isinstance(v, np.ndarray) and v.ndim == 0:
        v = v[()]
    if not is_int(v) or v < 0:
        raise ValueError(f"state 'step' of {name!r} must be a whole number >= 0 (the steps taken), got {v!r}")
    return int(v)


class Optimizer:
    """What SGD and AdamW share: the parameters by name, the state, the checks.

    Subclasses define :attr:`HYPERPARAMETERS` (the names of their settings,
    kept as attributes, ``lr`` first) and :meth:`_update` (one parameter's
    update, given its gradient and its state).
    """

    HYPERPARAMETERS: tuple = ("lr",)

    def __init__(self, params, lr):
        items = list(params.items()) if isinstance(params, dict) else list(params)
        self.params = {}
        seen = {}
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError("params must be a dict name -> array or a list of (name, array) pairs, "
                                f"got an item {item!r:.60}")
            name, p = item
            if not isinstance(name, str):
                raise TypeError(f"parameter names must be strings, got {name!r}")
            if name in self.params:
                raise ValueError(f"parameter {name!r} is given twice")
            if not hasattr(p, "shape") or not hasattr(p, "dtype"):
                raise TypeError(f"parameter {name!r} must be a NumPy or CuPy array, got {type(p).__name__}")
            if np.dtype(p.dtype) not in FLOAT_DTYPES:
                raise TypeError(f"parameter {name!r} is {p.dtype}: only float16, float32 and float64 "
                                "parameters can be trained")
            if id(p) in seen:
                raise ValueError(f"parameters {seen[id(p)]!r} and {name!r} are the same array: it would be "
                                 "updated twice per step; give it once")
            seen[id(p)] = name
            self.params[name] = p
        if not self.params:
            raise ValueError("params is empty: give the optimizer the arrays it should train")
        self.lr = lr
        self.state = {name: {"step": 0} for name in self.params}

    # ---------------------------------------------------------------- lr
    @property
    def lr(self):
        """The learning rate of the next step; set it between steps (see :func:`cosine_lr`)."""
        return self._lr

    @lr.setter
    def lr(self, value):
        _check_nonnegative(lr=value)
        self._lr = float(value)

    # -------------------------------------------------------------- step
    def step(self, grads: dict):
        """Update every parameter in place from ``grads`` (a dict name -> gradient array).

        Every gradient is checked (names, shapes, dtypes, finiteness) before any
        parameter changes, so a refused step leaves the parameters and the state
        as they were.
        """
        self._follow(grads)
        self._check_grads(grads)
        for name, p in self.params.items():
            state = self.state[name]
            master = self._master(name, p)
            state["step"] += 1
            self._update(master, grads[name].astype(master.dtype, copy=False), state)
            if master is not p:
                p[...] = master  # rounded to float16

    def _follow(self, grads):
        """Take up the arrays the model now holds under this optimizer's names.

        The gradients of :meth:`numba_sc.nn.Tape.backward` carry the parameter arrays
        the forward pass read (``grads.arrays``). When the model replaced one after
        this optimizer was built (``model.cuda()``: a CuPy copy; ``model.half()``: a
        float16 copy), the optimizer updates the new array from now on, with its
        state (moments, a float32 master copy) moved to the new array's side. A
        parameter whose shape changed is a different parameter: refused."""
        arrays = getattr(grads, "arrays", None)
        if not arrays:
            return
        for name, new in arrays.items():
            old = self.params.get(name)
            if old is None or new is old:
                continue
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(f"parameter {name!r} is now {tuple(new.shape)}, but this optimizer was built "
                                 f"for {tuple(old.shape)}: build a new optimizer for the new model")
            if np.dtype(new.dtype) not in FLOAT_DTYPES:
                raise TypeError(f"parameter {name!r} is now {new.dtype}: only float parameters can be trained")
            self.params[name] = new
            state = self.state[name]
            for k, v in list(state.items()):
                if hasattr(v, "shape"):
                    state[k] = like(v, new)

    def _check_grads(self, grads):
        if not isinstance(grads, dict):
            raise TypeError(f"step() takes a dict name -> gradient array, got {type(grads).__name__}")
        missing = [n for n in self.params if n not in grads]
        if missing:
            raise KeyError(f"no gradient for parameter(s) {missing}: every parameter the optimizer holds "
                           "needs one (to freeze a parameter, leave it out of the optimizer)")
        unknown = [n for n in grads if n not in self.params]
        if unknown:
            raise KeyError(f"gradient(s) for {unknown}, which the optimizer does not hold "
                           f"(it holds {list(self.params)[:8]}{' ...' if len(self.params) > 8 else ''})")
        finite = []
        for name, p in self.params.items():
            g = grads[name]
            if not hasattr(g, "shape") or not hasattr(g, "dtype"):
                raise TypeError(f"gradient of {name!r} must be an array, got {type(g).__name__}")
            if tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"gradient of {name!r} has shape {tuple(g.shape)}, the parameter "
                                 f"{tuple(p.shape)}: they must match")
            if g.dtype != p.dtype:
                raise TypeError(f"gradient of {name!r} is {g.dtype}, the parameter {p.dtype}: convert it, "
                                f"e.g. grad.astype(np.{np.dtype(p.dtype).name})")
            if is_cupy(g) != is_cupy(p):
                kinds = ("CuPy", "NumPy") if is_cupy(g) else ("NumPy", "CuPy")
                raise TypeError(f"gradient of {name!r} is a {kinds[0]} array but the parameter a {kinds[1]} "
                                "one: put both on the same side")
            finite.append(array_module(p).isfinite(g).all())
        # One read to the host for all the parameters (on a GPU, one synchronization).
        xp = array_module(next(iter(self.params.values())))
        ok = to_host(xp.stack(finite)) if xp is not np else np.array(finite)
        if not ok.all():
            bad = [n for n, f in zip(self.params, ok) if not f]
            raise FloatingPointError(f"gradient of {bad} contains NaN or inf: the step is refused and nothing "
                                     "was changed (a diverged loss? try a smaller lr)")

    def _master(self, name, p):
        """The array the update is computed on: ``p`` itself, or for a float16
        parameter its float32 copy in the state (made, or remade when ``p`` was
        changed from outside)."""
        if p.dtype == _state_dtype(p.dtype):
            return p
        state = self.state[name]
        master = state.get("master")
        xp = array_module(p)
        if master is None or not bool(xp.array_equal(master.astype(p.dtype), p)):
            master = state["master"] = p.astype(_state_dtype(p.dtype))
        return master

    def _update(self, w, g, state):  # pragma: no cover - defined by the subclasses
        raise NotImplementedError

    # -------------------------------------------------------------- state
    def hyperparameters(self) -> dict:
        return {k: getattr(self, k) for k in self.HYPERPARAMETERS}

    def state_dict(self) -> dict:
        """The optimizer's settings and state, as NumPy copies (``np.savez``-able
        once flattened): ``{"optimizer": "AdamW", "hyperparameters": {...},
        "state": {name: {"step": int, "exp_avg": array, ...}}}``."""
        state = {name: {k: (v if isinstance(v, int) else np.array(to_host(v))) for k, v in s.items()}
                 for name, s in self.state.items()}
        return {"optimizer": type(self).__name__, "hyperparameters": self.hyperparameters(), "state": state}

    def load_state_dict(self, state_dict: dict):
        """Restore what :meth:`state_dict` returned (settings included, ``lr`` too).
        The arrays are copied, onto the side (NumPy or CuPy) of each parameter.

        Everything is checked before anything changes: the three keys, the same
        parameter names as this optimizer's, each ``step`` a whole number >= 0 (a
        bool or a float is refused: a damaged file, not a count), each moment of its
        parameter's shape and finite (a NaN moment would make the weights NaN at the
        next step), the settings valid."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict (what optimizer.state_dict() returns), got "
                            f"{type(state_dict).__name__}")
        missing = [k for k in ("optimizer", "hyperparameters", "state") if k not in state_dict]
        if missing:
            raise ValueError(f"the optimizer state dict lacks {missing} (it has {sorted(state_dict)[:6]}): pass "
                             "what optimizer.state_dict() returned, e.g. checkpoint['optimizer'], not the "
                             "whole checkpoint or the model's state")
        kind = state_dict["optimizer"]
        if kind != type(self).__name__:
            raise ValueError(f"this state dict is of a {kind} optimizer, not a {type(self).__name__}")
        if not isinstance(state_dict["state"], dict) or not isinstance(state_dict["hyperparameters"], dict):
            raise TypeError("the optimizer state dict's 'state' and 'hyperparameters' must be dicts")
        names = set(state_dict["state"])
        if names != set(self.params):
            raise KeyError(f"the state dict is for other parameters: it holds {sorted(names - set(self.params))[:6]} "
                           f"this optimizer does not, and lacks {sorted(set(self.params) - names)[:6]}; load it "
                           "into an optimizer built on the same model's trainable_parameters()")
        new = {}
        for name, saved in state_dict["state"].items():
            p = self.params[name]
            xp = array_module(p)
            if not isinstance(saved, dict) or "step" not in saved:
                raise ValueError(f"state of {name!r} must be a dict with its 'step', got {saved!r:.60}")
            new[name] = {}
            for k, v in saved.items():
                if k == "step":
                    new[name][k] = _checked_step(v, name)
                    continue
                v = np.asarray(to_host(v))
                if not (np.issubdtype(v.dtype, np.floating) or np.issubdtype(v.dtype, np.integer)):
                    raise TypeError(f"state {k!r} of {name!r} holds {v.dtype} values; it must be numbers")
                if v.shape != tuple(p.shape):
                    raise ValueError(f"state {k!r} of {name!r} has shape {v.shape}, the parameter "
                                     f"{tuple(p.shape)}: the state is of another model")
                if not np.isfinite(v).all():
                    raise ValueError(f"state {k!r} of {name!r} holds NaN or inf: the checkpoint is damaged (or was "
                                     "saved after a diverged step); load an earlier one")
                new[name][k] = xp.array(v, dtype=_state_dtype(p.dtype))
        settings = self.hyperparameters()
        for k, v in state_dict["hyperparameters"].items():
            if k not in self.HYPERPARAMETERS:
                raise KeyError(f"unknown hyperparameter {k!r} for {type(self).__name__}")
            settings[k] = tuple(v) if isinstance(v, list) else v
        self.check_settings(**settings)  # a damaged state dict is refused before anything changes
        for k, v in settings.items():
            setattr(self, k, v)
        self.state = new

    @staticmethod
    def check_settings(lr, **_):
        """Raise unless the settings are valid (each optimizer checks its own)."""
        _check_nonnegative(lr=lr)


class SGD(Optimizer):
    """Stochastic gradient descent, with momentum and weight decay as in ``torch.optim.SGD``.

    For a parameter ``w`` with gradient ``g``, at step ``t = 1, 2, ...``::

        g = g + weight_decay * w                   (L2 weight decay: added to the gradient)
        b = g                     at t = 1         (the momentum buffer, when momentum > 0)
        b = momentum * b + g      at t > 1
        g = g + momentum * b      if nesterov, else  g = b
        w = w - lr * g

    With ``momentum = 0`` that is plain ``w = w - lr * (g + weight_decay * w)``.
    Nesterov momentum looks one step ahead along the buffer; it needs
    ``momentum > 0``. (PyTorch's ``dampening`` is 0 here.)
    """

    HYPERPARAMETERS = ("lr", "momentum", "weight_decay", "nesterov")

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        self.check_settings(lr, momentum, weight_decay, nesterov)
        super().__init__(params, lr)
        self.momentum, self.weight_decay, self.nesterov = float(momentum), float(weight_decay), bool(nesterov)

    @staticmethod
    def check_settings(lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        _check_nonnegative(lr=lr, momentum=momentum, weight_decay=weight_decay)
        if not isinstance(nesterov, (bool, np.bool_)):
            raise ValueError(f"nesterov must be True or False, got {nesterov!r}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (Nesterov is a kind of momentum)")

    def _update(self, w, g, state):
        if self.weight_decay:
            g = g + self.weight_decay * w  # a new array: the caller's gradient is left alone
        if self.momentum:
            b = state.get("momentum_buffer")
            if b is None:
                b = state["momentum_buffer"] = g.copy()
            else:
                b *= self.momentum
                b += g
            g = g + self.momentum * b if self.nesterov else b
        w -= self.lr * g


class AdamW(Optimizer):
    """Adam with decoupled weight decay, as in ``torch.optim.AdamW``.

    For a parameter ``w`` with gradient ``g``, at step ``t = 1, 2, ...``
    (``m`` and ``v`` start at zero)::

        w = w * (1 - lr * weight_decay)           (decoupled: not through the gradient)
        m = beta1 * m + (1 - beta1) * g           (running mean of the gradient)
        v = beta2 * v + (1 - beta2) * g * g       (running mean of its square)
        m_hat = m / (1 - beta1 ** t)              (bias correction: m, v started at 0)
        v_hat = v / (1 - beta2 ** t)
        w = w - lr * m_hat / (sqrt(v_hat) + eps)

    "Decoupled" is the W of AdamW: the decay shrinks the weight directly instead
    of being added to the gradient, where Adam's division by ``sqrt(v_hat)``
    would scale it differently for every weight. (Exactly as PyTorch computes
    it, the last line is ``w - (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 -
    beta2**t) + eps)``: the same, with ``eps`` added after the correction.)
    """

    HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        self.check_settings(lr, betas, eps, weight_decay)
        super().__init__(params, lr)
        self.betas, self.eps, self.weight_decay = (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)

    @staticmethod
    def check_settings(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        _check_nonnegative(lr=lr, eps=eps, weight_decay=weight_decay)
        ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
            isinstance(b, (int, float, np.integer, np.floating)) and not isinstance(b, bool) and 0 <= b < 1
            for b in betas)
        if not ok:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")

    def _update(self, w, g, state):
        beta1, beta2 = self.betas
        t = state["step"]
        xp = array_module(w)
        if "exp_avg" not in state:
            state["exp_avg"], state["exp_avg_sq"] = xp.zeros_like(w), xp.zeros_like(w)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.weight_decay:
            w *= 1 - self.lr * self.weight_decay
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * (g * g)
        step_size = self.lr / (1 - beta1 ** t)
        denom = xp.sqrt(v)
        denom /= math.sqrt(1 - beta2 ** t)
        denom += self.eps
        w -= step_size * (m / denom)


def cosine_lr(step: int, total: int, base_lr: float, warmup: int = 0, min_lr: float = 0.0) -> float:
    """The learning rate of step ``step`` (0, 1, ..., ``total - 1``) of a run of ``total`` steps.

    A linear warm-up over the first ``warmup`` steps, ``base_lr * (step + 1) /
    warmup`` (so the first step does not waste itself at lr 0), then half a
    cosine from ``base_lr`` down to ``min_lr`` at step ``total``::

        progress = (step - warmup) / (total - warmup)                  in [0, 1]
        lr = min_lr + (base_lr - min_lr) * (1 + cos(pi * progress)) / 2

    Steps past ``total`` get ``min_lr``. E.g. ``total = 100, warmup = 10``:
    steps 0..9 ramp 0.1 .. 1.0 x base_lr, step 55 is halfway down (0.5 x), step
    99 is ~0.0003 x.
    """
    if not (isinstance(total, (int, np.integer)) and total > 0):
        raise ValueError(f"total must be a positive number of steps, got {total!r}")
    if not (isinstance(warmup, (int, np.integer)) and 0 <= warmup <= total):
        raise ValueError(f"warmup must be a number of steps in [0, total={total}], got {warmup!r}")
    if not (isinstance(step, (int, np.integer)) and step >= 0):
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    _check_nonnegative(base_lr=base_lr, min_lr=min_lr)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if total == warmup:
        return base_lr if step < total else min_lr
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
