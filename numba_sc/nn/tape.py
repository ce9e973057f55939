"""A tape: each layer's backward step recorded during the forward pass, played back in reverse.

This is reverse-mode differentiation with nothing hidden. While a :class:`Tape`
is open, every layer of :mod:`numba_sc.nn` (and :func:`numba_sc.nn.add`,
:func:`numba_sc.nn.cat`) appends one *step* after it runs: its output array, its
input arrays, and a function that maps the gradient of the output to the
gradients of the inputs (and adds its parameters' gradients to a dictionary).
:meth:`Tape.backward` starts from the loss's gradient with respect to the
network's output and walks the steps from the last to the first; an array that
fed several layers (a residual shortcut, a U-Net skip) collects the sum of the
gradients they send back, which is the chain rule for a variable used twice::

    model.train()
    with nn.Tape() as tape:
        y = model(x)
    loss, g = cross_entropy(y.features, target)     # dL/dy
    grads = tape.backward(y, g)                      # {"stem.0.0.weight": dL/dW, ...}
    opt.step(grads)

Arrays are told apart by identity (``id``): every layer returns a new feature
array, and the tape holds a reference to each array it recorded, so no id is
reused while the tape lives. Layers whose output *is* their input
(:class:`numba_sc.nn.Identity`) record nothing: the gradient flows through
unchanged. The kernels each step calls are in :mod:`numba_sc.conv.gradient` (the
convolutions) and :mod:`numba_sc.nn.pointwise` (the rest).
"""
from __future__ import annotations

import contextvars

from ..core.backend import like
from ..gmas.workspace import workspace_bytes

_TAPE = contextvars.ContextVar("numba_sc_tape", default=None)


class Gradients(dict):
    """What :meth:`Tape.backward` returns: parameter name -> gradient, and in
    ``.arrays`` the parameter arrays the forward pass read, by the same names.

    An optimizer built before the model's arrays were replaced (``model.cuda()``,
    ``.half()``) finds the new arrays here and follows them, as a PyTorch optimizer
    follows its parameters through ``.cuda()``."""

    def __init__(self):
        super().__init__()
        self.arrays = {}


def current_tape():
    """The open :class:`Tape`, or None (then layers record nothing and pay nothing)."""
    return _TAPE.get()


class Tape:
    """Records backward steps while open (``with Tape() as tape:``).

    ``keep_buffers``: how many bytes of gathered input buffers the tape's layers may
    keep for their weight gradients (:meth:`keep_buffer`). A convolution's forward
    gathers K slots of its inputs' rows, many times the layer's input; kept, its
    weight gradient reads them instead of gathering again. ``0`` (the default) keeps
    none: each weight gradient gathers its inputs again, one gather kernel per layer.
    Measured on both networks' training steps (``benchmarks/probes/tape_buffers.py``,
    ``benchmarks/results/tape_buffers.json``), gathering again cost about the same
    time, and on the small scans a step took a fraction of the memory. ``None``: up
    to the workspace (:func:`numba_sc.set_workspace`; every buffer when it is
    unbounded); a number: up to that many bytes.
    """

    def __init__(self, keep_buffers: int | None = 0):
        if keep_buffers is not None and (isinstance(keep_buffers, bool) or not isinstance(keep_buffers, int)
                                         or keep_buffers < 0):
            raise ValueError(f"keep_buffers must be a whole number of bytes >= 0 (0: keep none) or None "
                             f"(up to the workspace), got {keep_buffers!r}")
        self.keep_buffers = keep_buffers
        self.steps = []  # (output array, input arrays, backward(g, param_grads) -> input grads)
        self._left = {}
        self._token = None
        self._played = False
        self.kept_bytes = 0  # the gathered input buffers the steps hold (see keep_buffer)

    def keep_buffer(self, nbytes: int) -> bool:
        """Whether a layer may keep a gathered input buffer of ``nbytes`` for its weight
        gradient (saving a gather in the backward pass): yes while the buffers kept by
        this tape stay within ``keep_buffers`` (None: the workspace, unbounded when it
        is), which counts them. A layer told no gathers again in the backward."""
        if self.keep_buffers is None:
            bound = workspace_bytes() or None  # (a workspace of 0 is unbounded)
        else:
            bound = self.keep_buffers
        if bound is not None and self.kept_bytes + nbytes > bound:
            return False
        self.kept_bytes += nbytes
        return True

    def __enter__(self):
        self._token = _TAPE.set(self)
        return self

    def __exit__(self, *exc):
        _TAPE.reset(self._token)
        return False

    def record(self, output, inputs, backward):
        """One step: ``backward(g, param_grads)`` returns one gradient per input (or None
        for an input that gets none) and adds ``{parameter name: gradient}`` to
        ``param_grads``."""
        self.steps.append((output, tuple(inputs), backward))

    def backward(self, y, grad) -> Gradients:
        """Play the steps back from ``grad`` = dL/d``y.features``; returns the parameters'
        gradients by name (:meth:`numba_sc.nn.Module.named_parameters` names), a
        :class:`Gradients`."""
        out = getattr(y, "features", y)
        if tuple(grad.shape) != tuple(out.shape):
            raise ValueError(f"grad must have the shape of y's features {tuple(out.shape)}, got "
                             f"{tuple(grad.shape)}")
        if grad.dtype != out.dtype:
            raise TypeError(f"grad is {grad.dtype} but y's features are {out.dtype}: pass "
                            f"grad.astype({out.dtype.name!r})")
        if self._played:
            raise RuntimeError("this tape was played back already, and its steps let go of their arrays "
                               "as they ran: record the forward pass again in a new Tape")
        if not any(step[0] is out for step in self.steps):
            raise ValueError("y was not made by a layer called while this tape was open: run the "
                             "forward pass inside 'with Tape() as tape:'")
        grads = {id(out): grad}
        params = Gradients()
        # Each step is dropped once it has run, and with it the arrays it held (its
        # inputs, a kept buffer), as PyTorch frees its graph: the backward pass's
        # memory falls as it goes instead of holding the whole forward to the end.
        steps, self.steps, self._played = self.steps, [], True
        while steps:
            output, inputs, step = steps.pop()
            g = grads.pop(id(output), None)
            if g is None:  # this layer's output does not reach y
                continue
            for a, ga in zip(inputs, step(g, params)):
                if a is None or ga is None:
                    continue
                ga = like(ga, a)  # a gradient lives where its array does (host or device)
                k = id(a)
                grads[k] = ga if k not in grads else grads[k] + ga
        self._left = grads
        return params

    def grad(self, x):
        """After :meth:`backward`: dL/d``x.features`` for a tensor that no recorded layer
        made (the network's input), or None when the loss does not depend on it."""
        return self._left.get(id(getattr(x, "features", x)))


def add_param_grad(params: dict, name: str, g, param):
    """``params[name] += g`` (a layer called twice in one pass gets both gradients), on
    the side of the parameter array ``param`` (host or device), as an optimizer wants."""
    g = like(g, param)
    params[name] = g if name not in params else params[name] + g
    if isinstance(params, Gradients):
        params.arrays[name] = param
