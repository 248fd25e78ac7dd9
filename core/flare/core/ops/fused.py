"""Fused ops: one node for a chain the fusion pass (flare.core.fusion) merges at prepare time.

Each is defined by the chain it replaces, and its reference *is* that chain
evaluated with the ops' own references, so a backend's fused kernel is held to
what the unfused graph computes. A backend that does not support a fused op
never sees one: the pass fuses only where every device of the session says
`supports(node)`.

- `linear(a, w[, bias][, residual])`: act(matmul(a, w) + bias) + residual,
  act in none / gelu / relu / sigmoid; bias a row of N, residual of the
  output's shape.
- `norm_affine(x, gamma[, beta])`: layer_norm or rms_norm over the last axis,
  times gamma, plus beta (rows of the last axis' size).
- `attention(q, k, v[, mask])`: matmul(q, k, transpose_b) -> softmax(scale,
  mask) -> matmul(., v), one head's scores kept in a row buffer.
- `leaky_relu(x)`: scale(x, alpha) + scale(relu(x), 1 - alpha), how the ONNX
  importer writes LeakyRelu with ops every backend has (four memory passes over
  an audio decoder's longest tensors; fused, one).
- `conv_add(x, w[, bias], residual)`: conv2d(x, w, bias) over one row (H = 1),
  reshaped to the residual's shape [B, C, W] (or kept [B, C, 1, W]), plus the
  residual: a residual block's convolution and its skip sum (HiFi-GAN, WaveNet,
  1-D ResNets), the sum taken as the output's start instead of a pass of its own.
"""
from __future__ import annotations

from ..errors import ShapeError
from .registry import OPS, OpDef, need_dtype, register
from . import spatial  # noqa: F401  (conv2d registered first: conv_add takes its params)

ACTIVATIONS = ("none", "gelu", "relu", "sigmoid")


def _row(node, op, t, n, what):
    need_dtype(node, op, t, ("f32",))
    if tuple(t.shape) != (n,):
        raise ShapeError(f"{op}: {what} {t.name!r} has shape {t.shape}, expected ({n},)", node)


def _linear_infer(node, srcs, params):
    if params["act"] not in ACTIVATIONS:
        raise ShapeError(f"linear: activation {params['act']!r} (one of {', '.join(ACTIVATIONS)})", node)
    want = 2 + int(params["has_bias"]) + int(params["has_residual"])
    if len(srcs) != want:
        raise ShapeError(f"linear with has_bias={params['has_bias']}, has_residual={params['has_residual']} "
                         f"takes {want} inputs, got {len(srcs)}", node)
    shape, dtype = OPS["matmul"].infer(node, srcs[:2], {"transpose_b": params["transpose_b"]})
    if params["has_bias"]:
        _row(node, "linear", srcs[2], shape[-1], "bias")
    if params["has_residual"]:
        res = srcs[-1]
        need_dtype(node, "linear", res, ("f32",))
        if tuple(res.shape) != tuple(shape):
            raise ShapeError(f"linear: residual {res.name!r} {res.shape} must have the output's shape {shape}", node)
    return shape, dtype


_ACT_OPS = {"gelu": "gelu", "relu": "relu", "sigmoid": "sigmoid"}


def _linear_ref(x, p):
    y = OPS["matmul"].reference(x[:2], {"transpose_b": p["transpose_b"]})
    if p["has_bias"]:
        y = OPS["add"].reference([y, x[2]], {})
    if p["act"] != "none":
        y = OPS[_ACT_OPS[p["act"]]].reference([y], {})
    if p["has_residual"]:
        y = OPS["add"].reference([y, x[-1]], {})
    return y


register(OpDef("linear", (2, 4), _linear_infer, _linear_ref,
               defaults={"transpose_b": False, "act": "none", "has_bias": False, "has_residual": False},
               doc="act(a @ w + bias) + residual (fused matmul epilogue)", fused=True, quant_srcs=(1,)))


def _norm_affine_infer(node, srcs, params):
    x = srcs[0]
    need_dtype(node, "norm_affine", x, ("f32",))
    if params["norm"] not in ("layer", "rms"):
        raise ShapeError(f"norm_affine: norm {params['norm']!r} (layer or rms)", node)
    if len(srcs) != 2 + int(params["has_beta"]):
        raise ShapeError(f"norm_affine with has_beta={params['has_beta']} takes {2 + int(params['has_beta'])} inputs", node)
    for t, what in zip(srcs[1:], ("gamma", "beta")):
        _row(node, "norm_affine", t, x.shape[-1], what)
    return x.shape, "f32"


def _norm_affine_ref(x, p):
    y = OPS[f"{p['norm']}_norm"].reference(x[:1], {"eps": p["eps"]})
    y = OPS["mul"].reference([y, x[1]], {})
    if p["has_beta"]:
        y = OPS["add"].reference([y, x[2]], {})
    return y


register(OpDef("norm_affine", (2, 3), _norm_affine_infer, _norm_affine_ref,
               defaults={"norm": "layer", "eps": 1e-5, "has_beta": False},
               doc="layer or RMS norm, times gamma, plus beta, in one pass", fused=True))

def _attention_infer(node, srcs, params):
    q, k, v = srcs[:3]
    scores, _ = OPS["matmul"].infer(node, [q, k], {"transpose_b": True})
    if len(srcs) != 3 + int(params["has_mask"]):
        raise ShapeError(f"attention with has_mask={params['has_mask']} takes {3 + int(params['has_mask'])} inputs", node)
    if params["has_mask"]:
        OPS["softmax"].infer(node, [_Shaped(scores), srcs[3]], {"scale": params["scale"]})
    return OPS["matmul"].infer(node, [_Shaped(scores), v], {"transpose_b": False})


class _Shaped:
    """A stand-in tensor of a given shape (f32) for reusing other ops' shape rules."""

    def __init__(self, shape):
        self.shape, self.dtype, self.name = tuple(shape), "f32", "scores"


def _attention_ref(x, p):
    s = OPS["matmul"].reference(x[:2], {"transpose_b": True})
    probs = OPS["softmax"].reference([s, x[3]] if p["has_mask"] else [s], {"scale": p["scale"]})
    return OPS["matmul"].reference([probs, x[2]], {"transpose_b": False})


register(OpDef("attention", (3, 4), _attention_infer, _attention_ref,
               defaults={"scale": 1.0, "has_mask": False},
               doc="softmax(q k^T * scale + mask) v per head, the scores never leaving cache", fused=True))


def _leaky_relu_infer(node, srcs, params):
    need_dtype(node, "leaky_relu", srcs[0], ("f32",))
    return srcs[0].shape, "f32"


def _leaky_relu_ref(x, p):
    a = p["alpha"]
    neg = OPS["scale"].reference(x[:1], {"scale": a, "bias": 0.0})
    pos = OPS["scale"].reference([OPS["relu"].reference(x[:1], {})], {"scale": 1.0 - a, "bias": 0.0})
    return OPS["add"].reference([neg, pos], {})


register(OpDef("leaky_relu", (1, 1), _leaky_relu_infer, _leaky_relu_ref, required=("alpha",),
               doc="alpha*x + (1 - alpha)*relu(x), i.e. x > 0 ? x : alpha*x (fused LeakyRelu)", fused=True))


def _conv_params(params):
    """conv_add's params that are conv2d's (all but has_bias)."""
    return {k: params[k] for k in OPS["conv2d"].defaults}


def _conv_add_infer(node, srcs, params):
    want = 3 + int(params["has_bias"])
    if len(srcs) != want:
        raise ShapeError(f"conv_add with has_bias={params['has_bias']} takes {want} inputs, got {len(srcs)}", node)
    (b, c, h, w), _ = OPS["conv2d"].infer(node, srcs[:-1], _conv_params(params))
    res = srcs[-1]
    need_dtype(node, "conv_add", res, ("f32",))
    if h != 1 or tuple(res.shape) not in ((b, c, w), (b, c, 1, w)):
        raise ShapeError(f"conv_add: residual {res.name!r} {res.shape} must be the convolution's output "
                         f"{(b, c, h, w)} over one row, as [B, C, W] or [B, C, 1, W]", node)
    return tuple(res.shape), "f32"


def _conv_add_ref(x, p):
    y = OPS["conv2d"].reference(x[:-1], _conv_params(p))
    return OPS["add"].reference([y.reshape(x[-1].shape), x[-1]], {})


register(OpDef("conv_add", (3, 4), _conv_add_infer, _conv_add_ref,
               defaults={**OPS["conv2d"].defaults, "has_bias": False},
               doc="conv2d over one row, plus a residual of its output's size (fused skip sum)", fused=True))


FUSED_OPS = tuple(name for name, op in OPS.items() if op.fused)
__all__ = ["ACTIVATIONS", "FUSED_OPS"]

