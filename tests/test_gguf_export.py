"""`flare export` of a GGUF model: the core keeps the file's quantized weights (U8 bytes with
their block dtype in the safetensors metadata), runs the same step graph, and its loader
refuses bytes that disagree with the declared dtype."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from flare.core.errors import CoreFormatError
from flare.models.gguf.export import GgufAdapter
from flare.models.gguf.model import GgufLM, serving_contract
from flare.models.gguf.testing import TinySpec, write_tiny
from flare.plugins.export import export_core, load_core
from flare.plugins.export.files import BLOCK_DTYPES_KEY, safetensors_header
from flare.plugins.export.runtime import CoreRuntime
from flare.plugins.export.serving.batch import Chunk, token_lm_inputs

pytestmark = pytest.mark.usefixtures("gguf_plugin")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf", TinySpec(qtype="q4_1", seed=5))


@pytest.fixture(scope="module")
def core(tiny, tmp_path_factory):
    adapter = GgufAdapter(path=str(tiny), max_ctx=32, max_seqs=2, prefill_chunk=4)
    return export_core(adapter, tmp_path_factory.mktemp("cores") / "tiny.core", progress=False, draft_layers=0)


def test_weights_stay_quantized_in_the_core(core, tiny):
    header = safetensors_header(core / "weights.safetensors", "weights")
    assert header["blk.0.attn_q.weight"]["dtype"] == "q4_1" and header["blk.0.attn_q.weight"]["shape"] == (64, 2)
    assert header["token_embd.weight"]["dtype"] == "q8_0"
    assert header["output_norm.weight"]["dtype"] == "f32"
    assert (core / "weights.safetensors").stat().st_size < tiny.stat().st_size + 8192


def test_core_runs_the_same_graph(core, tiny):
    ids = (1, 40, 41, 42)
    with GgufLM.load(str(tiny), max_ctx=32, max_seqs=2, prefill_chunk=4) as lm:
        want = lm.prefill(0, ids)
        serving = serving_contract(lm.cfg)
    with CoreRuntime(load_core(core)) as rt:
        inputs = token_lm_inputs(serving, [Chunk(0, 0, ids)], tokens=4, batch=1)
        got = rt.execute("prefill-t4-b1", **inputs)["logits"][0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _write_st(path, tensors, meta):
    header = dict(tensors)
    header["__metadata__"] = meta
    data = json.dumps(header).encode()
    size = max(t["data_offsets"][1] for t in tensors.values())
    path.write_bytes(struct.pack("<Q", len(data)) + data + bytes(size))


def test_loader_refuses_block_bytes_that_disagree(tmp_path):
    p = tmp_path / "w.safetensors"
    _write_st(p, {"w": {"dtype": "U8", "shape": [2, 30], "data_offsets": [0, 60]}},
              {BLOCK_DTYPES_KEY: json.dumps({"w": "q4_1"})})
    with pytest.raises(CoreFormatError, match="not whole q4_1 blocks"):
        safetensors_header(p, "weights")
    _write_st(p, {"w": {"dtype": "F32", "shape": [2, 5], "data_offsets": [0, 40]}},
              {BLOCK_DTYPES_KEY: json.dumps({"w": "q4_1"})})
    with pytest.raises(CoreFormatError, match="stored as 'F32'"):
        safetensors_header(p, "weights")
    _write_st(p, {"w": {"dtype": "U8", "shape": [2, 40], "data_offsets": [0, 80]}},
              {BLOCK_DTYPES_KEY: json.dumps({"w": "q9_9"})})
    with pytest.raises(CoreFormatError, match="block dtypes"):
        safetensors_header(p, "weights")
    _write_st(p, {"w": {"dtype": "U8", "shape": [2, 40], "data_offsets": [0, 80]}}, {})
    with pytest.raises(CoreFormatError, match="'U8' is not one of"):
        safetensors_header(p, "weights")
    _write_st(p, {"w": {"dtype": "U8", "shape": [2, 40], "data_offsets": [0, 80]}},
              {BLOCK_DTYPES_KEY: json.dumps({"w": "q4_1"})})
    assert safetensors_header(p, "weights")["w"]["shape"] == (2, 2)


def test_flare_export_gguf_with_a_path_option(tiny, tmp_path, capsys):
    from flare.core.cli import main

    out = tmp_path / "cli.core"
    code = main(["export", "gguf", "--option", f"path={tiny}", "--max-ctx", "32", "--prefill-chunk", "4",
                 "--draft-layers", "0", "--quiet", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert load_core(out).manifest.config["target"] == str(tiny)
    assert main(["export", "gguf", "--option", "colour=red", "-o", str(tmp_path / "x.core")]) == 2
    assert "unknown options ['colour']" in capsys.readouterr().err


def test_flare_run_core_uses_the_files_tokenizer_for_text(core, tiny, tmp_path, capsys):
    """`flare run NAME.core` of a GGUF model encodes text prompts with the file's BPE (not token-lm/1
    bytes after <bos> 256) and reports each answer as text, as `flare serve NAME.core` does; explicit
    ids above the byte range are in the vocabulary and allowed."""
    from flare.core.cli import main
    from flare.models.gguf.plugin import serving_tokenizer

    tok = serving_tokenizer(core, load_core(core).manifest)
    want = tok.encode("Hi there")
    assert want != [256, *b"Hi there"]                # the byte encoding would be wrong ids here
    lines = tmp_path / "requests.jsonl"
    lines.write_text(json.dumps({"id": "text", "prompt": "Hi there", "max_new_tokens": 3}) + "\n"
                     + json.dumps({"id": "ids", "prompt_ids": want, "max_new_tokens": 3}) + "\n")
    assert main(["run", str(core), "--requests", str(lines), "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    by_id = {r["id"]: r for r in report["per_request"]}
    assert by_id["text"]["prompt_tokens"] == len(want)
    assert by_id["text"]["tokens"] == by_id["ids"]["tokens"]          # the same ids, whichever way given
    dec = tok.decoder()
    assert by_id["text"]["text"] == "".join(dec.push(t) for t in by_id["text"]["tokens"]) + dec.flush()
    assert main(["run", str(core), "--prompt", "Hi there", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_request"][0]["tokens"] == by_id["text"]["tokens"]
    lines.write_text(json.dumps({"prompt_ids": [tok.vocab_size]}) + "\n")
    assert main(["run", str(core), "--requests", str(lines)]) == 2
    assert f"token ids in 0..{tok.vocab_size - 1}" in capsys.readouterr().err
