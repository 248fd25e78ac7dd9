"""A llama-family decoder from a GGUF file as a Flare graph: `prefill`, `decode`, `mixed`.

The step layout is the `token-lm/1` contract (moe-lm's): a flat batch of T
tokens, each with its position, its KV row (`seq * max_ctx + pos`; padding
uses the scratch row) and an additive mask row over a window of KV rows, so one
graph serves prefill chunks, decode batches and both mixed. KV caches are
`state` tensors named per layer, shared by every entry.

The window is the mask's width W (`input_shapes(..., window=W)`; all KV rows
when not given): keys and values are the first W rows of the cache (a `slice`
view, no copy), so attention scans the rows in use, as llama.cpp's n_kv does,
not max_seqs x max_ctx. W is the graph's dim `window` (mask axis 1), so an
exported program, declared at every KV row, is replayed at a smaller W by the
core's loader. The caller picks W from the step
(`flare.plugins.export.serving.batch.kv_window`); the runtime keeps a plan per
(tokens, W) shape.

Weights are the file's tensors as they are: quantized matrices feed
`matmul(transpose_b=True)` as block tensors, the Q8_0 embedding feeds
`get_rows`, and, with no `output.weight`, the same embedding is the output
head. RoPE is the adjacent-pair form (`neox=False`): llama.cpp's converter
permutes Q/K so that ggml's normal RoPE applies.

Attention is grouped-query: queries [T, H, D] are viewed as
[KVH, G, T, D] (head h uses KV head h // G, as ggml does) and the cached keys
as [KVH, 1, R, D], so the batched matmul broadcasts each KV head over its G
query heads without copying the cache.

MoE layers (Mixtral's form: `ffn_gate_inp` router, softmax, top-k,
renormalized gates, `ffn_{gate,up,down}_exps`) use `mul_mat_id` on the
quantized experts; in `offload` mode the experts are per-layer `cache`
tensors filled by the `stage_experts` host node (see staging.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from flare.core.errors import ShapeError
from flare.core.graph import GraphBuilder, Tensor
from flare.core.specs import STAGE_EXPERTS

from .config import LMConfig

RESIDENT = "resident"
OFFLOAD = "offload"
MODES = (RESIDENT, OFFLOAD)
ENTRIES = ("prefill", "decode", "mixed")
EXPERT_PARTS = ("gate", "up", "down")


def expert_tensor(layer: int, part: str) -> str:
    return f"blk.{layer}.ffn_{part}_exps.weight"


@dataclass(frozen=True)
class WeightInfo:
    """A weight's Flare shape and dtype, known without reading its bytes (export, describe)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class GraphSpec:
    """What the builder needs besides shapes: the config, the weights' shapes/dtypes, a loader
    per weight (a view into the mapped file; never called when only declaring), the expert mode."""

    cfg: LMConfig
    infos: Mapping[str, WeightInfo]
    load: Callable[[str], np.ndarray] | None = None
    experts: str = RESIDENT
    slots: int = 0


def input_shapes(cfg: LMConfig, tokens: int, outputs: int | None = None,
                 window: int | None = None) -> dict[str, tuple[int, ...]]:
    """Input shapes of a step of `tokens` tokens, `outputs` logit rows (None: every token) and
    a mask over `window` KV rows (None: all of them)."""
    shapes = {"tokens": (tokens,), "pos": (tokens,), "kv_rows": (tokens,),
              "mask": (tokens, cfg.kv_rows if window is None else window)}
    if outputs is not None:
        shapes["out_rows"] = (outputs,)
    return shapes


def build_step(b: GraphBuilder, spec: GraphSpec, shapes: Mapping[str, tuple], n_layers: int | None = None) -> None:
    """One step: logits of the `out_rows` tokens (of every token when absent). `n_layers`
    keeps only the first layers (a self-draft for speculative decoding)."""
    cfg = spec.cfg
    t = int(shapes["tokens"][0])

    def w(name: str) -> Tensor:
        info = spec.infos[name]
        loader = (lambda: spec.load(name)) if spec.load is not None else None
        return b.weight(name, loader, shape=info.shape, dtype=info.dtype)

    tokens = b.input("tokens", (t,), "i32")
    pos = b.input("pos", (t,), "i32")
    kv_rows = b.input("kv_rows", (t,), "i32")
    window = int(shapes["mask"][1]) if "mask" in shapes else cfg.kv_rows
    if not 1 <= window <= cfg.kv_rows:
        raise ShapeError(f"mask width {window} must be in 1..{cfg.kv_rows} (the KV rows)")
    mask = b.input("mask", (t, window), "f32")
    window = b.dim("window", mask, 1)
    out_rows = b.input("out_rows", shapes["out_rows"], "i32") if "out_rows" in shapes else None

    x = b.get_rows(w("token_embd.weight"), tokens, name="embed")
    for i in range(cfg.n_layers if n_layers is None else n_layers):
        x = _attention(b, cfg, i, x, pos, kv_rows, mask, window, w)
        x = _moe(b, spec, i, x, kv_rows, w) if cfg.is_moe else _ffn(b, cfg, i, x, w)
    if out_rows is not None:
        x = b.get_rows(x, out_rows, name="select_rows")
    h = b.mul(b.rms_norm(x, eps=cfg.norm_eps, name="out.norm"), w("output_norm.weight"), name="out.norm_w")
    head = "token_embd.weight" if cfg.tied_head else "output.weight"
    b.output("logits", b.matmul(h, w(head), transpose_b=True, name="out.logits"))


def _norm(b: GraphBuilder, cfg: LMConfig, x: Tensor, weight: Tensor, name: str) -> Tensor:
    return b.mul(b.rms_norm(x, eps=cfg.norm_eps, name=f"{name}.norm"), weight, name=f"{name}.norm_w")


def _attention(b: GraphBuilder, cfg: LMConfig, i: int, x: Tensor, pos: Tensor, kv_rows: Tensor, mask: Tensor,
               window: int, w: Callable[[str], Tensor]) -> Tensor:
    t = x.shape[0]
    nh, nkv, g, hd = cfg.n_heads, cfg.n_kv_heads, cfg.group, cfg.head_dim
    p, L = f"L{i}.attn", f"blk.{i}."
    h = _norm(b, cfg, x, w(L + "attn_norm.weight"), p)
    q = b.matmul(h, w(L + "attn_q.weight"), transpose_b=True, name=f"{p}.q")
    k = b.matmul(h, w(L + "attn_k.weight"), transpose_b=True, name=f"{p}.k")
    v = b.matmul(h, w(L + "attn_v.weight"), transpose_b=True, name=f"{p}.v")
    q = b.rope(b.reshape(q, shape=(t, nh, hd), name=f"{p}.q3"), pos, base=cfg.rope_base, neox=False,
               name=f"{p}.q_rope")
    k = b.rope(b.reshape(k, shape=(t, nkv, hd), name=f"{p}.k3"), pos, base=cfg.rope_base, neox=False,
               name=f"{p}.k_rope")
    k_cache = b.state(f"L{i}.k_cache", (cfg.kv_rows, cfg.kv_dim))
    v_cache = b.state(f"L{i}.v_cache", (cfg.kv_rows, cfg.kv_dim))
    kc = b.set_rows(k_cache, kv_rows, b.reshape(k, shape=(t, cfg.kv_dim), name=f"{p}.k2"), name=f"{p}.k_store")
    vc = b.set_rows(v_cache, kv_rows, v, name=f"{p}.v_store")
    # the window: the first `window` rows (a view; the size a replay gives the dim `window`)
    kc = b.slice(kc, axis=0, start=0, stop=window, name=f"{p}.k_window")
    vc = b.slice(vc, axis=0, start=0, stop=window, name=f"{p}.v_window")
    keys = b.permute(b.reshape(kc, shape=(-1, nkv, 1, hd), name=f"{p}.keys4"), axes=(1, 2, 0, 3),
                     name=f"{p}.keys")                                                    # [KVH, 1, W, D]
    vals = b.permute(b.reshape(vc, shape=(-1, nkv, 1, hd), name=f"{p}.vals4"), axes=(1, 2, 0, 3),
                     name=f"{p}.vals")
    qh = b.permute(b.reshape(q, shape=(t, nkv, g, hd), name=f"{p}.q4"), axes=(1, 2, 0, 3), name=f"{p}.qh")
    scores = b.matmul(qh, keys, transpose_b=True, name=f"{p}.scores")                    # [KVH, G, T, W]
    probs = b.softmax(scores, mask, scale=1.0 / math.sqrt(hd), name=f"{p}.probs")
    ctx = b.matmul(probs, vals, name=f"{p}.ctx")                                          # [KVH, G, T, D]
    ctx = b.contiguous(b.permute(ctx, axes=(2, 0, 1, 3), name=f"{p}.ctx_t"), name=f"{p}.ctx_c")
    out = b.matmul(b.reshape(ctx, shape=(t, cfg.q_dim), name=f"{p}.ctx2"), w(L + "attn_output.weight"),
                   transpose_b=True, name=f"{p}.out")
    return b.add(x, out, name=f"{p}.residual")


def _ffn(b: GraphBuilder, cfg: LMConfig, i: int, x: Tensor, w: Callable[[str], Tensor]) -> Tensor:
    p, L = f"L{i}.ffn", f"blk.{i}."
    h = _norm(b, cfg, x, w(L + "ffn_norm.weight"), p)
    gate = b.matmul(h, w(L + "ffn_gate.weight"), transpose_b=True, name=f"{p}.gate")
    up = b.matmul(h, w(L + "ffn_up.weight"), transpose_b=True, name=f"{p}.up")
    act = b.mul(b.silu(gate, name=f"{p}.silu"), up, name=f"{p}.act")
    down = b.matmul(act, w(L + "ffn_down.weight"), transpose_b=True, name=f"{p}.down")
    return b.add(x, down, name=f"{p}.residual")


def _moe(b: GraphBuilder, spec: GraphSpec, i: int, x: Tensor, kv_rows: Tensor, w: Callable[[str], Tensor]) -> Tensor:
    cfg = spec.cfg
    t, k = x.shape[0], cfg.top_k
    p, L = f"L{i}.ffn", f"blk.{i}."
    h = _norm(b, cfg, x, w(L + "ffn_norm.weight"), p)
    probs = b.softmax(b.matmul(h, w(L + "ffn_gate_inp.weight"), transpose_b=True, name=f"{p}.router"),
                      name=f"{p}.router_p")
    ids = b.top_k(probs, k=k, name=f"{p}.top_k")                                          # [T, k] expert ids
    gates = b.gather(probs, ids, name=f"{p}.gates")
    gates = b.div(gates, b.sum(gates, axis=-1, keepdims=True, name=f"{p}.gate_sum"), name=f"{p}.gates_n")
    e = f"L{i}.expert"
    if spec.experts == OFFLOAD:
        parts = {}
        for part in EXPERT_PARTS:
            info = spec.infos[expert_tensor(i, part)]
            parts[part] = b.cache(expert_tensor(i, part), (spec.slots, *info.shape[1:]), info.dtype)
        sel = b.host(ids, kv_rows, x, callback=STAGE_EXPERTS, shape=ids.shape, dtype="i32", args={"layer": i},
                     name=f"{e}.stage")                                                   # [T, k] cache slots
    else:
        parts = {part: w(expert_tensor(i, part)) for part in EXPERT_PARTS}
        sel = ids
    gate = b.mul_mat_id(parts["gate"], h, sel, name=f"{e}.gate")                          # [T, k, F]
    up = b.mul_mat_id(parts["up"], h, sel, name=f"{e}.up")
    act = b.mul(b.silu(gate, name=f"{e}.silu"), up, name=f"{e}.act")
    down = b.mul_mat_id(parts["down"], act, sel, name=f"{e}.down")                        # [T, k, D]
    weighted = b.mul(down, b.reshape(gates, shape=(t, k, 1), name=f"{p}.gates3"), name=f"{e}.weighted")
    return b.add(x, b.sum(weighted, axis=1, name=f"{e}.combine"), name=f"{p}.residual")


def entry_builders(spec: GraphSpec) -> dict[str, Callable[[GraphBuilder, Mapping[str, tuple]], None]]:
    """`prefill` (logits of `out_rows`), `decode` (one token per sequence, logits of every
    token) and `mixed` (the prefill graph under its own name); shared weights and KV state."""
    def prefill(b: GraphBuilder, shapes: Mapping[str, tuple]) -> None:
        build_step(b, spec, shapes)

    def decode(b: GraphBuilder, shapes: Mapping[str, tuple]) -> None:
        build_step(b, spec, {k: v for k, v in shapes.items() if k != "out_rows"})

    return {"prefill": prefill, "decode": decode, "mixed": prefill}
