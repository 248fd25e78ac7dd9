"""Typed errors. Every failure a user can cause or meet says *what* and *where*.

One hierarchy so callers can catch `FlareError` at the top and tests can
assert the precise kind. Messages name the node, tensor, backend or file.
"""
from __future__ import annotations


class FlareError(Exception):
    """Base of every error Flare raises on purpose."""


class GraphError(FlareError):
    """A graph is malformed: unknown op, cycle, bad reference. Names the node."""

    def __init__(self, message: str, node: str | None = None):
        self.node = node
        super().__init__(f"node {node!r}: {message}" if node else message)


class ShapeError(GraphError):
    """Shapes of an op's inputs or params do not fit its rule."""


class DTypeError(GraphError):
    """Dtypes of an op's inputs do not fit its rule."""


class InputError(FlareError):
    """An execute() input is missing, unknown, or of the wrong shape/dtype."""


class AllocationError(FlareError):
    """A reservation failed. Names the backend, the bytes asked and the bytes free.

    Raised instead of ever handing out a null or short buffer; whoever raises it
    has already released everything the failed attempt allocated.
    """

    def __init__(self, backend: str, asked: int, free: int, detail: str = ""):
        self.backend = backend
        self.asked = int(asked)
        self.free = int(free)
        msg = f"allocation failed on {backend}: asked {self.asked} bytes, {self.free} bytes free"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class ReleasedError(FlareError):
    """Use of a PreparedGraph (or buffer) after release()."""


class BackendUnavailable(FlareError):
    """A backend was asked for but cannot run here; the message says why."""


class PlacementError(FlareError):
    """The scheduler could not place nodes (strict mode, or nothing supports them)."""

    def __init__(self, message: str, nodes: list[str] | None = None):
        self.nodes = list(nodes or [])
        super().__init__(message)


class PluginError(FlareError):
    """A plugin is broken or two plugins register the same name."""


class ModelError(FlareError):
    """A model's weights or configuration are missing or malformed. Names the tensor/file."""


class CoreFormatError(FlareError):
    """An exported core (manifest, catalog, files) is malformed. Names the field."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)
