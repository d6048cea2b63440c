"""Flag validation at the command line: `pretrain_gpt.py` in its own process (a dry run, a refused flag's exit code)."""
from tests.support.config import tiny_argv
from tests.support.launch import pretrain_cli


def test_dry_run_llama2_7b_parameter_count():
    out = pretrain_cli("--dry-run", "--num-layers", "32", "--hidden-size", "4096",
                       "--ffn-hidden-size", "11008", "--num-attention-heads", "32", "--seq-length", "4096",
                       "--micro-batch-size", "1", "--global-batch-size", "1024", "--train-iters", "10", "--lr",
                       "3e-4", "--mock-data", "--vocab-size", "32000", "--swiglu", "--normalization", "RMSNorm",
                       "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
                       "--disable-bias-linear", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "parameters: 6,738,415,616" in out.stdout  # Llama2-7B's published count
    assert "gradient accumulation steps: 1024" in out.stdout
    assert "memory estimate per device" in out.stdout


def test_cli_error_exit_code_and_message():
    out = pretrain_cli(*tiny_argv(global_batch_size=6), timeout=120)
    assert out.returncode == 2
    assert "--global-batch-size 6" in out.stderr
