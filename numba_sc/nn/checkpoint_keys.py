"""Renaming a checkpoint's keys, for a network whose modules are named otherwise.

A spconv or TorchSparse training script names its modules as it likes
(``backbone.conv_input.0.weight`` where :mod:`numba_sc.nn.models` says
``stem.0.0.weight``). The converters (:mod:`numba_sc.nn.spconv_format`,
:mod:`numba_sc.nn.torchsparse_format`) take ``rename=``, applied to every key of the
checkpoint before its names are matched to the model's:

* a callable ``name -> new name`` (or None to drop the entry: an optimizer's state,
  a head this model lacks);
* a dict ``{regex: replacement}``, each pattern applied in turn with :func:`re.sub`
  (so ``{r"^backbone\\.": "", r"conv_input": "stem.0"}`` strips a prefix, then renames
  one module).

Two keys renamed to one name are refused (one would silently win).
"""
from __future__ import annotations

import re

__all__ = ["rename_keys"]


def rename_keys(state: dict, rename=None) -> dict:
    """``state`` with its keys renamed by ``rename`` (a callable, a ``{regex: replacement}``
    dict, or None: unchanged). Raises on two keys that become one."""
    if rename is None:
        return dict(state)
    if isinstance(rename, dict):
        rules = []
        for pattern, repl in rename.items():
            try:
                rules.append((re.compile(pattern), repl))
            except re.error as e:
                raise ValueError(f"rename: {pattern!r} is not a regular expression ({e})") from None

        def fn(name):
            for rx, repl in rules:
                name = rx.sub(repl, name)
            return name
    elif callable(rename):
        fn = rename
    else:
        raise TypeError(f"rename must be a callable (name -> new name, or None to drop) or a dict "
                        f"{{regex: replacement}}, got {type(rename).__name__}")
    out, source = {}, {}
    for key, value in state.items():
        new = fn(key)
        if new is None:
            continue
        if not isinstance(new, str):
            raise TypeError(f"rename turned {key!r} into {new!r}: it must return a string (or None to drop)")
        if new in out:
            raise ValueError(f"rename maps both {source[new]!r} and {key!r} to {new!r}: make the rule tell "
                             "them apart, or drop one (return None)")
        out[new], source[new] = value, key
    return out
