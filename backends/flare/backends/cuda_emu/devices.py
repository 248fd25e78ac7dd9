"""Opening a CUDA device for tests: the real GPU, or the real device code over the emulator.

Test modules parametrize over both kinds, so the same checks run everywhere:
on a machine without a GPU the `gpu` kind skips with the probe's reason, on a
GPU machine both run.
"""
from __future__ import annotations

KINDS = ("emulated", "gpu")


def open_device(kind: str):
    """(device, "") for `kind` in KINDS, or (None, why it cannot be opened here)."""
    if kind == "gpu":
        from flare.backends.cuda.backend import CudaBackend

        verdict = CudaBackend.probe()
        if not verdict.usable:
            return None, f"cuda: {verdict.reason}"
        return CudaBackend.open_devices()[0], ""
    if kind == "emulated":
        from .emulator import host_compiler, open_emulated_device

        try:
            import cuda.bindings  # noqa: F401
        except ImportError as exc:
            return None, f"cuda-bindings is not installed ({exc})"
        if host_compiler() is None:
            return None, "no C++ compiler to build the kernel emulator"
        return open_emulated_device(), ""
    raise ValueError(f"device kind {kind!r}: expected one of {KINDS}")


def bind_graph(dev, graph):
    """Every storage tensor of `graph` in its own buffer on `dev`, weights written:
    (buffers by storage id, bindings by tensor id). The caller releases the buffers."""
    import numpy as np

    from flare.core.backend import Binding
    from flare.core.dtypes import itemsize

    buffers, bindings = {}, {}
    try:
        for t in graph.tensors:
            st = t.storage
            if st.id not in buffers:
                buffers[st.id] = dev.alloc(st.nbytes, st.name)
            bindings[t.id] = Binding(buffers[st.id], t.offset * itemsize(t.dtype), t.shape, t.strides, t.dtype)
        for t in graph.weights.values():
            dev.write(bindings[t.id], np.asarray(t.host_data()))
    except BaseException:
        for buf in buffers.values():
            buf.release()
        raise
    return buffers, bindings


def cuda_required(config) -> bool:
    """Whether an unusable GPU must fail the run instead of skipping: FLARE_REQUIRE_CUDA=1,
    or pytest's `--require-backends` (Flare's pytest plugin) covering `cuda`."""
    import os

    if os.environ.get("FLARE_REQUIRE_CUDA"):
        return True
    try:
        required = config.getoption("--require-backends")
        selected = config.getoption("--backends")
    except ValueError:  # Flare's pytest plugin is not loaded
        return False
    if not required:
        return False
    if required == "*":
        return not selected or "cuda" in [b.strip() for b in selected.split(",")]
    return "cuda" in [b.strip() for b in required.split(",")]


def device_for_test(request, kind: str):
    """Open a device of `kind` for a pytest fixture, or skip (fail where CUDA is required)."""
    import pytest

    dev, why = open_device(kind)
    if dev is None:
        if kind == "gpu" and cuda_required(request.config):
            pytest.fail(f"{why} (CUDA is required here)", pytrace=False)
        pytest.skip(why)
    return dev
