"""The MoE decoder as a Flare graph: one builder serves `prefill`, `decode` and mixed batches.

Every step is a flat batch of T tokens, each with its own position and KV row
(`seq * max_ctx + pos`; padding tokens use the scratch row), and an additive
attention mask [T, kv_rows] built on the host. That one layout lets a batch
mix a prefill chunk of one sequence with decode tokens of others. KV caches
are `state` tensors named per layer, so the `prefill` and `decode` entries of
one PreparedGraph share them (states are shared by name).

Expert weights are graph weights in `resident` mode. In `offload` mode they
are per-layer `cache` tensors of S slots, filled by the `stage_experts` host
node, whose output (slot ids) feeds `mul_mat_id` in place of expert ids.
Node names carry the layer and a role (`L3.attn.q`, `L3.expert.up`, ...) so a
placement callback can route them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from flare.core.graph import GraphBuilder, Tensor
from flare.core.specs import STAGE_EXPERTS

from .config import MoeConfig
from .weights import tensor_shapes

RESIDENT = "resident"
OFFLOAD = "offload"
MODES = (RESIDENT, OFFLOAD)
STAGE_CALLBACK = STAGE_EXPERTS   # the runtime binds ModelSpec.stage_experts to this name


@dataclass(frozen=True)
class GraphSpec:
    """What the builder needs besides shapes: the model, weight access and the expert mode."""

    cfg: MoeConfig
    tensors: Mapping[str, np.ndarray]  # name -> array (a memory-mapped view is fine)
    experts: str = RESIDENT
    slots: int = 0                      # expert-cache slots per layer (offload)


def input_shapes(cfg: MoeConfig, tokens: int, outputs: int | None = None) -> dict[str, tuple[int, ...]]:
    """Input shapes of a step of `tokens` tokens; `outputs` rows of logits for `prefill`."""
    shapes = {"tokens": (tokens,), "pos": (tokens,), "kv_rows": (tokens,), "mask": (tokens, cfg.kv_rows)}
    if outputs is not None:
        shapes["out_rows"] = (outputs,)
    return shapes


def build_step(b: GraphBuilder, spec: GraphSpec, shapes: Mapping[str, tuple]) -> None:
    """Add one step's graph: logits of the `out_rows` tokens (or of every token when absent)."""
    cfg = spec.cfg
    t = int(shapes["tokens"][0])
    weight_shapes = tensor_shapes(cfg)

    def w(name: str) -> Tensor:
        return b.weight(name, _loader(spec.tensors, name), shape=weight_shapes[name], dtype="f32")

    tokens = b.input("tokens", (t,), "i32")
    pos = b.input("pos", (t,), "i32")
    kv_rows = b.input("kv_rows", (t,), "i32")
    mask = b.input("mask", (t, cfg.kv_rows), "f32")
    out_rows = b.input("out_rows", shapes["out_rows"], "i32") if "out_rows" in shapes else None

    x = b.get_rows(w("tok_emb"), tokens, name="embed")
    for i in range(cfg.n_layers):
        x = _attention(b, cfg, i, x, pos, kv_rows, mask, w)
        x = _moe(b, spec, i, x, kv_rows, w)
    if out_rows is not None:
        x = b.get_rows(x, out_rows, name="select_rows")
    h = b.mul(b.rms_norm(x, eps=cfg.norm_eps, name="out.norm"), w("out_norm"), name="out.norm_w")
    logits = b.matmul(h, w("lm_head"), transpose_b=True, name="out.logits")
    b.output("logits", logits)


def _loader(tensors: Mapping[str, np.ndarray], name: str) -> Callable[[], np.ndarray]:
    return lambda: tensors[name]


def _attention(b: GraphBuilder, cfg: MoeConfig, i: int, x: Tensor, pos: Tensor, kv_rows: Tensor, mask: Tensor,
               w: Callable[[str], Tensor]) -> Tensor:
    t = x.shape[0]
    nh, hd, q_dim, rows = cfg.n_heads, cfg.head_dim, cfg.qkv_dim, cfg.kv_rows
    p = f"L{i}.attn"
    h = b.mul(b.rms_norm(x, eps=cfg.norm_eps, name=f"{p}.norm"), w(f"L{i}.attn_norm"), name=f"{p}.norm_w")
    q = b.matmul(h, w(f"L{i}.wq"), transpose_b=True, name=f"{p}.q")
    k = b.matmul(h, w(f"L{i}.wk"), transpose_b=True, name=f"{p}.k")
    v = b.matmul(h, w(f"L{i}.wv"), transpose_b=True, name=f"{p}.v")
    q = b.rope(b.reshape(q, shape=(t, nh, hd), name=f"{p}.q3"), pos, base=cfg.rope_base, neox=True, name=f"{p}.q_rope")
    k = b.rope(b.reshape(k, shape=(t, nh, hd), name=f"{p}.k3"), pos, base=cfg.rope_base, neox=True, name=f"{p}.k_rope")
    k_cache = b.state(f"L{i}.k_cache", (rows, q_dim))
    v_cache = b.state(f"L{i}.v_cache", (rows, q_dim))
    kc = b.set_rows(k_cache, kv_rows, b.reshape(k, shape=(t, q_dim), name=f"{p}.k2"), name=f"{p}.k_store")
    vc = b.set_rows(v_cache, kv_rows, v, name=f"{p}.v_store")
    keys = b.permute(b.reshape(kc, shape=(rows, nh, hd), name=f"{p}.keys3"), axes=(1, 0, 2), name=f"{p}.keys")
    vals = b.permute(b.reshape(vc, shape=(rows, nh, hd), name=f"{p}.vals3"), axes=(1, 0, 2), name=f"{p}.vals")
    qh = b.permute(q, axes=(1, 0, 2), name=f"{p}.qh")                                   # [H, T, Dh]
    scores = b.matmul(qh, keys, transpose_b=True, name=f"{p}.scores")                    # [H, T, R]
    probs = b.softmax(scores, mask, scale=1.0 / math.sqrt(hd), name=f"{p}.probs")
    ctx = b.matmul(probs, vals, name=f"{p}.ctx")                                          # [H, T, Dh]
    ctx = b.contiguous(b.permute(ctx, axes=(1, 0, 2), name=f"{p}.ctx_t"), name=f"{p}.ctx_c")
    out = b.matmul(b.reshape(ctx, shape=(t, q_dim), name=f"{p}.ctx2"), w(f"L{i}.wo"), transpose_b=True, name=f"{p}.out")
    return b.add(x, out, name=f"{p}.residual")


def _moe(b: GraphBuilder, spec: GraphSpec, i: int, x: Tensor, kv_rows: Tensor, w: Callable[[str], Tensor]) -> Tensor:
    cfg = spec.cfg
    t, k = x.shape[0], cfg.top_k
    p = f"L{i}.ffn"
    h = b.mul(b.rms_norm(x, eps=cfg.norm_eps, name=f"{p}.norm"), w(f"L{i}.ffn_norm"), name=f"{p}.norm_w")
    logits = b.add(b.matmul(h, w(f"L{i}.router"), transpose_b=True, name=f"{p}.router"), w(f"L{i}.router_bias"),
                   name=f"{p}.router_b")
    probs = b.softmax(logits, name=f"{p}.router_p")
    ids = b.top_k(probs, k=k, name=f"{p}.top_k")                                          # [T, k] expert ids
    gates = b.gather(probs, ids, name=f"{p}.gates")
    gates = b.div(gates, b.sum(gates, axis=-1, keepdims=True, name=f"{p}.gate_sum"), name=f"{p}.gates_n")
    e = f"L{i}.expert"
    if spec.experts == OFFLOAD:
        gate_w = b.cache(f"L{i}.experts.gate", (spec.slots, cfg.d_ff, cfg.d_model))
        up_w = b.cache(f"L{i}.experts.up", (spec.slots, cfg.d_ff, cfg.d_model))
        down_w = b.cache(f"L{i}.experts.down", (spec.slots, cfg.d_model, cfg.d_ff))
        # ids, the KV rows (padding tokens stage nothing) and the residual stream before this layer's
        # FFN norm (prefetch guesses layer i+1's experts from it with layer i+1's norm and router)
        sel = b.host(ids, kv_rows, x, callback=STAGE_CALLBACK, shape=ids.shape, dtype="i32", args={"layer": i},
                     name=f"{e}.stage")                                                   # [T, k] cache slots
    else:
        gate_w, up_w, down_w = w(f"L{i}.experts.gate"), w(f"L{i}.experts.up"), w(f"L{i}.experts.down")
        sel = ids
    gate = b.mul_mat_id(gate_w, h, sel, name=f"{e}.gate")                                 # [T, k, F]
    up = b.mul_mat_id(up_w, h, sel, name=f"{e}.up")
    act = b.mul(b.silu(gate, name=f"{e}.silu"), up, name=f"{e}.act")
    down = b.mul_mat_id(down_w, act, sel, name=f"{e}.down")                               # [T, k, D]
    weighted = b.mul(down, b.reshape(gates, shape=(t, k, 1), name=f"{p}.gates3"), name=f"{e}.weighted")
    y = b.sum(weighted, axis=1, name=f"{e}.combine")
    return b.add(x, y, name=f"{p}.residual")


ENTRIES = ("prefill", "decode", "mixed")


def entry_builders(spec: GraphSpec) -> dict[str, Callable[[GraphBuilder, Mapping[str, tuple]], None]]:
    """`prefill` (per-token positions/sequences, logits of `out_rows`), `decode` (one
    token per sequence, logits of every token) and `mixed` (a prefill chunk and decode
    tokens of other sequences in one batch: the prefill graph under its own name, so a
    catalog can select or drop mixed programs). All are `build_step`; they share
    weights, KV state and expert caches by name."""
    def prefill(b: GraphBuilder, shapes: Mapping[str, tuple]) -> None:
        build_step(b, spec, shapes)

    def decode(b: GraphBuilder, shapes: Mapping[str, tuple]) -> None:
        build_step(b, spec, {k: v for k, v in shapes.items() if k != "out_rows"})

    return {"prefill": prefill, "decode": decode, "mixed": prefill}
