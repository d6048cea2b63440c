"""Evaluation of our checkpoints: perplexity, zero-shot multiple choice, lm-eval adapter, generation, run comparison.

* `scoring`: batched log-likelihood of token windows; `LogLikelihoodScorer` for text (lm-eval conventions);
* `perplexity`: on indexed `.bin/.idx` data exactly as training evaluates, or on text/JSONL files;
* `multiple_choice`: JSONL tasks {"context", "choices", "label"}, acc and acc_norm;
* `lm_eval_adapter`: `MegatronLM`, lm-evaluation-harness's `LM` interface (lm-eval optional);
* `generation`: greedy / temperature / top-k / top-p sampling;
* `run_compare`: TensorBoard scalars of several runs side by side (tools/compare_runs.py).
Tools: tools/evaluate.py, tools/generate.py, tools/compare_runs.py, tools/make_demo_tasks.py.
"""
