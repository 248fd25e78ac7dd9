"""Every tuned CPU kernel variant computes its op's reference (same tolerance as the
conformance suite), including `packed`, which repacks a weight into a split-owned buffer."""
import zlib

import numpy as np
import pytest

from flare.backends.cpu.kernels import VARIANTS
from flare.plugins.testing.conformance.cases import CASES
from flare.graph import GraphBuilder
from flare.ledger import LEDGER
from flare.reference import evaluate
from flare.session import Session

PAIRS = [(c, v) for c in CASES if c.op in VARIANTS for v in VARIANTS[c.op]]


@pytest.mark.parametrize("case,variant", PAIRS, ids=[f"{c.id}-{v}" for c, v in PAIRS])
def test_variant_matches_reference(case, variant):
    def entry(b, shapes):
        out, _ = case.build(b, np.random.default_rng(zlib.crc32(case.id.encode())))
        b.output("out", out)

    b = GraphBuilder()
    out, inputs = case.build(b, np.random.default_rng(zlib.crc32(case.id.encode())))
    b.output("out", out)
    want, _ = evaluate(b.build(), inputs)
    before = LEDGER.snapshot().count()
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": entry}, {"full": {k: v.shape for k, v in inputs.items()}},
                          tuning={"full": {f"cpu.{case.op}": variant}})
        got = pg.execute("full", **inputs)["out"]
        pg.release()
    assert LEDGER.snapshot().count() == before
    np.testing.assert_allclose(got, want["out"], rtol=case.tol[0], atol=case.tol[1])
