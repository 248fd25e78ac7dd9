"""The backend conformance suite, shipped inside the package.

Any backend — built in or third-party — runs it with
`pytest --pyargs flare.plugins.testing.conformance --backends=NAME`: every op against its NumPy
reference (tolerances stated per op in `cases.py`), strided and broadcast
inputs, and the lifecycle (state, re-planning, reset, release, no leaks).
"""
