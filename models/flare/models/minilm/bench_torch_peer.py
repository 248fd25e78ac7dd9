"""all-MiniLM-L6-v2 in PyTorch (CPU, float32, eager, no autograd): a peer where torch is importable.

The same forward as `minilm_numpy` (BERT encoder, additive padding mask,
exact GELU, mean pooling, L2 normalisation) with torch's kernels, so a
benchmark can place Flare next to the runtime most users would reach for.
torch is optional: this module is imported only when a configuration says
`peer = "torch"`, and the config parser refuses that peer where torch is not
importable. Weights come from the same safetensors file, tokens from the same
tokenizer; no sentence-transformers or transformers code is used.
"""
from __future__ import annotations

from math import sqrt
from typing import Any, Sequence

import numpy as np

from flare.plugins.bench.peer_runner import PeerRunner
from flare.plugins.bench.workload import Peer


class MiniLMTorch:
    """`embed(sentences)` -> unit-norm embeddings [n, hidden] float32 (NumPy)."""

    def __init__(self, max_length: int = 256, threads: int | None = None):
        import torch

        from flare.models.minilm.weights import SafetensorsWeights, load_config

        self.torch = torch
        if threads:
            torch.set_num_threads(int(threads))
        self.cfg = load_config()
        files = SafetensorsWeights()
        self.w = {k: torch.from_numpy(files.get(k)) for k in files.shapes if k != "embeddings.position_ids"}
        self.max_length = int(max_length)

    def encode(self, ids: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
        torch, w, cfg = self.torch, self.w, self.cfg
        F = torch.nn.functional
        B, L = ids.shape
        H, D = cfg.heads, cfg.hidden // cfg.heads
        with torch.inference_mode():
            ids_t = torch.from_numpy(np.ascontiguousarray(ids, np.int64))
            keep = (torch.arange(L)[None, :] < torch.tensor(list(lengths))[:, None]).to(torch.float32)
            bias = ((keep - 1.0) * 1e30)[:, None, None, :]
            x = w["embeddings.word_embeddings.weight"][ids_t] + w["embeddings.position_embeddings.weight"][:L] \
                + w["embeddings.token_type_embeddings.weight"][0]
            x = F.layer_norm(x, (cfg.hidden,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"],
                             cfg.layer_norm_eps)
            for i in range(cfg.layers):
                p = f"encoder.layer.{i}."

                def lin(t: Any, name: str) -> Any:
                    return F.linear(t, w[p + name + ".weight"], w[p + name + ".bias"])

                q = lin(x, "attention.self.query").view(B, L, H, D).transpose(1, 2)
                k = lin(x, "attention.self.key").view(B, L, H, D).transpose(1, 2)
                v = lin(x, "attention.self.value").view(B, L, H, D).transpose(1, 2)
                a = torch.softmax(q @ k.transpose(-1, -2) * (1.0 / sqrt(D)) + bias, dim=-1)
                ctx = (a @ v).transpose(1, 2).reshape(B, L, H * D)
                x = F.layer_norm(x + lin(ctx, "attention.output.dense"), (cfg.hidden,),
                                 w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"],
                                 cfg.layer_norm_eps)
                y = lin(F.gelu(lin(x, "intermediate.dense")), "output.dense")
                x = F.layer_norm(x + y, (cfg.hidden,), w[p + "output.LayerNorm.weight"],
                                 w[p + "output.LayerNorm.bias"], cfg.layer_norm_eps)
            pooled = (x * keep[:, :, None]).sum(1) / keep.sum(1, keepdim=True)
            out = F.normalize(pooled, p=2.0, dim=1, eps=1e-12)
        return out.numpy().astype(np.float32, copy=False)

    def embed(self, sentences: Sequence[str]) -> np.ndarray:
        from flare.models.minilm.tokenize import encode, pad_batch

        batch = pad_batch(encode(list(sentences), self.max_length))
        return self.encode(batch.ids, batch.lengths)


class MiniLMTorchRunner(PeerRunner):
    """The `torch` peer of the minilm-l6 workload."""

    def __init__(self, max_length: int = 256, threads: int | None = None):
        self.model = MiniLMTorch(max_length, threads)
        torch = self.model.torch
        self.description = f"PyTorch {torch.__version__} eager CPU forward, {torch.get_num_threads()} thread(s)"

    def compute(self, payload):
        return self.model.embed(payload)


PEER = Peer("torch", "the same forward in PyTorch on the CPU (flare.models.minilm.bench_torch_peer)", "torch",
         model="minilm-l6", open=lambda config: MiniLMTorchRunner(config.options["max_length"], config.threads), takes_threads=True)
