"""`flare serve` end to end: a real server process on a free loopback port, real HTTP clients.

- the official `openai` client, plain and streaming, unchanged but for base_url;
- 16 concurrent requests (half streaming) whose token ids equal `flare run NAME.core --json`'s;
- a client that disconnects mid-stream cancels its request;
- SIGTERM shuts down gracefully and the ledger is back to where it started;
- the same on 2 MPI ranks (skipped without mpirun/mpi4py).
About 10 s (two server starts, one `flare run`, one 2-rank start).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from flare.plugins.export import export_core  # noqa: E402
from flare.plugins.serve.process import ServerProcess, complete, ledger_after_stop  # noqa: E402

from flare.plugins.serve.process import MAIN  # noqa: E402
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
SHARED = "You are a helpful assistant. Answer briefly and precisely: "
PROMPTS = [(SHARED + q, n) for q, n in [("what is 2+2?", 6), ("name a colour", 9), ("why is the sky blue?", 12),
                                         ("say hi", 4)]] + \
          [(f"Prompt number {i} " + "abc" * (i % 5), 3 + i % 7) for i in range(12)]


@pytest.fixture(scope="module")
def core_path(tmp_path_factory) -> Path:
    return export_core("moe-lm", tmp_path_factory.mktemp("serve-e2e") / "tiny.core", progress=False)


@pytest.fixture(scope="module")
def expected(core_path, tmp_path_factory) -> dict[str, list[int]]:
    """`flare run NAME.core --json` on the same prompts (greedy)."""
    path = tmp_path_factory.mktemp("serve-e2e-req") / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": p, "max_new_tokens": n}) + "\n"
                            for i, (p, n) in enumerate(PROMPTS)))
    out = subprocess.run([sys.executable, "-c", MAIN, "run", str(core_path), "--requests", str(path), "--json"],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {r["id"]: r["tokens"] for r in json.loads(out.stdout)["per_request"]}


@pytest.fixture(scope="module")
def server(core_path):
    s = ServerProcess(str(core_path), "--speculative", "2", "--draft", "self", "--max-queue", "64")
    yield s
    s.stop()


def _complete(url: str, i: int, prompt: str, n: int, stream: bool) -> tuple[str, list[int], str, dict]:
    with httpx.Client(timeout=120) as c:
        a = complete(c, url, prompt, n, stream=stream, model="tiny.core", temperature=0)
    return str(i), a.token_ids, a.text, a.usage


def test_openai_client_plain_and_streaming(server, expected) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny.core"]
    prompt, n = PROMPTS[0]
    plain = client.completions.create(model="tiny.core", prompt=prompt, max_tokens=n, temperature=0)
    choice = plain.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert choice.model_extra["token_ids"] == expected["0"]
    assert plain.usage.prompt_tokens == len(prompt.encode()) + 1 and plain.usage.completion_tokens == len(expected["0"])
    parts = list(client.completions.create(model="tiny.core", prompt=prompt, max_tokens=n, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == choice.text
    assert parts[-1].choices[0].finish_reason == choice.finish_reason
    # asked again, the shared prompt's whole blocks come from the prefix cache
    again = client.completions.create(model="tiny.core", prompt=prompt, max_tokens=n, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 and again.choices[0].text == choice.text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="another-model", prompt="hi", max_tokens=2)
    assert err.value.body["param"] == "model"


def test_16_concurrent_requests_equal_flare_run(server, expected) -> None:
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda a: _complete(server.url, *a),
                                [(i, p, n, i % 2 == 1) for i, (p, n) in enumerate(PROMPTS)]))
    assert len(answers) == 16
    for rid, ids, text, usage in answers:
        assert ids == expected[rid], rid
        assert usage["completion_tokens"] == len(ids)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert re.search(r"flare_speculative_proposed_tokens [1-9]", metrics)


def _cancelled(url: str) -> int:
    m = re.search(r'flare_requests_total\{outcome="cancelled"\} ([0-9.]+)', httpx.get(f"{url}/metrics").text)
    return int(float(m.group(1))) if m else 0


def _wait_cancelled(url: str, at_least: int) -> None:
    deadline = time.monotonic() + 30
    while _cancelled(url) < at_least:
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A core with a long context, so a request can outlast the client's hang-up by far
    (with the 128-token core a loaded machine could finish the answer before the client
    closed, and nothing would be left to cancel)."""
    core = export_core("moe-lm", tmp_path_factory.mktemp("serve-long") / "long.core", options={"max_ctx": 2048},
                       mixed=False, progress=False)
    s = ServerProcess(str(core))
    yield s
    s.stop()


def test_client_disconnect_cancels_its_request(long_server) -> None:
    server = long_server
    before = _cancelled(server.url)
    # greedy on this prompt runs to max_tokens (~0.6 s here); "a long answer please" met EOS after 62 tokens
    # (~60 ms), which a quick server could answer inside the 20 ms client below, leaving nothing to cancel
    body = {"prompt": "Tell me a story", "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        next(r.iter_lines())                    # the first token arrived; now hang up
    _wait_cancelled(server.url, before + 1)
    with pytest.raises(httpx.ReadTimeout):      # not streaming: the client gives up before the answer
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=0.02)
    _wait_cancelled(server.url, before + 2)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_sigterm_releases_every_buffer(core_path) -> None:
    """With a request in flight: it finishes within the grace period or is cancelled; either way the
    stream ends, the process exits 0 and the ledger holds what it held at start."""
    import threading

    s = ServerProcess(str(core_path), "--no-mixed-prefill", "--speculative", "3", "--graceful-seconds", "0.2")
    assert _complete(s.url, 0, PROMPTS[1][0], 5, True)[1]
    ended: list[str] = []

    def long_stream() -> None:
        body = {"prompt": "x", "max_tokens": 120, "temperature": 0.7, "seed": 1, "stream": True}
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                lines = list(r.iter_lines())
            ended.append("done" if "data: [DONE]" in lines else "cut")
        except httpx.HTTPError as exc:          # the connection closed under it: cancelled
            ended.append(type(exc).__name__)

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.05)
    err = s.stop()
    t.join(30)
    assert ended and not t.is_alive(), err
    assert s.proc.returncode == 0, err
    after = ledger_after_stop(err)
    assert after is not None and after[0] == after[1], err


def test_speculative_refused_at_load_without_a_draft(tmp_path) -> None:
    path = export_core("moe-lm", tmp_path / "nodraft.core", progress=False, draft_layers=0)
    out = subprocess.run([sys.executable, "-c", MAIN, "serve", str(path), "--speculative", "2", "--port", "0"],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "options.speculative" not in out.stdout
    assert "--speculative was asked for, but the core has no draft program" in out.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt install openmpi-bin)")
def test_two_ranks_serve_the_same_tokens(core_path, expected) -> None:
    pytest.importorskip("mpi4py")
    s = ServerProcess(str(core_path), "--ranks", "2", "--speculative", "2", timeout=120)
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda a: _complete(s.url, *a),
                                    [(i, p, n, i % 2 == 0) for i, (p, n) in enumerate(PROMPTS[:4])]))
        again = _complete(s.url, 0, PROMPTS[0][0], PROMPTS[0][1], False)
    finally:
        err = s.stop()
    for rid, ids, _, _ in answers + [again]:
        assert ids == expected[rid], (rid, err)
    assert again[3]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert s.proc.returncode == 0, err
