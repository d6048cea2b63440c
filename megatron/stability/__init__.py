"""The stability lab: FP8 SwiGLU outlier dynamics at laptop scale, driven through ordinary CLI runs.

- `runs`: the variants (BF16, FP8 delayed, + Smooth-SwiGLU channel/token, fc2 in BF16), the presets' model and
  optimizer flags, and the subprocess runner that records every `pretrain_gpt.py` command it starts.
- `inject`: the controlled injection: a checkpoint edited so a few channels' up rows become +-c x their gate rows.
- `analysis`: per-run series from TensorBoard and checkpoints, seed statistics (mean +- std), plots.

`tools/stability_lab.py` is the CLI; docs/stability.md the protocol and the measured outcomes.
"""
