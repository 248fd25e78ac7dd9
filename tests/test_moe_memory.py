"""Offloading experts bounds device memory: the ledger's peak for an offload run is at
most 30% of a resident run's. Measured on the `mid` size (experts ~96% of the
bytes, the same share as `small`, but ~50 MB so the test stays fast); the
`small` figures come from bench/moe_resident_vs_offload.py."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.ledger import LEDGER
from flare.models.moe_lm import MoeLM, Sampling, encode, get_config
from flare.models.moe_lm import weights as moe_weights

DEVICE = "cpu:0"


@pytest.fixture(scope="module")
def mid_path(tmp_path_factory):
    return moe_weights.ensure(get_config("mid"), 0, tmp_path_factory.mktemp("moe_weights"))


def _peak_run(path, experts):
    """Peak device bytes above the baseline for load + a short generation, and the outputs."""
    baseline = LEDGER.live_bytes(DEVICE)
    LEDGER.reset_peak(DEVICE)
    model = MoeLM.load("mid", experts=experts, weights_path=path)
    try:
        ids, logits = model.generate(encode("Peak memory of a mixture of experts"), 6, Sampling(greedy=False, seed=2),
                                     stop_at_eos=False)
        stats = model.stats()
    finally:
        model.release()
    assert LEDGER.live_bytes(DEVICE) == baseline  # nothing leaked
    return LEDGER.peak_bytes(DEVICE) - baseline, ids, np.stack(logits), stats


def test_offload_peak_is_at_most_30_percent_of_resident(mid_path):
    cfg = get_config("mid")
    expert_share = cfg.expert_total_bytes / sum(int(np.prod(s)) * 4 for s in moe_weights.tensor_shapes(cfg).values())
    res_peak, res_ids, res_logits, _ = _peak_run(mid_path, "resident")
    off_peak, off_ids, off_logits, stats = _peak_run(mid_path, "offload")
    ratio = off_peak / res_peak
    print(f"\nmid: experts are {expert_share:.1%} of weights; peak device bytes resident {res_peak:,} "
          f"offload {off_peak:,} ({ratio:.1%}); cache {stats['slots_per_layer']}/{cfg.n_experts} slots per layer, "
          f"hit rate {stats['staging']['hit_rate']:.2f}")
    assert expert_share > 0.9
    assert ratio <= 0.30
    assert res_ids == off_ids and np.array_equal(res_logits, off_logits)
