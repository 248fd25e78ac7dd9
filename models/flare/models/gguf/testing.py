"""Small GGUF files written with llama.cpp's own `gguf.GGUFWriter`, for tests and benchmarks.

`write_tiny(path, ...)` writes a llama (or Mixtral-style MoE) decoder with
seeded random weights, quantized by `gguf.quants` (Q8_0, Q4_0, Q4_1) or, for
the k-quants that `gguf.quants` cannot quantize, random valid blocks, plus a
byte-level GPT-2 tokenizer (256 byte tokens, no merges) and a ChatML
template, so every path a real file takes (reader, tokenizer, template,
graph, staging) runs on a file of a few hundred KiB.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flare.core.dtypes import QUANT_TYPES

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def ensure_registered() -> None:
    """Register the gguf plugin with Flare's plugin manager where the installed entry points
    predate it (a source checkout run through PYTHONPATH); a no-op where it is installed."""
    from flare.core.plugin_manager import get_plugin_manager

    from . import plugin

    pm = get_plugin_manager()
    if "gguf" not in pm.models():
        pm.register(plugin, name="flare.models.gguf.plugin")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order (what byte-level BPE vocabularies start from)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


@dataclass(frozen=True)
class TinySpec:
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    n_experts: int = 0
    top_k: int = 2
    context_length: int = 256
    rope_base: float = 10000.0
    qtype: str = "q8_0"          # matrices; the embedding is always q8_0 (as SmolLM2's)
    seed: int = 0
    arch: str = "llama"

    @property
    def vocab(self) -> int:
        return len(SPECIALS) + 256


def _quantized(rng: np.random.Generator, shape: tuple[int, ...], qtype: str, scale: float) -> tuple[np.ndarray, object]:
    """(raw bytes array as GGUFWriter takes it, ggml type) of a [.., K] float matrix in `qtype`."""
    import gguf
    from gguf.quants import quantize

    ggml = gguf.GGMLQuantizationType(QUANT_TYPES[qtype].ggml_type) if qtype in QUANT_TYPES else \
        gguf.GGMLQuantizationType[qtype.upper()]
    if qtype in ("q4_k", "q6_k"):   # gguf.quants has no quantizer for these: random valid blocks
        bt = QUANT_TYPES[qtype]
        blocks = np.zeros((*shape[:-1], shape[-1] // bt.block_size), bt.numpy)
        raw = rng.integers(0, 256, blocks.nbytes, dtype=np.uint8)
        blocks = raw.view(bt.numpy).reshape(blocks.shape).copy()
        blocks["d"] = np.float16(scale / 64)
        if qtype == "q4_k":
            blocks["dmin"] = np.float16(scale / 128)
        else:
            blocks["scales"] = rng.integers(-8, 8, blocks["scales"].shape, dtype=np.int8)
        return blocks.view(np.uint8).reshape(*shape[:-1], -1), ggml
    data = (rng.standard_normal(shape) * scale).astype(np.float32)
    return quantize(data, ggml), ggml


def write_tiny(path: str | os.PathLike, spec: TinySpec = TinySpec(), *, shapes: dict | None = None,
               types: dict | None = None) -> Path:
    """Write a tiny decoder to `path`. `shapes`/`types` override a tensor's float shape or ggml type
    name (tests of bad input)."""
    import gguf

    rng = np.random.default_rng(spec.seed)
    shapes, types = dict(shapes or {}), dict(types or {})
    path = Path(path)
    w = gguf.GGUFWriter(path, spec.arch)
    a = spec.arch
    w.add_string("general.name", "tiny")
    w.add_uint32(f"{a}.block_count", spec.n_layers)
    w.add_uint32(f"{a}.context_length", spec.context_length)
    w.add_uint32(f"{a}.embedding_length", spec.d_model)
    w.add_uint32(f"{a}.feed_forward_length", spec.d_ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_kv_heads)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.vocab_size", spec.vocab)
    w.add_uint32(f"{a}.rope.dimension_count", spec.d_model // spec.n_heads)
    if spec.n_experts:
        w.add_uint32(f"{a}.expert_count", spec.n_experts)
        w.add_uint32(f"{a}.expert_used_count", spec.top_k)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [*SPECIALS, *byte_tokens()])
    w.add_array("tokenizer.ggml.token_type", [3] * len(SPECIALS) + [1] * 256)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHATML)

    d, f, kv = spec.d_model, spec.d_ff, spec.d_model // spec.n_heads * spec.n_kv_heads
    mats: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.vocab, d)}
    norms = ["output_norm.weight"]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        norms += [p + "attn_norm.weight", p + "ffn_norm.weight"]
        mats.update({p + "attn_q.weight": (d, d), p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kv, d),
                     p + "attn_output.weight": (d, d)})
        if spec.n_experts:
            e = spec.n_experts
            mats.update({p + "ffn_gate_exps.weight": (e, f, d), p + "ffn_up_exps.weight": (e, f, d),
                         p + "ffn_down_exps.weight": (e, d, f)})
        else:
            mats.update({p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f)})
    for name in norms:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shapes.get(name, (d,)))).astype(np.float32))
    if spec.n_experts:
        for i in range(spec.n_layers):
            name = f"blk.{i}.ffn_gate_inp.weight"
            w.add_tensor(name, rng.standard_normal(shapes.get(name, (spec.n_experts, d))).astype(np.float32))
    for name, shape in mats.items():
        shape = shapes.get(name, shape)
        qtype = types.get(name, "q8_0" if name == "token_embd.weight" else spec.qtype)
        if qtype == "f32":
            w.add_tensor(name, (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))
            continue
        raw, ggml = _quantized(rng, shape, qtype, 1.0 / np.sqrt(shape[-1]) if name != "token_embd.weight" else 1.0)
        w.add_tensor(name, raw, raw_dtype=ggml)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensor_offset_field(path: str | os.PathLike, tensor: str) -> int:
    """Byte position of `tensor`'s data-offset field in the header (to patch it in tests)."""
    import gguf

    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == tensor)
    parts = t.field.parts
    return int(t.field.offset) + sum(int(p.nbytes) for p in parts[:-1])


# The MoE file of the staging benchmarks (bench/configs/gguf_moe_*.toml; the shape bench/gguf_moe_offload.py
# writes too): Mixtral-style, experts ~90% of the weight bytes (as in real MoE files), small enough to write
# in seconds and to run on the 2-core box.
BENCH_MOE = TinySpec(n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, d_ff=512, n_experts=32, top_k=2,
                     context_length=512, qtype="q4_0", seed=7)


def ensure_bench_moe() -> Path:
    """The benchmark MoE file in Flare's cache folder, written once (through a temp file and a
    rename, so a concurrent or interrupted writer leaves no half file behind)."""
    import tempfile

    from flare.core.cache import cache_dir

    s = BENCH_MOE
    folder = cache_dir("gguf")
    path = folder / (f"bench-moe-l{s.n_layers}-d{s.d_model}-f{s.d_ff}-e{s.n_experts}k{s.top_k}-{s.qtype}"
                     f"-s{s.seed}.gguf")
    if not path.is_file():
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            write_tiny(tmp, s)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path
