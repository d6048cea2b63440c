"""How fast a run would be on hardware that is not here: a model of one training step.

- `extract.py`: the kernels of our compiled transformer block (forward and backward), read from inductor's
  scheduler at the real shapes on fake tensors, for BF16, our FP8 recipes and torchao's Float8Linear;
- `outside.py`: the rest of the step (embedding, LM head, loss, optimizer, FP8 weight casts, scaling update);
- `comm.py`: the collectives of the parallel layout, with the overlap rule;
- `hardware.py`: the devices and the achievable fractions, each with its public source;
- `kernels.py`: the roofline that turns a kernel into time; `step.py`: the step, tokens/s, MFU;
- `planner.py`: what `pretrain_gpt.py --dry-run --project-on DEVICE` prints; `calibration.py`: the model held
  against every published figure (docs/performance.md, "Calibration"); `flops.py`: parameter count, model FLOPs
  and the memory estimate of `--dry-run`.
"""
