"""Placement policy: attention, norms and router on one device; experts where the
residency policy (or a per-layer override) puts them.

The scheduler asks `policy(tensor, devices)` for every weight, state and node.
Names decide: `L{i}.experts.*` (expert weights or cache slots) and
`L{i}.expert.*` (expert nodes, the staging node) belong to layer i's experts;
everything else belongs to its layer (`L{i}.`) or to the main device. A node a
device cannot run is left to the scheduler (`None`), which falls back and, in
strict mode, reports it, instead of failing here.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from flare.core.errors import PlacementError
from flare.core.graph import Tensor

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
    `layers` / `expert_layers`: per-layer overrides. `devices` (the session's Device
    objects) lets it leave unsupported nodes to the scheduler."""

    def __init__(self, main: str | None = None, experts: str | None = None, *,
                 layers: Mapping[int, str] | None = None, expert_layers: Mapping[int, str] | None = None,
                 devices: Sequence[object] | None = None):
        self.main = main
        self.experts = experts
        self.layers = dict(layers or {})
        self.expert_layers = dict(expert_layers or {})
        self._devices = {getattr(d, "name", str(d)): d for d in (devices or [])}

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

    def __call__(self, tensor: Tensor, devices: list[str]) -> str | None:
        want = self.wanted(tensor.name) or devices[0]
        device = resolve(want, devices)
        dev = self._devices.get(device)
        if tensor.op is not None and tensor.op != "host" and dev is not None and not dev.supports(tensor):
            return None
        return device


def resolve(want: str, devices: Sequence[str]) -> str:
    """'cpu' -> 'cpu:0' among the session's devices; PlacementError naming the choices."""
    if want in devices:
        return want
    for d in devices:
        if d.split(":")[0] == want:
            return d
    raise PlacementError(f"moe-lm placement asks for device {want!r}, which is not in this session "
                         f"({', '.join(devices)})", [want])
