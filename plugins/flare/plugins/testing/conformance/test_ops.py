"""Every op on the backend under test against its NumPy reference (see cases.py).

The device is tested alone. One skip rule everywhere: a case whose graph has a
node the device's `supports` refuses is skipped, naming the nodes
(`refused_nodes`); each case records its op for the coverage summary printed at
the end of the run (`flare.plugins.testing.pytest_plugin`)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from flare.plugins.testing.conformance.cases import (CASES, FUSED_CASES, INPLACE_CASES, Case, case_entry,
                                                    refused_nodes)
from flare.plugins.testing.pytest_plugin import record_op
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


def test_backend_runs_some_op(backend, backend_session):
    """The minimum op set (docs/write-a-backend.md): no op is required — the CPU runs what a
    device refuses — but a device refusing every op would pass this suite by skipping it all."""
    device = backend_session.devices[0]
    runs = [c.id for c in CASES if not refused_nodes(_build(c)[0], device)]
    assert runs, f"{backend.name}: supports() refuses every op of every case, so the suite tests nothing"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_reference(backend, backend_session, case: Case, request):
    record_op(request, backend.name, case.op)
    graph, inputs = _build(case)
    device = backend_session.devices[0]
    _skip_refused(backend.name, graph, device)
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
def test_fused_chain_matches_reference(backend, backend_session, case: Case, request):
    """A chain the fusion pass can merge: fused exactly when the backend supports the fused
    op (else it runs as built), and the reference of the unfused graph either way. A chain
    with a node the device refuses is skipped, as op cases are."""
    from flare.core.fusion import fuse

    graph, inputs = _build(case)
    device = backend_session.devices[0]
    expected, _ = evaluate(graph, inputs)
    candidates: list = []
    fuse(graph, lambda node, chain: candidates.append(node) or False)
    assert [c.op for c in candidates] == [case.op]
    supported = device.supports(candidates[0])
    record_op(request, backend.name, case.op, as_chain=not supported)
    _skip_refused(backend.name, graph, device)
    shapes = {k: v.shape for k, v in inputs.items()}
    with backend_session.prepare({"full": case_entry(case)}, {"full": shapes}, name=case.id) as pg:
        got = pg.execute("full", **inputs)["out"]
        fusions = pg.describe()["entries"]["full"]["fusions"]
    assert len(fusions) == int(supported), fusions
    np.testing.assert_allclose(got, expected["out"], rtol=case.tol[0], atol=case.tol[1])


def _skip_refused(backend: str, graph, device) -> None:
    refused = refused_nodes(graph, device)
    if refused:
        pytest.skip(f"{backend} does not support {', '.join(refused)}")


@pytest.mark.parametrize("case", INPLACE_CASES, ids=[c.id for c in INPLACE_CASES])
def test_kernel_is_alias_safe(backend, backend_session, case: Case, request):
    """The kernel contract: an in-place op's output may share memory with its first input.

    `op(op(op(x)))` makes the planner put the middle result on the inner one's bytes;
    the same graph with the inner result kept as an output runs without that aliasing.
    A kernel that is right without aliasing and wrong with it reads its input after
    writing its output, and the failure says so."""
    record_op(request, backend.name, case.op)
    graph, inputs = _build(case)
    device = backend_session.devices[0]
    _skip_refused(backend.name, graph, device)
    want = evaluate(graph, inputs)[0]["out"]
    rng_seed = zlib.crc32(case.id.encode())

    def entry(keep_inner: bool):
        def build(b, shapes):
            out, _ = case.build(b, np.random.default_rng(rng_seed))
            b.output("out", out)
            if keep_inner:
                b.output("inner", out.srcs[0].srcs[0])   # an output keeps its own bytes: no aliasing
        return build

    shapes = {k: v.shape for k, v in inputs.items()}
    results = {}
    for keep in (True, False):
        with backend_session.prepare({"full": entry(keep)}, {"full": shapes}, strict=True,
                                     name=f"{case.id}:{'separate' if keep else 'aliased'}") as pg:
            plan = pg.current_plan("full")
            middle = plan.graph.outputs["out"].srcs[0]
            where = {}
            for bindings in plan.split_bindings:
                where.update({k: (id(v.buffer), v.offset) for k, v in bindings.items()})
            aliased = middle.id in where and where.get(middle.id) == where.get(middle.srcs[0].id)
            assert aliased != keep, (f"{case.id}: the planner {'did not alias' if not keep else 'aliased'} the "
                                     f"output and its first input; this test cannot check the kernel")
            results[keep] = pg.execute("full", **inputs)["out"]
    rtol, atol = case.tol

    def close(got) -> bool:
        return got.shape == want.shape and bool(np.allclose(got, want, rtol=rtol, atol=atol))

    if not close(results[True]):
        np.testing.assert_allclose(results[True], want, rtol=rtol, atol=atol,
                                   err_msg=f"{backend.name} {case.op}: wrong even without aliasing")
    if not close(results[False]):
        worst = float(np.max(np.abs(results[False].astype(np.float64) - want)))
        pytest.fail(f"{backend.name} {case.op}: kernel is not alias-safe: its output aliases its first input "
                    f"(an in-place op; docs/write-a-backend.md, 'Kernel contract') and the result is wrong "
                    f"(max abs error {worst:.3g}), while the same graph without aliasing is right; "
                    f"the kernel must not read its input after writing its output", pytrace=False)
