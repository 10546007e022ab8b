"""Checks of the public API's arguments: a TypeError or ValueError that names the parameter, the value and what
was expected, before anything reaches the core."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Mapping, Sequence

# the largest int the core takes (int32 counts and positions)
INT32_MAX = 2**31 - 1


def _is_int(value: Any) -> bool:
    # numpy integers count (operator.index accepts them), bools and floats do not
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def int_arg(name: str, value: Any, lo: int, hi: int = INT32_MAX) -> int:
    """`value` as an int in [lo, hi]."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value}, expected a value in [{lo}, {hi}]")
    return value


def optional_int_arg(name: str, value: Any, lo: int, hi: int = INT32_MAX) -> int | None:
    return None if value is None else int_arg(name, value, lo, hi)


def bool_arg(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def float_arg(name: str, value: Any, lo: float, hi: float = math.inf) -> float:
    """`value` as a finite float in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name} = {value}, expected a finite value in [{lo}, {hi}]")
    return value


def proportions_arg(name: str, value: Any) -> list[float]:
    """A sequence of finite proportions >= 0 (None: empty), e.g. llama.cpp's tensor split."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(value).__name__} {value!r}")
    return [float_arg(f"{name}[{i}]", v, 0.0) for i, v in enumerate(value)]


def choice_arg(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def token_ids(name: str, tokens: Any, n_vocab: int) -> list[int]:
    """A sequence of token ids, each an int in [0, n_vocab)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) and not hasattr(tokens, "__array__"):
        raise TypeError(f"{name} must be text or a sequence of token ids, got {type(tokens).__name__}")
    out = []
    for i, t in enumerate(tokens):
        if not _is_int(t):
            raise TypeError(f"{name}[{i}] must be an int token id, got {type(t).__name__} {t!r}")
        t = operator.index(t)
        if not 0 <= t < n_vocab:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {n_vocab})")
        out.append(t)
    return out


def stop_strings(stop: Any) -> list[str]:
    """None, a string, or a sequence of non-empty strings."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if isinstance(items, bytes) or not isinstance(items, Sequence):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a string, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError(f"stop[{i}] is an empty string, which would stop before any text")
    return list(items)


def logit_bias_arg(bias: Any, n_vocab: int) -> dict[int, float]:
    """{token id: bias}; ids may be ints or decimal strings (OpenAI's JSON keys), biases finite or -inf."""
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise TypeError(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not _is_int(token):
            raise TypeError(f"logit_bias key {key!r} must be a token id (an int or a decimal string)")
        token = operator.index(token)
        if not 0 <= token < n_vocab:
            raise ValueError(f"logit_bias key {key!r} is outside the vocabulary [0, {n_vocab})")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"logit_bias[{key!r}] must be a number, got {type(value).__name__} {value!r}")
        value = float(value)
        if math.isnan(value) or value == math.inf:
            raise ValueError(f"logit_bias[{key!r}] = {value}, expected a finite value or -inf")
        out[token] = value
    return out


def str_arg(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def objects_arg(where: str, value: Any, expected: str) -> list[Mapping]:
    """`value` if it is a list of objects (JSON's; Mappings), else a TypeError naming `where` and what was
    `expected` there."""
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise TypeError(f"{where}: expected {expected}, got {type(value).__name__}")
    return value
