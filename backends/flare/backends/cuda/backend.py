"""The CUDA backend: the plugin's entry (probe, open devices). Each GPU is a `CudaDevice`."""
from __future__ import annotations

from typing import Any, Mapping

from flare.core.backend import Backend, ProbeResult
from flare.core.errors import BackendUnavailable

from .compiler import KernelCompiler, default_compiler, pick_target
from .device import CudaDevice
from .probe import cached_facts, judge


class CudaBackend(Backend):
    """NVIDIA GPUs through the driver API (cuda-bindings) and NVRTC.

    Config for `open_devices`: `devices` (indices to open, default all usable),
    `cache_dir` (compiled-kernel cache; default ~/.cache/flare/cuda or
    $FLARE_CACHE_DIR/cuda)."""

    name = "cuda"

    @classmethod
    def probe(cls) -> ProbeResult:
        return judge(cached_facts())

    @classmethod
    def open_devices(cls, config: Mapping[str, Any] | None = None) -> list[CudaDevice]:
        config = dict(config or {})
        facts = cached_facts()
        verdict = judge(facts)
        if not verdict.usable:
            raise BackendUnavailable(f"cuda: {verdict.reason}")
        compiler = KernelCompiler(config["cache_dir"]) if config.get("cache_dir") else default_compiler()
        wanted = config.get("devices")
        devices: list[CudaDevice] = []
        try:
            for gpu in facts.gpus:
                if wanted is not None and gpu.index not in wanted:
                    continue
                target = pick_target(gpu.capability, facts.nvrtc_archs)
                if target is None:
                    continue
                devices.append(CudaDevice(gpu, target[0], target[1], compiler))
        except Exception:
            for dev in devices:
                dev.close()
            raise
        if not devices:
            raise BackendUnavailable(f"cuda: none of the requested devices {wanted} is usable ({verdict.reason})")
        return devices
