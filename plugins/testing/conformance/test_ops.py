"""Every op on the backend under test against its NumPy reference (see cases.py)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from flare.plugins.testing.conformance.cases import CASES, Case
from flare.graph import GraphBuilder
from flare.ledger import LEDGER
from flare.ops import OPS
from flare.reference import evaluate


def _build(case: Case):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    b = GraphBuilder()
    out, inputs = case.build(b, rng)
    b.output("out", out)
    return b.build(), inputs


def test_every_registry_op_has_a_case():
    used = set()
    for case in CASES:
        graph, _ = _build(case)
        used |= {n.op for n in graph.nodes}
    missing = sorted(set(OPS) - used - {"host"})  # host nodes run Python on the host, not a kernel
    assert not missing, f"ops without a conformance case: {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_reference(backend, backend_session, case: Case):
    graph, inputs = _build(case)
    device = backend_session.devices[0]
    unsupported = [f"{n.name} ({n.op})" for n in graph.nodes if OPS[n.op].view is None and not device.supports(n)]
    if unsupported:
        pytest.skip(f"{backend.name} does not support {', '.join(unsupported)}")
    expected, _ = evaluate(graph, inputs)
    before = LEDGER.snapshot()

    def entry(b, shapes):
        out, _ = case.build(b, np.random.default_rng(zlib.crc32(case.id.encode())))
        b.output("out", out)

    shapes = {k: v.shape for k, v in inputs.items()}
    with backend_session.prepare({"full": entry}, {"full": shapes}, strict=True, name=case.id) as pg:
        got = pg.execute("full", **inputs)["out"]
        again = pg.execute("full", **inputs)["out"]
    assert LEDGER.snapshot().count(device.name) == before.count(device.name), "buffers leaked after release"
    want = expected["out"]
    assert got.shape == want.shape and got.dtype == want.dtype
    rtol, atol = case.tol
    if rtol == 0 and atol == 0:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(got, again)  # replaying the capture is deterministic
