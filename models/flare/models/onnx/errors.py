"""The importer's errors: each names the node or tensor, and exits 2 through the CLI."""
from __future__ import annotations

from flare.core.errors import ModelError


class OnnxError(ModelError):
    """A malformed or unusable ONNX file: names the file and the node or tensor."""


class UnsupportedOpError(OnnxError):
    """Ops this importer cannot lower (every one named, with its node, in one line)."""
