"""CpuDevice.compile for the native executor: nodes -> command lists (+ NumPy steps).

Tuning (an exported core's per-program kernel choices) was measured on the NumPy
kernels; of its choices the native path keeps the one that is a data layout
(`packed`: the matmul weight stored transposed in a split-owned buffer) and runs
its own C kernel where the choice is only another NumPy implementation."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from flare.core.backend import SplitProgram
from flare.core.graph import WEIGHT
from flare.core.host_calls import host_node_step
from flare.core.ops import OPS

from . import Native
from ..lowering import Cmd, conv_prepackable, prepackable, translate, use_packed, use_packed_conv, use_packed_lstm
from ..split import CommandList, NativeSplit
from .winograd import transform_weight_of, use_winograd, winograd_takes

if TYPE_CHECKING:
    from ..device import CpuDevice


def compile_native(device: "CpuDevice", native: Native, program: SplitProgram) -> NativeSplit:
    """Translate every node; runs of translated nodes become one CommandList each."""
    steps: list[Callable[[], None]] = []
    owned: list[Any] = []
    fallback: list[str] = []
    pending: list[tuple[str, list[Cmd]]] = []
    native_nodes = 0
    prepacked: list[str] = []
    winograd: list[str] = []
    runs: list[list[tuple[str, list[Cmd]]]] = []
    order: list[Any] = []  # ("run", index) or a NumPy step
    try:
        for node in program.nodes:
            if OPS[node.op].view is not None:
                continue
            out = device.host_view(program.binding(node))
            srcs = [device.host_view(program.binding(s)) for s in node.srcs]
            if node.op == "host":
                # a host node the partitioner left in this split (`runs_in_walk`): its callback's
                # command (expert staging's step in C), else (below) the callback as a step of the split
                cmds = _host_command(program, node, out, srcs)
            elif node.op == "matmul" and program.tuning.get("matmul") == "packed" and not srcs[1].dtype.names:
                # a layout choice the C kernels honour: the weight stored [K, N] once, in the split
                srcs = device._pack(node, srcs, owned)
                cmds = translate(_Untransposed(node), out, srcs)
            else:
                cmds = translate(node, out, srcs)
                if cmds and node.op in ("matmul", "linear") and node.params.get("transpose_b") \
                        and node.srcs[1].storage.role == WEIGHT and prepackable(cmds[0], srcs[1]):
                    use_packed(cmds[0], device.packs.get(srcs[1], node.srcs[1].name, owned))
                    prepacked.append(node.name)
                elif cmds and node.op == "conv1d" and node.srcs[1].storage.role == WEIGHT \
                        and conv_prepackable(cmds[0], srcs[1]):
                    # the row layout's product against panels of the weight [Cout, Cin*K], packed once
                    # (OpenBLAS packed it on every call) and run by the FMA chain of pgemm
                    co = srcs[1].shape[0]
                    use_packed_conv(cmds[0], device.packs.get(srcs[1].reshape(co, -1), node.srcs[1].name, owned))
                    prepacked.append(node.name)
                elif cmds and len(cmds) == 1 and len(srcs) > 1 and node.srcs[1].storage.role == WEIGHT \
                        and winograd_takes(cmds[0], srcs[1], native.lib):
                    # F(4, K) Winograd: the weight transformed once (U = G w) for the C path
                    use_winograd(cmds[0], device.packs.get(srcs[1], node.srcs[1].name, owned, transform_weight_of),
                                 native.lib, device.threads)
                    prepacked.append(node.name)
                    winograd.append(node.name)
                elif cmds and node.op == "lstm" and node.srcs[1].storage.role == WEIGHT:
                    # W_hh in panels: each step's W h is then broadcast FMAs, no horizontal sums
                    use_packed_lstm(cmds[0], device.packs.get(srcs[1], node.srcs[1].name, owned))
                    prepacked.append(node.name)
            if cmds is None:
                if pending:
                    runs.append(pending)
                    order.append(("run", len(runs) - 1))
                    pending = []
                order.append(host_node_step(node, program.bindings, device, program.host_calls) if node.op == "host"
                             else device.numpy_step(program, node, owned))
                fallback.append(f"{node.name} ({node.op})")
            else:
                pending.append((node.name, cmds))
                native_nodes += 1
        if pending:
            runs.append(pending)
            order.append(("run", len(runs) - 1))
        scratch_bytes = max((c["scratch"] for run in runs for _, cmds in run for c in cmds), default=0)
        scratch = None
        if scratch_bytes:
            buf = device.alloc(scratch_bytes, tag="cpu:native-scratch")
            owned.append(buf)
            scratch = buf.handle[:scratch_bytes].view(np.uint8)
        for item in order:
            if isinstance(item, tuple):
                run = runs[item[1]]
                flat = [(name, c) for name, cmds in run for c in cmds]
                steps.append(CommandList(native, [c for _, c in flat], [n for n, _ in flat], scratch, device.pool))
            else:
                steps.append(item)
    except BaseException:
        for buf in owned:
            buf.release()
        raise
    info = {"executor": "native", "native_nodes": native_nodes, "numpy_nodes": fallback,
            "calls_into_c": sum(1 for s in steps if isinstance(s, CommandList)),
            "prepacked_weights": len(prepacked), "winograd_convs": len(winograd), "threads": device.threads,
            "split_commands": sum(s.split_commands() for s in steps if isinstance(s, CommandList))}
    return NativeSplit(steps, owned, info)


def _host_command(program: SplitProgram, node: Any, out: np.ndarray, srcs: list[np.ndarray]) -> list[Cmd] | None:
    """The command a host node's callback offers for this split (`walk_command(node, ctx, out,
    srcs)` -> a command dict or None), as a one-command list."""
    if program.host_calls is None:
        return None
    callbacks, ctx = program.host_calls
    make = getattr(callbacks.get(node.params.get("callback")), "walk_command", None)
    c = make(node, ctx, out, srcs) if make is not None else None
    return None if c is None else [c]


class _Untransposed:
    """A matmul node seen with `transpose_b` off (its right operand was already transposed)."""

    def __init__(self, node: Any):
        self.op, self.name = node.op, node.name
        self.params = {**node.params, "transpose_b": False}
