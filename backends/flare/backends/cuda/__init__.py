"""The CUDA backend: NVRTC-compiled kernels replayed as CUDA graphs.

Importing this package (or its `plugin` module) never touches cuda-bindings or
the driver; they are imported when the backend is probed or opened, so Flare
works, and says why CUDA is unusable, on machines without them.
"""
