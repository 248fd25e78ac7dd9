"""The model a GGUF file describes, as one frozen record read from its metadata.

Architectures: `llama` (SmolLM2, TinyLlama, Llama 2/3 shapes: GQA, RoPE base
from the metadata) and its mixture-of-experts form (Mixtral's: `llama` with
`llama.expert_count` and `ffn_*_exps` tensors). Everything the graph, the KV
cache, the staging cache and the NumPy reference need is derived here, and
every tensor's shape is checked against it before anything is built, so a
file whose tensors disagree with its metadata is refused naming the tensor.

The runtime limits (`max_seqs`, `max_ctx`, `prefill_chunk`) are the caller's
choice, bounded by the file's `context_length`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .reader import GGUFError, GGUFFile

ARCHITECTURES = ("llama",)
F32_BYTES = 4


@dataclass(frozen=True)
class LMConfig:
    """Shape of one decoder and the runtime limits it is prepared for."""

    name: str
    arch: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rope_base: float
    norm_eps: float
    context_length: int
    n_experts: int = 0
    top_k: int = 0
    tied_head: bool = True        # no `output.weight`: the embedding is the head
    bos: int = 1
    eos: int = 2
    pad: int = 2
    max_seqs: int = 1
    max_ctx: int = 1024
    prefill_chunk: int = 64

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_rows(self) -> int:
        return self.max_seqs * self.max_ctx + 1

    @property
    def scratch_row(self) -> int:
        return self.max_seqs * self.max_ctx

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def slots_needed(self, tokens: int) -> int:
        return min(self.n_experts, tokens * self.top_k)

    def kv_bytes(self) -> int:
        return 2 * self.n_layers * self.kv_rows * self.kv_dim * F32_BYTES

    def replace(self, **changes: Any) -> "LMConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def read_config(f: GGUFFile, name: str | None = None, *, max_seqs: int = 1, max_ctx: int = 1024,
                prefill_chunk: int = 64) -> LMConfig:
    """The LMConfig of a file, with every tensor the graph reads checked against it."""
    arch = f.metadata("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: general.architecture {arch!r} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES)})")

    def key(k: str, default: Any = ...) -> Any:
        return f.metadata(f"{arch}.{k}", default)

    def positive(k: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GGUFError(f"{f.path}: metadata key {arch}.{k} is {value!r}; expected a positive integer")
        return int(value)

    n_layers = positive("block_count", key("block_count"))
    d_model = positive("embedding_length", key("embedding_length"))
    d_ff = positive("feed_forward_length", key("feed_forward_length"))
    n_heads = positive("attention.head_count", key("attention.head_count"))
    n_kv = positive("attention.head_count_kv", key("attention.head_count_kv", n_heads))
    if d_model % n_heads:
        raise GGUFError(f"{f.path}: {arch}.embedding_length {d_model} is not a multiple of "
                        f"{arch}.attention.head_count {n_heads}")
    if n_heads % n_kv:
        raise GGUFError(f"{f.path}: {arch}.attention.head_count {n_heads} is not a multiple of "
                        f"{arch}.attention.head_count_kv {n_kv}")
    head_dim = d_model // n_heads
    if head_dim % 2:
        raise GGUFError(f"{f.path}: head size {head_dim} is odd; RoPE needs pairs")
    rope_dims = key("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"{f.path}: {arch}.rope.dimension_count {rope_dims} (partial RoPE) is not supported; "
                        f"the head size is {head_dim}")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None) and float(key("rope.scaling.factor", 1.0)) != 1.0:
        raise GGUFError(f"{f.path}: {arch}.rope.scaling.type {scaling!r} is not supported")
    if "rope_freqs.weight" in f:
        raise GGUFError(f"{f.path}: tensor rope_freqs.weight (Llama 3.1 RoPE frequency factors) is not supported")
    rope_base = float(key("rope.freq_base", 10000.0))
    norm_eps = float(key("attention.layer_norm_rms_epsilon", 1e-5))
    context = positive("context_length", key("context_length", 2048))
    n_experts = int(key("expert_count", 0) or 0)
    top_k = int(key("expert_used_count", 0) or 0)
    if n_experts and not 1 <= top_k <= n_experts:
        raise GGUFError(f"{f.path}: {arch}.expert_used_count {top_k} must be in 1..{arch}.expert_count {n_experts}")
    emb_shape, _ = f.tensor_info("token_embd.weight")
    vocab = int(key("vocab_size", emb_shape[0]))
    if f.has("tokenizer.ggml.tokens"):
        n_tokens = f.length("tokenizer.ggml.tokens")
        if n_tokens != vocab:
            raise GGUFError(f"{f.path}: tokenizer.ggml.tokens holds {n_tokens} tokens, {arch}.vocab_size says {vocab}")
    if not 1 <= max_seqs <= 64:
        raise GGUFError(f"max_seqs {max_seqs} must be in 1..64")
    if not 2 <= max_ctx <= context:
        raise GGUFError(f"max_ctx {max_ctx} must be in 2..{context} ({arch}.context_length)")
    if prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1) or prefill_chunk > max_ctx:
        raise GGUFError(f"prefill_chunk {prefill_chunk} must be a power of two in 1..{max_ctx}")
    eos = int(f.metadata("tokenizer.ggml.eos_token_id", 2))
    cfg = LMConfig(
        name=name or str(f.metadata("general.name", f.path.stem)), arch=arch, n_layers=n_layers, d_model=d_model,
        d_ff=d_ff, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab=vocab, rope_base=rope_base,
        norm_eps=norm_eps, context_length=context, n_experts=n_experts, top_k=top_k,
        tied_head="output.weight" not in f, bos=int(f.metadata("tokenizer.ggml.bos_token_id", 1)), eos=eos,
        pad=int(f.metadata("tokenizer.ggml.padding_token_id", eos)), max_seqs=max_seqs, max_ctx=max_ctx,
        prefill_chunk=prefill_chunk)
    check_tensors(f, cfg)
    return cfg


def expected_shapes(cfg: LMConfig) -> dict[str, tuple[tuple[int, ...], int]]:
    """tensor name -> (logical Flare shape in weights, i.e. blocks unrolled, rank) the graph reads."""
    d, kv, f_, e = cfg.d_model, cfg.kv_dim, cfg.d_ff, cfg.n_experts
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab, d), "output_norm.weight": (d,)}
    if not cfg.tied_head:
        out["output.weight"] = (cfg.vocab, d)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "attn_q.weight": (cfg.q_dim, d), p + "attn_k.weight": (kv, d),
                    p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, cfg.q_dim),
                    p + "ffn_norm.weight": (d,)})
        if e:
            out.update({p + "ffn_gate_inp.weight": (e, d), p + "ffn_gate_exps.weight": (e, f_, d),
                        p + "ffn_up_exps.weight": (e, f_, d), p + "ffn_down_exps.weight": (e, d, f_)})
        else:
            out.update({p + "ffn_gate.weight": (f_, d), p + "ffn_up.weight": (f_, d), p + "ffn_down.weight": (d, f_)})
    return out


NORMS = ("attn_norm", "ffn_norm", "output_norm", "ffn_gate_inp")


def check_tensors(f: GGUFFile, cfg: LMConfig) -> None:
    """Every tensor the graph reads exists with the shape the metadata implies (blocks unrolled)."""
    from flare.core.dtypes import block_size

    for name, logical in expected_shapes(cfg).items():
        shape, dtype = f.tensor_info(name)
        got = (*shape[:-1], shape[-1] * block_size(dtype))
        if got != logical:
            raise GGUFError(f"{f.path}: tensor {name} holds {list(got)} weights (Flare order), the metadata "
                            f"implies {list(logical)}")
        if any(n in name for n in NORMS) and dtype != "f32":
            raise GGUFError(f"{f.path}: tensor {name} is {dtype}; norms and routers must be F32")
