"""kevscore: score many questions against many documents with Kev (Qwen3.5-architecture) models."""
__version__ = "0.1.0"
