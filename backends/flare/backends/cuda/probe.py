"""Is CUDA usable here, and if not, exactly why?

Split in two so the judgement is testable without a GPU: `gather_facts()`
asks the machine (bindings, NVRTC, driver library, cuInit, devices) and never
raises; `judge(facts)` is a pure function from those facts to a
`ProbeResult`, with one clear reason per way things go wrong:

- cuda-bindings not installed          -> pip install flare-runtime[cuda]
- no driver library (libcuda)          -> install the NVIDIA driver
- driver present, cuInit fails         -> CUDA_ERROR_NO_DEVICE etc., named
- NVRTC missing                        -> pip install nvidia-cuda-nvrtc
- driver older than NVRTC's major      -> update the driver (or an older NVRTC)
- every GPU older than NVRTC supports  -> named with NVRTC's range
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from flare.core.backend import ProbeResult

from . import driver as drv

INSTALL_HINT = "pip install flare-runtime[cuda]"


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    capability: tuple[int, int]
    total_memory: int


@dataclass(frozen=True)
class ProbeFacts:
    """What `gather_facts` found; every field may be missing on a partial machine."""

    bindings_version: str | None = None
    bindings_error: str | None = None
    nvrtc_version: tuple[int, int] | None = None
    nvrtc_archs: tuple[int, ...] = ()
    nvrtc_error: str | None = None
    driver_error: str | None = None        # the driver library could not be loaded
    init_status: str | None = None         # cuInit's CUresult name
    driver_version: int | None = None      # cuDriverGetVersion, e.g. 12080
    gpus: tuple[GpuFacts, ...] = ()
    gpu_error: str | None = None           # a device query failed after cuInit succeeded

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt_version(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def _gather_nvrtc(facts: dict[str, Any]) -> None:
    from .compiler import nvrtc_version, supported_archs

    try:
        facts["nvrtc_version"] = nvrtc_version()
        facts["nvrtc_archs"] = supported_archs()
    except Exception as exc:  # CompilerUnavailable, or anything the loader raises
        facts["nvrtc_error"] = str(exc)


def _gather_driver(driver: Any, facts: dict[str, Any]) -> None:
    try:
        result = driver.cuInit(0)
    except Exception as exc:  # cuda.pathfinder: libcuda is not there
        facts["driver_error"] = f"{type(exc).__name__}: {exc}"
        return
    status = result[0] if isinstance(result, tuple) else result
    facts["init_status"] = drv.status_name(status)
    try:
        facts["driver_version"] = int(drv.call(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
    except Exception:
        pass
    if facts["init_status"] != drv.SUCCESS:
        return
    try:
        gpus = []
        attr = driver.CUdevice_attribute
        for i in range(int(drv.call(driver.cuDeviceGetCount(), "cuDeviceGetCount"))):
            dev = drv.call(driver.cuDeviceGet(i), "cuDeviceGet")
            raw = drv.call(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
            name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            major = drv.call(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                             "cuDeviceGetAttribute")
            minor = drv.call(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                             "cuDeviceGetAttribute")
            total = drv.call(driver.cuDeviceTotalMem(dev), "cuDeviceTotalMem")
            gpus.append(GpuFacts(i, name, (int(major), int(minor)), int(total)))
        facts["gpus"] = tuple(gpus)
    except Exception as exc:
        facts["gpu_error"] = f"{type(exc).__name__}: {exc}"


def gather_facts() -> ProbeFacts:
    """Ask this machine. Never raises: a failure is itself a fact."""
    facts: dict[str, Any] = {}
    try:
        import cuda.bindings

        driver = drv.load()
        facts["bindings_version"] = getattr(cuda.bindings, "__version__", "?")
    except Exception as exc:  # ImportError, or a broken install
        return ProbeFacts(bindings_error=f"{type(exc).__name__}: {exc}")
    _gather_nvrtc(facts)
    _gather_driver(driver, facts)
    return ProbeFacts(**facts)


def judge(facts: ProbeFacts) -> ProbeResult:
    """The verdict on `facts`: usable or not, and the one reason that matters most.

    Hardware facts come before software ones (no point installing NVRTC on a
    machine without a GPU); `details` carries every fact for `flare backends`."""
    details = facts.as_dict()

    def no(reason: str) -> ProbeResult:
        return ProbeResult(False, reason, (), details)

    if facts.bindings_error:
        return no(f"cuda-bindings is not installed: {INSTALL_HINT}")
    if facts.driver_error:  # the loader's own words stay in details["driver_error"]
        return no("no NVIDIA driver: the CUDA driver library (libcuda.so) could not be loaded; "
                  "install the NVIDIA driver")
    if facts.init_status == drv.NO_DEVICE or (facts.init_status == drv.SUCCESS and not facts.gpus
                                                and not facts.gpu_error):
        ver = f" {_fmt_version(drv.version_tuple(facts.driver_version))}" if facts.driver_version else ""
        return no(f"the NVIDIA driver{ver} is installed but there is no CUDA device "
                  "(CUDA_ERROR_NO_DEVICE; check CUDA_VISIBLE_DEVICES and that the GPU is visible here)")
    if facts.init_status != drv.SUCCESS:
        return no(f"cuInit failed: {facts.init_status}")
    if facts.gpu_error:
        return no(f"querying the CUDA devices failed: {facts.gpu_error}")
    if facts.nvrtc_error or facts.nvrtc_version is None:
        return no(f"NVRTC (the runtime CUDA compiler) is missing: pip install nvidia-cuda-nvrtc "
                  f"({facts.nvrtc_error or 'no version'})")
    note = ""
    if facts.driver_version is not None:
        dv = drv.version_tuple(facts.driver_version)
        nv = facts.nvrtc_version
        if dv[0] < nv[0]:
            return no(f"the NVIDIA driver is too old: it supports CUDA {_fmt_version(dv)}, NVRTC is "
                      f"{_fmt_version(nv)}; update the driver to one for CUDA {nv[0]}.x, or install "
                      f"nvidia-cuda-nvrtc {dv[0]}.x")
        if dv < nv:
            note = (f"; driver CUDA {_fmt_version(dv)} is older than NVRTC {_fmt_version(nv)}: "
                    "CUBIN only (no PTX fallback)")
    from .compiler import pick_target

    usable = [g for g in facts.gpus if pick_target(g.capability, facts.nvrtc_archs) is not None]
    if not usable:
        archs = facts.nvrtc_archs
        span = f"sm_{min(archs)}..sm_{max(archs)}" if archs else "no architectures"
        found = ", ".join(f"{g.name} (sm_{g.capability[0]}{g.capability[1]})" for g in facts.gpus)
        return no(f"{found}: older than every architecture NVRTC {_fmt_version(facts.nvrtc_version)} "
                  f"supports ({span})")
    dv_text = _fmt_version(drv.version_tuple(facts.driver_version)) if facts.driver_version else "?"
    gpus = ", ".join(f"cuda:{g.index} {g.name} (sm_{g.capability[0]}{g.capability[1]}, "
                     f"{g.total_memory / 2**30:.0f} GiB)" for g in usable)
    reason = f"{gpus}; driver CUDA {dv_text}, NVRTC {_fmt_version(facts.nvrtc_version)}{note}"
    return ProbeResult(True, reason, tuple(f"cuda:{g.index}" for g in usable), details)


@functools.lru_cache(maxsize=1)
def cached_facts() -> ProbeFacts:
    """Facts gathered once per process (cuInit and device queries do not change)."""
    return gather_facts()
