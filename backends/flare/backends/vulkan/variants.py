"""Kernel variants: the workgroup and tile sizes a shader is specialized with.

Each tunable op has a few named variants (the values become specialization constants 5 and
up, so one SPIR-V file serves all of them). `program.tuning[op]` (from an exported core's
tuning profile, as on the CPU backend) picks one by name; otherwise the device's default
applies: GPUs get wide workgroups and big shared-memory tiles (matmul.comp), CPU drivers
(lavapipe runs one workgroup per thread, a subgroup as one SIMD register, a barrier as a
switch between coroutines, and every shared or buffer load as one scalar load per lane)
get the lane-blocked matmul (matmul_lanes.comp: 16 x 16 outputs per invocation straight
from the buffers, four k per vec4 load, no shared memory: 32 load instructions per 1024
FMAs), measured on lavapipe at 23.6 GFLOPS against 6.9 for the best shared-memory tile at
n = 512, and 14 against 5 GFLOPS on silero-vad's convolutions.

`FLARE_VULKAN_KERNEL_PROFILE=gpu|cpu` (device config `kernel_profile`) overrides the
device-type default, so the GPU variants (several subgroups per workgroup, shared-memory
combination, 256-invocation tiles) run, and are tested, on lavapipe too.

A variant that the device cannot run (shared memory or invocations over its limits) is
never chosen: `pick` falls back to the default, and `fits` tells `kernels` when even that
does not fit (the generic kernel then runs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

CPU_TYPE = 4  # VkPhysicalDeviceType CPU


@dataclass(frozen=True)
class Tile:
    """matmul.comp: WG invocations compute a BM x BN tile, TM x TN each, K in steps of BK."""

    wg: int
    bm: int
    bn: int
    bk: int
    tm: int
    tn: int

    def __post_init__(self) -> None:
        if self.bm % self.tm or self.bn % self.tn or self.wg != (self.bm // self.tm) * (self.bn // self.tn) or self.bk % 4:
            raise ValueError(f"{self}: WG must be (BM/TM)*(BN/TN) and BK a multiple of 4")

    def spec(self) -> tuple[int, ...]:
        return (self.wg, self.bm, self.bn, self.bk, self.tm, self.tn)

    def shared_bytes(self) -> int:
        return 4 * self.bk * (self.bm + 1 + self.bn + 1)


@dataclass(frozen=True)
class Lanes:
    """matmul_lanes.comp: WG invocations side by side along n, each a TM x TN output block."""

    wg: int
    tm: int
    tn: int

    def __post_init__(self) -> None:
        if self.tn % 4:
            raise ValueError(f"{self}: TN must be a multiple of 4 (vec4 loads along n)")

    def spec(self) -> tuple[int, ...]:
        return (self.wg, self.tm, self.tn)


@dataclass(frozen=True)
class Rows:
    """One workgroup of `wg` invocations per row (matvec: `nr` outputs per workgroup)."""

    wg: int
    nr: int = 1

    def spec(self) -> tuple[int, ...]:
        return (self.wg, self.nr)


MATMUL: dict[str, Tile | Lanes] = {
    "t64": Tile(256, 64, 64, 16, 4, 4),
    "t32": Tile(64, 32, 32, 16, 4, 4),
    "t64r8k32": Tile(64, 64, 64, 32, 8, 8),
    "t64r16": Tile(16, 64, 64, 16, 16, 16),
    "t128r16": Tile(32, 128, 64, 16, 16, 16),
    "t16": Tile(16, 16, 32, 16, 4, 8),
    "l16": Lanes(8, 16, 16),
    "l8": Lanes(8, 8, 8),
}
SMALL_TILE = {"gpu": "t16", "cpu": "l8"}  # default when the output (per batch) is at most 32 x 32
IDS_TILE = {"gpu": "t64", "cpu": "t64r16"}  # mul_mat_id's tiled path is matmul.comp only (a Tile)
MATVEC: dict[str, Rows] = {"wg8": Rows(8, 4), "wg32": Rows(32, 4), "wg128": Rows(128, 2)}
ROWS: dict[str, Rows] = {"wg8": Rows(8), "wg32": Rows(32), "wg128": Rows(128), "wg256": Rows(256)}

# op -> variant table (conv1d and mul_mat_id run on the matmul / matvec shaders)
TABLES: dict[str, dict[str, Any]] = {
    "matmul": MATMUL, "conv1d": MATMUL, "mul_mat_id": MATVEC, "matvec": MATVEC,
    "softmax": ROWS, "layer_norm": ROWS, "rms_norm": ROWS, "norm_affine": ROWS, "attention": ROWS,
    "sum": ROWS, "mean": ROWS, "max": ROWS, "argmax": ROWS, "top_k": ROWS,
}
DEFAULT_GPU = {"matmul": "t64", "matvec": "wg128", "rows": "wg128"}
DEFAULT_CPU = {"matmul": "l16", "matvec": "wg8", "rows": "wg8"}


def _family(op: str) -> str:
    table = TABLES[op]
    return "matmul" if table is MATMUL else "matvec" if table is MATVEC else "rows"


def profile_of(info: Any, requested: str | None) -> str:
    """'cpu' or 'gpu': the requested kernel profile, else by device type."""
    if requested:
        if requested not in ("cpu", "gpu"):
            raise ValueError(f"kernel profile must be 'cpu' or 'gpu', not {requested!r}")
        return requested
    return "cpu" if info.type_code == CPU_TYPE else "gpu"


def default(op: str, device: Any, shape: tuple[int, int] | None = None) -> str:
    """The variant `op` uses on this device when no tuning says otherwise (`shape`: a matmul's
    output rows and columns per batch)."""
    family = _family(op)
    if family == "matmul" and shape is not None and max(shape) <= 32:
        return SMALL_TILE[device.kernel_profile]
    defaults = DEFAULT_CPU if device.kernel_profile == "cpu" else DEFAULT_GPU
    name = defaults[family]
    return name if fits(TABLES[op][name], device.info) else _smallest(op)


def _smallest(op: str) -> str:
    return min(TABLES[op], key=lambda n: TABLES[op][n].wg)


def fits(v: Any, info: Any) -> bool:
    if v.wg > info.max_workgroup_invocations:
        return False
    return not isinstance(v, Tile) or v.shared_bytes() <= info.max_shared_memory


def pick(op: str, tuning: Mapping[str, str], device: Any, *, family: str | None = None,
         shape: tuple[int, int] | None = None) -> Any:
    """The variant for `op`: the tuned one when named and runnable here, else the default."""
    table = TABLES[family or op]
    name = tuning.get(op)
    if name in table and fits(table[name], device.info):
        return table[name]
    return table[default(family or op, device, shape)]


def pick_tile(device: Any, shape: tuple[int, int]) -> Tile:
    """The shared-memory tile for mul_mat_id's tiled path (matmul.comp only; `shape`: the
    output rows and columns per expert, at most)."""
    tile = MATMUL["t16" if max(shape) <= 32 else IDS_TILE[device.kernel_profile]]
    assert isinstance(tile, Tile)
    return tile if fits(tile, device.info) else MATMUL["t16"]


def pick_quant(op: str, tuning: Mapping[str, str], device: Any, shape: tuple[int, int], qsub: int) -> Tile | Lanes:
    """The matmul variant for quantized weights (matmul_q.comp for a Tile, matmul_q_lanes.comp for
    Lanes): as `pick`, but a tile's k-step must stay inside one scale's sub-block of `qsub`
    weights (it dequantizes BK weights of a column with one scale), else the `t16` tile."""
    v = pick(op, tuning, device, shape=shape)
    if isinstance(v, Tile) and (qsub % v.bk or not fits(v, device.info)):
        v = MATMUL["t16"]
    return v


# weights per invocation step of matvec_q.comp: a whole sub-block on CPU drivers (one scale read
# per sub-block and row; lavapipe pays per load), 8 on GPUs (more invocations share a row of K)
QUANT_UNIT_GPU = 8


def quant_unit(device: Any, qsub: int) -> int:
    """UNIT of matvec_q.comp for a block type with `qsub` weights per scale."""
    return qsub if device.kernel_profile == "cpu" else min(QUANT_UNIT_GPU, qsub)


def names(op: str) -> tuple[str, ...]:
    """The variant names a tuning profile may give for `op` on Vulkan."""
    return tuple(TABLES.get(op, {}))
