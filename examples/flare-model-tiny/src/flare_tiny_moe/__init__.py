"""flare-model-tiny: an example third-party Flare model (see docs/write-a-model.md).

`plugin` registers the ModelSpec (the entry point), `model` builds the graph and
says where its nodes go, `staging` copies selected experts into the cache.
"""
__version__ = "0.1.0"
