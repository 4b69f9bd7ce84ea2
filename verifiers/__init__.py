"""Verifiers, one module per runtime: `stub` (pure torch), `hf` (transformers), `mlx` (mlx_lm)."""
