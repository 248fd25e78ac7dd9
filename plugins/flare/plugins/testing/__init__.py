"""Testing plugins: the pytest backend matrix (`pytest11` entry point), the backend
conformance suite a third-party backend runs with
`pytest --pyargs flare.plugins.testing.conformance --backends=NAME`."""
