"""A partial third-party backend, as an author writes one from docs/write-a-backend.md:
device `f64:0` computes six ops (matmul, add, mul, gelu, softmax, layer_norm) in
float64 and stores f32; `supports` refuses every other op, so the conformance suite
skips those cases and runs the lifecycle graphs' other nodes on the CPU fallback.

Memory is host memory (bytearrays the host addresses, `host_view` returns views),
kernels follow the kernel contract: `kernel(out, srcs, params)`, params with
defaults, matmul's b may be f16, and `out` may alias `srcs[0]` (every kernel computes
its result before writing it). `FLARE_F64_ALIAS_UNSAFE=1` swaps in a layer_norm that
reads its input after writing its output, for the test that the suite catches it.
"""
from __future__ import annotations

import math
import os

import numpy as np

from flare.core.backend import Backend, BufferType, Device, MemoryInfo, PreparedSplit, ProbeResult, numpy_view
from flare.core.errors import BackendUnavailable, ReleasedError
from flare.core.ledger import LEDGER
from flare.core.ops import OPS
from flare.core.plugin_manager import hookimpl
from flare.core.specs import BackendSpec

ALIGNMENT = 64
MEMORY = 256 << 20
_erf = np.frompyfunc(math.erf, 1, 1)


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float64)


def _matmul(out, srcs, p):
    b = _f64(srcs[1])
    np.copyto(out, _f64(srcs[0]) @ (np.swapaxes(b, -1, -2) if p["transpose_b"] else b), casting="same_kind")


def _gelu(out, srcs, p):
    x = _f64(srcs[0])
    np.copyto(out, 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64)), casting="same_kind")


def _softmax(out, srcs, p):
    z = _f64(srcs[0]) * p["scale"]
    if len(srcs) > 1:
        z = z + _f64(srcs[1])
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    np.copyto(out, e / e.sum(axis=-1, keepdims=True), casting="same_kind")


def _layer_norm(out, srcs, p):
    x = _f64(srcs[0])
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    np.copyto(out, (x - mean) / np.sqrt(var + p["eps"]), casting="same_kind")


def _layer_norm_alias_unsafe(out, srcs, p):
    """Uses `out` as scratch for the squares, then reads the input again: wrong when they alias."""
    x = srcs[0]
    mean = _f64(x).mean(axis=-1, keepdims=True)
    np.square(x, out=out)
    var = _f64(out).mean(axis=-1, keepdims=True) - mean ** 2
    np.copyto(out, (_f64(x) - mean) / np.sqrt(var + p["eps"]), casting="same_kind")


KERNELS = {
    "matmul": _matmul,
    "add": lambda out, srcs, p: np.copyto(out, _f64(srcs[0]) + _f64(srcs[1]), casting="same_kind"),
    "mul": lambda out, srcs, p: np.copyto(out, _f64(srcs[0]) * _f64(srcs[1]), casting="same_kind"),
    "gelu": _gelu,
    "softmax": _softmax,
    "layer_norm": _layer_norm,
}


class F64Program(PreparedSplit):
    """The split's kernels bound to numpy views of its bindings."""

    def __init__(self, device: "F64Device", program):
        self._device = device
        kernels = dict(KERNELS)
        if os.environ.get("FLARE_F64_ALIAS_UNSAFE") == "1":
            kernels["layer_norm"] = _layer_norm_alias_unsafe
        view = lambda t: device.host_view(program.bindings[t.id])  # noqa: E731
        self._steps = [(kernels[n.op], view(n), [view(s) for s in n.srcs], dict(n.params))
                       for n in program.nodes if OPS[n.op].view is None]
        device.programs += 1

    def run(self) -> None:
        if self._steps is None:
            raise ReleasedError(f"{self._device.name}: this program was released")
        for kernel, out, srcs, params in self._steps:
            kernel(out, srcs, params)

    def release(self) -> None:
        if self._steps is not None:
            self._steps = None
            self._device.programs -= 1


class F64Device(Device):
    backend = "f64"

    def __init__(self, name: str):
        super().__init__(name)
        self.programs = 0

    def buffer_type(self) -> BufferType:
        return BufferType("f64-host", ALIGNMENT, MEMORY)

    def memory(self) -> MemoryInfo:
        return MemoryInfo(max(0, MEMORY - LEDGER.live_bytes(self.name)), MEMORY)

    def _alloc_raw(self, nbytes: int) -> bytearray:
        return bytearray(nbytes)

    def _free_raw(self, handle) -> None:
        pass

    def host_view(self, binding) -> np.ndarray:
        return numpy_view(np.frombuffer(binding.buffer.handle, np.uint8), binding)

    def write(self, binding, array) -> None:
        np.copyto(self.host_view(binding), array, casting="same_kind")

    def read_into(self, binding, out) -> None:
        np.copyto(out, self.host_view(binding))

    def supports(self, node) -> bool:
        # float64 kernels read floats: block-quantized weights (docs/ops.md) go elsewhere
        return node.op in KERNELS and all(s.dtype in ("f32", "f16") for s in node.srcs)

    def compile(self, program) -> F64Program:
        return F64Program(self, program)

    def live_objects(self) -> dict[str, int]:
        return {"programs": self.programs}


class F64Backend(Backend):
    name = "f64"

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "six ops in float64 on the host", ("f64:0",))

    @classmethod
    def open_devices(cls, config=None) -> list[F64Device]:
        count = int((config or {}).get("count", 1))
        if count != 1:
            raise BackendUnavailable(f"f64: {count} devices asked for, 1 offered")
        return [F64Device("f64:0")]


@hookimpl
def flare_backends() -> list[BackendSpec]:
    return [BackendSpec("f64", F64Backend, version="0.1.0", description="a partial backend: six ops in float64")]
