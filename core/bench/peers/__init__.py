"""Peers: other ways to serve a workload's requests (onnxruntime, NumPy, torch), to compare Flare with."""
