"""An lm-evaluation-harness model (`lm_eval.api.model.LM`) backed by one of our checkpoints.

lm-eval is an optional extra (`pip install lm-eval`); this module imports without it, and the
adapter then works as a plain object with the same three methods (that is how the tests exercise
it). With lm-eval installed, evaluate offline on local task data (no hub access is needed when the
task's dataset points at local files):

    from lm_eval import simple_evaluate
    from megatron.evaluation.lm_eval_adapter import MegatronLM
    lm = MegatronLM.from_checkpoint("runs/demo/checkpoints")
    results = simple_evaluate(model=lm, tasks=["my_local_task"], task_manager=TaskManager(include_path="tasks/"))

Requests are lm-eval `Instance`s; only their `.args` are read:
`loglikelihood` (context, continuation), `loglikelihood_rolling` (text,) and
`generate_until` (context, {"until": [...], "max_gen_toks": n, "do_sample": bool, "temperature": t}).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from megatron.evaluation.generation import SamplingConfig, decode_continuation, generate
from megatron.evaluation.scoring import LogLikelihoodScorer

try:  # optional dependency
    from lm_eval.api.model import LM as _LMBase

    LM_EVAL_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    LM_EVAL_AVAILABLE = False

    class _LMBase:  # the part of lm-eval's LM base class the evaluator relies on
        def __init__(self) -> None:
            self._rank, self._world_size = 0, 1

        @property
        def rank(self) -> int:
            return self._rank

        @property
        def world_size(self) -> int:
            return self._world_size


class MegatronLM(_LMBase):
    """lm-eval's three request types answered by `LogLikelihoodScorer` and `generate`."""

    def __init__(self, model: nn.Module, tokenizer, max_length: int, batch_size: int = 8,
                 max_gen_toks: int = 256, bf16: bool = False) -> None:
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_gen_toks = max_gen_toks
        self.scorer = LogLikelihoodScorer(model, tokenizer, max_length, batch_size, bf16=bf16)

    @classmethod
    def from_checkpoint(cls, load: str, iteration: Optional[int] = None, device: str = "cpu",
                        tokenizer_overrides: Optional[dict] = None, **kwargs: Any) -> "MegatronLM":
        """Build from a checkpoint folder; the tokenizer is the one recorded in the checkpoint's config."""
        import dataclasses

        from megatron.checkpoint_conversion import load_gpt_checkpoint
        from megatron.tokenizer import build_tokenizer

        loaded = load_gpt_checkpoint(load, iteration, device)
        data = dataclasses.replace(loaded.data_config, **(tokenizer_overrides or {}))
        return cls(loaded.model, build_tokenizer(data), loaded.model_config.seq_length, **kwargs)

    # ----------------------------------------------------------------------------- lm-eval API
    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([tuple(r.args[:2]) for r in requests])

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        return [self.scorer.rolling_loglikelihood(r.args[0]) for r in requests]

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args[0], dict(request.args[1] if len(request.args) > 1 else {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            do_sample = bool(gen_kwargs.pop("do_sample", False))
            temperature = float(gen_kwargs.pop("temperature", 1.0 if do_sample else 0.0))
            sampling = SamplingConfig(max_new_tokens=int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks)),
                                      temperature=temperature if do_sample else 0.0,
                                      top_k=int(gen_kwargs.pop("top_k", 0) or 0),
                                      top_p=float(gen_kwargs.pop("top_p", 1.0) or 1.0))
            prompt = self.tokenizer.tokenize(context) if context else [self.tokenizer.eod]
            ids = generate(self.model, prompt, sampling, self.max_length, eod=self.tokenizer.eod,
                           seed=int(gen_kwargs.pop("seed", 0) or 0), vocab_size=self.tokenizer.vocab_size)
            text = decode_continuation(self.tokenizer, prompt, ids)
            for stop in until:  # cut at the earliest stop sequence, as lm-eval's HF model does
                if stop and stop in text:
                    text = text.split(stop)[0]
            outputs.append(text)
        return outputs

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def __repr__(self) -> str:
        return f"MegatronLM(max_length={self.max_length}, tokenizer={self.tokenizer_name})"
