"""Silero VAD v5/v6 (16 kHz) as a Flare model: streaming and offline voice activity detection.

Weights come from the ONNX file shipped in the `silero-vad` wheel (read with
`onnx`, cached as safetensors); the graph is rebuilt from Flare ops so every
backend runs it, and onnxruntime stays the oracle in the tests.
"""
