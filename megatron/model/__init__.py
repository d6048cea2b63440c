"""The Llama-style GPT model (single device; parallelism is applied to it afterwards)."""
from megatron.model.gpt import GPTModel

__all__ = ["GPTModel"]
