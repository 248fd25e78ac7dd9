"""Application plugins built on the runtime: benchmarks, exported cores and serving,
the pytest backend matrix and the conformance suite. Each adds its CLI commands and
extension points through hooks; nothing in the runtime (`flare` itself) imports them."""
