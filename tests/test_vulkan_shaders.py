"""The committed SPIR-V matches its GLSL.

Two checks: the manifest's hashes of each shader's sources and .spv (no compiler needed,
so a .comp edited without rebuilding fails everywhere), and, where glslc is installed and
is the version that built the manifest, recompiling gives the committed bytes exactly.
Fix either failure with `python scripts/build_shaders.py` and commit the .spv files.
"""
from __future__ import annotations

import json

import pytest

from flare.backends.vulkan import pipelines, shaderbuild


def test_every_shader_has_spv_and_is_in_the_manifest():
    names = shaderbuild.shader_names()
    assert set(names) == set(pipelines.SHADERS), "pipelines.SHADERS must list exactly the shaders on disk"
    assert set(json.loads(shaderbuild.MANIFEST.read_text())["shaders"]) == set(names)
    for name in names:
        assert (shaderbuild.SHADER_DIR / f"{name}.spv").read_bytes()[:4] == b"\x03\x02\x23\x07"  # SPIR-V magic
    source = "".join((shaderbuild.SHADER_DIR.parent / f).read_text() for f in ("lowering.py", "fusion.py"))
    used = {n for n in names if f'"{n}"' in source}
    assert used == set(names), f"shaders no lowering uses: {sorted(set(names) - used)}"


def test_spv_not_stale_by_manifest():
    stale = shaderbuild.stale_by_manifest()
    assert not stale, f"rebuild with `python scripts/build_shaders.py`: stale {stale}"


def test_spv_not_stale_by_compiling():
    if shaderbuild.glslc_path() is None:
        pytest.skip("glslc is not installed (Debian: apt install glslc); the manifest check still ran")
    recorded = json.loads(shaderbuild.MANIFEST.read_text())["glslc"]
    if shaderbuild.glslc_version() != recorded:
        pytest.skip(f"glslc here is {shaderbuild.glslc_version()!r}, the .spv were built with {recorded!r}: "
                    "byte equality only holds for the same compiler")
    stale = shaderbuild.stale_by_compiling()
    assert not stale, f"committed .spv differ from glslc output: {stale}; run `python scripts/build_shaders.py`"
