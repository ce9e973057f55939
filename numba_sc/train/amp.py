"""Mixed precision: float16 arithmetic, float32 weights, and a loss scale that moves.

A training step in float16 moves half the bytes of a float32 one and runs its
matrix products on the tensor cores' fastest path. Three problems come with it,
and each piece of this module answers one of them (Micikevicius et al.,
"Mixed Precision Training", ICLR 2018, is the paper behind the recipe):

**1. Small updates vanish: fp32 master weights** (:class:`MasterWeights`).
float16 keeps 11 significant bits, so next to a weight of 1.0 the nearest other
values are ~0.001 away, and an update of 1e-4 rounds away to nothing, step
after step. The optimizer therefore updates float32 copies of the weights (the
*masters*; they are the arrays the optimizer was built on), and after each step
the float16 weights the layers compute with are rounded afresh from them. A
hundred updates of 1e-4 then move a weight by 0.01, as they should. BatchNorm's
weights stay float32 throughout (its statistics and parameters are never half).

**2. Small gradients vanish: loss scaling** (:class:`LossScaler`). The gradient
of a mean over ~100k points is ``(p - onehot) / 100000``, around 1e-5 and below,
and it shrinks further on its way back through the layers; float16's smallest
normal number is 6e-5 (its subnormals stop at 6e-8), so most of it rounds to
zero. Multiplying the loss by a *scale* ``S`` (here ``2**16``) multiplies every
gradient by ``S`` (the backward pass is linear in its incoming gradient), which
lifts them into float16's range; the weight gradients are divided by ``S`` again
in float32, before the optimizer sees them. A power of two, so that neither the
product nor the division rounds anything.

**3. Big gradients overflow: the scale is dynamic.** Too large a scale pushes
some gradient past float16's largest value (65504) to infinity, and the
infinity or a NaN made from it would wreck every weight it touches. So after
the backward pass the (unscaled, float32) gradients are checked: when any is
not finite, the step is *skipped* (no weight, no optimizer state changes) and
the scale is halved; after ``growth_interval`` steps in a row without overflow
it is doubled, to find out whether a larger scale fits now. The scale thus
hovers just below the largest one that does not overflow, and a skipped step
now and then is the price of keeping the small gradients (PyTorch's
``torch.amp.GradScaler`` follows the same rule, with the same defaults:
``2**16``, halve on overflow, double after 2000 good steps).

What stays float32: the loss and its gradient are computed from the float16
logits widened to float32 (:func:`numba_sc.train.loss.cross_entropy`), scaled
there, and only then rounded to float16 for the backward pass; BatchNorm's
statistics; the optimizer's state. The step that uses all of this is
:class:`numba_sc.train.trainer.Trainer` (``amp=True``; ``numba-sc train fit --amp``).

**Checkpoints** hold the full-precision model (:meth:`MasterWeights.state_dict`:
the masters under the model's own parameter names, so the file loads into a
float32 model as any other) and the scaler's state (:meth:`LossScaler.state_dict`:
its scale and its count of good steps), so a resumed run continues with the
very losses, skips and scales of an uninterrupted one.
"""
from __future__ import annotations

import math

import numpy as np

from ..core.backend import like, to_host
from ..core.device import array_module

HALF = np.dtype(np.float16)
FULL = np.dtype(np.float32)


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _power_of_two(value, name):
    ok = (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0 and math.frexp(float(value))[0] == 0.5)
    if not ok:
        raise ValueError(f"{name} must be a positive power of two (e.g. 2.0**16: multiplying and dividing by it "
                         f"rounds nothing), got {value!r}")
    return float(value)


class LossScaler:
    """The loss scale and its rule (module docstring, point 3).

    ``scale``: what the loss is multiplied by (a power of two, ``init_scale`` at
    first). After each step, :meth:`update` is told whether the step's gradients
    were finite: if not, the scale halves (never below ``min_scale``) and the count
    of good steps restarts; after ``growth_interval`` good steps in a row it
    doubles. Worked example, ``growth_interval=2``, starting at 8::

        step    finite   scale after   good steps after
        1       yes      8             1
        2       yes      16            0        (2 good steps: doubled)
        3       no       8             0        (skipped, halved)
        4       yes      8             1
    """

    def __init__(self, init_scale=2.0 ** 16, growth_interval=2000, min_scale=1.0):
        self.scale = _power_of_two(init_scale, "init_scale")
        self.growth_interval = _positive_int(growth_interval, "growth_interval")
        self.min_scale = _power_of_two(min_scale, "min_scale")
        self.good_steps = 0  # steps without overflow since the scale last changed
        self.skipped = 0  # steps skipped for overflow, in all

    def update(self, finite: bool):
        """Apply the rule after a step whose gradients were (``finite``) or were not finite."""
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= 2.0
                self.good_steps = 0
        else:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.skipped += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_interval": self.growth_interval, "min_scale": self.min_scale,
                "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict):
        """Restore :meth:`state_dict`'s values (checked before any is set)."""
        missing = {"scale", "growth_interval", "good_steps"} - set(state)
        if missing:
            raise KeyError(f"the loss scaler's state lacks {sorted(missing)}: not a LossScaler.state_dict()")
        scale = _power_of_two(float(state["scale"]), "scale")
        interval = _positive_int(int(state["growth_interval"]), "growth_interval")
        min_scale = _power_of_two(float(state.get("min_scale", self.min_scale)), "min_scale")
        good = int(state["good_steps"])
        if not 0 <= good < interval:
            raise ValueError(f"good_steps must be in [0, growth_interval={interval}), got {good}")
        self.scale, self.growth_interval, self.min_scale, self.good_steps = scale, interval, min_scale, good
        self.skipped = int(state.get("skipped", 0))

    def __repr__(self):
        return f"LossScaler(scale={self.scale:g}, good_steps={self.good_steps}/{self.growth_interval})"


class MasterWeights:
    """A float16 model and the float32 weights it is rounded from (module docstring, point 1).

    Build the model in float32 (on its device), build the optimizer on
    ``model.trainable_parameters()``, then ``MasterWeights(model, optimizer)``: the
    optimizer's arrays become the masters, and the model's convolution and linear
    weights are replaced by float16 copies (``model.half()``). After every
    optimizer step, :meth:`copy_to_model` rounds the masters into those copies.
    Parameters that stay float32 in a half model (BatchNorm's, biases) are shared
    by both: nothing to copy.
    """

    def __init__(self, model, optimizer):
        arrays = dict(model.trainable_parameters())
        if set(arrays) != set(optimizer.params):
            raise ValueError("the optimizer must hold exactly the model's trainable parameters: build it on "
                             "model.trainable_parameters() before mixed precision")
        for name, p in arrays.items():
            if optimizer.params[name] is not p:
                raise ValueError(f"the optimizer's {name!r} is not the model's array: build the optimizer on "
                                 "model.trainable_parameters() after moving the model (model.cuda()), and "
                                 "before mixed precision converts it")
            if np.dtype(p.dtype) != FULL:
                raise TypeError(f"parameter {name!r} is {p.dtype}: give mixed precision a float32 model (its "
                                "arrays become the float32 masters)")
        self.model = model
        self.masters = dict(optimizer.params)  # name -> float32 array, updated by the optimizer
        model.half()
        self.half = {name: p for name, p in model.trainable_parameters() if p is not self.masters[name]}

    def copy_to_model(self):
        """Round every master into the model's float16 copy of it (after an optimizer step)."""
        for name, h in self.half.items():
            array_module(h).copyto(h, self.masters[name], casting="same_kind")

    def state_dict(self) -> dict:
        """The model's state dict with the masters in place of their float16 roundings:
        the full-precision model, loadable into a float32 model."""
        state = self.model.state_dict()
        for name, m in self.masters.items():
            state[name] = np.array(to_host(m))
        return state

    def load_state_dict(self, state: dict):
        """Load a full-precision state dict: the model's own parameters (checked, and
        rounded into the float16 ones) and the masters, exactly."""
        self.model.load_state_dict(state)
        for name, m in self.masters.items():
            m[...] = like(np.asarray(to_host(state[name]), FULL), m)


def model_dtype(model):
    """The dtype a model computes in: that of its first convolution or linear weight
    (float16 after ``model.half()``), float32 for a model without any."""
    for _, m in model.named_modules():
        for p, role in m._params.items():
            if role == "model":
                return np.dtype(getattr(m, p).dtype)
    return FULL


__all__ = ["LossScaler", "MasterWeights", "model_dtype"]
