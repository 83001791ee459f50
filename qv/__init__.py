"""qv: serve hybrid Qwen3.5-family models (Gated DeltaNet + gated attention) on Volta and newer GPUs."""

__version__ = "0.1.0"
