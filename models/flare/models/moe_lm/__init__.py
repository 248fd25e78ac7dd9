"""moe-lm: a mixture-of-experts decoder LM with synthetic weights, for expert
placement, expert staging (resident vs offload) and mixed prefill batches."""
from .batch import SeqChunk, make_inputs
from .config import BOS, EOS, PAD, SIZES, MoeConfig, decode_bytes, encode, get_config
from .model import MoeLM
from .sampling import Sampler, Sampling
from .staging import ExpertCacheError, ExpertStager

__all__ = ["BOS", "EOS", "PAD", "SIZES", "ExpertCacheError", "ExpertStager", "MoeConfig", "MoeLM", "Sampler",
           "Sampling", "SeqChunk", "decode_bytes", "encode", "get_config", "make_inputs"]
