"""`host`: a node computed by a named Python callback on the host.

It is how a model's expert-staging step sits *inside* the graph between the
router and the expert matmul: the scheduler gives every `host` node a split of
its own, the runtime reads its inputs to the host, calls the callback the
PreparedGraph was given under `params["callback"]`, and writes the returned
array (shape `params["shape"]`, dtype `params["dtype"]`) back. The callback
is named rather than stored so graphs stay serializable.
"""
from __future__ import annotations

from ..dtypes import DTYPES
from ..errors import DTypeError, ShapeError
from .registry import OpDef, register


def _host_infer(node, srcs, params):
    if params["dtype"] not in DTYPES:
        raise DTypeError(f"host output dtype {params['dtype']!r}", node)
    if not isinstance(params["callback"], str) or not params["callback"]:
        raise ShapeError("host needs a callback name", node)
    return tuple(params["shape"]), params["dtype"]


def _host_ref(x, p):
    raise RuntimeError(f"host op {p['callback']!r} has no reference: evaluate it with its callback")


register(OpDef("host", (0, 8), _host_infer, _host_ref, defaults={"args": {}}, required=("callback", "shape", "dtype")))
