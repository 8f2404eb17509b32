"""The Kev model: its config, checkpoints, prompts, layers, and the built-in demo checkpoint."""
