"""The CPU backend's two executors: the native command list (C) and the NumPy closures.

The conformance suite runs on the default (native where it builds); here every
case also runs on the NumPy path (`native = false`), and we check that the
native path really covers each op instead of silently falling back.
"""
from __future__ import annotations

import numpy as np
import pytest

from flare.backends.cpu import native
from flare.plugins.testing.conformance.cases import CASES, FUSED_CASES, case_entry, case_expected
from flare.ledger import LEDGER
from flare.session import Session

# cases the native path hands to NumPy on purpose (f16 operands of BLAS calls, f32 -> f16 casts)
# f16 operands of matmul / mul_mat_id and casts to f16 take the NumPy kernel by design (the C
# executor's GEMMs are f32; see backends/cpu/README.md); every other case must run in C
NUMPY_BY_DESIGN = {c.id for c in CASES if (c.op in ("matmul", "mul_mat_id") and "f16" in c.id)} | {"cast_f32_f16"}
needs_native = pytest.mark.skipif(native.load() is None, reason=f"native CPU executor unavailable: {native.REASON}")


def _run(case, native_on: bool):
    inputs, want = case_expected(case)
    with Session(["cpu"], config={"cpu": {"native": native_on}}) as sess:
        pg = sess.prepare({"full": case_entry(case)}, {"full": {k: v.shape for k, v in inputs.items()}})
        got = pg.execute("full", **inputs)["out"]
        splits = [p.describe() for p in pg.current_plan("full").programs if p is not None]
        pg.release()
    return got, want, splits


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_numpy_path_matches_reference(case):
    before = LEDGER.snapshot().count()
    got, want, splits = _run(case, native_on=False)
    assert all(d["executor"] == "numpy" for d in splits)
    np.testing.assert_allclose(got, want, rtol=case.tol[0], atol=case.tol[1])
    assert LEDGER.snapshot().count() == before


@pytest.mark.parametrize("case", FUSED_CASES, ids=[c.id for c in FUSED_CASES])
def test_numpy_path_runs_chains_unfused(case):
    got, want, splits = _run(case, native_on=False)
    np.testing.assert_allclose(got, want, rtol=case.tol[0], atol=case.tol[1])
    assert sum(d["numpy_nodes"] for d in splits) > 1


@needs_native
@pytest.mark.parametrize("case", CASES + FUSED_CASES, ids=[c.id for c in CASES + FUSED_CASES])
def test_native_path_covers_op(case):
    got, want, splits = _run(case, native_on=True)
    np.testing.assert_allclose(got, want, rtol=case.tol[0], atol=case.tol[1])
    fallback = [n for d in splits for n in d["numpy_nodes"]]
    if case.id in NUMPY_BY_DESIGN:
        assert fallback, "expected the NumPy fallback for this case"
    else:
        assert not fallback, f"ran on NumPy instead of C: {fallback}"


@needs_native
def test_native_index_error_names_node():
    def entry(b, shapes):
        b.output("out", b.get_rows(b.weight("t", np.ones((4, 3), np.float32)), b.input("i", (2,), "i32"), name="lookup"))

    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": entry}, {"full": {"i": (2,)}})
        with pytest.raises(IndexError, match="lookup"):
            pg.execute("full", i=np.array([1, 9], np.int32))
        pg.release()


# Shapes past the small-matmul kernel, so each BLAS route of k_matmul is taken:
# gemv of a stored-transposed and a plain weight, the streaming kernel (wdot, up to 16 rows,
# with a row tail), (W a^T)^T for up to 64 rows, plain GEMM,
# batch folded into rows (shared weight), per-batch GEMMs, and a transposed view of a.
MATMULS = {
    "gemv_wT": ((1, 96), (80, 96), True),
    "gemv_w": ((1, 96), (96, 80), False),
    "wdot_wT": ((14, 96), (83, 96), True),
    "swap_wT": ((40, 96), (80, 96), True),
    "many_rows_wT": ((100, 96), (80, 96), True),
    "folded_batch": ((3, 20, 48), (64, 48), True),
    "per_batch": ((2, 3, 20, 48), (2, 3, 30, 48), True),
    "plain": ((40, 48), (48, 64), False),
}


@pytest.mark.parametrize("native_on", [pytest.param(True, marks=needs_native), False], ids=["native", "numpy"])
@pytest.mark.parametrize("name", sorted(MATMULS))
def test_matmul_routes(name, native_on):
    sa, sb, tb = MATMULS[name]
    rng = np.random.default_rng(7)
    a, w = rng.uniform(-1, 1, sa).astype(np.float32), rng.uniform(-1, 1, sb).astype(np.float32)

    def entry(b, shapes):
        b.output("y", b.matmul(b.input("a", sa), b.weight("w", w), transpose_b=tb))

    with Session(["cpu"], config={"cpu": {"native": native_on}}) as sess:
        pg = sess.prepare({"full": entry}, {"full": {"a": sa}})
        got = pg.execute("full", a=a)["y"]
        pg.release()
    want = np.matmul(a.astype(np.float64), np.swapaxes(w, -1, -2) if tb else w)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@needs_native
def test_threads_config_sets_the_blas():
    blas = native.load().blas
    before = blas.threads()
    try:
        for n in (1, 2):
            with Session(["cpu"], config={"cpu": {"threads": n}}) as sess:
                assert sess.devices[0].describe()["blas_threads"] == n
    finally:
        blas.set_threads(before)


def test_threads_must_be_a_positive_whole_number(monkeypatch):
    from flare.errors import InputError

    with pytest.raises(InputError, match="threads.*between 1 and 4096"):
        Session(["cpu"], config={"cpu": {"threads": 0}})
    monkeypatch.setenv("FLARE_CPU_THREADS", "lots")
    with pytest.raises(InputError, match="FLARE_CPU_THREADS='lots': expected a whole number"):
        Session(["cpu"])
