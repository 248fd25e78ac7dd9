"""The backend conformance suite, shipped inside the package.

Any backend — built in or third-party — runs it with
`pytest --pyargs flare.plugins.testing.conformance --backends=NAME`: every op against its NumPy
reference (tolerances stated per op in `cases.py`), strided and broadcast
inputs, fused-op chains, the kernel contract's aliasing rule for in-place ops,
and the lifecycle (state, re-planning, reset, release, no leaks).

A partial backend passes it too: a case with a node the device refuses is
skipped naming the node (one rule for op, fused-chain and aliasing cases), the
lifecycle graphs run with a CPU device behind it for what it refuses, and the
run ends with a coverage summary (`flare.plugins.testing.pytest_plugin`).
"""
