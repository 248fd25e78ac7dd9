"""GGUF models: llama-family and Mixtral-style MoE decoders read from GGUF files, with their
quantized weights used as they are, the file's tokenizer and chat template, and expert
staging straight from the memory-mapped file."""
from .config import LMConfig, read_config
from .reader import GGUFError, GGUFFile
from .weights import NAMED, GGUFModel, resolve

__all__ = ["GGUFError", "GGUFFile", "GGUFModel", "LMConfig", "NAMED", "read_config", "resolve"]
