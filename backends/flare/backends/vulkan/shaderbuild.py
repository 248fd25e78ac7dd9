"""Compiling the GLSL compute shaders to the SPIR-V committed next to them.

The `.spv` files are committed so users need no shader compiler. Two checks keep them
honest: `manifest.json` records a hash of each shader's sources (its `.comp` plus the
shared include) and of its `.spv`, checkable without any compiler; and where `glslc`
is installed, recompiling must give the committed bytes exactly (when the glslc version
matches the one recorded; another version may legitimately emit other bytes).
`scripts/build_shaders.py` is the command line around this module.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

SHADER_DIR = Path(__file__).resolve().parent / "shaders"
MANIFEST = SHADER_DIR / "manifest.json"
INCLUDES = ("common.glsl", "wg_reduce.glsl")  # hashed for every shader
# hashed only for the shaders that #include them (so adding one leaves the other hashes valid)
OPTIONAL_INCLUDES = ("quant.glsl",)
GLSLC_FLAGS = ("-O", "--target-env=vulkan1.1")


def glslc_path() -> str | None:
    return shutil.which("glslc")


def glslc_version() -> str:
    out = subprocess.run([glslc_path() or "glslc", "--version"], capture_output=True, text=True, check=True).stdout
    return " | ".join(line.strip() for line in out.splitlines()[:3] if line.strip())


def shader_names() -> list[str]:
    return sorted(p.stem for p in SHADER_DIR.glob("*.comp"))


def source_hash(name: str) -> str:
    """sha256 over the shader's .comp, the shared includes and the optional ones it includes (what its .spv is built from)."""
    h = hashlib.sha256()
    source = (SHADER_DIR / f"{name}.comp").read_text()
    optional = tuple(inc for inc in OPTIONAL_INCLUDES if f'#include "{inc}"' in source)
    for part in (f"{name}.comp", *INCLUDES, *optional):
        h.update(part.encode() + b"\0" + (SHADER_DIR / part).read_bytes() + b"\0")
    return h.hexdigest()


def compile_shader(name: str, out: Path) -> None:
    """glslc one shader; raises CalledProcessError with glslc's message on a compile error."""
    cmd = [glslc_path() or "glslc", *GLSLC_FLAGS, "-I", str(SHADER_DIR), str(SHADER_DIR / f"{name}.comp"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def compiled_bytes(name: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.spv"
        compile_shader(name, out)
        return out.read_bytes()


def build() -> dict:
    """Rebuild every .spv and the manifest; returns the manifest."""
    manifest = {"glslc": glslc_version(), "flags": list(GLSLC_FLAGS), "shaders": {}}
    for name in shader_names():
        spv = SHADER_DIR / f"{name}.spv"
        compile_shader(name, spv)
        manifest["shaders"][name] = {"source_sha256": source_hash(name),
                                     "spv_sha256": hashlib.sha256(spv.read_bytes()).hexdigest()}
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def stale_by_manifest() -> list[str]:
    """Shaders whose sources or .spv no longer match the manifest (needs no compiler)."""
    manifest = json.loads(MANIFEST.read_text())
    stale = []
    for name in shader_names():
        entry = manifest["shaders"].get(name)
        spv = SHADER_DIR / f"{name}.spv"
        if (entry is None or not spv.exists() or entry["source_sha256"] != source_hash(name)
                or entry["spv_sha256"] != hashlib.sha256(spv.read_bytes()).hexdigest()):
            stale.append(name)
    return stale


def stale_by_compiling() -> list[str]:
    """Shaders whose committed .spv differs from what glslc produces now."""
    return [n for n in shader_names()
            if not (SHADER_DIR / f"{n}.spv").exists() or compiled_bytes(n) != (SHADER_DIR / f"{n}.spv").read_bytes()]
