"""Megatron-FP8: Megatron-DeepSpeed style LLM pretraining with stable FP8."""
__version__ = "0.1.0"
