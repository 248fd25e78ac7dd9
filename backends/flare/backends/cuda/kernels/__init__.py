"""CUDA C sources of Flare's kernels (package data, compiled at run time by NVRTC).

A package (not a plain folder) so that setuptools ships the `*.cu`/`*.cuh`/`*.h`
files with the wheel and `importlib.resources` finds them in any install.
"""
