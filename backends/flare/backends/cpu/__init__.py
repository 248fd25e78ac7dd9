"""The built-in CPU backend: NumPy (and a little cffi C) kernels over planned arenas."""
