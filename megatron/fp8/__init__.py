"""FP8 training: formats, recipes, FP8 linear layers, module swap, statistics."""
