"""The continuous-batching scheduler on an exported moe-lm core (CPU)."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from flare.plugins.export import LoadOptions, export_core, load_core
from flare.plugins.export.runtime import CoreRuntime
from flare.plugins.export.serving import Chunk, Engine, Request, RequestError, read_requests, token_lm_inputs
from flare.plugins.serve.offline import Batcher

PROMPTS = [("Hello world", 9), ("The quick brown fox", 7), ("abc", 11), ("Mixture of experts", 6), ("zz", 4),
           ("Once upon a time", 8), ("x", 1), ("Serving many requests at once", 5)]


@pytest.fixture(scope="module")
def core_path(tmp_path_factory) -> Path:
    return export_core("moe-lm", tmp_path_factory.mktemp("serving") / "moe.core", progress=False)


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    from flare.models.moe_lm import encode

    return [Request(f"r{i}", tuple(encode(p)), n) for i, (p, n) in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def reference(requests) -> dict[str, list[int]]:
    """Each request generated alone by the model itself (greedy)."""
    from flare.models.moe_lm import MoeLM

    with MoeLM.load("tiny") as m:
        return {r.id: m.generate(list(r.prompt), r.max_new_tokens)[0] for r in requests}


def _serve(core_path: Path, requests, mixed: bool | None, **kw):
    core = load_core(core_path, LoadOptions(mixed_prefill=mixed))
    with CoreRuntime(core) as rt:
        sched = Batcher(Engine(rt), **kw)
        report = sched.run(list(requests))
        return report, sched.trace, dict(rt.launches)


def test_progress_without_mixed_programs(core_path, requests, reference) -> None:
    report, trace, launches = _serve(core_path, requests, mixed=False)
    assert report["completed"] == len(requests) and not report["rejected"]
    assert report["steps"]["mixed"] == 0 and not any(p.startswith("mixed") for p in launches)
    for r in report["per_request"]:
        assert r["tokens"] == reference[r["id"]], r["id"]    # batching changes nothing
        assert r["ttft_s"] is not None and r["finished_s"] is not None
    # no starvation: prefill never runs twice in a row while a sequence waits to decode
    for prev, cur in zip(trace, trace[1:]):
        assert not (prev[0] == cur[0] == "prefill" and cur[3] > 0), trace
    # and every decoding sequence gets a token at least every other step
    assert all(kind in ("prefill", "decode") for kind, *_ in trace)


def test_mixed_steps_share_launches(core_path, requests, reference) -> None:
    on, trace_on, _ = _serve(core_path, requests, mixed=True)
    off, _, _ = _serve(core_path, requests, mixed=False)
    assert on["completed"] == len(requests) and on["steps"]["mixed"] > 0
    assert {r["id"]: r["tokens"] for r in on["per_request"]} == reference
    assert on["launches"] < off["launches"]
    assert on["generated_tokens"] == off["generated_tokens"] == sum(len(t) for t in reference.values())


def test_arrivals_and_ttft_with_a_fake_clock(core_path, requests) -> None:
    now = [0.0]

    def clock():
        now[0] += 0.001       # every look at the clock costs a millisecond
        return now[0]

    def sleep(dt):
        now[0] += dt

    late = [Request("early", requests[0].prompt, 3, 0.0), Request("late", requests[1].prompt, 3, 5.0)]
    report, _, _ = _serve(core_path, late, mixed=None, clock=clock, sleep=sleep)
    by_id = {r["id"]: r for r in report["per_request"]}
    assert by_id["early"]["finished_s"] < 5.0 <= by_id["late"]["finished_s"]
    assert 0 < by_id["late"]["ttft_s"] < 1.0              # measured from its own arrival


def test_too_long_requests_are_rejected_not_fatal(core_path, requests) -> None:
    reqs = [Request("long", (256,) * 120, 20), requests[0]]
    report, _, _ = _serve(core_path, reqs, mixed=False)
    assert "exceeds the context of 128" in report["rejected"]["long"]
    assert report["completed"] == 1


def test_token_lm_layout_from_its_definition(core_path) -> None:
    """The contract, checked from its definition: token i of a chunk writes KV row
    seq * max_ctx + pos and attends to exactly its own sequence's rows up to pos; padding
    writes and reads only the scratch row; out_rows are each chunk's last token. moe-lm
    builds its steps with the same function, from the manifest's own contract."""
    from flare.models.moe_lm import SeqChunk, get_config, make_inputs

    cfg, serving = get_config("tiny"), load_core(core_path).manifest.serving
    rng = np.random.default_rng(0)
    for _ in range(20):
        seqs = rng.choice(cfg.max_seqs, size=rng.integers(1, cfg.max_seqs + 1), replace=False)
        chunks = [Chunk(int(s), int(rng.integers(0, 60)), rng.integers(0, 256, rng.integers(1, 4)).tolist())
                  for s in seqs]
        n = sum(len(c.tokens) for c in chunks)
        pad = int(n + rng.integers(0, 3))
        got = token_lm_inputs(serving, chunks, tokens=pad, batch=len(chunks))
        at, last = 0, []
        for c in chunks:
            for i, tok in enumerate(c.tokens):
                pos, row = c.start + i, c.seq * serving.max_ctx + c.start + i
                assert got["tokens"][at] == tok and got["pos"][at] == pos and got["kv_rows"][at] == row
                open_rows = np.flatnonzero(got["mask"][at] == 0)
                np.testing.assert_array_equal(open_rows, np.arange(c.seq * serving.max_ctx, row + 1))
                at += 1
            last.append(at - 1)
        for r in range(n, pad):
            assert got["kv_rows"][r] == serving.scratch_row and got["tokens"][r] == serving.pad
            np.testing.assert_array_equal(np.flatnonzero(got["mask"][r] == 0), [serving.scratch_row])
        np.testing.assert_array_equal(got["out_rows"], last)
        model = make_inputs(cfg, [SeqChunk(c.seq, c.start, c.tokens) for c in chunks], pad_to=pad)
        for k in got:
            np.testing.assert_array_equal(model[k], got[k], err_msg=k)


def test_request_parsing() -> None:
    reqs = read_requests(io.StringIO('{"prompt": "hi"}\n\n# comment\n{"id": "b", "prompt_ids": [256, 7], '
                                     '"max_new_tokens": 2, "arrival": 0.5}\n'), default_new=3)
    assert reqs == [Request("0", (256, 104, 105), 3, 0.0), Request("b", (256, 7), 2, 0.5)]
    for line, msg in [("{", "line 1: not JSON"), ('{"prompt": ""}', "needs a non-empty"),
                      ('{"prompt": "a", "max_new_tokens": 0}', "max_new_tokens"),
                      ('{"prompt_ids": [1, "x"]}', "prompt_ids"), ('{"id": "a", "prompt": "a"}\n{"id": "a", "prompt": "b"}',
                                                                 "used twice")]:
        with pytest.raises(RequestError, match=msg):
            read_requests(io.StringIO(line))
