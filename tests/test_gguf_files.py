"""GGUF model plugin on small files written with llama.cpp's own gguf.GGUFWriter: the reader's
checks (bad input exits 2 with one line naming the key or tensor), the graph against the NumPy
reference for every quantized type, KV-cache decode against prefill, and MoE experts staged
straight from the memory-mapped file against resident ones."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from flare.models.gguf import numpy_reference as ref
from flare.models.gguf.model import GgufLM, Sampling
from flare.models.gguf.reader import GGUFError, GGUFFile
from flare.models.gguf.testing import TinySpec, tensor_offset_field, write_tiny

pytestmark = pytest.mark.usefixtures("gguf_plugin")


def _cli(argv, capsys):
    from flare.core.cli import main

    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


# ------------------------------------------------------------------------------- bad input
def _bad_files(tmp_path, tiny_gguf):
    out = {}
    p = tmp_path / "truncated.gguf"
    p.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    out["truncated"] = (p, "past the end of the file")
    p = tmp_path / "header.gguf"
    p.write_bytes(tiny_gguf.read_bytes()[:200])
    out["truncated header"] = (p, "truncated or malformed")
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    out["magic"] = (p, "not a GGUF file")
    out["arch"] = (write_tiny(tmp_path / "arch.gguf", TinySpec(arch="mamba")), "general.architecture 'mamba'")
    out["qtype"] = (write_tiny(tmp_path / "q5.gguf", TinySpec(), types={"blk.1.attn_v.weight": "q5_0"}),
                    "tensor blk.1.attn_v.weight: type Q5_0 is not supported")
    out["shape"] = (write_tiny(tmp_path / "shape.gguf", TinySpec(), shapes={"blk.0.attn_k.weight": (64, 64)}),
                    "tensor blk.0.attn_k.weight holds [64, 64]")
    p = tmp_path / "offset.gguf"
    shutil.copyfile(tiny_gguf, p)
    at = tensor_offset_field(p, "blk.1.ffn_up.weight")
    data = bytearray(p.read_bytes())
    data[at: at + 8] = (1 << 40).to_bytes(8, "little")
    p.write_bytes(bytes(data))
    out["offset"] = (p, "tensor blk.1.ffn_up.weight: bytes")
    return out


@pytest.mark.parametrize("case", ["truncated", "truncated header", "magic", "arch", "qtype", "shape", "offset"])
def test_bad_gguf_exits_2_with_one_line_naming_it(case, tiny_gguf, tmp_path, capsys):
    path, needle = _bad_files(tmp_path, tiny_gguf)[case]
    code, err = _cli(["run", str(path), "--prompt", "hi", "--max-new-tokens", "1"], capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: GGUFError: "), err
    assert needle in err[0] and str(path) in err[0], err


def test_missing_file_exits_2(tmp_path, capsys):
    code, err = _cli(["run", str(tmp_path / "none.gguf"), "--prompt", "hi"], capsys)
    assert code == 2 and len(err) == 1 and "no such file" in err[0]


def test_reader_gives_block_tensors_as_views_of_the_mapping(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    q = f.tensor("blk.0.attn_q.weight")
    assert q.shape == (64, 2) and q.dtype.names == ("d", "qs")            # q8_0: [N, K / 32] blocks
    assert f.tensor_info("token_embd.weight") == ((259, 2), "q8_0")
    assert not q.flags.owndata and q.base is not None                      # no copy of the file's bytes
    with pytest.raises(GGUFError, match="tensor nope is missing"):
        f.tensor("nope")


# ------------------------------------------------------------------------- graph vs reference
SPECS = {
    "q8_0": TinySpec(),
    "q4_0": TinySpec(qtype="q4_0", n_kv_heads=1),
    "q4_1": TinySpec(qtype="q4_1"),
    "q4_k": TinySpec(qtype="q4_k", d_model=256, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=1),
    "q6_k": TinySpec(qtype="q6_k", d_model=256, n_heads=4, n_kv_heads=4, d_ff=256, n_layers=1),
}


@pytest.mark.parametrize("qtype", list(SPECS))
def test_graph_matches_the_numpy_reference(qtype, backend, tmp_path):
    """Every position's logits against float64 math on the gguf.quants-dequantized weights.
    Tolerance: the issue's bound for the real model, mean KL <= 0.01 nats, and top-1 agreement
    >= 90%. Kernels may round the activations to 8 bits per block before integer dots, as ggml
    does (measured here: KL 2e-6..4e-4, logits off by up to 1.4 of ~55); these random tiny
    models have near-ties a trained model does not, so one flipped argmax in ~20 tokens is
    allowed (a wrong layout or head mapping breaks both bounds by orders of magnitude)."""
    path = write_tiny(tmp_path / f"{qtype}.gguf", SPECS[qtype])
    with backend.session("cpu") as sess:
        lm = GgufLM.load(str(path), session=sess, max_ctx=32, prefill_chunk=8)
        ids = lm.model.tokenizer().encode("Odd sizes: 13 tokens!")
        got = lm.prefill(0, ids, all_logits=True)
        want = ref.forward(lm.cfg, lm.model.tensor, ids)
        kl, top1 = ref.kl_top1(want, got)
        assert got.shape == (len(ids), 259)
        assert kl <= 0.01 and top1 >= 0.9, (kl, top1)
        lm.release()


def test_decode_with_the_kv_cache_equals_prefill(tiny_gguf):
    """GQA attention over cached rows: decoding token by token gives the logits of one prefill."""
    with GgufLM.load(str(tiny_gguf), max_ctx=32, max_seqs=2, prefill_chunk=4) as lm:
        ids = lm.model.tokenizer().encode("cache me")
        whole = lm.prefill(1, ids, all_logits=True)
        steps = [lm.decode([0], [t], [i])[0] for i, t in enumerate(ids)]
        # same tokens, same cache rows; only the kernels' shapes differ (matvec vs matmul: another
        # summation order, the same per-block activation rounding), so float32 rounding apart
        np.testing.assert_allclose(np.stack(steps), whole, rtol=1e-3, atol=1e-2)


def test_tokenizer_and_chat_template_from_metadata(tiny_gguf):
    with GgufLM.load(str(tiny_gguf), max_ctx=16) as lm:
        tok = lm.model.tokenizer()
        ids = tok.chat_ids("Hé")
        assert ids[0] == 1 and ids.count(2) == 1                     # <|im_start|>, <|im_end|> matched whole
        assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nHé<|im_end|>\n<|im_start|>assistant\n"
        assert tok.encode("Hé") == [3 + b for b in "Hé".encode()]    # bytes, after the three specials


# ---------------------------------------------------------------------------------- MoE
MOE = TinySpec(n_experts=16, top_k=2, qtype="q4_0", n_layers=3, d_ff=256, seed=3)


def test_moe_graph_matches_the_reference(backend, tmp_path):
    path = write_tiny(tmp_path / "moe.gguf", MOE)
    with backend.session("cpu") as sess, GgufLM.load(str(path), session=sess, max_ctx=32, prefill_chunk=8) as lm:
        ids = lm.model.tokenizer().encode("mixture of experts")
        kl, top1 = ref.kl_top1(ref.forward(lm.cfg, lm.model.tensor, ids), lm.prefill(0, ids, all_logits=True))
        assert kl <= 0.01 and top1 >= 0.9, (kl, top1)      # bounds as in test_graph_matches_the_numpy_reference


def test_moe_experts_staged_from_the_file_give_identical_logits(tmp_path):
    """Offload: a bounded cache of quantized expert slots filled from the mapped file per step;
    same tokens and bitwise-equal logits as resident experts, in fewer persistent bytes."""
    path = write_tiny(tmp_path / "moe.gguf", MOE)
    out = {}
    for mode in ("resident", "offload"):
        with GgufLM.load(str(path), max_ctx=64, prefill_chunk=4, experts=mode) as lm:
            ids = lm.model.tokenizer().chat_ids("Tell me about experts")
            tokens, logits = lm.generate(ids, 6, Sampling(greedy=True), stop_at_eos=False)
            out[mode] = (tokens, np.stack(logits), sum(lm.graph.persistent_bytes().values()), lm.stats())
    assert out["offload"][0] == out["resident"][0]
    np.testing.assert_array_equal(out["offload"][1], out["resident"][1])
    staging = out["offload"][3]["staging"]
    assert out["offload"][3]["slots_per_layer"] == 8 and staging["experts_staged"] > 0 and staging["evictions"] > 0
    assert out["offload"][2] < 0.7 * out["resident"][2]


def test_moe_experts_staged_on_every_backend_give_the_resident_tokens(backend, tmp_path):
    """On each backend (the caches in its memory: on the CPU the host step lends the stager its
    inputs as views and the slots go straight into the node's output, elsewhere inputs are read
    back and slots written), staged experts give the resident experts' tokens and, on one
    device, the same logits within float reordering; the stager staged and evicted."""
    path = write_tiny(tmp_path / "moe.gguf", MOE)
    out = {}
    for mode in ("resident", "offload"):
        with backend.fallback_session() as sess, \
                GgufLM.load(str(path), session=sess, max_ctx=64, prefill_chunk=4, experts=mode) as lm:
            ids = lm.model.tokenizer().encode("a mixture of many small experts")[:8]   # kept short: cuda-emu
            tokens, logits = lm.generate(ids, 3, Sampling(greedy=True), stop_at_eos=False)
            out[mode] = (tokens, np.stack(logits), lm.stats())
    assert out["offload"][0] == out["resident"][0]
    # same kernels over the same bytes (a slot instead of an expert index): equal up to the order
    # a backend sums in; bitwise on the CPU (test above)
    np.testing.assert_allclose(out["offload"][1], out["resident"][1], rtol=0, atol=1e-4)
    staging = out["offload"][2]["staging"]
    assert staging["experts_staged"] > 0 and staging["evictions"] > 0 and staging["hits"] > 0


def test_offload_needs_an_moe_file_and_a_cache_that_fits(tiny_gguf, tmp_path):
    from flare.core.errors import ModelError

    with pytest.raises(ModelError, match="mixture-of-experts"):
        GgufLM.load(str(tiny_gguf), experts="offload")
    path = write_tiny(tmp_path / "moe.gguf", MOE)
    with pytest.raises(ModelError, match="may need 8"):
        GgufLM.load(str(path), experts="offload", cache_mb=0.01, prefill_chunk=4, max_ctx=32)


def test_prefetching_the_next_layers_experts_keeps_logits_identical(tmp_path):
    """Offload with prefetch: layer i+1's guessed experts are copied on a background thread while
    layer i computes; staging waits for that copy, so logits equal resident experts' bit for bit,
    and some selected experts were resident only thanks to the prefetch."""
    path = write_tiny(tmp_path / "moe.gguf", MOE)
    out = {}
    for mode, prefetch in (("resident", 0), ("offload", 2)):
        with GgufLM.load(str(path), max_ctx=64, prefill_chunk=4, experts=mode, prefetch=prefetch) as lm:
            if lm.stager is not None:
                lm.stager.take_back = False      # wait for every guess: counts independent of timing
            ids = lm.model.tokenizer().chat_ids("Tell me about experts")
            _, logits = lm.generate(ids, 6, Sampling(greedy=True), stop_at_eos=False)
            out[mode] = (np.stack(logits), lm.stats())
    np.testing.assert_array_equal(out["offload"][0], out["resident"][0])
    staging = out["offload"][1]["staging"]
    assert staging["prefetched"] > 0 and staging["prefetch_hits"] > 0, staging


def test_prefetch_is_refused_where_it_would_race(tmp_path, tiny_gguf):
    from flare.core.errors import ModelError

    with pytest.raises(ModelError, match="prefetch needs experts=offload"):
        GgufLM.load(str(tiny_gguf), prefetch=2)


def test_describe_and_run_by_model_name(tiny_gguf, capsys):
    import json

    from flare.core.cli import main

    assert main(["describe", "gguf", "--option", f"path={tiny_gguf}", "--option", "max_ctx=32", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["entries"]) >= {"prefill", "decode"}
    code, err = _cli(["run", "gguf", str(tiny_gguf), "--prompt", "hi", "--greedy", "--max-new-tokens", "2"], capsys)
    assert code == 0, err


def test_release_gives_back_every_byte(tmp_path):
    """Weights, KV state, expert caches and arenas: the ledger's live bytes return to where they were."""
    from flare.core.ledger import LEDGER

    path = write_tiny(tmp_path / "moe.gguf", MOE)
    before = LEDGER.live_bytes("cpu:0")
    lm = GgufLM.load(str(path), max_ctx=32, prefill_chunk=4, experts="offload", prefetch=2)
    lm.generate(lm.model.tokenizer().encode("leak?"), 3, Sampling(greedy=True))
    assert LEDGER.live_bytes("cpu:0") > before
    lm.release()
    lm.release()                                        # idempotent
    assert LEDGER.live_bytes("cpu:0") == before


def test_a_file_and_its_tokenizer_are_shared_between_threads(tiny_gguf):
    """open_gguf parses a file once per process and hands every thread the same read-only object;
    the tokenizer is built once and encodes from several threads at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from flare.models.gguf.weights import GGUFModel, open_gguf

    with ThreadPoolExecutor(4) as pool:
        files = list(pool.map(lambda _: open_gguf(tiny_gguf), range(8)))
        assert all(f is files[0] for f in files)
        model = GGUFModel.open(str(tiny_gguf), max_ctx=16)
        texts = [f"thread {i}: héllo" for i in range(16)]
        got = list(pool.map(lambda t: model.tokenizer().encode(t), texts))
    assert got == [model.tokenizer().encode(t) for t in texts]
    assert model.tokenizer() is GGUFModel.open(str(tiny_gguf), max_ctx=32).tokenizer()
