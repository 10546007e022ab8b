"""pydflash: DFlash speculative decoding for Qwen3 / Qwen3.5 GGUF models, on ggml."""

from .errors import (
    BackendError,
    ContextLengthExceededError,
    ConversionError,
    GGUFFormatError,
    ModelLoadError,
    PydflashError,
    UnsupportedModelError,
)
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Completion",
    "Tokenizer",
    "PydflashError",
    "ModelLoadError",
    "GGUFFormatError",
    "UnsupportedModelError",
    "ContextLengthExceededError",
    "BackendError",
    "ConversionError",
]


def __getattr__(name):
    # Model pulls in the compiled core; the tokenizer and the converters work without it
    if name in ("Model", "Completion"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'pydflash' has no attribute {name!r}")
