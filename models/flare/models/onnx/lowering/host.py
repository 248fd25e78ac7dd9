"""Host steps (ops whose output shape depends on data, random draws) and If."""
from __future__ import annotations

import numpy as np

from .base import HOST_STEPS, _host, attributes, cval, lowers


for _op in ("NonZero", "Unique", "Compress"):
    HOST_STEPS[_op] = _host


@lowers("If")
def _if(tr, node, ins, attrs):
    """The branch the condition picks, inlined (the condition is read on the host when computed)."""
    cond = bool(np.asarray(tr.c(ins[0])).reshape(-1)[0])
    return tr.run_branch(attrs["then_branch" if cond else "else_branch"])


for _op in ("NonMaxSuppression",):  # its output length is the number of boxes kept: data-dependent
    HOST_STEPS[_op] = _host


def _random_like(tr, node, ins):
    """RandomNormalLike / RandomUniformLike: drawn on the host (seeded by the node's `seed` when it has one)."""
    attrs = attributes(node)
    x = ins[0]
    from ..values import np_dtype_of

    dtype = np_dtype_of(attrs["dtype"], "dtype") if "dtype" in attrs else x.dtype
    rng = np.random.default_rng(int(attrs["seed"]) if "seed" in attrs else None)
    if node.op_type == "RandomNormalLike":
        arr = rng.normal(attrs.get("mean", 0.0), attrs.get("scale", 1.0), x.shape)
    else:
        arr = rng.uniform(attrs.get("low", 0.0), attrs.get("high", 1.0), x.shape)
    v = cval(arr.astype(dtype))
    v.runtime = True  # a fresh draw per call: an input of the next segment, never a cached weight
    return [v]


HOST_STEPS["RandomNormalLike"] = _random_like


HOST_STEPS["RandomUniformLike"] = _random_like
