"""Every tuned CPU kernel variant computes its op's reference (same tolerance as the
conformance suite), including `packed`, which repacks a weight into a split-owned buffer."""
import numpy as np
import pytest

from flare.backends.cpu.kernels import VARIANTS
from flare.core.ledger import LEDGER
from flare.plugins.testing.conformance.cases import CASES, case_entry, case_expected
from flare.core.session import Session

PAIRS = [(c, v) for c in CASES if c.op in VARIANTS for v in VARIANTS[c.op]]


@pytest.mark.parametrize("case,variant", PAIRS, ids=[f"{c.id}-{v}" for c, v in PAIRS])
def test_variant_matches_reference(case, variant):
    inputs, want = case_expected(case)
    before = LEDGER.snapshot().count()
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": case_entry(case)}, {"full": {k: v.shape for k, v in inputs.items()}},
                          tuning={"full": {f"cpu.{case.op}": variant}})
        got = pg.execute("full", **inputs)["out"]
        pg.release()
    assert LEDGER.snapshot().count() == before
    np.testing.assert_allclose(got, want, rtol=case.tol[0], atol=case.tol[1])
