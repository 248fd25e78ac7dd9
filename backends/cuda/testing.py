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
        from .device import CudaBackend

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
