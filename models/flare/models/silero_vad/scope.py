"""Named scopes for graph nodes, so placement callbacks can tell model stages apart.

`Scope(b, "frontend").conv1d(x, w)` is `b.conv1d(x, w)` with the node named
`frontend/conv1d_0`. A placement callback sees only the tensor, so a stage
prefix in the name is how a model says "this node belongs to the encoder".
(Shared by Flare's model plugins; a `GraphBuilder.scope()` in core would replace it.)
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable

from flare.core.graph import GraphBuilder, Tensor


# builder -> prefix -> counter: two Scope objects with one prefix never clash.
_COUNTERS: "weakref.WeakKeyDictionary[GraphBuilder, dict[str, itertools.count]]" = weakref.WeakKeyDictionary()


class Scope:
    """Forwards op calls to a builder, naming each node `<prefix>/<op>_<n>`."""

    def __init__(self, b: GraphBuilder, prefix: str):
        self.b = b
        self.prefix = prefix
        self._n = _COUNTERS.setdefault(b, {}).setdefault(prefix, itertools.count())

    def __getattr__(self, op_name: str) -> Callable[..., Tensor]:
        if op_name.startswith("_"):
            raise AttributeError(op_name)

        def call(*srcs: Any, **params: Any) -> Tensor:
            name = params.pop("name", None) or f"{self.prefix}/{op_name}_{next(self._n)}"
            return self.b.op(op_name, *srcs, name=name, **params)

        return call


def stage_of(name: str) -> str:
    """The stage prefix of a node or weight name ('frontend/conv1d_0' -> 'frontend')."""
    return name.split("/", 1)[0] if "/" in name else ""
