"""Training: the loop, its train state, checkpoints, logging and FLOP accounting."""
