"""`flare new backend NAME` / `flare new model NAME`: a working plugin distribution to start from.

The skeletons are the example packages of the repository (`examples/flare-backend-mirror`,
`examples/flare-model-tiny`), shipped as templates in `templates/` and renamed: the
result installs with `pip install ./flare-backend-NAME`, registers itself through its
entry point, and passes its own tests and (for a backend) the shipped conformance
suite as generated. `tests/test_scaffold.py` checks the templates are the examples
byte for byte and that both skeletons install and pass in a fresh venv.
"""
