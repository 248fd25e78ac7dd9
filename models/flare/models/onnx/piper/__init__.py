"""Piper text-to-speech through the ONNX importer (`flare run piper "Hello, world." -o hello.wav`).

A sub-package of the ONNX plugin, not a model package of its own: it is the
importer running a voice file, and models do not import one another.
"""
