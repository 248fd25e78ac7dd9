"""Model configuration: the sizes of the synthetic MoE decoder and its byte tokens.

One frozen dataclass answers every "how big" question (weights, KV cache,
expert cache) so the weight generator, the graph builder, the staging cache
and the NumPy reference cannot disagree. Sizes are named so a file on disk,
a test and a benchmark all mean the same model.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from flare.core.errors import ModelError

# Byte-level vocabulary: ids 0..255 are bytes, then the specials.
N_BYTES = 256
BOS, EOS, PAD, SEP = 256, 257, 258, 259
SPECIALS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, "<sep>": SEP}
VOCAB = N_BYTES + len(SPECIALS)
F32_BYTES = 4


@dataclass(frozen=True)
class MoeConfig:
    """Shape of one MoE decoder.

    `max_seqs * max_ctx` KV rows (plus one scratch row for padding tokens) are
    shared by all sequences of a batch; `prefill_chunk` is the most tokens one
    prefill step carries, which bounds how many experts a step can touch.
    `router_skew` gives experts an uneven popularity (a Zipf-like bias on the
    router logits), as trained MoE routers have; 0 makes routing uniform.
    """

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    d_ff: int
    max_seqs: int
    max_ctx: int
    prefill_chunk: int
    default_cache_fraction: float
    router_skew: float = 0.0
    vocab: int = VOCAB
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.top_k > self.n_experts or self.top_k < 1:
            raise ModelError(f"moe-lm {self.name}: top_k {self.top_k} must be in 1..{self.n_experts}")
        if self.head_dim % 2:
            raise ModelError(f"moe-lm {self.name}: head_dim {self.head_dim} must be even for rope")
        if self.prefill_chunk < 1 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ModelError(f"moe-lm {self.name}: prefill_chunk {self.prefill_chunk} must be a power of two")

    # -- derived sizes --------------------------------------------------------
    @property
    def qkv_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        """Rows of each KV-cache tensor: every (sequence, position) plus a scratch row."""
        return self.max_seqs * self.max_ctx + 1

    @property
    def scratch_row(self) -> int:
        """The KV row padding tokens write to; no real token ever attends to it."""
        return self.max_seqs * self.max_ctx

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert of one layer (gate + up + down)."""
        return 3 * self.d_ff * self.d_model * F32_BYTES

    @property
    def expert_total_bytes(self) -> int:
        return self.n_layers * self.n_experts * self.expert_bytes

    def slots_needed(self, tokens: int) -> int:
        """Experts one layer may need resident at once for a step of `tokens` tokens."""
        return min(self.n_experts, tokens * self.top_k)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "MoeConfig":
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as exc:
            raise ModelError(f"moe-lm: malformed config in weights metadata: {exc}") from None

    def replace(self, **changes: Any) -> "MoeConfig":
        return dataclasses.replace(self, **changes)


SIZES: Mapping[str, MoeConfig] = {
    # tests: ~1.8 MB of weights, experts evict (8 of 16 slots by default)
    "tiny": MoeConfig("tiny", d_model=64, n_layers=2, n_heads=4, head_dim=16, n_experts=16, top_k=2, d_ff=64,
                      max_seqs=4, max_ctx=128, prefill_chunk=4, default_cache_fraction=0.5, router_skew=0.5),
    # memory tests: experts ~96% of the bytes, like `small`, but ~50 MB. 16 of 64 slots, as `small`:
    # the expert copies are the whole offload gap (s23); 16 slots hold 0.28x resident's peak ledger
    # (13.8 of 49.8 MiB) and copy ~51 experts a request against ~75 at 12 (0.23x); the bench pair
    # moe_offload_12slots.toml keeps the 12-slot figure beside it
    "mid": MoeConfig("mid", d_model=128, n_layers=2, n_heads=4, head_dim=32, n_experts=64, top_k=2, d_ff=256,
                     max_seqs=2, max_ctx=64, prefill_chunk=4, default_cache_fraction=0.25, router_skew=0.5),
    # benchmarks: ~400 MB of experts, generated on demand into the cache dir. 16 of 64 slots:
    # 12 measured 1.57-1.64x resident's time at 21% of its memory, 16 measured 1.43-1.48x at 27%
    "small": MoeConfig("small", d_model=256, n_layers=4, n_heads=8, head_dim=32, n_experts=64, top_k=2, d_ff=512,
                       max_seqs=4, max_ctx=256, prefill_chunk=4, default_cache_fraction=0.25, router_skew=0.5),
}


def get_config(size: str) -> MoeConfig:
    """The config of a named size; ModelError listing the sizes otherwise."""
    try:
        return SIZES[size]
    except KeyError:
        raise ModelError(f"moe-lm: unknown size {size!r}; sizes are {', '.join(SIZES)}") from None


def encode(text: str, bos: bool = True) -> list[int]:
    """Byte-level tokens of `text` (UTF-8), optionally after <bos>."""
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode_bytes(ids: list[int]) -> bytes:
    """The bytes of byte tokens; specials are dropped."""
    return bytes(i for i in ids if 0 <= i < N_BYTES)
