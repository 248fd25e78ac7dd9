"""tiny-moe's configuration, weights, graph and placement.

One mixture-of-experts layer over `tokens` rows of width 16:

    h      = rms_norm(x) * norm.weight
    probs  = softmax(h @ router.weight^T)           router over 16 experts
    ids    = top_k(probs, 2), gates = probs[ids]
    y      = x + sum_j gates_j * down[ids_j] @ silu(up[ids_j] @ h)

Expert weights are `experts.up` [16, 32, 16] and `experts.down` [16, 16, 32].
With `experts=resident` they are graph weights (uploaded to the device once).
With `experts=offload` the graph holds `cache` tensors of `slots` experts
instead, and a `host` node named `stage_experts` — the name the runtime binds
to the ModelSpec's `stage_experts` callback — returns, per (token, choice),
the cache slot its expert was copied into; `mul_mat_id` then indexes the cache
with slots where the resident graph indexes the weights with expert ids.
Every node and weight of the expert half is named `experts.*`, which is all
the placement callback looks at.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from flare.core.errors import ModelError
from flare.core.graph import GraphBuilder, Tensor
from flare.core.specs import STAGE_EXPERTS

D_MODEL, D_FF, N_EXPERTS, TOP_K = 16, 32, 16, 2
RESIDENT, OFFLOAD = "resident", "offload"
EXPERT_TENSORS = ("experts.up", "experts.down")
EXPERT_PREFIX = "experts."


@dataclass(frozen=True)
class TinyConfig:
    """The options a caller may give (`Session.prepare_model("tiny-moe", options)`, or
    `flare run/describe tiny-moe --option KEY=VALUE`)."""

    experts: str = OFFLOAD   # resident | offload
    slots: int = 8           # expert-cache slots (offload)
    tokens: int = 4          # rows of the first planned input
    seed: int = 0            # of the random weights

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "TinyConfig":
        """Read and check options; a ModelError names the option, its value and what is allowed."""
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ModelError(f"tiny-moe: unknown option(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(cls.__dataclass_fields__)}")
        values = {}
        for key, value in options.items():
            kind = type(getattr(cls, key))
            try:
                values[key] = kind(value)
            except (TypeError, ValueError):
                raise ModelError(f"tiny-moe: option {key}={value!r} is not {kind.__name__}") from None
        cfg = cls(**values)
        if cfg.experts not in (RESIDENT, OFFLOAD):
            raise ModelError(f"tiny-moe: option experts={cfg.experts!r}; expected {RESIDENT!r} or {OFFLOAD!r}")
        if not 1 <= cfg.slots <= N_EXPERTS:
            raise ModelError(f"tiny-moe: option slots={cfg.slots} must be in 1..{N_EXPERTS}")
        if cfg.tokens < 1:
            raise ModelError(f"tiny-moe: option tokens={cfg.tokens} must be >= 1")
        return cfg


@lru_cache(maxsize=4)
def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random weights: the same seed gives the same model in every process."""
    rng = np.random.default_rng(seed)

    def init(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    return {"norm.weight": (1 + 0.1 * rng.standard_normal(D_MODEL)).astype(np.float32),
            "router.weight": init(N_EXPERTS, D_MODEL),
            "experts.up": init(N_EXPERTS, D_FF, D_MODEL),
            "experts.down": init(N_EXPERTS, D_MODEL, D_FF)}


def build_forward(b: GraphBuilder, shapes: Mapping[str, tuple], cfg: TinyConfig) -> None:
    """The `forward` entry: input `x` [tokens, 16], output `y` of the same shape."""
    w = weights(cfg.seed)
    x = b.input("x", shapes["x"])
    h = b.mul(b.rms_norm(x, eps=1e-5, name="norm"), b.weight("norm.weight", w["norm.weight"]), name="norm.scaled")
    probs = b.softmax(b.matmul(h, b.weight("router.weight", w["router.weight"]), transpose_b=True, name="router"), name="router_p")
    ids = b.top_k(probs, k=TOP_K, name="top_k")                           # [T, 2] expert ids
    gates = b.gather(probs, ids, name="gates")                             # [T, 2]
    up_w, down_w, sel = _expert_weights(b, cfg, ids)
    up = b.mul_mat_id(up_w, h, sel, name="experts.up_mm")                   # [T, 2, 32]
    down = b.mul_mat_id(down_w, b.silu(up, name="experts.silu"), sel, name="experts.down_mm")   # [T, 2, 16]
    t = x.shape[0]
    weighted = b.mul(down, b.reshape(gates, shape=(t, TOP_K, 1), name="gates3"), name="experts.weighted")
    y = b.sum(weighted, axis=1, name="experts.combine")
    b.output("y", b.add(x, y, name="residual"))


def _expert_weights(b: GraphBuilder, cfg: TinyConfig, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(up, down, selector): all experts as weights indexed by expert id, or the cache indexed by slot."""
    if cfg.experts == RESIDENT:
        w = weights(cfg.seed)
        return b.weight("experts.up", w["experts.up"]), b.weight("experts.down", w["experts.down"]), ids
    up = b.cache("experts.up", (cfg.slots, D_FF, D_MODEL))
    down = b.cache("experts.down", (cfg.slots, D_MODEL, D_FF))
    slots = b.host(ids, callback=STAGE_EXPERTS, shape=ids.shape, dtype="i32", name="experts.stage")
    return up, down, slots


def placement(tensor: Tensor, devices: list[str]) -> str | None:
    """ModelSpec.placement: the expert half on the session's last device, the rest on its first.

    The scheduler asks for every weight, state/cache tensor and node (by name); with
    one device both answers are that device. Returning None would leave the tensor to
    the scheduler's own rules (weights follow, then device order)."""
    return devices[-1] if tensor.name.startswith(EXPERT_PREFIX) else devices[0]
