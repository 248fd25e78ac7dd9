"""Hooks `flare bench` adds (through `flare_addhooks`): how models join the benchmark."""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("flare")


@hookspec
def flare_bench_workloads() -> list:
    """Return `flare.plugins.bench.Workload` subclasses (or instances), one per model name.

    A workload says how a request looks, which `[options]` a configuration may
    set, what "faster" is measured in and how close two outputs must be. Two
    workloads for one model are an error. Import heavy modules inside the
    workload's methods, not here: the hook runs whenever `flare bench` starts.
    """


@hookspec
def flare_bench_peers() -> list:
    """Return `flare.plugins.bench.Peer`s: other ways to serve a model's requests.

    Each names its `model` (a workload kind), the Python package it needs and
    `open(config) -> Runner`. A configuration picks one with `peer = "NAME"`.
    """
