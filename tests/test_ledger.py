"""The ledger's running totals: `live_bytes` reads them instead of summing every live record."""
from __future__ import annotations

import threading

from flare.core.ledger import Ledger


def _summed(ledger: Ledger, device: str | None = None) -> int:
    return sum(r.nbytes for r in ledger.live_records(device))


def test_live_bytes_follows_allocs_and_frees_per_device_and_overall():
    ledger = Ledger()
    assert ledger.live_bytes() == 0 and ledger.live_bytes("cpu:0") == 0   # a device never seen
    a = ledger.record_alloc("cpu:0", 100, "a")
    b = ledger.record_alloc("cpu:1", 30, "b")
    c = ledger.record_alloc("cpu:0", 7, "c")
    assert (ledger.live_bytes("cpu:0"), ledger.live_bytes("cpu:1"), ledger.live_bytes()) == (107, 30, 137)
    ledger.record_free(a)
    assert (ledger.live_bytes("cpu:0"), ledger.live_bytes()) == (7, 37)
    for device in ("cpu:0", "cpu:1", None):
        assert ledger.live_bytes(device) == _summed(ledger, device) == ledger.snapshot().bytes(device)
    ledger.record_free(b)
    ledger.record_free(c)
    assert ledger.live_bytes() == 0 and ledger.live_bytes("cpu:1") == 0


def test_live_bytes_stays_exact_under_concurrent_allocs_and_frees():
    """Threads allocate and free on two devices while another reads: no update is lost (the
    totals are changed under the ledger's lock), and every read is a total some moment had."""
    ledger = Ledger()
    rounds, seen = 2000, []
    stop = threading.Event()

    def churn(device: str, size: int) -> None:
        for _ in range(rounds):
            lid = ledger.record_alloc(device, size, "t")
            ledger.record_free(lid)
        ledger.record_alloc(device, size, "kept")

    def read() -> None:
        while not stop.is_set():
            seen.append(ledger.live_bytes("cpu:0"))

    reader = threading.Thread(target=read)
    reader.start()
    workers = [threading.Thread(target=churn, args=(dev, size)) for dev, size in
               (("cpu:0", 8), ("cpu:0", 8), ("cpu:1", 5), ("cpu:1", 5))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    reader.join()
    assert (ledger.live_bytes("cpu:0"), ledger.live_bytes("cpu:1"), ledger.live_bytes()) == (16, 10, 26)
    assert ledger.live_bytes() == _summed(ledger)
    assert set(seen) <= {0, 8, 16}
