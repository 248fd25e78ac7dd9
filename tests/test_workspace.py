"""GraphWorkspace and PreparedGraph memory: shared arenas, growth, re-binding,
entry points sharing one allocation, reset, and release order."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.backend import Binding
from flare.core.errors import AllocationError, InputError, ReleasedError
from flare.core.ledger import LEDGER
from flare.core.session import Session
from flare.backends.cpu.backend import CpuBackend
from flare.backends.cpu.device import CpuDevice

RNG = np.random.default_rng(3)
W = RNG.uniform(-1, 1, (32, 32)).astype(np.float32)


def encoder(b, shapes):
    x = b.input("x", shapes["x"])
    h = b.tanh(b.matmul(x, b.weight("w", W)))
    b.output("y", b.relu(b.matmul(h, h, transpose_b=True)))


def decoder(b, shapes):
    x = b.input("x", shapes["x"])
    b.output("y", b.sigmoid(b.add(b.matmul(x, b.weight("w", W)), x)))


def ref_encoder(x):
    h = np.tanh(x @ W)
    return np.maximum(h @ h.T, 0)


def ref_decoder(x):
    return 1 / (1 + np.exp(-(x @ W + x)))


def arena_ptr(ws, dev="cpu:0"):
    return ws.chunk(dev, 0).handle.ctypes.data


def test_two_graphs_share_one_arena():
    with Session(["cpu"]) as sess:
        ws = sess.workspace()
        enc = sess.prepare({"full": encoder}, {"full": {"x": (16, 32)}}, workspace=ws, name="enc")
        size_enc = ws.nbytes()
        dec = sess.prepare({"full": decoder}, {"full": {"x": (4, 32)}}, workspace=ws, name="dec")
        alone = {}
        for name, pg in (("enc", enc), ("dec", dec)):
            alone[name] = sum(p.total for p in pg.current_plan("full").device_plans.values())
        assert ws.nbytes() == max(alone.values()) == size_enc, "workspace = largest need, not the sum"
        x1 = RNG.uniform(-1, 1, (16, 32)).astype(np.float32)
        x2 = RNG.uniform(-1, 1, (4, 32)).astype(np.float32)
        for _ in range(2):  # interleave: each overwrites the other's intermediates
            np.testing.assert_allclose(enc.execute("full", x=x1)["y"], ref_encoder(x1), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(dec.execute("full", x=x2)["y"], ref_decoder(x2), rtol=1e-4, atol=1e-5)
        enc_bind = enc.current_plan("full").split_bindings[0]
        dec_bind = dec.current_plan("full").split_bindings[0]
        bufs = {id(b.buffer) for b in enc_bind.values()} & {id(b.buffer) for b in dec_bind.values()}
        assert bufs, "the two graphs bind the same arena buffer"


def test_growth_bumps_generation_and_rebinds_other_graphs():
    with Session(["cpu"]) as sess:
        ws = sess.workspace()
        dec = sess.prepare({"full": decoder}, {"full": {"x": (2, 32)}}, workspace=ws)
        gen, ptr = ws.generation, arena_ptr(ws)
        enc = sess.prepare({"full": encoder}, {"full": {"x": (64, 32)}}, workspace=ws)
        assert ws.generation == gen + 1 and arena_ptr(ws) != ptr
        x = RNG.uniform(-1, 1, (2, 32)).astype(np.float32)
        rebinds = dec.stats["rebinds"]
        np.testing.assert_allclose(dec.execute("full", x=x)["y"], ref_decoder(x), rtol=1e-4, atol=1e-5)
        assert dec.stats["rebinds"] == rebinds + 1, "the older graph re-bound to the new arena"
        dec.execute("full", x=x)
        assert dec.stats["rebinds"] == rebinds + 1, "and only once"
        enc.release()
        dec.release()
        assert LEDGER.live_bytes("cpu:0") == 0


def test_longer_inputs_replan_and_grow_shorter_reuse():
    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": encoder}, {"full": {"x": (4, 32)}})
        ws = pg.workspace
        for n in (4, 40, 8, 40, 3):
            x = RNG.uniform(-1, 1, (n, 32)).astype(np.float32)
            np.testing.assert_allclose(pg.execute("full", x=x)["y"], ref_encoder(x), rtol=1e-4, atol=1e-4)
            if n == 40:
                peak = LEDGER.live_bytes("cpu:0")
        assert LEDGER.live_bytes("cpu:0") == peak, "shorter requests after a long one allocate nothing"
        assert pg.stats["plans_built"] == 4  # 4, 40, 8, 3; the second 40 came from the plan cache
        assert ws.generation >= 2


def test_entry_points_share_one_allocation():
    def full(b, shapes):
        x = b.input("x", shapes["x"])
        h = b.tanh(b.matmul(x, b.weight("w", W)))
        b.output("y", b.add(b.matmul(h, b.weight("w", W)), b.state("bias", (1, 32))))

    def body(b, shapes):
        x = b.input("x", shapes["x"])
        b.output("y", b.add(b.tanh(b.matmul(x, b.weight("w", W))), b.state("bias", (1, 32))))

    with Session(["cpu"]) as sess:
        pg = sess.prepare({"full": full, "body": body}, {"full": {"x": (8, 32)}, "body": {"x": (8, 32)}})
        needs = [pg.current_plan(e).device_plans["cpu:0"].total for e in ("full", "body")]
        assert pg.workspace.nbytes() == max(needs) < sum(needs)
        assert len(pg.persistent.weights) == 1, "weights shared by entry points are uploaded once"
        pg.write_rows("bias", 0, np.ones((1, 32), np.float32))
        x = RNG.uniform(-1, 1, (8, 32)).astype(np.float32)
        np.testing.assert_allclose(pg.execute("body", x=x)["y"], np.tanh(x @ W) + 1, rtol=1e-5, atol=1e-5)
        pg.release()


class RecordingDevice(CpuDevice):
    """A real CPU device that also records the order of lifecycle events."""

    log: list[str] = []

    def compile(self, program):
        split = super().compile(program)
        original = split.release
        def release():
            RecordingDevice.log.append("capture")
            original()
        split.release = release
        return split

    def _free_raw(self, handle):
        RecordingDevice.log.append("buffer")


class RecordingBackend(CpuBackend):
    name = "recording"

    @classmethod
    def open_devices(cls, config=None):
        return [RecordingDevice("recording:0")]


def test_release_order_captures_then_buffers_then_workspace():
    from flare.core.plugin_manager import PluginManager
    from flare.core.specs import BackendSpec
    from flare.core.plugin_manager import hookimpl

    class Plugin:
        @hookimpl
        def flare_backends(self):
            return [BackendSpec("recording", RecordingBackend)]

    pm = PluginManager(autoload=False)
    pm.register(Plugin())
    with Session(["recording"], plugins=pm) as sess:
        ws = sess.workspace()
        pg = sess.prepare({"full": encoder}, {"full": {"x": (4, 32)}}, workspace=ws)
        pg.execute("full", x=np.ones((4, 32), np.float32))
        RecordingDevice.log.clear()
        pg.release()
        log = RecordingDevice.log
        # captures first; then persistent buffers (input, weight); the arena last (workspace detach)
        assert log[0] == "capture" and log.count("capture") == 1
        assert log[1:] == ["buffer", "buffer", "buffer"]
        assert ws.nbytes() == 0 and LEDGER.live_bytes("recording:0") == 0
        with pytest.raises(ReleasedError):
            pg.describe()


def test_reset_zeroes_state_but_keeps_memory():
    def counter(b, shapes):
        st = b.state("n", (1,))
        b.output("n", b.copy_into(st, b.add(st, b.input("one", (1,)))))
    with Session(["cpu"]) as sess, sess.prepare({"full": counter}, {"full": {"one": (1,)}}) as pg:
        one = np.ones(1, np.float32)
        assert [pg.execute("full", one=one)["n"][0] for _ in range(3)] == [1, 2, 3]
        live = LEDGER.snapshot()
        pg.reset()
        assert pg.execute("full", one=one)["n"][0] == 1
        assert LEDGER.snapshot().live == live.live


def test_failed_growth_leaves_everything_as_it_was():
    with Session(["cpu"], config={"cpu": {"memory_limit": "2MiB"}}) as sess:
        ws = sess.workspace()
        small = sess.prepare({"full": decoder}, {"full": {"x": (4, 32)}}, workspace=ws)
        before = LEDGER.snapshot()
        gen = ws.generation
        with pytest.raises(AllocationError) as err:
            sess.prepare({"full": encoder}, {"full": {"x": (2000, 32)}}, workspace=ws)
        assert err.value.backend == "cpu:0" and err.value.asked > err.value.free
        assert LEDGER.snapshot().live == before.live and ws.generation == gen
        x = RNG.uniform(-1, 1, (4, 32)).astype(np.float32)
        np.testing.assert_allclose(small.execute("full", x=x)["y"], ref_decoder(x), rtol=1e-4, atol=1e-5)


def test_a_tensor_too_large_reports_the_device_real_free_bytes():
    """The planner knows sizes, not memory: the AllocationError must carry the device's free
    bytes (limit minus what is live), not the largest buffer size."""
    limit = 64 << 10
    with Session(["cpu"], config={"cpu": {"memory_limit": limit}}) as sess:
        keep = sess.devices[0].alloc(10_000, tag="held")

        def big(b, shapes):
            x = b.input("x", shapes["x"])
            b.output("y", b.relu(b.matmul(x, b.weight("w", np.ones((32, 1024), np.float32)))))

        with pytest.raises(AllocationError) as err:
            sess.prepare({"full": big}, {"full": {"x": (32, 32)}})
        assert err.value.free == limit - 10_000, str(err.value)
        assert f"{limit - 10_000} bytes free" in str(err.value)
        keep.release()


def test_headroom_grows_by_steps_and_regrown_inputs_double():
    """A workspace with headroom allocates 1.5x the need when it must grow, so a slightly longer
    input after it neither grows the arena nor makes the other plans re-bind; a regrown input
    buffer takes twice its old size (the same reason). Results stay right throughout."""
    with Session(["cpu"]) as sess:
        ws = sess.workspace("roomy", headroom=1.5)
        pg = sess.prepare({"full": encoder}, {"full": {"x": (16, 32)}}, workspace=ws)
        need = pg.current_plan("full").device_plans["cpu:0"].total
        assert ws.nbytes("cpu:0") == int(need * 1.5)
        gen, store_gen = ws.generation, pg.persistent.generation
        for n in (16, 17, 18):
            x = RNG.uniform(-1, 1, (n, 32)).astype(np.float32)
            np.testing.assert_allclose(pg.execute("full", x=x)["y"], ref_encoder(x), rtol=1e-4, atol=1e-4)
        assert ws.generation == gen, "17 and 18 rows fit the headroom: no growth"
        assert pg.persistent.generation == store_gen + 1, "x grew once (16 -> 17 rows), to 32 rows"
        assert pg.persistent.inputs[("x", "cpu:0")].nbytes == 2 * 16 * 32 * 4
        with pytest.raises(InputError, match="headroom"):
            sess.workspace("bad", headroom=0.5)
        pg.release()
    assert LEDGER.live_bytes("cpu:0") == 0
