"""The CPU backend's two executors: the native command list (C) and the NumPy closures.

The conformance suite runs on the default (native where it builds); here every
case also runs on the NumPy path (`native = false`), and we check that the
native path really covers each op instead of silently falling back.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from flare.backends.cpu import native
from flare.plugins.testing.conformance.cases import CASES, FUSED_CASES, case_entry, case_expected
from flare.plugins.testing.conformance.cases_extra import importer_ops
from flare.core.ledger import LEDGER
from flare.core.session import Session

# cases the native path hands to NumPy on purpose (f16 operands of BLAS calls, f32 -> f16 casts)
# f16 operands of matmul / mul_mat_id and casts to f16 take the NumPy kernel by design (the C
# executor's GEMMs are f32; see backends/flare/backends/cpu/README.md); every other case must run in C
NUMPY_BY_DESIGN = {c.id for c in CASES if (c.op in ("matmul", "mul_mat_id") and "f16" in c.id)} | {"cast_f32_f16"}
# ... and the ops added for imported ONNX graphs, which have NumPy kernels only so far
NUMPY_BY_DESIGN |= {c.id for c in CASES if c.op in importer_ops()}
NUMPY_BY_DESIGN -= {"conv2d_1d", "conv2d_1d_bias"}  # ... except 1-D convolutions (H = 1, one group): conv1d
NUMPY_BY_DESIGN -= {c.id for c in CASES if c.op == "erf"}  # ... and erf (Piper's flow: 24 NumPy steps a sentence)
needs_native = pytest.mark.skipif(native.load() is None, reason=f"native CPU executor unavailable: {native.REASON}")


def _run(case, native_on: bool):
    inputs, want = case_expected(case)
    with Session(["cpu"], config={"cpu": {"native": native_on}}) as sess:
        pg = sess.prepare({"full": case_entry(case)}, {"full": {k: v.shape for k, v in inputs.items()}})
        got = pg.execute("full", **inputs)["out"]
        splits = [p.describe() for p in pg.current_plan("full").programs if p is not None]
        splits[0]["fusions"] = pg.describe()["entries"]["full"]["fusions"]
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
    # nothing fused (an elementwise-only chain, leaky_relu's, may still run as one NumPy step)
    assert not splits[0]["fusions"] and (case.op == "leaky_relu" or sum(d["numpy_nodes"] for d in splits) > 1)


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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("length", [1, 2, 4, 16, 17])
def test_short_rows_against_one_value_per_row(threads, length):
    """[B, C, L] (op) [C, 1], L short: the pointer-stepped rows of BINARY (a conv's bias), split
    across threads at rows that cut (i0, i1) blocks, equal NumPy's; L = 17 takes the general loop."""
    rng = np.random.default_rng(length)
    x = rng.standard_normal((2000, 37, length)).astype(np.float32)
    bias = rng.standard_normal((37, 1)).astype(np.float32)

    def entry(b, shapes):
        xi, w = b.input("x", x.shape), b.weight("bias", bias)
        b.output("add", b.add(xi, w))
        b.output("sub", b.sub(xi, w))
        b.output("mul", b.mul(xi, w))
        b.output("div", b.div(xi, w))
        b.output("slice", b.add(b.slice(xi, axis=0, start=3, stop=1950), w))   # offset rows

    with Session(["cpu"], config={"cpu": {"threads": threads}}) as sess:
        pg = sess.prepare({"full": entry}, {"full": {"x": x.shape}})
        got = pg.execute("full", x=x)
        for name, want in (("add", x + bias), ("sub", x - bias), ("mul", x * bias), ("div", x / bias),
                           ("slice", x[3:1950] + bias)):
            np.testing.assert_array_equal(got[name], want, err_msg=name)
        pg.release()


def _vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_packed_weights_take_huge_pages():
    """A packed weight of 2 MiB or more starts on a 2 MiB boundary in a mapping advised for
    transparent huge pages (device._huge_page_backed); smaller ones are cut in order from shared
    slabs of such pages, which live while any of their cuts does; products stay the reference's
    and the ledger counts each packed copy's own bytes."""
    from flare.backends.cpu.device import HUGE_PAGE, PACK_SLAB
    from flare.core.ledger import LEDGER

    rng = np.random.default_rng(11)
    big = (rng.standard_normal((1536, 384)) / 20).astype(np.float32)        # packed: 2.36 MB
    small = [(rng.standard_normal((384, 384)) / 20).astype(np.float32) for _ in range(8)]  # 590 KB each
    x = rng.standard_normal((5, 384)).astype(np.float32)

    def entry(b, shapes):
        xi = b.input("x", x.shape)
        b.output("big", b.matmul(xi, b.weight("big", big), transpose_b=True))
        for i, w in enumerate(small):
            b.output(f"s{i}", b.matmul(xi, b.weight(f"s{i}", w), transpose_b=True))

    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        mode = ""
    with Session(["cpu"]) as sess:
        dev = sess.devices[0]
        pg = sess.prepare({"full": entry}, {"full": {"x": x.shape}})
        got = pg.execute("full", x=x)
        np.testing.assert_allclose(got["big"], x @ big.T, rtol=1e-5, atol=1e-5)
        for i, w in enumerate(small):
            np.testing.assert_allclose(got[f"s{i}"], x @ w.T, rtol=1e-5, atol=1e-5)
        packs = sorted((e[1] for e in dev.packs._entries.values()), key=lambda v: v.nbytes)
        assert len(packs) == 9 and packs[-1].ctypes.data % HUGE_PAGE == 0
        slabs = {id(v.base.base if v.base.base is not None else v.base) for v in packs[:-1]}
        assert len(slabs) == -(-8 // (PACK_SLAB // packs[0].nbytes))    # cut in order: 7 a slab, 2 slabs
        assert dev.packs.nbytes() == big.nbytes + sum(w.nbytes for w in small)
        for v in packs:
            vma = _vma_of(v.ctypes.data)
            if "THPeligible" in vma and mode and "[never]" not in mode:
                assert vma["THPeligible"] == "1", vma
        pg.release()
        assert dev.packs.nbytes() == 0
        assert not [r for r in LEDGER.live_records(dev.name) if r.tag.startswith("cpu:prepacked")]


# Shapes past the small-matmul kernel, so each route of k_matmul is taken. A constant weight
# stored [N, K] runs the pre-packed microkernel (`packed_*`: odd N, K and row tails, panel counts
# odd and even, batch folded into rows, K blocks and row chunks, the AVX-512 row tilings); the same shapes with the right operand an input (not
# packable) take gemv, the streaming kernel (wdot, up to 16 rows), (W a^T)^T up to 64 rows, GEMM;
# plus per-batch GEMMs and a plain [K, N] weight.  name -> (a shape, b shape, transpose_b, b is a weight)
MATMULS = {
    "gemv_wT": ((1, 96), (80, 96), True, True),
    "gemv_w": ((1, 96), (96, 80), False, True),
    "wdot_wT": ((14, 96), (83, 96), True, False),
    "swap_wT": ((40, 96), (80, 96), True, False),
    "many_rows_wT": ((100, 96), (80, 96), True, False),
    "folded_batch": ((3, 20, 48), (64, 48), True, False),
    "per_batch": ((2, 3, 20, 48), (2, 3, 30, 48), True, False),
    "plain": ((40, 48), (48, 64), False, True),
    # the invariant kernels' tails: idot's k tail (K % 8) and odd rows/columns, ichain's column tail
    "idot_k_tail": ((5, 29), (19, 29), True, False),
    "idot_row_tails": ((1, 29), (19, 29), True, False),   # M = 1: 8 outputs reduced at once, 3 left over
    "ichain_tails": ((7, 33), (33, 21), False, False),
    "packed_odd": ((13, 29), (37, 29), True, True),
    "packed_row_tail": ((9, 96), (83, 96), True, True),
    "packed_two_rows": ((2, 201), (17, 201), True, True),
    "packed_even_panels": ((17, 64), (64, 64), True, True),
    "packed_many_rows": ((100, 96), (80, 96), True, True),
    "packed_folded_batch": ((3, 7, 48), (50, 48), True, True),
    "packed_k_blocks_row_chunks": ((100, 1000), (37, 1000), True, True),  # K in 3 blocks, rows 48+48+4
    # AVX-512 row tiles: up to 14 rows in one tile, up to 28 as 14 + the rest, beyond in tiles of 8
    "packed_one_tile": ((14, 400), (50, 400), True, True),
    "packed_two_tiles": ((28, 400), (50, 400), True, True),
    "packed_row_tiles_of_8": ((29, 400), (50, 400), True, True),
}


@pytest.mark.parametrize("policy", ["invariant", "fastest"])
@pytest.mark.parametrize("native_on", [pytest.param(True, marks=needs_native), False], ids=["native", "numpy"])
@pytest.mark.parametrize("name", sorted(MATMULS))
def test_matmul_routes(name, native_on, policy, monkeypatch):
    """FLARE_CPU_MATMUL=invariant (the default: idot/ichain, a constant weight packed at every row
    count; tests/test_batch_invariance.py) and =fastest (the per-shape routes named above)."""
    monkeypatch.setenv("FLARE_CPU_MATMUL", policy)
    check_matmul_route(name, native_on, policy)


def check_matmul_route(name: str, native_on: bool, policy: str = "invariant") -> None:
    sa, sb, tb, is_weight = MATMULS[name]
    rng = np.random.default_rng(7)
    a, w = rng.uniform(-1, 1, sa).astype(np.float32), rng.uniform(-1, 1, sb).astype(np.float32)

    def entry(b, shapes):
        rhs = b.weight("w", w) if is_weight else b.input("w", sb)
        b.output("y", b.matmul(b.input("a", sa), rhs, transpose_b=tb))

    inputs = {"a": a} if is_weight else {"a": a, "w": w}
    with Session(["cpu"], config={"cpu": {"native": native_on}}) as sess:
        pg = sess.prepare({"full": entry}, {"full": {k: v.shape for k, v in inputs.items()}})
        got = pg.execute("full", **inputs)["y"]
        splits = [p.describe() for p in pg.current_plan("full").programs if p is not None]
        pg.release()
    want = np.matmul(a.astype(np.float64), np.swapaxes(w, -1, -2) if tb else w)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if native_on:
        packed = name.startswith("packed_") or (policy == "invariant" and name == "gemv_wT")  # one row too
        assert sum(d["prepacked_weights"] for d in splits) == int(packed)


@needs_native
@pytest.mark.parametrize("isa", [0, 1, 2], ids=native.PACKED_ISAS)
def test_packed_microkernel_variants(isa):
    """Every packed microkernel the machine has (plain C, AVX2, AVX-512) on the packed shapes."""
    lib = native.load().lib
    if lib.flare_packed_isa(isa) != isa:
        lib.flare_packed_isa(-1)
        pytest.skip(f"this CPU lacks {native.PACKED_ISAS[isa]}")
    try:
        for name in sorted(n for n in MATMULS if n.startswith("packed_")):
            check_matmul_route(name, True)
    finally:
        lib.flare_packed_isa(-1)


@needs_native
@pytest.mark.parametrize("isa", [0, 1], ids=["plain C", "AVX2+FMA"])
def test_invariant_kernel_variants_give_the_same_bits(isa):
    """idot and ichain (kernels.c) on every ISA the machine has: the same bits as the best one, since
    each lane is a chain of exactly rounded fmaf (vectorized or not) and the lane sum a fixed tree.
    Most of a is exactly 0 (as attention's masked probabilities): the AVX2 ichain skips those k, the
    plain one adds fma(0, b, s) = s, and the bits must still agree."""
    lib = native.load().lib
    names = [n for n in MATMULS if not n.startswith("packed_")]
    rng = np.random.default_rng(5)

    def run() -> dict[str, np.ndarray]:
        out = {}
        for name in names:
            sa, sb, tb, _ = MATMULS[name]
            a, w = rng.uniform(-1, 1, sa).astype(np.float32), rng.uniform(-1, 1, sb).astype(np.float32)
            a[a < 0.4] = 0.0

            def entry(b, shapes, sa=sa, sb=sb, tb=tb):
                b.output("y", b.matmul(b.input("a", sa), b.input("w", sb), transpose_b=tb))

            with Session(["cpu"]) as sess:
                pg = sess.prepare({"full": entry}, {"full": {"a": sa, "w": sb}})
                out[name] = pg.execute("full", a=a, w=w)["y"].copy()
                pg.release()
        return out

    best = lib.flare_invariant_isa(-1)
    if isa > best:
        pytest.skip("this CPU lacks AVX2+FMA")
    rng = np.random.default_rng(5)
    want = run()
    try:
        assert lib.flare_invariant_isa(isa) == isa
        rng = np.random.default_rng(5)
        got = run()
    finally:
        lib.flare_invariant_isa(-1)
    for name in names:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} on isa {isa}")


@needs_native
def test_packed_linear_epilogue_and_shared_pack():
    """A fused linear (bias, GELU, residual) on a packed weight, at two input shapes: the two plans
    share one packed copy, freed with the last plan."""
    rng = np.random.default_rng(3)
    w, bias = rng.uniform(-1, 1, (40, 24)).astype(np.float32), rng.uniform(-1, 1, 40).astype(np.float32)

    def entry(b, shapes):
        x = b.input("x", shapes["x"])
        r = b.input("r", shapes["r"])
        b.output("y", b.add(b.gelu(b.add(b.matmul(x, b.weight("w", w), transpose_b=True), b.weight("b", bias))), r))

    before = LEDGER.snapshot().count()
    with Session(["cpu"]) as sess:
        dev = sess.devices[0]
        pg = sess.prepare({"full": entry}, {"full": {"x": (5, 24), "r": (5, 40)}})
        for rows in (5, 11):
            x = rng.uniform(-1, 1, (rows, 24)).astype(np.float32)
            r = rng.uniform(-1, 1, (rows, 40)).astype(np.float32)
            got = pg.execute("full", x=x, r=r)["y"]
            z = x.astype(np.float64) @ w.T.astype(np.float64) + bias
            from math import erf, sqrt
            want = 0.5 * z * (1 + np.vectorize(erf)(z / sqrt(2))) + r
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert len(dev.packs._entries) == 1
        assert dev.packs.nbytes() == dev.describe()["prepacked_bytes"] == 48 * 24 * 4
        pg.release()
        assert dev.packs.nbytes() == 0
    assert LEDGER.snapshot().count() == before


@needs_native
def test_threads_config_sets_the_pool_and_the_blas():
    """`threads` sizes the device's pool; BLAS is single-threaded under the native executor (its
    pool splits the BLAS calls) and follows `threads` under the NumPy executor."""
    blas = native.load().blas
    before = blas.threads()
    try:
        for n in (1, 2, 3):
            with Session(["cpu"], config={"cpu": {"threads": n}}) as sess:
                info = sess.devices[0].describe()
                assert info["threads"] == n and info["blas_threads"] == 1
                assert sess.devices[0].pool.threads == n
            with Session(["cpu"], config={"cpu": {"threads": n, "native": False}}):
                assert blas.threads() == n
    finally:
        blas.set_threads(before)


def test_default_threads_are_the_physical_cores(monkeypatch):
    from flare.backends.cpu.native.threads import physical_cores

    monkeypatch.delenv("FLARE_CPU_THREADS", raising=False)
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    with Session(["cpu"]) as sess:
        assert sess.devices[0].threads == cores


def test_threads_must_be_a_positive_whole_number(monkeypatch):
    from flare.core.errors import InputError

    with pytest.raises(InputError, match="threads.*between 1 and 4096"):
        Session(["cpu"], config={"cpu": {"threads": 0}})
    monkeypatch.setenv("FLARE_CPU_THREADS", "lots")
    with pytest.raises(InputError, match="FLARE_CPU_THREADS='lots': expected a whole number"):
        Session(["cpu"])


def test_a_build_says_what_it_builds_once(tmp_path, monkeypatch, capsys):
    """The first build of a cffi module prints one progress line (a silent compile looks hung);
    a cached one loads silently."""
    pytest.importorskip("cffi")
    from flare.backends.cpu.native.build import build

    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    source, cdef = "int twice(int x) { return 2 * x; }", "int twice(int x);"
    assert build("_flare_test_twice", source, cdef, announce="building the test kernel").lib.twice(21) == 42
    err = capsys.readouterr().err
    assert err.startswith("building the test kernel (once, cached in ") and str(tmp_path) in err and err.count("\n") == 1
    assert build("_flare_test_twice", source, cdef, announce="building the test kernel").lib.twice(2) == 4
    assert capsys.readouterr().err == ""


@needs_native
def test_command_records_are_laid_out_as_cffi_lays_out_flare_cmd():
    """CommandList builds its records as a NumPy array (split.record_dtype): every field, short
    lists zero-padded, must read back through cffi's `flare_cmd` exactly as the command said."""
    from flare.backends.cpu.split import CommandList, record_dtype

    nat = native.load()
    ffi = nat.ffi
    assert record_dtype(ffi).itemsize == ffi.sizeof("flare_cmd")
    out, a, b = np.zeros(8, np.float32), np.ones(8, np.float32), np.ones(8, np.float32)
    scratch = np.zeros(64, np.uint8)
    cmds = [{"kind": 3, "flags": 5, "out": out, "src": [a, None, b], "ne": [1, 1, 2, 4], "os": [0, 0, 4, 1],
             "ss": [[0, 0, 4, 1], [9, 8, 7, 6]], "ip": [11, -12], "fp": [0.5], "scratch": 16},
            {"kind": 7, "flags": 0, "out": a, "src": [b], "ne": [1, 1, 1, 8], "os": [0, 0, 0, 1],
             "ss": [[0, 0, 0, 1]], "ip": [], "fp": [], "scratch": 0}]
    cl = CommandList(nat, cmds, ["x", "y"], scratch)
    ptr = lambda arr: int(ffi.cast("uintptr_t", arr))  # noqa: E731
    for i, c in enumerate(cmds):
        rec = cl._arr[i]
        assert (rec.kind, rec.flags) == (c["kind"], c["flags"])
        assert ptr(rec.out) == c["out"].ctypes.data
        assert [ptr(rec.src[j]) for j in range(4)] == [s.ctypes.data if s is not None else 0 for s in c["src"]] \
            + [0] * (4 - len(c["src"]))
        assert list(rec.ne) == c["ne"] and list(rec.os) == c["os"]
        assert [list(rec.ss[j]) for j in range(4)] == c["ss"] + [[0] * 4] * (4 - len(c["ss"]))
        assert list(rec.ip) == c["ip"] + [0] * (8 - len(c["ip"]))
        assert list(rec.fp) == c["fp"] + [0.0] * (4 - len(c["fp"]))
        assert ptr(rec.scratch) == (scratch.ctypes.data if c["scratch"] else 0)
