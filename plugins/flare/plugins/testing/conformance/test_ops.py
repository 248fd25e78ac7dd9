"""Every op on the backend under test against its NumPy reference (see cases.py)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from flare.plugins.testing.conformance.cases import CASES, FUSED_CASES, Case, case_entry
from flare.core.graph import GraphBuilder
from flare.core.ledger import LEDGER
from flare.core.ops import OPS
from flare.core.reference import evaluate


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
    used |= {c.op for c in FUSED_CASES}  # fused ops: made from chains by the fusion pass
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


@pytest.mark.parametrize("case", FUSED_CASES, ids=[c.id for c in FUSED_CASES])
def test_fused_chain_matches_reference(backend, backend_session, case: Case):
    """A chain the fusion pass can merge: fused exactly when the backend supports the fused
    op (else it runs as built), and the reference of the unfused graph either way."""
    from flare.core.fusion import fuse

    graph, inputs = _build(case)
    expected, _ = evaluate(graph, inputs)
    device = backend_session.devices[0]
    candidates: list = []
    fuse(graph, lambda node, chain: candidates.append(node) or False)
    assert [c.op for c in candidates] == [case.op]
    supported = device.supports(candidates[0])
    shapes = {k: v.shape for k, v in inputs.items()}
    with backend_session.prepare({"full": case_entry(case)}, {"full": shapes}, name=case.id) as pg:
        got = pg.execute("full", **inputs)["out"]
        fusions = pg.describe()["entries"]["full"]["fusions"]
    assert len(fusions) == int(supported), fusions
    np.testing.assert_allclose(got, expected["out"], rtol=case.tol[0], atol=case.tol[1])
