"""Vulkan start-up: the VkPipelineCache file, parallel pipeline builds, priming, reporting.

No timings are asserted: evidence is the cache file's header and counters (pipelines
built, primed, loaded bytes), equal outputs of serial and parallel builds, and the
object counters after release.
"""
from __future__ import annotations


import numpy as np
import pytest

from flare.core.errors import InputError
from flare.core.graph import GraphBuilder
from flare.core.session import Session

from flare.backends.vulkan import VulkanBackend
from flare.backends.vulkan import pipeline_cache as pc
from flare.backends.vulkan import prime as pr
from flare.backends.vulkan.testing import HandBound
from flare.plugins.testing.threads import run_threads

PROBE = VulkanBackend.probe()
RNG = np.random.default_rng(24)
W1 = RNG.uniform(-1, 1, (24, 16)).astype(np.float32)
W2 = RNG.uniform(-1, 1, (8, 24)).astype(np.float32)
B1 = RNG.uniform(-1, 1, 24).astype(np.float32)
X = RNG.uniform(-1, 1, (6, 16)).astype(np.float32)

needs_vulkan = pytest.mark.skipif(not PROBE.usable, reason=f"Vulkan unusable here: {PROBE.reason}")


class _Info:
    """The identity fields pipeline_cache.py reads from a PhysicalDeviceInfo."""
    vendor_id, device_id, driver_version = 0x10005, 0, 1
    pipeline_cache_uuid = bytes(range(16))
    device_uuid = bytes(16)


def _vk_header(info, extra: bytes = b"") -> bytes:
    return pc.VK_HEADER.pack(32, 1, info.vendor_id, info.device_id, info.pipeline_cache_uuid) + extra


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh Flare cache folder for this test (the pipeline cache file and primed record go there)."""
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    return tmp_path / "vulkan"


# -- the file format, no device needed ----------------------------------------------------

def test_pack_unpack_round_trip():
    info = _Info()
    payload = _vk_header(info, b"driver bytes")
    assert pc.unpack(pc.pack(payload), info) == (payload, "")


@pytest.mark.parametrize("case, why", [
    ("short", "shorter than its header"),
    ("magic", "not a Flare pipeline cache file"),
    ("truncated", "truncated"),
    ("flipped", "checksum mismatch"),
    ("foreign", "made for vendor"),
    ("no_vk_header", "no Vulkan pipeline cache header"),
])
def test_unpack_rejects_bad_files(case, why):
    info = _Info()
    good = pc.pack(_vk_header(info, b"x" * 40))
    blob = {
        "short": good[:10],
        "magic": b"NOTFLARE" + good[8:],
        "truncated": good[:-5],
        "flipped": good[:-1] + bytes([good[-1] ^ 1]),
        "foreign": pc.pack(pc.VK_HEADER.pack(32, 1, 0x10de, 7, bytes(16)) + b"x"),
        "no_vk_header": pc.pack(b"tiny"),
    }[case]
    payload, reason = pc.unpack(blob, info)
    assert payload is None and why in reason


def test_cache_path_names_device_and_driver(tmp_path):
    info = _Info()
    info.device_uuid = bytes.fromhex("00112233445566778899aabbccddeeff")
    assert pc.cache_path(info, tmp_path).name == "pipeline-cache-00112233445566778899aabbccddeeff-1.bin"


def test_prime_mode_setting():
    class Lavapipe:
        driver_id, name = pr.DRIVER_ID_MESA_LLVMPIPE, "llvmpipe (LLVM 15.0.6, 256 bits)"

    class Gpu:
        driver_id, name = 1, "AMD Radeon"

    assert pr.prime_mode(Gpu, None) == 0 and pr.prime_mode(Gpu, "auto") == 0
    assert pr.prime_mode(Gpu, "1") >= 1 and pr.prime_mode(Lavapipe, "off") == 0
    with pytest.raises(InputError, match="prime='sometimes'"):
        pr.prime_mode(Lavapipe, "sometimes")


def test_prime_mode_off_without_mesa_cache(monkeypatch):
    class Lavapipe:
        driver_id, name = pr.DRIVER_ID_MESA_LLVMPIPE, "llvmpipe"

    monkeypatch.setenv("MESA_SHADER_CACHE_DISABLE", "true")
    assert pr.prime_mode(Lavapipe, None) == 0  # nothing to carry what helpers compile
    monkeypatch.delenv("MESA_SHADER_CACHE_DISABLE")
    assert pr.prime_mode(Lavapipe, None) >= 1


def test_primed_record_round_trip_ignores_garbage(tmp_path):
    path = tmp_path / "primed.txt"
    rec = pr.PrimedRecord(path)
    key = ("copy", (0, 0, 0, 0, 0))
    assert key not in rec
    rec.add([key])
    rec.save()
    path.write_text(path.read_text() + "not a digest\n\x00\x01\n")
    again = pr.PrimedRecord(path)
    assert key in again and ("copy", (1, 0, 0, 0, 0)) not in again and len(again.done) == 1


# -- on a device ----------------------------------------------------------------------------

def _graph():
    """Several distinct pipelines: linear (matmul + bias + gelu), softmax, norm, elementwise."""
    b = GraphBuilder()
    x = b.input("x", X.shape)
    h = b.gelu(b.add(b.matmul(x, b.weight("w1", W1), transpose_b=True), b.weight("b1", B1)))
    y = b.matmul(b.layer_norm(h), b.weight("w2", W2), transpose_b=True)
    b.output("y", b.softmax(b.tanh(y)))
    return b.build()


def _run_hand(dev) -> np.ndarray:
    hb = HandBound(dev, _graph())
    try:
        return hb.run({"x": X})["y"]
    finally:
        hb.split.release()
        hb.buffer.release()


@needs_vulkan
def test_cache_file_written_at_close_and_loaded_at_next_open(cache_dir):
    (dev,) = VulkanBackend.open_devices({"prime": "0"})
    path = dev.disk_cache.path
    assert path.parent == cache_dir and dev.disk_cache.status == "missing"
    assert dev.cache_objects()["pipeline_caches"] == 1
    first = _run_hand(dev)
    dev.close()
    payload, why = pc.unpack(path.read_bytes(), dev.info)
    assert payload is not None, why  # our header, checksum, and the driver's header for this device
    assert not list(cache_dir.glob("*.tmp"))  # the temp file was renamed, nothing half-written left
    (again,) = VulkanBackend.open_devices({"prime": "0"})
    try:
        assert again.disk_cache.status == "loaded" and again.disk_cache.loaded_bytes == len(payload)
        np.testing.assert_array_equal(_run_hand(again), first)
        stats = again.pipeline_stats()
        assert stats["built"] >= 4 and 0 <= stats["cache_hits"] <= stats["built"]
        assert stats["cache_file"]["status"] == "loaded"
    finally:
        again.close()


@needs_vulkan
@pytest.mark.parametrize("garbage", ["random", "truncated", "foreign"])
def test_corrupt_or_foreign_cache_file_is_ignored(cache_dir, garbage):
    (probe,) = VulkanBackend.open_devices({"prime": "0"})
    path, info = probe.disk_cache.path, probe.info
    probe.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    if garbage == "random":
        path.write_bytes(RNG.integers(0, 256, 300, dtype=np.uint8).tobytes())
    elif garbage == "truncated":
        path.write_bytes(pc.pack(_vk_header(info, b"z" * 64))[:-10])
    else:  # whole and checksummed, but for another vendor's device
        path.write_bytes(pc.pack(pc.VK_HEADER.pack(32, 1, info.vendor_id ^ 1, 3, bytes(16)) + b"z" * 64))
    (dev,) = VulkanBackend.open_devices({"prime": "0"})
    try:
        assert dev.disk_cache.status.startswith("ignored") and dev.disk_cache.loaded_bytes == 0
        out = _run_hand(dev)
        assert np.isfinite(out).all() and np.allclose(out.sum(axis=-1), 1.0, atol=1e-5)
    finally:
        dev.close()
    assert pc.unpack(path.read_bytes(), info)[0] is not None  # replaced by a good file at close


@needs_vulkan
def test_pipeline_cache_can_be_turned_off(cache_dir):
    (dev,) = VulkanBackend.open_devices({"pipeline_cache": "0", "prime": "0"})
    try:
        _run_hand(dev)
        assert dev.disk_cache.status == "disabled"
    finally:
        dev.close()
    assert not cache_dir.exists() or not list(cache_dir.iterdir())


@needs_vulkan
def test_parallel_builds_and_priming_match_serial_and_build_only_what_is_used(cache_dir):
    (serial,) = VulkanBackend.open_devices({"build_threads": 1, "prime": "0", "pipeline_cache": "0"})
    (parallel,) = VulkanBackend.open_devices({"build_threads": 4, "prime": "1", "pipeline_cache": "0"})
    try:
        ref = _run_hand(serial)
        hb = HandBound(parallel, _graph())
        split = hb.compile()
        info = split.describe()
        distinct = len({(d.shader, d.spec) for d in split.dispatches})
        # only the variants these dispatches use were built, all at once, and each primed once
        assert info["pipelines"] == info["pipelines_built"] == distinct == parallel.cache_objects()["pipelines"]
        assert info["pipelines_primed"] == distinct and parallel.prime_stats["lanes"] >= 1
        np.testing.assert_array_equal(hb.run({"x": X})["y"], ref)
        hb2 = HandBound(parallel, _graph())
        again = hb2.compile().describe()  # same pipelines: nothing built or primed again
        assert again["pipelines_built"] == 0 and again["pipelines_primed"] == 0
        for h in (hb, hb2):
            h.split.release()
            h.buffer.release()
    finally:
        serial.close()
        parallel.close()


@needs_vulkan
def test_priming_and_builds_leave_no_objects_behind(cache_dir):
    (dev,) = VulkanBackend.open_devices({"build_threads": 3, "prime": "1"})
    try:
        base = dev.live_objects()
        _run_hand(dev)
        assert dev.live_objects() == base  # lanes' pools, fences, buffers and helper devices are gone
        assert dev.cache_objects()["pipelines"] > 0
    finally:
        dev.close()
    assert not any(dev.live_objects().values()) and not any(dev.cache_objects().values())


@needs_vulkan
def test_concurrent_prepares_on_one_device_match_serial(cache_dir):
    """Threads compiling graphs with overlapping pipelines on one device at once: each
    pipeline is built once, and every output equals the serial one bit for bit."""
    def build(b, shapes):
        x = b.input("x", shapes["x"])
        h = b.gelu(b.add(b.matmul(x, b.weight("w1", W1), transpose_b=True), b.weight("b1", B1)))
        y = b.matmul(b.layer_norm(h), b.weight("w2", W2), transpose_b=True)
        b.output("y", b.softmax(b.tanh(y)))

    with Session(["vulkan"], config={"vulkan": {"build_threads": 1, "prime": "0", "pipeline_cache": "0"}}) as sess:
        pg = sess.prepare({"f": build}, {"f": {"x": X.shape}})
        ref = pg.execute("f", x=X)["y"]
        pg.release()
    with Session(["vulkan"], config={"vulkan": {"build_threads": 4, "prime": "1"}}) as sess:
        dev = sess.devices[0]
        assert dev.pipelines.workers == 4
        outs: list[np.ndarray] = []

        def worker(_: int) -> None:
            pg = sess.prepare({"f": build}, {"f": {"x": X.shape}})
            outs.append(pg.execute("f", x=X)["y"])
            assert pg.describe()["entries"]["f"]["prepare_s"] > 0
            pg.release()

        errors = run_threads(worker, 4)
        assert not errors, errors
        built = dev.pipeline_stats()["built"]
        assert built == dev.cache_objects()["pipelines"]  # no pipeline built twice
    assert len(outs) == 4
    for out in outs:
        np.testing.assert_allclose(out, ref, rtol=0, atol=0)


@needs_vulkan
def test_a_failing_prime_stops_cleanly_and_the_run_still_compiles(cache_dir, monkeypatch):
    calls = {"n": 0}
    real = pr._Lane.prime

    def flaky(self, key):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated driver failure while priming")
        return real(self, key)

    monkeypatch.setattr(pr._Lane, "prime", flaky)
    (ref_dev,) = VulkanBackend.open_devices({"prime": "0", "pipeline_cache": "0"})
    try:
        ref = _run_hand(ref_dev)
    finally:
        ref_dev.close()
    (dev,) = VulkanBackend.open_devices({"prime": "1", "build_threads": 1})
    try:
        base = dev.live_objects()
        hb = HandBound(dev, _graph())
        info = hb.compile().describe()
        assert 1 <= info["pipelines_primed"] < info["pipelines"]  # stopped after the failure
        np.testing.assert_array_equal(hb.run({"x": X})["y"], ref)
        hb.split.release()
        hb.buffer.release()
        assert dev.live_objects() == base
    finally:
        dev.close()
    assert not list(cache_dir.glob("primed-*"))  # an incomplete priming is not recorded
