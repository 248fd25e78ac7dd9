"""`flare serve` attacked as a client would: malformed bodies, oversized and deep ones, stalled and vanishing
clients, SIGTERM under load, and a hypothesis fuzz of request bodies, all against a real server process on
loopback. Each attack gets its 4xx in the OpenAI shape (or its documented behaviour), the log holds no
traceback, and the server answers with the same tokens afterwards. Also `flare run X.core --requests` on a
large file (linear) and on a deeply nested line (exit 2). About 30 s.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from flare.plugins.export import export_core  # noqa: E402
from flare.plugins.serve.process import MAIN, ServerProcess, ledger_after_stop  # noqa: E402

ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
PROBE = {"prompt": "Probe the server", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def core_path(tmp_path_factory) -> Path:
    return export_core("moe-lm", tmp_path_factory.mktemp("attacks") / "tiny.core", options={"max_ctx": 1024},
                       progress=False)


@pytest.fixture(scope="module")
def server(core_path):
    s = ServerProcess(str(core_path), "--speculative", "2", "--read-timeout", "1", "--max-body-kib", "64")
    said = "".join(s.lines)                   # progress: what it loads, then that it is ready
    assert "flare serve: loading" in said and "preparing" in said and "ready" in said, said
    with httpx.Client(timeout=60) as c:
        s.probe = c.post(f"{s.url}/v1/completions", json=PROBE).json()["choices"][0]["token_ids"]
    yield s
    log = s.stop()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert s.proc.returncode == 0, log[-3000:]


def _still_the_same(s) -> None:
    r = httpx.post(f"{s.url}/v1/completions", json=PROBE, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == s.probe


def _rejected(s, status: int) -> float:
    m = re.search(rf'flare_rejected_requests_total{{status="{status}"}} ([0-9.e+]+)', httpx.get(f"{s.url}/metrics").text)
    return float(m.group(1)) if m else 0.0


BAD_BODIES = [
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (b'{"prompt": "x", "stop": 7}', "stop"), (b'{"prompt": "x", "stop": true}', "stop"),
    (b'{"prompt": "x", "stop": {"x": 1}}', "stop"), (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop"),
    (b'{"prompt": "x", "n": 1.0}', "n"), (b'{"prompt": "x", "n": true}', "n"),
    (b'{"prompt": "x", "logprobs": 0}', "logprobs"), (b'{"prompt": [256, 257, 65]}', "prompt"),
    (b'{"prompt": "x", "temperature": 1e400}', "temperature"), (b'{"prompt": "x", "seed": 1.5}', "seed"),
    (b'{"prompt": "x", "top_p": 0}', "top_p"), (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b"[" * 20000 + b"]" * 20000, None), (b'{"a": ' * 40 + b"1" + b"}" * 40, None),
    (b"\xff\xfe not utf-8", None), (b"", None),
]


def test_malformed_bodies_get_400_in_the_openai_shape(server) -> None:
    before = _rejected(server, 400)
    with httpx.Client(timeout=30) as c:
        for body, param in BAD_BODIES:
            r = c.post(f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["type"] == "invalid_request_error", (body[:60], r.text)
            if param is not None:
                assert err["param"] == param, (body[:60], err)
        r = c.post(f"{server.url}/v1/chat/completions", content=json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    assert _rejected(server, 400) == before + len(BAD_BODIES) + 1
    _still_the_same(server)


def test_a_body_too_large_is_413_declared_or_not(server) -> None:
    big = b'{"prompt": "' + b"a" * (200 << 10) + b'"}'
    r = httpx.post(f"{server.url}/v1/completions", content=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the body is")

    def chunks():                               # no Content-Length: counted while reading
        for _ in range(20):
            yield b" " * (8 << 10)
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413
    _still_the_same(server)


def _raw(server, data: bytes, wait: float) -> bytes:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        time.sleep(wait)
        sock.settimeout(10)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def test_stalled_and_vanishing_clients(server) -> None:
    t0 = time.monotonic()
    assert _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", 0.1) == b""   # mid-headers: closed
    assert time.monotonic() - t0 < 8
    stalled = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n{\"prompt\"", 0.1)
    assert b" 408 " in stalled.split(b"\r\n")[0] and b"did not arrive" in stalled                  # mid-body: 408
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):                             # clients that leave mid-body
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"pro")
    time.sleep(0.3)
    _still_the_same(server)


def test_openai_client_chat_plain_and_streamed(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Say something"}]
    plain = client.chat.completions.create(model="tiny.core", messages=msgs,
                                           max_tokens=8, temperature=0, seed=1)
    parts = list(client.chat.completions.create(model="tiny.core", messages=msgs, max_tokens=8, temperature=0,
                                                stream=True))
    assert plain.choices[0].message.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == plain.choices[0].message.content
    streamed_ids = [t for p in parts if p.choices for t in p.choices[0].model_extra["token_ids"]]
    assert streamed_ids == plain.choices[0].model_extra["token_ids"]
    assert parts[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny.core", messages=msgs, stop={"x": 1})   # type: ignore[arg-type]
    assert err.value.body["param"] == "stop"


def test_fuzzed_bodies_never_break_the_server(server) -> None:
    """hypothesis: arbitrary JSON bodies (bounded count and time) get 200 or an OpenAI-shaped 4xx, never a
    500; the server then answers as before."""
    hyp = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | \
        st.text(max_size=8)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) |
                          st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
    field = st.sampled_from(["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
                             "logprobs", "echo", "model", "messages", "best_of", "max_completion_tokens"])
    bodies = st.dictionaries(field, values, max_size=6) | values
    client = httpx.Client(timeout=60)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=bodies, route=st.sampled_from(["completions", "chat/completions"]))
    def check(body, route) -> None:
        if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 4)       # bounded work per example
        body = {**body, "max_completion_tokens": 4} if route == "chat/completions" and isinstance(body, dict) \
            else body
        r = client.post(f"{server.url}/v1/{route}", content=json.dumps(body))
        assert r.status_code in (200, 400), (body, r.status_code, r.text[:200])
        if r.status_code == 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    try:
        check()
    finally:
        client.close()
    assert hyp is not None
    _still_the_same(server)


def _admitted(s) -> int:
    text = httpx.get(f"{s.url}/metrics").text
    total = sum(float(v) for v in re.findall(r"^flare_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))
    for name in ("flare_queue_depth", "flare_running_requests"):
        total += float(re.search(rf"^{name} ([0-9.e+]+)$", text, re.M).group(1))
    return int(total)


def test_sigterm_past_the_grace_period_answers_503_and_ends_streams(core_path) -> None:
    """32 long requests fill the 4 slots and the queue, a stream waits behind them; SIGTERM with a 0.3 s
    grace period: what finished is 200, every other plain request a 503 in JSON, the stream an error
    event and [DONE]; no traceback, exit 0, the ledger back where it started."""
    from concurrent.futures import ThreadPoolExecutor

    s = ServerProcess(str(core_path), "--graceful-seconds", "0.3", "--no-prefix-cache", "--log-level", "info")
    results: dict[str, object] = {}
    opened = threading.Event()

    def plain(i: int) -> httpx.Response:
        return httpx.post(f"{s.url}/v1/completions", timeout=60,
                          json={"prompt": f"long answer {i}", "max_tokens": 1000, "temperature": 0})

    def stream() -> None:
        body = {"prompt": "the stream", "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            opened.set()
            results["stream"] = list(r.iter_lines())

    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(plain, i) for i in range(32)]
        deadline = time.monotonic() + 60
        while _admitted(s) < 32:                 # every request is in (queued, running or done)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t = threading.Thread(target=stream)
        t.start()
        assert opened.wait(60)
        log = s.stop()
        answers = [f.result() for f in futures]
    t.join(60)
    lines = [x for x in results["stream"] if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:]), lines[-3:]
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 503} and 503 in codes, codes
    assert all(r.json()["error"]["type"] == "server_error" for r in answers if r.status_code == 503)
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert s.proc.returncode == 0
    after = ledger_after_stop(log)
    assert after is not None and after[0] == after[1], log


def test_flare_run_requests_file_is_linear_and_deep_lines_exit_2(core_path, tmp_path) -> None:
    from flare.plugins.export.serving.requests import read_requests

    lines = "".join(json.dumps({"id": f"r{i}", "prompt_ids": [256, 65], "max_new_tokens": 1}) + "\n"
                    for i in range(30000))
    t0 = time.perf_counter()
    assert len(read_requests(lines.splitlines())) == 30000
    assert time.perf_counter() - t0 < 20        # was 31 s (quadratic); generous for a loaded machine
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt": "x"}\n' + "[" * 100000 + "]" * 100000 + "\n")
    out = subprocess.run([sys.executable, "-c", MAIN, "run", str(core_path), "--requests", str(deep)],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("error:") == 1 and "line 2" in out.stderr, out.stderr
    assert "nested" in out.stderr and "Traceback" not in out.stderr


def test_serve_a_model_by_name_exports_it_once(tmp_path, monkeypatch, capsys) -> None:
    from flare.core.errors import InputError
    from flare.plugins.serve.cli import resolve_core

    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    core = resolve_core("moe-lm")
    assert core == tmp_path / "serve" / "cores" / "moe-lm.core" and "exporting moe-lm once" in capsys.readouterr().err
    assert resolve_core("moe-lm") == core and "exporting" not in capsys.readouterr().err     # reused
    with pytest.raises(InputError, match="not a core directory, a .gguf file, nor an exportable model"):
        resolve_core("no-such-model")
    s = ServerProcess("moe-lm", env={"FLARE_CACHE_DIR": str(tmp_path)})
    try:
        assert httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"] == "moe-lm.core"
    finally:
        assert "exporting" not in s.stop()
