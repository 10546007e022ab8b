"""pydflash: DFlash speculative decoding for Qwen3 / Qwen3.5 GGUF models, on ggml."""

from .errors import (
    BackendError,
    ContextLengthExceededError,
    ConversionError,
    GGUFFormatError,
    InsufficientMemoryError,
    ModelBusyError,
    ModelLoadError,
    PydflashError,
    UnsupportedModelError,
)
from .grammar import Grammar
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Completion",
    "plan",
    "MemoryPlan",
    "Tokenizer",
    "Grammar",
    "PydflashError",
    "ModelLoadError",
    "GGUFFormatError",
    "InsufficientMemoryError",
    "UnsupportedModelError",
    "ContextLengthExceededError",
    "BackendError",
    "ConversionError",
    "ModelBusyError",
]


def __getattr__(name):
    # Model pulls in the compiled core; the tokenizer and the converters work without it
    if name in ("Model", "Completion"):
        from . import model

        return getattr(model, name)
    if name in ("plan", "MemoryPlan"):
        from . import memory_plan

        return getattr(memory_plan, name)
    raise AttributeError(f"module 'pydflash' has no attribute {name!r}")
