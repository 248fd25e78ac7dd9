"""The mirror backend's own tests. They run against the installed package and the
installed Flare; the shipped conformance suite checks every op and the lifecycle:

    pytest --pyargs flare.plugins.testing.conformance --backends=mirror --require-backends
"""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.errors import AllocationError, BackendUnavailable
from flare.core.ledger import LEDGER
from flare.core.plugin_manager import get_plugin_manager
from flare.core.session import Session
from flare_mirror import __version__
from flare_mirror.device import ALIGNMENT, MirrorBackend

RNG = np.random.default_rng(3)
W = RNG.standard_normal((16, 8)).astype(np.float32)


def mlp(b, shapes):
    x = b.input("x", shapes["x"])
    h = b.gelu(b.matmul(x, b.weight("w", W), transpose_b=True))
    b.output("y", b.softmax(b.add(h, b.sum(h, axis=0, keepdims=True))))


def run(devices, x, **kwargs):
    with Session(devices, **kwargs) as sess, sess.prepare({"full": mlp}, {"full": {"x": x.shape}}) as pg:
        return pg.execute("full", x=x)["y"]


def cpu_numpy(x):
    """The CPU backend on its NumPy kernels, the ones the mirror runs: equal bit for bit."""
    return run(["cpu"], x, config={"cpu": {"native": False}})


def test_registered_through_its_entry_point():
    spec = get_plugin_manager().backends()["mirror"]
    assert spec.backend is MirrorBackend and spec.version == __version__


def test_probe_says_why_not(monkeypatch):
    monkeypatch.setenv("FLARE_MIRROR_DEVICES", "0")
    probe = MirrorBackend.probe()
    assert not probe.usable and "FLARE_MIRROR_DEVICES=0" in probe.reason
    with pytest.raises(BackendUnavailable, match="not usable here: FLARE_MIRROR_DEVICES=0"):
        Session(["mirror"])
    monkeypatch.setenv("FLARE_MIRROR_DEVICES", "two")
    assert "'two' is not a number" in MirrorBackend.probe().reason


def test_memory_is_private_and_aligned():
    x = RNG.standard_normal((5, 8)).astype(np.float32)
    with Session(["mirror"]) as sess, sess.prepare({"full": mlp}, {"full": {"x": x.shape}}) as pg:
        dev = sess.devices[0]
        bindings = [b for split in pg.current_plan("full").split_bindings for b in split.values()]
        assert bindings and all(b.offset % ALIGNMENT == 0 for b in bindings)
        assert all(dev.host_view(b) is None for b in bindings)   # bytes move only through write/read_into
        np.testing.assert_array_equal(pg.execute("full", x=x)["y"], cpu_numpy(x))


def test_growth_rebinds_instead_of_compiling():
    """A bigger entry grows the shared workspace; the small entry's program is re-pointed, not rebuilt."""
    small, big = RNG.standard_normal((2, 8)).astype(np.float32), RNG.standard_normal((64, 8)).astype(np.float32)
    with Session(["mirror"]) as sess:
        pg = sess.prepare({"small": mlp, "big": mlp}, {"small": {"x": small.shape}})
        dev = sess.devices[0]
        first = pg.execute("small", x=small)["y"]
        compiles = dev.stats["compiles"]
        pg.prepare("big", {"x": big.shape})                     # the arena grows
        assert pg.execute("small", x=small)["y"].tolist() == first.tolist()
        assert dev.stats["rebinds"] >= 1 and dev.stats["compiles"] == compiles + 1   # only `big` compiled
        np.testing.assert_array_equal(pg.execute("big", x=big)["y"], cpu_numpy(big))
        pg.release()
        assert dev.live_objects() == {"programs": 0}


def test_two_mirror_devices_copy_through_the_host():
    x = RNG.standard_normal((3, 8)).astype(np.float32)

    def place(t, devices):
        return devices[1] if t.op == "softmax" else devices[0]

    with Session(["mirror:0", "mirror:1"]) as sess:
        with sess.prepare({"full": mlp}, {"full": {"x": x.shape}}, placement=place) as pg:
            got = pg.execute("full", x=x)["y"]
            assert [s["device"] for s in pg.describe()["entries"]["full"]["split_list"]] == ["mirror:0", "mirror:1"]
    np.testing.assert_array_equal(got, cpu_numpy(x))


def test_out_of_memory_is_a_typed_error_and_leaves_nothing():
    x = np.zeros((4, 8), np.float32)
    with Session(["mirror"], config={"mirror": {"memory": 256}}) as sess:
        with pytest.raises(AllocationError, match="mirror:0"):
            sess.prepare({"full": mlp}, {"full": {"x": x.shape}})
        assert LEDGER.snapshot().count("mirror:0") == 0
        assert sess.devices[0].live_objects() == {"programs": 0}
