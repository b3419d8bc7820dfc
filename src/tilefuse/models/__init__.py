"""Reference transformer models: a compact native Llama, and Hugging Face ones from configs."""
from .hf import MODELS, Built, CausalLM, TransformersMissing, build, config
from .llama import Llama, LlamaConfig, llama, llama_block

__all__ = ["MODELS", "Built", "CausalLM", "TransformersMissing", "build", "config", "Llama", "LlamaConfig", "llama",
           "llama_block"]
