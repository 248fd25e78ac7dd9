"""Typed errors. Every failure a user can cause or meet says *what* and *where*.

One hierarchy so callers can catch `FlareError` at the top and tests can
assert the precise kind. Messages name the node, tensor, backend or file.

Each class carries the exit code every `flare` command uses for it (one
convention, see `flare.core.cli`): USAGE (2) when the user's input or options are
wrong — the input, a file, an option value, a core, a model's configuration or
weights, a backend that cannot run here —, RUN_FAILED (1) when the run itself
failed (out of memory, a device error, a broken plugin, a released graph).
"""
from __future__ import annotations

OK, RUN_FAILED, USAGE = 0, 1, 2


class FlareError(Exception):
    """Base of every error Flare raises on purpose."""

    exit_code: int = RUN_FAILED


class GraphError(FlareError):
    """A graph is malformed: unknown op, cycle, bad reference. Names the node."""

    exit_code = USAGE

    def __init__(self, message: str, node: str | None = None):
        self.node = node
        super().__init__(f"node {node!r}: {message}" if node else message)


class ShapeError(GraphError):
    """Shapes of an op's inputs or params do not fit its rule."""


class DTypeError(GraphError):
    """Dtypes of an op's inputs do not fit its rule."""


class InputError(FlareError):
    """Bad input: an execute() input (missing, unknown, wrong shape/dtype), an option value,
    a file's contents, an environment variable. Names what and where."""

    exit_code = USAGE


class AllocationError(FlareError):
    """A reservation failed. Names the backend, the bytes asked and the bytes free.

    Raised instead of ever handing out a null or short buffer; whoever raises it
    has already released everything the failed attempt allocated.
    """

    def __init__(self, backend: str, asked: int, free: int | None, detail: str = ""):
        self.backend = backend
        self.asked = int(asked)
        self.free = None if free is None else int(free)  # None: the raiser cannot know (a planner)
        self.detail = detail
        have = "free bytes unknown" if self.free is None else f"{self.free} bytes free"
        msg = f"allocation failed on {backend}: asked {self.asked} bytes, {have}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class ReleasedError(FlareError):
    """Use of a PreparedGraph (or buffer) after release()."""


class BackendUnavailable(FlareError):
    """A backend was asked for but cannot run here (or does not exist); the message says why."""

    exit_code = USAGE


class PlacementError(FlareError):
    """The scheduler could not place nodes (strict mode, or nothing supports them)."""

    def __init__(self, message: str, nodes: list[str] | None = None):
        self.nodes = list(nodes or [])
        super().__init__(message)


class PluginError(FlareError):
    """A plugin is broken or two plugins register the same name."""


class ModelError(FlareError):
    """A model's weights or configuration are missing or malformed. Names the tensor/file.

    Exit code 2: the model's options, configuration and weight files are its input
    (an expert cache too small for the options given, a weight file of the wrong shape)."""

    exit_code = USAGE


class UnknownModelError(ModelError):
    """No model of that name is registered (the command line named it)."""


class CoreFormatError(FlareError):
    """An exported core (manifest, catalog, files) is malformed. Names the field."""

    exit_code = USAGE

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


def exit_code(exc: BaseException) -> int:
    """The `flare` exit code for an exception: its class's for a FlareError; USAGE for a
    path the user named that cannot be opened; RUN_FAILED for anything else."""
    if isinstance(exc, FlareError):
        return int(exc.exit_code)
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return USAGE
    return RUN_FAILED
