"""Placement policy: attention, norms and router on one device; experts where the
residency policy (or a per-layer override) puts them.

The scheduler asks `policy(tensor, devices)` for every weight, state and node.
Names decide: `L{i}.experts.*` (expert weights or cache slots) and
`L{i}.expert.*` (expert nodes, the staging node) belong to layer i's experts;
everything else belongs to its layer (`L{i}.`) or to the main device. Op nodes
are answered with `Prefer(device)`: a node that device cannot run is placed by
the scheduler's other rules instead, which records the fallback (describe()'s
`placement_fallbacks`; an error in strict mode). Weights, state and caches are
placed where asked.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from flare.core.errors import PlacementError
from flare.core.graph import Tensor
from flare.core.partition import Prefer

_EXPERT = re.compile(r"^L(\d+)\.experts?\.")
_LAYER = re.compile(r"^L(\d+)\.")


def parse_layer_map(items: Iterable[str] | None) -> dict[int, str]:
    """['0-2=cpu', '3=vulkan'] -> {0: 'cpu', 1: 'cpu', 2: 'cpu', 3: 'vulkan'}."""
    out: dict[int, str] = {}
    for item in items or ():
        layers, sep, device = item.partition("=")
        if not sep or not device:
            raise ValueError(f"layer placement {item!r}: expected LAYERS=DEVICE, e.g. 0-1=cpu or 3=vulkan")
        for part in layers.split(","):
            lo, dash, hi = part.partition("-")
            if not lo.strip().isdigit() or (dash and not hi.strip().isdigit()):
                raise ValueError(f"layer placement {item!r}: {part!r} is not a layer or range")
            for layer in range(int(lo), int(hi if dash else lo) + 1):
                out[layer] = device.strip()
    return out


class Placement:
    """A placement callback. `main`: device of attention/norms/router (default: the
    session's first); `experts`: device of all experts (default: main);
    `layers` / `expert_layers`: per-layer overrides. Registered with no devices
    (`plugin.py`), it needs none: op nodes get a `Prefer`, which the scheduler
    overrules where the device cannot run them."""

    def __init__(self, main: str | None = None, experts: str | None = None, *,
                 layers: Mapping[int, str] | None = None, expert_layers: Mapping[int, str] | None = None):
        self.main = main
        self.experts = experts
        self.layers = dict(layers or {})
        self.expert_layers = dict(expert_layers or {})

    def wanted(self, name: str) -> str | None:
        """The device name (as given by the user) this tensor should go to."""
        m = _EXPERT.match(name)
        if m:
            layer = int(m.group(1))
            return self.expert_layers.get(layer) or self.experts or self.layers.get(layer) or self.main
        m = _LAYER.match(name)
        if m:
            return self.layers.get(int(m.group(1))) or self.main
        return self.main

    def __call__(self, tensor: Tensor, devices: Sequence[str]) -> str | Prefer:
        device = resolve(self.wanted(tensor.name) or devices[0], devices)
        return Prefer(device) if tensor.op is not None and tensor.op != "host" else device


def resolve(want: str, devices: Sequence[str]) -> str:
    """'cpu' -> 'cpu:0' among the session's devices; PlacementError naming the choices."""
    if want in devices:
        return want
    for d in devices:
        if d.split(":")[0] == want:
            return d
    raise PlacementError(f"moe-lm placement asks for device {want!r}, which is not in this session "
                         f"({', '.join(devices)})", [want])
