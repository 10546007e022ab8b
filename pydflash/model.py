"""`pydflash.Model`: load a GGUF target and generate from it (llama-cpp-python-style names).

The decode loop runs in C++ (`pydflash._core`) with the GIL released; this module only turns text into
tokens and back, handles stop strings, streaming and timings.
"""

from __future__ import annotations

import atexit
import codecs
import logging
import math
import os
import queue
import secrets
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

from . import _core, cost_cache, drafter_target, rpc, ubatch
from ._arguments import (INT32_MAX, bool_arg, choice_arg, float_arg, int_arg, logit_bias_arg, optional_int_arg,
                         stop_strings, token_ids)
from .errors import ContextLengthExceededError, GGUFFormatError, InsufficientMemoryError, ModelBusyError
from .grammar import grammar_arg
from .memory_plan import (by_category, checked_paths, context_size, device_budget, engine_config, engine_options,
                          plan_for_load, proposers_arg)
from .tokenizer import Tokenizer

__all__ = ["Model", "Completion"]

logger = logging.getLogger("pydflash")
_LOG_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}


def _forward_core_log(level: int, text: str) -> None:
    logger.log(_LOG_LEVELS.get(level, logging.INFO), "%s", text)


_core.set_log_callback(_forward_core_log)
# drop the callback before the interpreter goes away: the core holds a reference to it in a static
atexit.register(_core.set_log_callback, None)


def _log_verbosely(verbose: bool) -> None:
    """verbose=True: the core's log and pydflash's at DEBUG, to stderr unless the application has a handler."""
    if verbose:
        logger.setLevel(logging.DEBUG)
        if not logger.handlers:
            logger.addHandler(logging.StreamHandler())


# the sampling parameters of the chat-shaped calls (create_chat_completion, create_message, create_response)
_CHAT_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                  "frequency_penalty", "repeat_last_n", "logit_bias", "seed")


def _chat_sampling(arguments: Mapping) -> dict:
    """Model.generate's sampling keyword arguments among a chat-shaped call's own (its locals())."""
    return {name: arguments[name] for name in _CHAT_SAMPLING}


@dataclass
class Completion:
    """The result of `Model.generate`. `timings` uses llama-server's names; `seed` is the one the call drew with
    (pass it back to reproduce a sampled call); `logprobs`, with `logprobs=n`, is llama-cpp-python's completion
    shape: tokens (text), text_offset, token_logprobs and top_logprobs (n entries per token, text -> logprob)."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (stop token or string), "length" (max_tokens or n_ctx), "abort"
    timings: dict = field(default_factory=dict)
    seed: int | None = None
    logprobs: dict | None = None


def sampling_args(n_vocab: int, temperature, top_k, top_p, min_p, typical_p, repeat_penalty, presence_penalty,
                  frequency_penalty, repeat_last_n, logit_bias, logprobs) -> dict:
    """The sampling parameters checked (ValueError / TypeError naming the one at fault), as the core takes them."""
    args = dict(temperature=float_arg("temperature", temperature, 0.0),
                top_k=max(0, int_arg("top_k", top_k, -INT32_MAX)),  # <= 0: off (llama.cpp's; -1 is vLLM's)
                top_p=float_arg("top_p", top_p, 0.0, 1.0),
                min_p=float_arg("min_p", min_p, 0.0, 1.0),
                typical_p=float_arg("typical_p", typical_p, 0.0, 1.0),
                repeat_penalty=float_arg("repeat_penalty", repeat_penalty, 0.0),
                presence_penalty=float_arg("presence_penalty", presence_penalty, -math.inf),
                frequency_penalty=float_arg("frequency_penalty", frequency_penalty, -math.inf),
                repeat_last_n=int_arg("repeat_last_n", repeat_last_n, -1),
                logit_bias=logit_bias_arg(logit_bias, n_vocab),
                logprobs=optional_int_arg("logprobs", logprobs, 0, n_vocab))
    if len(args["logit_bias"]) == n_vocab and all(b == -math.inf for b in args["logit_bias"].values()):
        raise ValueError(f"logit_bias bans every one of the {n_vocab} tokens: nothing could be sampled")
    if args["repeat_penalty"] == 0.0:
        raise ValueError("repeat_penalty = 0.0, expected a value > 0 (1.0: off)")
    return args


class TokenStep(NamedTuple):
    """One committed token as a stream meets it (`Pieces.steps()`): the text it released, its id and the core's
    logprobs of it (from the raw logits, as llama-server's n_probs; None unless logprobs were asked for)."""
    text: str  # what is safe to show after it: a stop string's possible start and a split character held back
    token: int | None  # the last: the stop token that ended it, else None (the held-back text its end released)
    logprob: float | None
    top: list[tuple[int, float]] | None  # the best (id, logprob) pairs, best first
    incomplete: bool  # the text so far ends inside a UTF-8 character (the rest comes with later tokens)


class Pieces:
    """The (text, logprobs) pieces of a generation, iterated once: a piece per batch of committed tokens (a
    speculative round's), or with steps() a TokenStep per token. After the last: `result`, the core's result, and
    `completion`, the Completion that `generate` returns for the same call. Closing the iteration early aborts the
    generation."""

    def __init__(self, it: Iterator[tuple[str, dict | None, list[TokenStep]]],
                 finish: Callable[[str, dict], Completion] | None = None):
        self._it, self._finish = it, finish
        self._iterated = False
        self.result: dict | None = None
        self.completion: Completion | None = None

    def __iter__(self) -> Iterator[tuple[str, dict | None]]:
        for text, lp, _ in self._batches():
            if text or lp is not None:
                yield text, lp

    def steps(self) -> Iterator[TokenStep]:
        """The generation token by token (iterated instead of the pieces, once)."""
        for _, _, steps in self._batches():
            yield from steps

    def _batches(self) -> Iterator[tuple[str, dict | None, list[TokenStep]]]:
        if self._iterated:
            raise RuntimeError("a generation's pieces can be iterated once (the result is in .completion / .result)")
        self._iterated = True
        texts: list[str] = []
        try:
            while True:
                try:
                    text, lp, steps = next(self._it)
                except StopIteration as end:
                    self.result = end.value
                    break
                if self._finish is not None:
                    texts.append(text)
                yield text, lp, steps
        finally:
            self._it.close()  # a consumer that stops early aborts the generation now, not when collected
        if self._finish is not None:
            self.completion = self._finish("".join(texts), self.result)


# generate's sampling keyword arguments and their defaults: what Model.pieces takes as **sampling (and
# post_sampling_probs: logprobs from the draw's distribution, after every stage, as llama-server's)
GENERATE_SAMPLING = dict(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, repeat_penalty=1.0,
                         presence_penalty=0.0, frequency_penalty=0.0, repeat_last_n=64, logit_bias=None, seed=None,
                         logprobs=None, post_sampling_probs=False, grammar=None)


def _nothing_generated(finish_reason: str, sampling: dict) -> dict:
    """The core's result for a generation aborted before it began."""
    result = {"tokens": [], "finish_reason": finish_reason,
              "timings": {"prompt_n": 0, "cached_n": 0, "prompt_ms": 0.0, "predicted_n": 0, "predicted_ms": 0.0,
                          "n_target_evals": 0, "sample_ms": 0.0}}
    if sampling.get("logprobs") is not None:
        result["logprobs"] = {"token_logprobs": [], "top_logprobs": []}
    return result


# llama.cpp's LLAMA_DEFAULT_SEED, and -1 as llama-cpp-python and llama-server take it: a fresh seed
RANDOM_SEEDS = (-1, 0xFFFFFFFF)


def _seed_arg(seed) -> int | None:
    seed = optional_int_arg("seed", seed, -(2**63), 2**64 - 1)
    return None if seed in RANDOM_SEEDS else seed


def _timings(raw: dict) -> dict:
    t = dict(raw)
    for kind in ("prompt", "predicted"):
        n, ms = t[f"{kind}_n"], t[f"{kind}_ms"]
        t[f"{kind}_per_token_ms"] = ms / n if n else 0.0
        t[f"{kind}_per_second"] = 1000.0 * n / ms if ms > 0 else 0.0
    if "n_rounds" in t:
        # tau: tokens committed per verify round (accepted drafts + the target's bonus token)
        rounds = t["n_rounds"]
        t["tau"] = (t["draft_n_accepted"] + rounds) / rounds if rounds else 0.0
        # by depth: of the rounds that verified a draft at depth k+1, the share whose accepted path reached it
        t["acceptance_by_position"] = [a / p if p else 0.0 for a, p in zip(t.pop("accepted_at"), t.pop("proposed_at"))]
        t["draft_acceptance_rate"] = t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else 0.0
        # verified tokens per committed token over the speculative rounds
        t["verified_per_token"] = t["verify_n"] / (t["draft_n_accepted"] + rounds) if rounds else 0.0
    return t


def _raw_logprobs_at(raw: dict | None, i: int) -> tuple[float | None, list[tuple[int, float]] | None]:
    """(logprob, top (id, logprob) pairs) of token i in the core's logprobs of a batch (None, None without)."""
    return (None, None) if raw is None else (raw["token_logprobs"][i], raw["top_logprobs"][i])


def _items(pieces: "Pieces", with_logprobs: bool) -> Iterator:
    """stream()'s items: (text, logprobs) pairs, or the texts alone."""
    for text, lp in pieces:
        if with_logprobs:
            yield text, lp
        elif text:
            yield text


class _StopStrings:
    """Incremental UTF-8 decoding of generated tokens, cut at the first stop string.

    Text that could still be the start of a stop string is held back until it is known not to be one."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]):
        self._tok = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.stopped = False

    def feed(self, tokens: Sequence[int]) -> str:
        """Text that is safe to emit after these tokens (never a split character, never part of a stop string)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"".join(self._tok.token_bytes(t) for t in tokens))
        for s in self._stop:
            at = self._pending.find(s)
            if at >= 0:
                self.stopped = True
                out, self._pending = self._pending[:at], ""
                return out
        hold = 0
        for s in self._stop:  # longest suffix of pending that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(s[:k]):
                    hold = k
                    break
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out):]
        return out

    @property
    def incomplete(self) -> bool:
        """The bytes fed so far end inside a UTF-8 character."""
        return bool(self._decoder.getstate()[0])

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out


class _LoadBar:
    """A tqdm bar over the bytes of weights read while a GGUF loads (none unless asked for; tqdm itself draws
    nothing when stderr is not a terminal)."""

    def __init__(self, path: str, show: bool):
        self._desc, self._show, self._bar = f"loading {os.path.basename(path)}", show, None

    def update(self, done: int, total: int) -> None:
        if not self._show:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=self._desc, unit="B", unit_scale=True, unit_divisor=1024,
                             leave=False, disable=None)
        self._bar.update(done - self._bar.n)

    def __enter__(self) -> "_LoadBar":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()


class Model:
    """A GGUF target model with its session (KV cache) and tokenizer.

    >>> with pydflash.Model("qwen3.gguf", n_ctx=2048) as m:
    ...     print(m.generate("def fib(n):", max_tokens=32).text)

    n_ctx: the context in tokens (0: the model's trained context, as llama-cpp-python's n_ctx=0).
    n_ubatch: the prefill micro-batch; "auto" measures which size is fastest on this machine at the first long
    prompt (pydflash/ubatch.py). delta_net (Qwen3.5 targets): how prefill micro-batches run the delta rule,
    "fused" (ggml's op), "chunked" (stock ops) or "auto" (fused where the backend has it). A configuration that
    does not fit in memory is refused before anything loads (InsufficientMemoryError; see pydflash.plan).
    n_cpu_moe (MoE targets): the experts of the first N layers (-1: all) stay in system memory, the rest of each
    layer where n_gpu_layers puts it (llama.cpp's --n-cpu-moe). rpc_servers: "host:port" (a list, or one
    comma-separated string as llama-cpp-python takes it) of `pydflash rpc-server`s whose device n_gpu_layers then
    offloads to, as to a GPU (pydflash.rpc; unauthenticated: trusted networks only). tensor_split: each GPU
    device's proportion of the offloaded layers, in device order (local GPUs, then rpc_servers), e.g. [3, 1]
    (llama.cpp's --tensor-split; None or all zero: in proportion to each device's free memory). proposers: what
    drafts each round, ("dflash",) (the default with a draft_model_path) or ("ngram",): n-gram (prompt lookup)
    drafting, with no drafter file, which proposes what followed earlier occurrences of the context's last tokens
    (block_size 8 unless given; spec_mode and tree_budget as for a drafter), or ("mtp",): the target's own
    multi-token-prediction head (Qwen3.5's nextn block, kept by llama.cpp's converter), block_size - 1 drafts a
    round (block 4 for a chain, 8 for trees and auto, unless given): a chain, a tree of its top candidates, or
    (spec_mode="auto") what of that tree pays; or two or three of them, e.g. ("dflash", "ngram", "mtp"): their
    candidates merged into one tree that spec_mode="auto" cuts each round, which also chooses which models
    (drafter, head) run from what their rounds reach. With no proposers and no
    draft_model_path, a file that ships an MTP head speculates with it (speculative=False decodes plainly).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        n_cpu_moe: int = 0,
        tensor_split: Sequence[float] | None = None,
        proposers: Sequence[str] | None = None,
        rpc_servers: str | Sequence[str] | None = None,
        n_threads: int | None = None,
        kv_type: str = "f16",
        n_ubatch: int | str = "auto",
        draft_model_path: str | os.PathLike | None = None,
        block_size: int | None = None,
        spec_mode: str = "auto",
        tree_budget: int | None = None,
        tree_seed: str = "best_first",
        draft_window: int = 4096,
        seed: int | None = None,
        verbose: bool = False,
        progress: bool = False,
        delta_net: str = "auto",
    ):
        # an RPC server's device is offloaded to as a GPU: registered before the plan places the layers
        rpc.add_servers(rpc_servers)
        options = engine_options(n_ctx=context_size(n_ctx, model_path), kv_type=kv_type, n_gpu_layers=n_gpu_layers,
                                 n_cpu_moe=n_cpu_moe, tensor_split=tensor_split,
                                 proposers=proposers_arg(proposers, draft_model_path), n_ubatch=n_ubatch,
                                 spec_mode=spec_mode, block_size=block_size, tree_budget=tree_budget,
                                 draft_window=draft_window, delta_net=delta_net)
        n_threads = optional_int_arg("n_threads", n_threads, 1)
        self.seed = _seed_arg(seed)  # the default of sampled calls (None: a fresh seed per call)
        self.tree_seed = choice_arg("tree_seed", tree_seed, ("chain", "best_first"))
        _log_verbosely(bool_arg("verbose", verbose))
        progress = bool_arg("progress", progress)
        self.model_path, self.draft_model_path = checked_paths(model_path, draft_model_path)
        self.kv_type, self.spec_mode = kv_type, spec_mode
        planned = self._refuse_if_short(options)
        self.tokenizer = Tokenizer.from_gguf(self.model_path)
        self._load_weights(planned, options, n_threads, progress)
        # continuous batching of the generations that this Model's sessions (new_session) run at the same time:
        # made with the second session
        self._batcher = None
        self._resolve_engine(options)
        self._open_session(log=True)

    def _refuse_if_short(self, options: dict) -> tuple:
        """Plan this configuration (pydflash.plan: the GGUFs' metadata, nothing loaded) and raise
        InsufficientMemoryError, naming the device, the shortfall and what would fit, if it needs more than the
        system's available memory or the GPU's free memory (compute buffers measured over the whole context's
        graphs: a smaller window's may need a few percent more). Returns the plan's target and drafter, for
        _load_weights to load."""
        # the layers where the load will place them (no GPU: every layer on the CPU, as the load says)
        options = dict(options, n_gpu_layers=_core.usable_gpu_layers(options["n_gpu_layers"]))
        # the whole context's graphs only (sweep=False): a few ms, where the windows' sweep could take seconds
        memory, *planned = plan_for_load((self.model_path, self.draft_model_path), options, device_budget())
        if memory.fits is False:
            short = ", ".join(f"{d.upper()} needs {memory.total(d) / 2**20:.1f} MiB, {memory.budget[d] / 2**20:.1f} "
                              f"MiB available ({n / 2**20:.1f} MiB short)" for d, n in memory.shortfall().items())
            parts = ", ".join(f"{c} {sum(memory.bytes[c].values()) / 2**20:.1f} MiB" for c in memory.bytes)
            fix = "; ".join(f"{k}={v!r}" for k, v in memory.suggestions.items()) or "none found"
            raise InsufficientMemoryError(f"{self.model_path}: this configuration does not fit: {short} ({parts}). "
                                          f"Would fit instead: {fix}", memory)
        return tuple(planned)

    def _load_weights(self, planned: tuple, options: dict, n_threads: int | None, progress: bool) -> None:
        """The target's weights (and the drafter's), read once and shared by every session over them: the models
        the plan built (_refuse_if_short), moved into real buffers."""
        self._model, draft_model = planned
        with _LoadBar(self.model_path, progress) as bar:
            self._model.load_weights(n_gpu_layers=options["n_gpu_layers"], n_cpu_moe=options["n_cpu_moe"],
                                     tensor_split=options["tensor_split"], n_threads=n_threads or 0,
                                     progress=bar.update, delta_net=options["delta_net"])
        if self.tokenizer.n_vocab != self._model.n_vocab:  # (llama.cpp refuses either way too: a token's row
            # past the list would be generated with no text, and an id past the rows read outside the weights)
            raise GGUFFormatError(
                f"{self.model_path}: tokenizer.ggml.tokens has {self.tokenizer.n_vocab} entries but "
                f"token_embd.weight has {self._model.n_vocab} rows (one per token)")
        kv_bytes = self._model.kv_bytes_for(options["n_ctx"], self.kv_type, self.kv_type)
        logger.info("%s: %s, %d layers, weights %.1f MiB, KV cache (n_ctx=%d, %s) %.1f MiB", self.model_path,
                    self._model.arch, self._model.n_layer, self._model.weight_bytes / 2**20, options["n_ctx"],
                    self.kv_type, kv_bytes / 2**20)
        self._draft_model = draft_model
        # a drafter that names another model than this target: said now, and its acceptance after the first
        # generation that drafts (_report_drafter_acceptance)
        self._drafter_mismatch = None
        if draft_model is not None:
            with _LoadBar(self.draft_model_path, progress) as bar:
                draft_model.load_weights(progress=bar.update)
            self._drafter_mismatch = drafter_target.mismatch(self.model_path, self.draft_model_path)
            if self._drafter_mismatch:
                logger.warning("%s", self._drafter_mismatch)

    def _resolve_engine(self, options: dict) -> None:
        """The session's and the drafter's parameters (decode/engine_params.h), as the plan resolved them; with
        n_ubatch "auto", the micro-batches to time and the disk cache's key for the answer (pydflash/ubatch.py)."""
        self._engine = engine_config(self._model, self._draft_model, options)
        self._draft_config = dict(self._engine.draft or {}, tree_seed=self.tree_seed)
        self._session_config = self._engine.session
        self._ubatch_sizes = self._engine.ubatch_candidates or None
        self._ubatch_key = None
        # where the layers and experts are: what a measured cost depends on
        ncmoe, split = self._model.n_cpu_moe, self._model.tensor_split
        placement = (f"ngl={options['n_gpu_layers']}" + (f",ncmoe={ncmoe}" if ncmoe else "")
                     + (f",ts={'/'.join(f'{v:g}' for v in split)}" if split else ""))
        if self._ubatch_sizes is not None:
            self._ubatch_key = ubatch.cache_key(self.model_path, self.draft_model_path, self._model.n_threads,
                                                placement, self._ubatch_sizes)
        self._cost_key = cost_cache.cache_key(self.model_path, self.draft_model_path, self._model.n_threads,
                                              placement, mtp=self._engine.mtp is not None)

    def _open_session(self, log: bool = False) -> None:
        """This Model's own session over the loaded weights: KV cache, recurrent state, the drafter's context
        cache and feature ring, compute buffers and backends."""
        self._session = _core.Session(self._model, **self._session_config)
        if log and self._model.is_recurrent:
            n_rollback = self._session_config["n_rollback"]
            per_node = self._model.recurrent_bytes_for(2) - self._model.recurrent_bytes_for(1)
            logger.info("%s: recurrent state %.1f MiB: the committed state and the delta-rule and conv inputs of %d "
                        "tokens or tree nodes, %.2f MiB each (a verify of up to %d)", self.model_path,
                        self._session.recurrent_bytes / 2**20, n_rollback, per_node / 2**20, n_rollback)
        self._draft = None
        # n-gram lookup ("ngram" among the proposers): its index of this session's tokens and what auto learns of it
        self._ngram = None if self._engine.ngram is None else _core.NgramDrafter(**self._engine.ngram)
        # the target's own MTP head (by default where the file has one and no drafter is given)
        self._mtp = None if self._engine.mtp is None else _core.MtpDrafter(self._session, **self._engine.mtp)
        if log and self._mtp is not None:
            logger.info("%s: the model's MTP head drafts (block %d, %s)", self.model_path, self._mtp.block_size,
                        self._mtp.spec_mode)
        if self._draft_model is not None:
            # over the target session: the drafter computes in the session's steps, on its CPU threads
            self._draft = _core.DraftSession(self._session, self._draft_model, **self._draft_config)
            if log:
                logger.info("%s: DFlash draft, block %d (trained %d), target layers %s, weights %.1f MiB, "
                            "context cache (window %d) %.1f MiB, feature ring (%d rows) %.1f MiB",
                            self.draft_model_path, self._draft.block_size, self._draft.trained_block_size,
                            self._draft.capture_layers, self._draft.weight_bytes / 2**20, self._draft.window,
                            self._draft.kv_bytes / 2**20, self._draft.ring_capacity, self._draft.ring_bytes / 2**20)
        # what verifying cost here before (cost_cache.py)
        cost_cache.restore(self._draft if self._draft is not None else self._mtp, self._cost_key)
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._ubatch_pending = self._ubatch_sizes is not None

    def _choose_ubatch(self, tokens: list[int]) -> None:
        """n_ubatch "auto": before the first prefill that needs more than one of the smallest micro-batches,
        measure (or read from the disk cache) which size is fastest here, and keep it for this session."""
        if not self._ubatch_pending or len(tokens) <= min(self._ubatch_sizes):
            return
        self._ubatch_pending = False
        size, measured = ubatch.calibrate(self._session, self._draft, tokens, self._ubatch_sizes, self._ubatch_key)
        self._session.n_ubatch = size
        if measured:
            logger.info("%s: prefill micro-batch %d (ms per token: %s)", self.model_path, size,
                        ", ".join(f"{k}: {v:.3f}" for k, v in sorted(measured.items())))

    def new_session(self) -> "Model":
        """Another Model over the same loaded weights (target, drafter, tokenizer) with a session of its own:
        KV cache, recurrent state, the drafter's cache and feature ring, compute buffers, prompt cache and what
        the cost-aware choice has learnt. Generations on the two run in parallel threads, each step's target
        evaluations batched into one (continuous batching: the weights are read once for all of them, and each
        generation's output is what it would be alone); weights are not copied (`pydflash serve --parallel N`
        runs N of them)."""
        self._check_open()
        if self._batcher is None:
            self._batcher = _core.EvalBatcher(self._model)
            cost_cache.restore_steps(self._batcher, self._cost_key)  # what batched steps cost here before
        other = object.__new__(type(self))
        other.__dict__.update({k: v for k, v in self.__dict__.items()
                               if k not in ("_session", "_draft", "_ngram", "_mtp", "_lock", "_cancelled",
                                            "_batch_sessions")})
        other._open_session()
        return other

    @classmethod
    def demo(cls, **kwargs) -> "Model":
        """The embedded trained Qwen3 target with its DFlash drafter (no download); keyword arguments as for
        `Model(...)`."""
        from .demo_pair import demo_paths

        target, draft = demo_paths()
        kwargs.setdefault("draft_model_path", draft)
        return cls(target, **kwargs)

    def memory(self) -> dict:
        """Bytes allocated now, by category and device, in the shape `pydflash.plan(...)` plans them:
        {"weights" | "kv" | "recurrent" | "ring" | "draft" | "compute": {"cpu": n, "gpu": n}}. Compute buffers
        grow to the largest graph run so far (the plan's figure is the largest this configuration can run)."""
        self._check_open()
        computes = [self._session.compute_memory, self._session.commit_compute_memory] + \
            ([self._draft.compute_memory] if self._draft else []) + ([self._mtp.compute_memory] if self._mtp else [])
        compute = {"cpu": sum(c[0] for c in computes), "gpu": sum(c[1] for c in computes)}
        return by_category(self._model, self._session, self._draft_model, self._draft, compute, self._mtp)

    # ---- properties ----
    @property
    def n_ctx(self) -> int:
        self._check_open()
        return self._session.n_ctx

    @property
    def n_ubatch(self) -> int:
        """The prefill micro-batch (with n_ubatch="auto": the largest candidate until the first long prompt)."""
        self._check_open()
        return self._session.n_ubatch

    @property
    def n_vocab(self) -> int:
        self._check_open()
        return self._model.n_vocab

    @property
    def arch(self) -> str:
        self._check_open()
        return self._model.arch

    @property
    def n_threads(self) -> int:
        self._check_open()
        return self._model.n_threads

    @property
    def kv_bytes(self) -> int:
        self._check_open()
        return self._session.kv_bytes

    @property
    def recurrent_bytes(self) -> int:
        """Hybrid targets: bytes of the recurrent state: the committed state, the one a verify writes, and each
        verified token's or node's delta-rule and conv inputs (it grows a little with tree_budget). 0 for
        attention-only targets."""
        self._check_open()
        return self._session.recurrent_bytes

    @property
    def tree_budget(self) -> int | None:
        """Draft nodes a verify may hold (tree: each round's; auto: the most; chain: block_size - 1) with a draft
        model loaded, else None: the engine's (decode/engine_params.h), from tree_budget or its default."""
        self._check_open()
        return self._engine.tree_budget

    @property
    def block_size(self) -> int | None:
        """Tokens per draft/verify round when a draft model or n-gram lookup drafts, else None."""
        self._check_open()
        if self._draft is not None:
            return self._draft.block_size
        if self._mtp is not None:
            return self._mtp.block_size
        return self._ngram.block_size if self._ngram is not None else None

    @property
    def proposers(self) -> tuple[str, ...]:
        """What drafts each round: ("dflash",), ("ngram",), ("mtp",) (the target's own MTP head), two or three of them
        (one tree of their candidates, auto), or () (plain decoding)."""
        self._check_open()
        return (("dflash",) if self._draft is not None else ()) + (("ngram",) if self._ngram is not None else ()) + \
            (("mtp",) if self._mtp is not None else ())

    # ---- text ----
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.detokenize(token_ids("tokens", tokens, self.n_vocab))

    def _prompt_tokens(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """tokenize() for a prompt: a text too long for the context whatever its tokens (more bytes than n_ctx
        of the longest token) raises ContextLengthExceededError at once (tokenizing runs at ~1 us a byte: a
        100 MB text took minutes to be refused)."""
        size, unit = len(text), "bytes" if isinstance(text, bytes) else "characters"  # (a character: 1+ bytes)
        if size > self.n_ctx and size > self.n_ctx * self.tokenizer.longest_token_bytes:
            raise ContextLengthExceededError(
                f"the prompt has {size} {unit}, more than n_ctx = {self.n_ctx} tokens of at most "
                f"{self.tokenizer.longest_token_bytes} bytes each can hold", None, self.n_ctx)
        return self.tokenize(text, add_special=add_special, parse_special=parse_special)

    # ---- generation ----
    def _prepare(self, prompt: str | bytes | Sequence[int], max_tokens: int | None,
                 speculative: bool) -> tuple[list[int], int, bool]:
        """The prompt's tokens, the max_tokens to ask the core for and `speculative`, every argument checked."""
        self._check_open()
        bool_arg("speculative", speculative)
        max_tokens = optional_int_arg("max_tokens", max_tokens, 0)
        if isinstance(prompt, (str, bytes)):
            tokens = self._prompt_tokens(prompt)
        else:
            tokens = token_ids("prompt", prompt, self.n_vocab)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) > self.n_ctx:
            raise ContextLengthExceededError(
                f"the prompt has {len(tokens)} tokens but n_ctx = {self.n_ctx}", len(tokens), self.n_ctx)
        # None: until an end-of-generation token or the end of the context (where the core stops)
        return tokens, INT32_MAX if max_tokens is None else max_tokens, speculative

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = 128, temperature: float = 0.0, *,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                 repeat_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repeat_last_n: int = 64, logit_bias: dict | None = None, seed: int | None = None,
                 logprobs: int | None = None, stop: str | Sequence[str] | None = None,
                 speculative: bool = True, grammar=None) -> Completion:
        """Generate a continuation of `prompt` (text, or token ids). With a draft model loaded, DFlash
        speculative decoding is used unless `speculative=False`; the output is the same either way, also when
        sampling: for a given seed, speculative decoding commits the tokens plain sampling draws.

        Sampling follows llama.cpp's chain, in its order: logit_bias, penalties (repeat_penalty,
        presence_penalty, frequency_penalty over the last repeat_last_n tokens, prompt included; -1: all),
        top_k, typical_p, top_p, min_p, temperature. temperature=0.0 (the default) decodes greedily (after
        biases and penalties). seed: an int makes the call reproducible; None takes the Model's seed, or a fresh
        one when that is None too (Completion.seed says which). logprobs=n returns each token's log-probability
        and the n most likely tokens' (log-softmax of the target's logits). max_tokens=None generates until an
        end-of-generation token or the end of the context. grammar (a pydflash.Grammar, or llama.cpp's GBNF text)
        constrains the output to it, before every other stage (pydflash/grammar.py; llguidance)."""
        sampling = self._sampling(temperature, top_k, top_p, min_p, typical_p, repeat_penalty, presence_penalty,
                                  frequency_penalty, repeat_last_n, logit_bias, seed, logprobs, grammar=grammar)
        pieces: list[str] = []
        prepared = self._prepare(prompt, max_tokens, speculative)
        result = self._run(prepared, stop, lambda text, _lp, _steps: pieces.append(text), sampling)
        return Completion("".join(pieces), result["tokens"], result["finish_reason"], _timings(result["timings"]),
                          sampling.get("seed"), self._logprobs(result["tokens"], result.get("logprobs")))

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_tokens: int | None = 128, *,
                       parallel: int | None = None, **kwargs) -> list[Completion]:
        """`generate` for each of `prompts` (keyword arguments as for generate, the same for every prompt), up to
        `parallel` of them at a time (default: all, at most 16), batched: at each step every running
        generation's target evaluation (a prompt micro-batch, a token, a chain or a tree of drafts) runs in one,
        the weights read once for all of them. Each Completion is what `generate` gives for its prompt alone.
        The extra sessions (`new_session`) are kept for the next call."""
        self._check_open()
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts (texts or token-id lists), got one text: use "
                            "generate() for one prompt, or put it in a list")
        if isinstance(prompts, Mapping) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a list of prompts (texts or token-id lists), got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        parallel = optional_int_arg("parallel", parallel, 1)
        n = min(len(prompts), parallel if parallel is not None else 16)
        for prompt in prompts:  # every prompt checked before any generation starts
            self._prepare(prompt, max_tokens, bool(kwargs.get("speculative", True)))
        if n <= 1:
            return [self.generate(p, max_tokens, **kwargs) for p in prompts]
        if not hasattr(self, "_batch_sessions"):
            self._batch_sessions: list[Model] = []
        while len(self._batch_sessions) < n - 1:
            self._batch_sessions.append(self.new_session())
        sessions = [self, *self._batch_sessions[:n - 1]]
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i, prompt in enumerate(prompts):
            todo.put((i, prompt))
        out: list = [None] * len(prompts)

        def work(session: Model) -> None:
            while True:
                try:
                    i, prompt = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    out[i] = session.generate(prompt, max_tokens, **kwargs)
                except BaseException as e:  # raised in the caller's thread, below
                    out[i] = e

        workers = [threading.Thread(target=work, args=(s,), daemon=True) for s in sessions]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for c in out:
            if isinstance(c, BaseException):
                raise c
        return out

    def stream(self, prompt: str | Sequence[int], max_tokens: int | None = 128, temperature: float = 0.0, *,
               top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               repeat_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               repeat_last_n: int = 64, logit_bias: dict | None = None, seed: int | None = None,
               logprobs: int | None = None, stop: str | Sequence[str] | None = None,
               speculative: bool = True, grammar=None) -> Iterator[str] | Iterator[tuple[str, dict | None]]:
        """Yield the continuation as text pieces as they are generated; a piece never splits a character.
        Arguments as for `generate`. With logprobs=n each item is a (text, logprobs) pair instead: logprobs (as in
        Completion.logprobs, text offsets into the whole completion) covers the tokens committed since the last
        item (None for a last piece of text that was held back), text what became safe to print."""
        sampling = self._sampling(temperature, top_k, top_p, min_p, typical_p, repeat_penalty, presence_penalty,
                                  frequency_penalty, repeat_last_n, logit_bias, seed, logprobs, grammar=grammar)
        # the prompt and every argument checked now, not at the first next()
        return _items(self._pieces(prompt, max_tokens, stop, speculative, sampling), logprobs is not None)

    def pieces(self, prompt: str | Sequence[int], max_tokens: int | None = 128, *,
               stop: str | Sequence[str] | None = None, speculative: bool = True, **sampling) -> Pieces:
        """The generation as (text, logprobs or None) pieces, as `stream(..., logprobs=n)` yields them, for callers
        that also need how it ended (the OpenAI-shaped calls, the CLI): once iterated to the end, `.completion` is
        the Completion `generate` returns. `sampling`: generate's sampling keyword arguments (temperature, top_k,
        ..., logit_bias, seed, logprobs), with its defaults. The prompt and every argument are checked now, not
        at the first next()."""
        unknown = sorted(set(sampling) - set(GENERATE_SAMPLING))
        if unknown:  # (before: "Model._sampling() got an unexpected keyword argument")
            raise TypeError(f"pieces() got an unexpected keyword argument {unknown[0]!r}")
        args = self._sampling(**{**GENERATE_SAMPLING, **sampling})

        def completion(text: str, result: dict) -> Completion:
            return Completion(text, result["tokens"], result["finish_reason"], _timings(result["timings"]),
                              args["seed"], self._logprobs(result["tokens"], result.get("logprobs")))

        return Pieces(self._generate_iter(self._prepare(prompt, max_tokens, speculative), stop, args), completion)

    def _pieces(self, prompt, max_tokens, stop, speculative, sampling) -> "Pieces":
        """The generation's pieces; the prompt and max_tokens are checked now (a prompt over the context raises
        here, not in the first next())."""
        return Pieces(self._generate_iter(self._prepare(prompt, max_tokens, speculative), stop, sampling))

    def _generate_iter(self, prepared, stop, sampling) -> Iterator[tuple[str, dict | None, list[TokenStep]]]:
        """(text, logprobs or None, the tokens' steps) as tokens are committed, generated on a worker thread;
        returns (as StopIteration.value) the core's result. Closing the iterator early aborts the generation."""
        pieces: queue.Queue = queue.Queue()
        done = object()
        outcome: dict = {}

        def put(text: str, lp: dict | None, steps: list[TokenStep]) -> None:
            if text or lp is not None or steps:
                pieces.put((text, lp, steps))

        cancel = threading.Event()  # this generation's: the consumer's stopping must reach it whenever it comes

        def worker():
            try:
                outcome["result"] = self._run(prepared, stop, put, sampling, cancel)
            except BaseException as e:  # re-raised in the consumer
                outcome["error"] = e
            finally:
                pieces.put(done)

        thread = threading.Thread(target=worker, daemon=True)
        finished = False
        try:
            thread.start()  # in the try: a KeyboardInterrupt raised while it starts also ends the generation
            while True:
                piece = pieces.get()
                if piece is done:
                    finished = True
                    break
                yield piece
        finally:
            if not finished:  # the consumer stopped early
                cancel.set()
                session = self._session
                if session is not None:  # (None: the Model was closed meanwhile, which ended the generation)
                    session.abort()
            if thread.is_alive():  # (not yet, if start() was interrupted: _run then returns at once)
                thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    # ---- OpenAI-shaped calls (llama-cpp-python's) ----
    def create_completion(self, prompt: str | Sequence[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                          logprobs: int | None = None, echo: bool = False, stop: str | Sequence[str] | None = None,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                          repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False,
                          seed: int | None = None, logit_bias: dict | None = None, repeat_last_n: int = 64,
                          stream_options: dict | None = None, speculative: bool = True,
                          grammar=None) -> dict | Iterator[dict]:
        """An OpenAI-shaped text completion (llama-cpp-python's defaults); stream=True returns an iterator of
        chunks, the last carrying finish_reason and timings (and, with stream_options={"include_usage": True},
        one more with usage). The parameters in llama-cpp-python's order. With `suffix`, the completion fills the
        middle between the prompt and the suffix, with the model's FIM tokens laid out as llama-server's /infill
        lays them out: [FIM_PRE] prompt [FIM_SUF] suffix [FIM_MID] (after BOS where the model adds one; the prompt
        keeps its last 3/4 of the context, the suffix its first 1/4); ValueError for a model without them.
        grammar: as for generate."""
        from .completions import create_completion

        echoed = prompt
        if suffix is not None:
            prompt = self._infill_prompt(prompt, suffix)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, repeat_last_n=repeat_last_n, logit_bias=logit_bias,
                        seed=seed, logprobs=logprobs, grammar=grammar)
        return create_completion(self, prompt, max_tokens=max_tokens, echo=echo, stop=stop, stream=stream,
                                 stream_options=stream_options, speculative=speculative, sampling=sampling,
                                 echoed=echoed)

    __call__ = create_completion  # (llama-cpp-python's Llama.__call__: llm("Q: ...", max_tokens=32))

    def _infill_prompt(self, prompt: str | Sequence[int], suffix: str) -> list[int]:
        """create_completion's fill-in-the-middle prompt: llama-server's /infill layout of `prompt` and `suffix`,
        cut to the context (a batch as large as it, and no tokens kept for the answer: no repository part)."""
        from .infill import InfillRequest, infill_tokens

        if not isinstance(suffix, str):
            raise TypeError(f"suffix must be a str, got {type(suffix).__name__}")
        prefix = prompt if isinstance(prompt, str) else token_ids("prompt", prompt, self.n_vocab)
        try:
            return infill_tokens(self, InfillRequest(input_prefix=prefix, input_suffix=suffix), n_batch=self.n_ctx,
                                 n_predict=0)
        except ValueError as e:  # (InfillUnsupported: no FIM tokens)
            raise ValueError(f"suffix={suffix!r}: {self.model_path}: {e}") from None

    def create_chat_completion(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                               tool_choice: str | None = None, temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: str | Sequence[str] | None = None, seed: int | None = None,
                               response_format: dict | None = None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, repeat_last_n: int = 64, logit_bias: dict | None = None,
                               logprobs: bool = False, top_logprobs: int | None = None,
                               chat_template: str | None = None, chat_format: str | None = None,
                               chat_template_kwargs: dict | None = None, stream_options: dict | None = None,
                               speculative: bool = True, grammar=None) -> dict | Iterator[dict]:
        """An OpenAI-shaped chat completion (llama-cpp-python's defaults): the prompt is the GGUF's chat template
        (or chat_template= / chat_format="chatml") rendered with `tools` and `chat_template_kwargs` (e.g.
        {"enable_thinking": False}); a <think> block in the reply comes back as reasoning_content.
        response_format {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}, or a
        grammar (a pydflash.Grammar or GBNF text), constrains the reply (pydflash/grammar.py)."""
        from .completions import create_chat_completion

        sampling = {**_chat_sampling(locals()), "grammar": grammar}
        return create_chat_completion(self, messages, tools=tools, tool_choice=tool_choice,
                                      response_format=response_format, chat_template_kwargs=chat_template_kwargs,
                                      template=chat_template, chat_format=chat_format, max_tokens=max_tokens,
                                      stop=stop, stream=stream, stream_options=stream_options, logprobs=logprobs,
                                      top_logprobs=top_logprobs, speculative=speculative, sampling=sampling)

    def create_message(self, messages: Sequence[dict], *, max_tokens: int | None = None, system=None,
                       tools: Sequence[dict] | None = None, tool_choice: dict | None = None,
                       thinking: dict | None = None, stop_sequences: Sequence[str] | None = None,
                       temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                       typical_p: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       repeat_penalty: float = 1.0, repeat_last_n: int = 64, logit_bias: dict | None = None,
                       seed: int | None = None, stream: bool = False, chat_template: str | None = None,
                       chat_format: str | None = None, chat_template_kwargs: dict | None = None,
                       speculative: bool = True) -> dict | Iterator[dict]:
        """An Anthropic-shaped message (the Messages API, as `POST /v1/messages` serves it): `messages` with text,
        thinking, tool_use and tool_result blocks, `system`, `tools` (name, description, input_schema),
        `thinking` ({"type": "enabled"} or "disabled": the template's enable_thinking); the reply's content
        blocks, stop_reason and usage, or with stream=True its events. Sampling defaults: create_chat_completion's
        (pydflash/anthropic_messages.py)."""
        from .anthropic_messages import create_message

        sampling = _chat_sampling(locals())
        return create_message(self, messages, system=system, tools=tools, tool_choice=tool_choice, thinking=thinking,
                              max_tokens=max_tokens, stop_sequences=stop_sequences, stream=stream,
                              chat_template_kwargs=chat_template_kwargs, template=chat_template,
                              chat_format=chat_format, speculative=speculative, sampling=sampling)

    def create_response(self, input, *, instructions: str | None = None, tools: Sequence[dict] | None = None,
                        tool_choice: str | None = None, text: dict | None = None, reasoning: dict | None = None,
                        max_output_tokens: int | None = None, temperature: float = 0.2, top_p: float = 0.95,
                        top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, presence_penalty: float = 0.0,
                        frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                        logit_bias: dict | None = None, seed: int | None = None, stream: bool = False,
                        chat_template: str | None = None, chat_format: str | None = None,
                        chat_template_kwargs: dict | None = None, speculative: bool = True) -> dict | Iterator[dict]:
        """An OpenAI Responses-shaped answer (as `POST /v1/responses` serves it): `input` as a string or items
        (messages, function_call, function_call_output, reasoning), `instructions`, function `tools`; the reply's
        output items, status and usage, or with stream=True its events. Sampling defaults:
        create_chat_completion's (pydflash/openai_responses.py)."""
        from .openai_responses import create_response

        sampling = _chat_sampling(locals())
        return create_response(self, input, instructions=instructions, tools=tools, tool_choice=tool_choice, text=text,
                               reasoning=reasoning, max_output_tokens=max_output_tokens, stream=stream,
                               chat_template_kwargs=chat_template_kwargs, template=chat_template,
                               chat_format=chat_format, speculative=speculative, sampling=sampling)

    def _sampling(self, temperature, top_k, top_p, min_p, typical_p, repeat_penalty, presence_penalty,
                  frequency_penalty, repeat_last_n, logit_bias, seed, logprobs, post_sampling_probs=False,
                  grammar=None) -> dict:
        """The core's sampling dict, every parameter checked; the seed resolved (given, the Model's, or fresh);
        a grammar's matcher for this generation."""
        self._check_open()
        args = sampling_args(self.n_vocab, temperature, top_k, top_p, min_p, typical_p, repeat_penalty,
                             presence_penalty, frequency_penalty, repeat_last_n, logit_bias, logprobs)
        if bool_arg("post_sampling_probs", post_sampling_probs):
            args["post_sampling_probs"] = True
        grammar = grammar_arg(grammar)
        if grammar is not None:
            args["constraint"] = grammar.matcher(self)
        seed = _seed_arg(seed)
        if seed is None:
            seed = self.seed if self.seed is not None else secrets.randbits(64)
        args["seed"] = seed
        return args

    def _logprobs(self, tokens: list[int], raw: dict | None, offset: int = 0) -> dict | None:
        """llama-cpp-python's completion logprobs for `tokens` from the core's (ids); text offsets from `offset`
        (the characters of the completion before them)."""
        if raw is None:
            return None

        def piece(token: int) -> str:
            return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

        texts = [piece(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "text_offset": offsets, "token_logprobs": raw["token_logprobs"],
                "top_logprobs": [{piece(t): lp for t, lp in top} for top in raw["top_logprobs"]]}

    def _run(self, prepared, stop, emit, sampling, cancel: threading.Event | None = None) -> dict:
        """Generate from `prepared` (what _prepare returned), emit(text, logprobs, steps) as tokens are committed.
        `cancel`, set by abort() or by a consumer that stops early, ends this generation wherever it lands: before
        the core starts (which clears its own abort flag then) or during it."""
        cancel = cancel or threading.Event()
        if cancel.is_set():  # stopped before this thread began: leave at once, without taking the lock
            return _nothing_generated("abort", sampling)
        tokens, max_tokens, speculative = prepared
        stops = _StopStrings(self.tokenizer, stop_strings(stop))

        produced = 0  # characters of the committed tokens so far (logprobs' text offsets)

        def on_tokens(new_tokens: list[int], raw_logprobs: dict | None = None) -> bool:
            nonlocal produced
            lp = self._logprobs(new_tokens, raw_logprobs, produced)
            if lp is not None:
                produced += sum(len(t) for t in lp["tokens"])
            steps = []
            for i, token in enumerate(new_tokens):  # token by token: what each one released
                if stops.stopped:
                    break
                steps.append(TokenStep(stops.feed([token]), token, *_raw_logprobs_at(raw_logprobs, i),
                                       stops.incomplete))
            emit("".join(step.text for step in steps), lp, steps)
            return not stops.stopped and not cancel.is_set()

        self._check_open()
        if not self._lock.acquire(blocking=False):
            raise ModelBusyError(f"{self.model_path}: this Model is already generating (in another thread, or in a "
                                 f"stream not yet finished); it runs one generation at a time: use one Model per "
                                 f"thread, or finish (or close) the stream first")
        self._cancelled = cancel  # abort() ends this generation from now on
        try:
            self._check_open()  # (closed after the call was made: a stream started later, another thread's close)
            if not speculative and self._draft is not None:
                self._draft.forget()  # the target's cache moves on without the drafter's rows
            self._choose_ubatch(tokens)
            if cancel.is_set():  # aborted before the core began; after this, the callback or its flag ends it
                return _nothing_generated("abort", sampling)
            result = self._session.generate(tokens, max_tokens=max_tokens,
                                            stop_tokens=sorted(self.tokenizer.eog_token_ids), callback=on_tokens,
                                            draft=self._draft if speculative else None,
                                            ngram=self._ngram if speculative else None,
                                            mtp=self._mtp if speculative else None, sampling=sampling,
                                            batcher=self._batcher)
            cost_cache.remember((self._draft if self._draft is not None else self._mtp) if speculative else None,
                                self._cost_key)
            cost_cache.remember_steps(self._batcher if speculative else None, self._cost_key)
        finally:
            self._lock.release()
        self._report_drafter_acceptance(result["timings"])
        if stops.stopped:
            result["finish_reason"] = "stop"
        else:
            emit(*self._last_step(stops.flush(), result))
        return result

    @staticmethod
    def _last_step(tail: str, result: dict) -> tuple[str, None, list[TokenStep]]:
        """emit()'s arguments for the held-back text the end releases, with the stop token that ended the
        generation (which no text shows) as its step where one did."""
        token = result.get("stop_token")
        if token is None:
            return tail, None, [TokenStep(tail, None, None, None, False)] if tail else []
        return tail, None, [TokenStep(tail, token, *_raw_logprobs_at(result.get("stop_logprobs"), 0), False)]

    def _report_drafter_acceptance(self, timings: dict) -> None:
        """Once, after the first generation that drafted: the mismatched drafter's measured acceptance."""
        if self._drafter_mismatch and timings.get("draft_n", 0) > 0:
            accepted, drafted = timings["draft_n_accepted"], timings["draft_n"]
            logger.warning("%s: %d of its %d drafts were accepted (%.0f%%) in its first generation here",
                           self.draft_model_path, accepted, drafted, 100.0 * accepted / drafted)
            self._drafter_mismatch = None

    def abort(self) -> None:
        """Stop the generation in progress on this Model (callable from any thread): it ends within one round
        (a verify or a prefill micro-batch), with finish_reason "abort" and the text committed so far."""
        session = self._session
        if session is not None:
            self._cancelled.set()
            session.abort()

    # ---- lifetime ----
    def _check_open(self) -> None:
        if self._session is None:
            raise RuntimeError("this Model is closed")

    def close(self) -> None:
        """Free this session (the weights go with the last session over them). A generation in progress on it
        (another thread's, a stream's) is aborted and ends within one round before the session goes."""
        for other in self.__dict__.pop("_batch_sessions", []):
            other.close()
        if getattr(self, "_session", None) is None:
            return
        self.abort()
        with self._lock:
            self._session = None
            self._draft = None
            self._ngram = None
            self._mtp = None
            self._model = None

    def __reduce__(self):
        # (llama-cpp-python reloads its Llama from the path when unpickled; a copy here would lose the session)
        raise TypeError(f"a Model ({self.model_path}) cannot be pickled: it holds loaded weights and a session; pass "
                        f"its path and arguments, and load it where it is needed")

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
