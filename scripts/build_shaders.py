#!/usr/bin/env python3
"""Rebuild the Vulkan backend's SPIR-V from its GLSL (needs `glslc`, Debian package glslc).

    python scripts/build_shaders.py          # rebuild every .spv and shaders/manifest.json
    python scripts/build_shaders.py --check  # exit 1 if a committed .spv is stale

Commit the .spv files and manifest.json with the .comp change that made them.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _shaderbuild():
    """Load backends/flare/backends/vulkan/shaderbuild.py by path: works without installing Flare."""
    path = ROOT / "backends" / "flare" / "backends" / "vulkan" / "shaderbuild.py"
    spec = importlib.util.spec_from_file_location("flare_vulkan_shaderbuild", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report stale .spv files instead of rebuilding")
    args = ap.parse_args(argv)
    sb = _shaderbuild()
    if sb.glslc_path() is None:
        print("glslc not found (Debian: apt install glslc)", file=sys.stderr)
        return 2
    if args.check:
        stale = sorted(set(sb.stale_by_manifest()) | set(sb.stale_by_compiling()))
        for name in stale:
            print(f"stale: {name}.spv")
        return 1 if stale else 0
    manifest = sb.build()
    print(f"built {len(manifest['shaders'])} shaders with {manifest['glslc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
