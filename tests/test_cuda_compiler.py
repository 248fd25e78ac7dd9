"""NVRTC compilation of every CUDA kernel, and the compiled-image cache. No GPU needed."""
from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed (pip install flare-runtime[cuda])")

from flare.backends.cuda import compiler as cc  # noqa: E402
from flare.backends.cuda.compiler import (CompileError, KernelCompiler, KernelSource, cache_key,  # noqa: E402
                                          kernel_sources, pick_target)

try:
    NVRTC = cc.nvrtc_version()
except cc.CompilerUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"NVRTC unavailable: {exc}", allow_module_level=True)

ARCHS = (80, 90)
SOURCES = kernel_sources()


@pytest.fixture(scope="module")
def compiler():
    """The default on-disk cache: the first run compiles, later runs check the cached images."""
    return KernelCompiler()


def test_every_kernel_file_is_found():
    assert set(SOURCES) >= {"elementwise", "matmul", "norm", "index", "layout", "reduce", "rope", "conv"}
    for src in SOURCES.values():
        assert "common.cuh" in src.headers
        assert src.kernels(), f"{src.name}.cu defines no FLARE_KERNEL"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_compiles_to_ptx_and_cubin(compiler, name, arch):
    src = SOURCES[name]
    ptx = compiler.compile(src, arch, "ptx")
    assert ptx.image.strip(b"\0 "), "empty PTX"
    assert ptx.ptx_target == f"sm_{arch}"
    for kernel in src.kernels():
        assert f".entry {kernel}(".encode() in ptx.image, f"{kernel} missing from the PTX"
    cubin = compiler.compile(src, arch, "cubin")
    assert cubin.image.startswith(b"\x7fELF"), "a CUBIN is an ELF image"
    assert len(cubin.image) > 1000
    for kernel in src.kernels():
        assert kernel.encode() in cubin.image


TINY = KernelSource("tiny", 'extern "C" __global__ void k(float* p) { p[threadIdx.x] = 1.0f; }')


def test_cache_key_changes_with_source_arch_format_version_and_options():
    base = cache_key(TINY, 90, "cubin", (13, 0))
    other_src = KernelSource("tiny", TINY.text + "\n// changed")
    other_header = KernelSource("tiny", TINY.text, {"common.cuh": "// x"})
    assert len({
        base,
        cache_key(other_src, 90, "cubin", (13, 0)),
        cache_key(other_header, 90, "cubin", (13, 0)),
        cache_key(TINY, 80, "cubin", (13, 0)),
        cache_key(TINY, 90, "ptx", (13, 0)),
        cache_key(TINY, 90, "cubin", (13, 1)),
        cache_key(TINY, 90, "cubin", (13, 0), options=("--std=c++17", "-G")),
    }) == 7
    assert cache_key(TINY, 90, "cubin", (13, 0)) == base  # and it is stable


def test_second_compile_hits_the_disk_cache(tmp_path):
    first = KernelCompiler(tmp_path)
    a = first.compile(TINY, 90, "cubin")
    assert not a.from_cache and first.compiled == 1
    assert first.path(TINY, 90, "cubin").exists()
    assert first.compile(TINY, 90, "cubin") is a  # memory cache
    second = KernelCompiler(tmp_path)  # a new process, in effect
    b = second.compile(TINY, 90, "cubin")
    assert b.from_cache and second.compiled == 0 and b.image == a.image
    c = second.compile(TINY, 80, "cubin")  # another arch is another entry
    assert not c.from_cache and second.compiled == 1
    changed = KernelSource("tiny", TINY.text + "\n")
    assert not second.compile(changed, 90, "cubin").from_cache


def test_version_is_part_of_the_cache_file(tmp_path):
    comp = KernelCompiler(tmp_path)
    path_now = comp.path(TINY, 90, "ptx")
    comp._version = (NVRTC[0], NVRTC[1] + 1)  # as if NVRTC were upgraded
    assert comp.path(TINY, 90, "ptx") != path_now


def test_unwritable_cache_only_costs_recompiling(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    comp = KernelCompiler(blocker / "cuda")
    assert comp.compile(TINY, 90, "ptx").image


def test_cache_dir_follows_flare_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    assert cc.cache_dir() == tmp_path / "cuda"


def test_compile_error_carries_the_nvrtc_log(tmp_path):
    bad = KernelSource("bad", 'extern "C" __global__ void k() { undefined_thing(); }')
    with pytest.raises(CompileError, match="undefined_thing"):
        KernelCompiler(tmp_path).compile(bad, 90, "cubin")


def test_supported_archs_include_the_test_targets():
    archs = cc.supported_archs()
    assert set(ARCHS) <= set(archs)


@pytest.mark.parametrize("capability, want", [
    ((9, 0), (90, "cubin")),           # H100/H200: exact SASS
    ((8, 6), (86, "cubin")),
    ((9, 9), (90, "ptx")),             # unknown newer minor: PTX of the newest older arch, JIT by the driver
    ((5, 2), None),                    # older than anything NVRTC supports
])
def test_pick_target(capability, want):
    assert pick_target(capability, (75, 80, 86, 89, 90)) == want


def test_compiling_leaves_python_bytes_intact(tmp_path):
    """NVRTC fills the buffers it is given: they must be fresh memory. A one-byte log
    once went into CPython's shared b" " object and turned every b" " into b"\\0"."""
    KernelCompiler(tmp_path / "cuda").compile(TINY, 90, "ptx")
    assert b" " * 3 == bytes([32, 32, 32])
