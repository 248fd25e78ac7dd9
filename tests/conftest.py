"""Fixtures shared by test files of several models and plugins.

The backend matrix itself (`backend`, `--backends`) comes from the pytest plugin
`flare.plugins.testing`; what lives here is test data that several files need,
built once per session.
"""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gguf_plugin() -> None:
    """The gguf model plugin registered with Flare's plugin manager, where the installed
    entry points predate it (a source checkout run through PYTHONPATH); a no-op where it is
    installed. GGUF test files name it in their `pytestmark`."""
    pytest.importorskip("gguf")
    from flare.models.gguf.testing import ensure_registered

    ensure_registered()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, gguf_plugin: None) -> Path:
    """The default tiny llama GGUF (`flare.models.gguf.testing.write_tiny`, a few hundred KiB),
    written once per session; tests that change a file copy it first."""
    from flare.models.gguf.testing import TinySpec, write_tiny

    return write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf", TinySpec())
