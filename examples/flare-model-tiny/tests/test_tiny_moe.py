"""tiny-moe's own tests, against the installed package and the installed Flare:
the registered spec, a NumPy reference, staged == resident, placement on two
devices, and the errors a user can cause."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.errors import ModelError
from flare.core.plugin_manager import get_plugin_manager
from flare.core.session import Session
from flare_tiny_moe.model import TOP_K, weights
from flare_tiny_moe.staging import ExpertCacheError

RNG = np.random.default_rng(11)


def inputs(n: int, tokens: int = 4) -> list[np.ndarray]:
    return [RNG.standard_normal((tokens, 16)).astype(np.float32) for _ in range(n)]


def reference(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """The layer in float64 NumPy, written from the model's docstring."""
    w = {k: v.astype(np.float64) for k, v in weights(seed).items()}
    x = x.astype(np.float64)
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w["norm.weight"]
    logits = h @ w["router.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :TOP_K]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e in ids[t]:
            up = w["experts.up"][e] @ h[t]
            y[t] += probs[t, e] * (w["experts.down"][e] @ (up / (1 + np.exp(-up))))
    return x + y


def test_registered_with_placement_and_staging():
    spec = get_plugin_manager().model("tiny-moe")
    assert spec.placement is not None and spec.stage_experts is not None and spec.run is None


@pytest.mark.parametrize("experts", ["resident", "offload"])
def test_matches_numpy_reference(experts):
    with Session(["cpu"]) as sess:
        pg = sess.prepare_model("tiny-moe", {"experts": experts})
        for x in inputs(3):
            np.testing.assert_allclose(pg.execute("forward", x=x)["y"], reference(x), rtol=1e-4, atol=1e-5)


def test_staged_equals_resident_and_the_cache_is_kept():
    with Session(["cpu"]) as sess:
        staged = sess.prepare_model("tiny-moe", {"experts": "offload", "slots": 8})
        resident = sess.prepare_model("tiny-moe", {"experts": "resident"})
        stager = staged.callbacks["stage_experts"]          # bound by the runtime from the ModelSpec
        assert "stage_experts" not in resident.callbacks
        for x in inputs(8):
            np.testing.assert_array_equal(staged.execute("forward", x=x)["y"], resident.execute("forward", x=x)["y"])
        assert stager.stats.evictions > 0                    # 8 steps touched more than 8 of 16 experts
        staged_before = stager.stats.staged
        staged.reset()                                       # per-request state only: the cache survives
        staged.execute("forward", x=x)
        assert stager.stats.staged == staged_before          # the last step's experts are still resident
        # the expert weights stay on the host: the device holds 8 slots, not 16 experts
        assert sum(staged.persistent_bytes().values()) < sum(resident.persistent_bytes().values())


def test_placement_puts_the_experts_on_the_last_device():
    x = inputs(1)[0]
    with Session(["cpu:0", "cpu:1"]) as sess, sess.prepare_model("tiny-moe") as pg:
        got = pg.execute("forward", x=x)["y"]
        plan = pg.current_plan("forward")
        for split in plan.schedule.splits:
            names = {n.name.startswith("experts.") for n in split.nodes}
            assert names == {split.device == "cpu:1"}, (split.device, [n.name for n in split.nodes])
        assert {s.device for s in plan.schedule.splits} == {"cpu:0", "cpu:1"}
    np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)


def test_errors_name_the_option():
    with Session(["cpu"]) as sess:
        with pytest.raises(ExpertCacheError, match="slots=2 cannot hold the 8 experts"):
            sess.prepare_model("tiny-moe", {"slots": 2})
        with pytest.raises(ModelError, match="unknown option.*colour"):
            sess.prepare_model("tiny-moe", {"colour": "blue"})
        with pytest.raises(ModelError, match="experts='sometimes'"):
            sess.prepare_model("tiny-moe", {"experts": "sometimes"})
        pg = sess.prepare_model("tiny-moe", {"slots": 8})
        with pytest.raises(ExpertCacheError, match="selected \\d+ experts .* but the cache has 8 slots"):
            pg.execute("forward", x=inputs(1, tokens=32)[0])   # a longer step than the cache was sized for
