"""Serving an exported LM core with continuous batching (prefill, decode and mixed steps)."""
from .batch import Chunk, token_lm_inputs
from .engine import Engine
from .requests import Request, RequestError, read_requests
from .batcher import Batcher

__all__ = ["Chunk", "Engine", "Request", "RequestError", "Batcher", "read_requests", "token_lm_inputs"]
