"""What serving an exported LM core needs without its model plugin: the token-lm/1 step layout, the
program buckets, requests, the sampler and the tokenizer protocol. The continuous-batching loop itself
is `flare.plugins.serve.loop` (one loop for `flare serve` and `flare run NAME.core`)."""
from .batch import Chunk, token_lm_inputs
from .engine import Engine
from .requests import Request, RequestError, read_requests

__all__ = ["Chunk", "Engine", "Request", "RequestError", "read_requests", "token_lm_inputs"]
