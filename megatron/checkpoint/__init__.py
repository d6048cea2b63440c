"""Checkpoints: every file the trainer writes and every reader of them, beneath the engines.

* `store`: the torch engine's layout (iteration folders, the tracker, atomic commits, RNG state) and its reader;
* `tp_shards`: the same layout with one shard per tensor-parallel rank;
* `deepspeed_io`: DeepSpeed's files in our folders (save/load glue, file names, the `weights_only` allowlist);
* `layouts`: detect the layout of a folder and read its model weights, whatever wrote them;
* `full_state`: the whole training state of any layout (weights, optimizer moments, masters) as full tensors;
* `reshard`: load that state into an engine of another layout (TP, PP, DP, ZeRO stage);
* `configs`: the config slices rebuilt from a checkpoint's config.json; `train_state`: the loop's counters.

Nothing here imports `megatron.training`; the engines call it. The Hugging Face conversion, which builds models,
is `megatron.checkpoint_conversion`, above it.
"""
