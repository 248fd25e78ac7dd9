"""The kernels' argument block as a ctypes structure, and tensor descriptors.

Every kernel takes one `KArgs` by value (see kernels/common.cuh, which
static_asserts the same sizes). One layout for all kernels keeps Python and
CUDA C in step in a single place, and makes a launch's arguments a flat byte
block that a CUDA graph node copies and a rebind rewrites.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

from flare.core.backend import Binding
from flare.core.dtypes import is_quant, itemsize

MAX_TENSORS = 6
MAX_INTS = 8
MAX_FLOATS = 4
# dtype codes of the descriptors: common.cuh DT_* and, for the block-quantized types (whose
# elements are blocks: offsets, shapes and strides count blocks), quant.cuh DT_Q*
DTYPE_CODES = {"f32": 0, "f16": 1, "i32": 2, "i64": 3, "q4_0": 4, "q4_1": 5, "q8_0": 6, "q4_k": 7, "q6_k": 8}


class TensorDesc(ctypes.Structure):
    """Mirror of `struct TensorDesc`: address, element offset, shape[4], strides[4]."""

    _fields_ = [
        ("ptr", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("shape", ctypes.c_int64 * 4),
        ("stride", ctypes.c_int64 * 4),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
    ]


class KArgs(ctypes.Structure):
    """Mirror of `struct KArgs`: up to six tensors, a work count, ints and floats."""

    _fields_ = [
        ("t", TensorDesc * MAX_TENSORS),
        ("n", ctypes.c_int64),
        ("i", ctypes.c_int64 * MAX_INTS),
        ("f", ctypes.c_float * MAX_FLOATS),
    ]


assert ctypes.sizeof(TensorDesc) == 88 and ctypes.sizeof(KArgs) == 616, "layout must match common.cuh"


def pad4(shape: Sequence[int], strides: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Left-pad a rank-1..4 layout to rank 4 with size-1, stride-0 axes."""
    if len(shape) > 4 or len(shape) != len(strides):
        raise ValueError(f"layout {tuple(shape)}/{tuple(strides)} is not rank 1..4")
    extra = 4 - len(shape)
    return (1,) * extra + tuple(int(d) for d in shape), (0,) * extra + tuple(int(s) for s in strides)


def broadcast_strides(shape: Sequence[int], strides: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """Strides that read a tensor of `shape` as `target` (NumPy broadcasting: stride 0)."""
    extra = len(target) - len(shape)
    if extra < 0:
        raise ValueError(f"cannot broadcast {tuple(shape)} to {tuple(target)}")
    out = []
    for axis, want in enumerate(target):
        if axis < extra:
            out.append(0)
            continue
        have, stride = shape[axis - extra], strides[axis - extra]
        if have == want:
            out.append(stride if want != 1 else 0)
        elif have == 1:
            out.append(0)
        else:
            raise ValueError(f"cannot broadcast {tuple(shape)} to {tuple(target)}")
    return tuple(out)


def address_of(binding: Binding) -> int:
    """The buffer's base address (a device pointer on CUDA, a host one when emulated)."""
    handle = binding.buffer.handle
    if handle is None:
        raise ValueError(f"binding into {binding.buffer!r} has no memory")
    return int(handle)


def fill(desc: TensorDesc, binding: Binding, shape: Sequence[int] | None = None,
         strides: Sequence[int] | None = None) -> None:
    """Describe `binding` in `desc`, optionally as another layout of the same memory
    (a broadcast, an axis swap) given by `shape`/`strides` in elements."""
    size = itemsize(binding.dtype)
    if is_quant(binding.dtype):
        # A block is 18..210 bytes, so a placement aligned for floats (an arena slot, an expert
        # cache slot) is not a whole number of blocks from the buffer's start: the byte offset
        # goes into the address and kernels count blocks from there. quant.cuh reads the
        # blocks' float16 fields as 16-bit words: even offsets only.
        if binding.offset % 2:
            raise ValueError(f"byte offset {binding.offset} of a {binding.dtype} tensor is odd (16-bit fields)")
        base, offset = address_of(binding) + binding.offset, 0
    elif binding.offset % size:
        raise ValueError(f"byte offset {binding.offset} of a {binding.dtype} tensor is not element-aligned")
    else:
        base, offset = address_of(binding), binding.offset // size
    shape = binding.shape if shape is None else shape
    strides = binding.strides if strides is None else strides
    s4, st4 = pad4(shape, strides)
    desc.ptr = base
    desc.offset = offset
    desc.shape[:] = s4
    desc.stride[:] = st4
    desc.dtype = DTYPE_CODES[binding.dtype]
    desc.ndim = len(shape)


def clone(args: KArgs) -> KArgs:
    """An independent copy (launch plans keep their own argument blocks)."""
    out = KArgs()
    ctypes.memmove(ctypes.addressof(out), ctypes.addressof(args), ctypes.sizeof(KArgs))
    return out
