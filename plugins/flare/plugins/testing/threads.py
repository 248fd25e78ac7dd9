"""Run a test body on several Python threads at once and hand its failures to the main thread.

Concurrency is part of Flare's contract, so many tests share a graph, a session or a runner
between threads. An assertion raised on a worker thread is lost unless it is collected, and
a deadlock would hang the suite: every such test goes through `run_threads`.
"""
from __future__ import annotations

import threading
from typing import Callable


def run_threads(target: Callable[[int], object], n: int, timeout: float = 120.0) -> list[BaseException]:
    """Call `target(i)` for i in range(n), each on its own thread, all started before any is
    joined; return what they raised (the caller asserts on it). A thread still running after
    `timeout` seconds fails the test as hung."""
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # collected and asserted on by the caller
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors
