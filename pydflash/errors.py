"""The exceptions pydflash raises. Every message names the file, key, tensor or field and, where it applies,
the expected and the actual value. The C++ core raises the same classes (registered by `pydflash._core`)."""

from __future__ import annotations

__all__ = [
    "PydflashError",
    "ModelLoadError",
    "GGUFFormatError",
    "UnsupportedModelError",
    "ContextLengthExceededError",
    "BackendError",
    "ConversionError",
    "ModelBusyError",
    "InsufficientMemoryError",
]


class PydflashError(Exception):
    """Base class of every pydflash error."""


class ModelLoadError(PydflashError):
    """A model file could not be opened or read (missing, unreadable, truncated, not GGUF)."""


class GGUFFormatError(ModelLoadError):
    """A GGUF file is readable but a key or tensor is missing, mistyped or has the wrong shape."""


class UnsupportedModelError(ModelLoadError):
    """The file is valid GGUF but describes something pydflash does not run (architecture, tensor type...)."""


class ContextLengthExceededError(PydflashError, ValueError):
    """A prompt (plus what is to be generated) does not fit the context, or a context does not fit in memory."""

    def __init__(self, message: str, n_tokens: int | None = None, n_ctx: int | None = None):
        super().__init__(message)
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx


class InsufficientMemoryError(ModelLoadError, ContextLengthExceededError):
    """A configuration's memory plan (pydflash.plan) exceeds what a device has: raised by Model(...) before it
    loads anything. `plan` holds the breakdown, its shortfall() and suggestions (what would fit instead). Also a
    ContextLengthExceededError, which a context too large for memory always was."""

    def __init__(self, message: str, plan=None):
        ContextLengthExceededError.__init__(self, message, None, plan.config["n_ctx"] if plan else None)
        self.plan = plan


class BackendError(PydflashError):
    """A compute backend failed (allocation, graph computation)."""


class ConversionError(PydflashError):
    """A Hugging Face checkpoint or GGUF could not be converted or quantized."""


class ModelBusyError(PydflashError, RuntimeError):
    """A Model (one session: KV cache, recurrent state, drafter context) was asked to generate while it already
    is, from another thread or in a stream not yet finished. One generation at a time per Model."""
