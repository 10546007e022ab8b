"""The `pydflash` command:

    pydflash demo                                   speculative vs plain decoding on the embedded trained pair
    pydflash run MODEL.gguf -p "prompt" [--draft D] one continuation, streamed (sampling flags as llama.cpp's)
    pydflash chat MODEL.gguf [--draft D]            an interactive chat in the terminal (/reset, Ctrl-C stops
                                                    the answer being written)
    pydflash bench MODEL.gguf [--draft D]           plain vs speculative decoding on built-in prompts
    pydflash serve MODEL.gguf [--draft D]           an OpenAI-compatible server (pip install "pydflash[server]")
    pydflash plan MODEL.gguf [--draft D] [--vram 24GiB] [--json]
                                                    the memory a configuration needs per device, and whether
                                                    it fits (from the GGUFs' metadata; nothing is loaded)

`pydflash generate MODEL PROMPT` is `run` with the prompt as a positional argument (the older spelling).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import statistics
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, TextIO

from . import llama_flags
from .style import Style


def _open_model(args: argparse.Namespace):
    from .model import Model

    return Model(args.model, n_ctx=args.n_ctx, n_threads=args.threads, kv_type=args.kv_type,
                 n_ubatch=args.n_ubatch or "auto", n_gpu_layers=args.n_gpu_layers, n_cpu_moe=args.n_cpu_moe,
                 tensor_split=args.tensor_split, rpc_servers=args.rpc, proposers=args.proposers,
                 draft_model_path=args.draft, block_size=args.block_size, spec_mode=args.spec_mode,
                 tree_budget=args.tree_budget, verbose=args.verbose, progress=True)


# the sampling flags (_sampling_arguments) and Model's parameter each sets
_SAMPLING_FLAGS = dict(temp="temperature", top_k="top_k", top_p="top_p", min_p="min_p", typical="typical_p",
                       repeat_penalty="repeat_penalty", presence_penalty="presence_penalty",
                       frequency_penalty="frequency_penalty", repeat_last_n="repeat_last_n", seed="seed")


def _sampling(args: argparse.Namespace, model=None) -> dict:
    """Model's sampling arguments from the flags (serve: the ones given); --ignore-eos bans `model`'s
    end-of-generation tokens."""
    out = {name: getattr(args, flag) for flag, name in _SAMPLING_FLAGS.items() if getattr(args, flag) is not None}
    if getattr(args, "ignore_eos", False) and model is not None:
        out["logit_bias"] = {t: float("-inf") for t in model.tokenizer.eog_token_ids}
    grammar = _grammar(args)
    if grammar is not None:
        out["grammar"] = grammar
    return out


def _grammar(args: argparse.Namespace):
    """The Grammar of --grammar, --grammar-file, --json-schema or --json-schema-file (at most one), or None."""
    given = [(flag, getattr(args, name, None)) for flag, name in (("--grammar", "grammar"),
                                                                  ("--grammar-file", "grammar_file"),
                                                                  ("--json-schema", "json_schema"),
                                                                  ("--json-schema-file", "json_schema_file"))]
    given = [(flag, value) for flag, value in given if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"two grammars: {' and '.join(flag for flag, _ in given)}")
    flag, value = given[0]
    if flag.endswith("-file"):
        try:
            value = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {value}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    from .grammar import Grammar

    return Grammar.from_gbnf(value) if flag.startswith("--grammar") else Grammar.from_json_schema(value)


def _prompt(args: argparse.Namespace) -> str:
    """The text to continue: -p, -f FNAME or generate's positional prompt (one of them)."""
    given = [name for name, value in (("-p", args.prompt), ("-f", args.prompt_file), ("the prompt argument",
                                                                                       args.prompt_text))
             if value is not None]
    if len(given) > 1:
        raise ValueError(f"two prompts: {' and '.join(given)}")
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the prompt file {args.prompt_file}: {getattr(e, 'strerror', None) or e}") \
                from None
        text = text[:-1] if text.endswith("\n") else text
    else:
        text = args.prompt if args.prompt is not None else args.prompt_text
    if text is None:
        raise ValueError("no prompt: pass -p TEXT (or -f FNAME)")
    return llama_flags.process_escapes(text) if args.escape else text


def _run(args: argparse.Namespace) -> int:
    prompt = _prompt(args)
    with _open_model(args) as model:
        pieces = model.pieces(prompt, args.max_tokens, **_sampling(args, model))
        for text, _ in pieces:
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        c = pieces.completion
        t = c.timings
        if c.finish_reason == "length" and t["prompt_n"] + t["cached_n"] + len(c.tokens) >= model.n_ctx:
            print(f"pydflash: warning: generation stopped at the end of the context (n_ctx = {model.n_ctx})",
                  file=sys.stderr)
    return 0


def chat_loop(model, read: Callable[[str], str], out: TextIO, *, sampling: dict, max_tokens: int | None,
              system: str | None = None, chat_template_kwargs: dict | None = None) -> None:
    """The interactive chat: read() a line per turn ('/reset' forgets the conversation, '/exit' or end of input
    leaves), the answer streamed to `out` (reasoning dimmed on a terminal). Ctrl-C while an answer is being
    written stops that answer only (what was written stays in the history); at the prompt it leaves."""
    style = Style(out)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = read(style.bold("> "))
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = history[:1] if system else []
            out.write("(conversation reset)\n")
            continue
        history.append({"role": "user", "content": line})
        answer, finish = "", None
        chunks = model.create_chat_completion(history, stream=True, max_tokens=max_tokens,
                                              chat_template_kwargs=chat_template_kwargs, **sampling)
        try:
            for chunk in chunks:
                if not chunk["choices"]:
                    continue
                delta = chunk["choices"][0]["delta"]
                finish = chunk["choices"][0]["finish_reason"] or finish
                if delta.get("reasoning_content"):
                    out.write(style.dim(delta["reasoning_content"]))
                if delta.get("content"):
                    answer += delta["content"]
                    out.write(delta["content"])
                out.flush()
        except KeyboardInterrupt:
            chunks.close()  # aborts the generation
            finish = "interrupted"
            out.write(style.dim(" [stopped]"))
        out.write("\n")
        if finish == "length" and max_tokens is None:
            out.write(style.dim(f"(the context of {model.n_ctx} tokens is full: /reset to go on)") + "\n")
        history.append({"role": "assistant", "content": answer})


@contextlib.contextmanager
def _ctrl_c_interrupts() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt while chatting on a terminal, also in a process that started with SIGINT
    ignored (as a shell without job control starts a background command, and so its children): the chat's
    terminal is its own, and Ctrl-C there is how its user stops an answer."""
    if not sys.stdin.isatty() or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _chat(args: argparse.Namespace) -> int:
    with _open_model(args) as model, _ctrl_c_interrupts():
        kwargs = {"enable_thinking": False} if args.no_think else None
        chat_loop(model, input, sys.stdout, sampling=_sampling(args), max_tokens=args.max_tokens,
                  system=args.system, chat_template_kwargs=kwargs)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .demo_pair import demo_prompts

    if args.n_prompts < 1:
        raise ValueError(f"--n-prompts = {args.n_prompts}, expected at least 1")
    prompts = demo_prompts()[: args.n_prompts]
    with _open_model(args) as model:
        model.generate(prompts[0], max_tokens=8, speculative=False)  # warm-up: pages, graphs
        if model.proposers:
            model.generate(prompts[0], max_tokens=8)  # and the proposer's (auto's calibration)
        modes = [("plain", False)] + ([("speculative", True)] if model.proposers else [])
        rows = {name: {"tokens": 0, "ms": 0.0, "tau": []} for name, _ in modes}
        for prompt in prompts:
            for name, speculative in modes:  # interleaved
                c = model.generate(prompt, max_tokens=args.max_tokens, speculative=speculative,
                                   **_sampling(args, model))
                rows[name]["tokens"] += max(0, len(c.tokens) - 1)  # the first comes from the prompt pass
                rows[name]["ms"] += c.timings["predicted_ms"]
                if c.timings.get("n_rounds"):
                    rows[name]["tau"].append(c.timings["tau"])
    plain = 1000.0 * rows["plain"]["tokens"] / rows["plain"]["ms"] if rows["plain"]["ms"] else 0.0
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, temperature {args.temp}")
    print(f"{'mode':<12} {'tok/s':>9} {'tau':>6} {'/ plain':>8}")
    for name, r in rows.items():
        tps = 1000.0 * r["tokens"] / r["ms"] if r["ms"] else 0.0
        tau = f"{statistics.mean(r['tau']):.2f}" if r["tau"] else "-"
        print(f"{name:<12} {tps:9.1f} {tau:>6} {tps / plain if plain else 0.0:8.2f}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from .server import serve
    except ImportError as e:
        raise ValueError(str(e)) from None
    if args.parallel < 1:
        raise ValueError(f"--parallel must be at least 1, got {args.parallel}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be at least 0, got {args.max_queue}")
    template, chat_format = _server_template(args)
    if args.parallel > 1:
        _refuse_parallel_if_short(args)
    with _open_model(args) as model:
        serve(model, host=args.host, port=args.port, parallel=args.parallel, api_key=args.api_keys or None,
              alias=args.alias, max_queue=args.max_queue, read_timeout=args.read_timeout, chat_template=template,
              chat_format=chat_format, metrics=args.metrics, slots_endpoint=not args.no_slots,
              defaults=_request_defaults(args), log_level="warning" if args.log_disable else "info",
              **({"n_batch": args.n_batch} if args.n_batch is not None else {}))
    return 0


def _request_defaults(args: argparse.Namespace) -> dict:
    """What a request that does not say gets from serve's flags, as llama-server's: -n, the sampling flags given,
    --chat-template-kwargs and --reasoning."""
    defaults = _sampling(args)
    if args.max_tokens is not None:
        defaults["max_tokens"] = args.max_tokens
    kwargs = dict(args.chat_template_kwargs or {})
    if args.reasoning != "auto":
        kwargs.setdefault("enable_thinking", args.reasoning == "on")
    if kwargs:
        defaults["chat_template_kwargs"] = kwargs
    return defaults


def _server_template(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(template text, chat format) from --chat-template-file, --chat-template (a text or a built-in name) and
    --chat-format, one of them, checked before the model loads."""
    from .completions import CHAT_FORMATS

    given = [flag for flag, value in (("--chat-template-file", args.chat_template_file), ("--chat-template",
                                      args.chat_template), ("--chat-format", args.chat_format)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of {' and '.join(given)}")
    if args.chat_template is not None:
        if args.chat_template in CHAT_FORMATS:
            return None, args.chat_template
        return args.chat_template, None
    return _chat_template_file(args.chat_template_file, args.chat_format), args.chat_format


def _refuse_parallel_if_short(args: argparse.Namespace) -> None:
    """`serve --parallel N`: the plan of N sessions over one copy of the weights (pydflash.plan(parallel=N)) must
    fit, or nothing loads (the Model itself plans one session)."""
    from . import _core
    from .errors import InsufficientMemoryError
    from .memory_plan import plan

    memory = plan(args.model, args.draft, n_ctx=args.n_ctx, kv_type=args.kv_type,
                  n_gpu_layers=_core.usable_gpu_layers(args.n_gpu_layers), n_cpu_moe=args.n_cpu_moe,
                  tensor_split=args.tensor_split, rpc_servers=args.rpc, proposers=args.proposers,
                  spec_mode=args.spec_mode, block_size=args.block_size, tree_budget=args.tree_budget,
                  parallel=args.parallel, suggest=False, sweep=False)
    if memory.fits is False:
        short = ", ".join(f"{d.upper()} needs {memory.needed(d) / 2**20:.1f} MiB, {memory.budget[d] / 2**20:.1f} MiB "
                          f"available ({n / 2**20:.1f} MiB short)" for d, n in memory.shortfall().items())
        raise InsufficientMemoryError(f"{args.model}: --parallel {args.parallel} sessions do not fit: {short}; fewer "
                                      f"slots or a smaller -c would (pydflash plan --parallel N shows each part)",
                                      memory)


def _chat_template_file(path: str | None, chat_format: str | None) -> str | None:
    """--chat-template-file's text, checked with --chat-format before the model loads."""
    from .completions import check_chat_format

    if chat_format is not None:
        check_chat_format(chat_format, "--chat-format")
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template-file {path}: cannot be read ({e})") from None


def _plan(args: argparse.Namespace) -> int:
    import json

    from .memory_plan import plan

    memory = plan(args.model, args.draft, n_ctx=args.n_ctx, kv_type=args.kv_type, n_gpu_layers=args.n_gpu_layers,
                  n_cpu_moe=args.n_cpu_moe, tensor_split=args.tensor_split, rpc_servers=args.rpc,
                  proposers=args.proposers, n_ubatch=args.n_ubatch, spec_mode=args.spec_mode,
                  block_size=args.block_size, tree_budget=args.tree_budget, draft_window=args.draft_window,
                  vram=args.vram, ram=args.ram, largest=args.largest, parallel=args.parallel)
    if args.json:
        print(json.dumps(memory.as_dict(), indent=2))
    else:
        c = memory.config
        print(f"{c['model_path']}" + (f" + {c['draft_model_path']}" if c["draft_model_path"] else "") +
              f": n_ctx {c['n_ctx']}, kv {c['kv_type']}, n_gpu_layers {c['n_gpu_layers']}"
              + (f", n_cpu_moe {c['n_cpu_moe']}" if c["n_cpu_moe"] else "") + f", n_ubatch {c['n_ubatch']}"
              + (f", {'/'.join(c['proposers'])} {c['spec_mode']} (block {c['block_size']}, tree budget "
                 f"{c['tree_budget']})" if c["proposers"] else "") + (f", {c['parallel']} sessions in parallel"
                                                                      if c["parallel"] > 1 else ""))
        print(memory.table())
    return 0 if memory.fits is not False else 2


def _rpc_server(args: argparse.Namespace) -> int:
    from .rpc import serve

    serve(args.host, args.port, args.threads or os.cpu_count() or 1, args.device)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .demo_pair import demo_prompts

    if args.n_prompts < 1:
        raise ValueError(f"--n-prompts must be at least 1, got {args.n_prompts}")
    prompts = [args.prompt] if args.prompt else demo_prompts()[: args.n_prompts]
    # the identity of the outputs is printed; it is a demonstration, not a test (tests/test_pairs.py)
    run_demo(prompts, max_tokens=args.max_tokens, n_threads=args.threads, block_size=args.block_size,
             realistic=not args.tiny_only, cache=args.cache_dir)
    return 0


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {port}")
    return port


def _int_or_auto(text: str):
    return text if text == "auto" else int(text)


def _proportions(text: str) -> list[float]:
    """llama.cpp's --tensor-split value: proportions separated by ',' or '/', e.g. 3,1"""
    try:
        return [float(v) for v in re.split(r"[,/]+", text.strip()) if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected proportions such as 3,1, got {text!r}") from None


def _placement_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's flags for where the layers go beyond -ngl: a MoE target's experts in system memory (the rest
    of each layer where -ngl puts it), the split over GPU devices, RPC servers as devices."""
    moe = p.add_mutually_exclusive_group()
    moe.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0, metavar="N",
                     help="keep the experts of the first N layers in system memory (MoE targets)")
    moe.add_argument("-cmoe", "--cpu-moe", dest="n_cpu_moe", action="store_const", const=-1,
                     help="keep every layer's experts in system memory (MoE targets)")
    p.add_argument("-ts", "--tensor-split", type=_proportions, default=None, metavar="N0,N1,...",
                   help="proportions of the -ngl layers for each GPU device in order (local GPUs, then --rpc "
                        "servers), e.g. 3,1 (default: by free memory)")
    p.add_argument("--rpc", default=None, metavar="SERVERS",
                   help="comma-separated host:port of pydflash rpc-servers to offload -ngl layers to")


def _proposers_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proposers", type=lambda text: tuple(x.strip() for x in text.split(",") if x.strip()),
                   default=None, metavar="NAMES",
                   help="what drafts each round: dflash (the default with --draft), ngram (prompt lookup: what "
                        "followed earlier occurrences of the last tokens; no draft model needed), mtp (the model's "
                        "own multi-token-prediction head, the default without --draft where the GGUF has one), or "
                        "two or three of them, e.g. dflash,ngram,mtp (merged in one tree each round; --spec-mode "
                        "auto, which also chooses which models run)")


def _model_arguments(p: argparse.ArgumentParser, *, max_tokens: int | None, model_option: bool = True) -> None:
    """Model's arguments, under llama.cpp's names too (-m, --ctx-size, --predict, -ctk/-ctv, --model-draft,
    --spec-draft-n-max; llama_flags.reconcile reconciles them)."""
    _model_file_arguments(p, model_option)
    p.add_argument("-n", "--max-tokens", "--predict", "--n-predict", dest="max_tokens", type=int, default=max_tokens)
    p.add_argument("-c", "--n-ctx", "--ctx-size", dest="n_ctx", type=int, default=4096)
    p.add_argument("-t", "--threads", type=int, default=None)
    _kv_type_arguments(p)
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=int, default=0)
    _placement_arguments(p)
    _draft_arguments(p)
    p.add_argument("--spec-mode", choices=("auto", "tree", "chain"), default="auto",
                   help="with a draft: choose per round (auto), DDTree trees, or DFlash chains")
    p.add_argument("--tree-budget", type=int, default=None, help="draft nodes a tree verifies (tree: per round, "
                                                                  "auto: at most)")
    p.add_argument("-v", "--verbose", action="store_true")
    llama_flags.add_model_flags(p)


def _model_file_arguments(p: argparse.ArgumentParser, model_option: bool) -> None:
    # (`generate MODEL PROMPT` keeps its model positional and required: with an optional one, argparse would
    # take a lone positional for the prompt)
    p.add_argument("model", nargs="?" if model_option else None, default=None,
                   help="path to a qwen3 / qwen35 / qwen3moe / qwen35moe GGUF")
    if model_option:
        p.add_argument("-m", "--model", dest="model_option", default=None, metavar="FNAME",
                       help="the model, as llama.cpp's -m (instead of the positional argument)")


def _kv_type_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-type", default=None,
                   help="the K and V cache type: f32, f16 (default), bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl")
    p.add_argument("-ctk", "--cache-type-k", default=None, metavar="TYPE",
                   help="llama.cpp's K cache type (K and V share one type here: give -ctv the same)")
    p.add_argument("-ctv", "--cache-type-v", default=None, metavar="TYPE", help="llama.cpp's V cache type")


def _draft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-md", "--draft", "--model-draft", "--spec-draft-model", dest="draft", default=None,
                   help="a dflash draft GGUF for speculative decoding")
    _proposers_argument(p)
    p.add_argument("--block-size", type=int, default=None, help="tokens a round verifies: the anchor and its drafts")
    p.add_argument("--spec-draft-n-max", type=int, default=None, metavar="N",
                   help="llama.cpp's drafts per round: the same as --block-size N+1")


def _sampling_arguments(p: argparse.ArgumentParser, temp: float | None) -> None:
    """The sampling flags with llama-cpp-python's defaults (temp: the command's), or (temp None: serve) none, a
    request's own values or the API's defaults applying where a flag is not given."""
    given = temp is not None
    samp = p.add_argument_group("sampling (llama.cpp's flags and order; the defaults are llama-cpp-python's)"
                                if given else "sampling: the defaults of requests that do not set them")
    samp.add_argument("--temp", "--temperature", dest="temp", type=float, default=temp,
                      help=f"temperature (0: greedy; default {temp})" if given else "temperature (0: greedy)")
    for flags, kind, default, text in ((("--top-k",), int, 40, "0: off"), (("--top-p",), float, 0.95, "1: off"),
                                       (("--min-p",), float, 0.05, "0: off"),
                                       (("--typical",), float, 1.0, "typical-p (1: off)"),
                                       (("--repeat-penalty",), float, 1.0, "1: off"),
                                       (("--presence-penalty",), float, 0.0, None),
                                       (("--frequency-penalty",), float, 0.0, None),
                                       (("--repeat-last-n",), int, 64, "tokens the penalties look at (-1: all)")):
        samp.add_argument(*flags, type=kind, default=default if given else None, help=text)
    samp.add_argument("-s", "--seed", type=int, default=None, help="a seed makes sampling reproducible")
    if given:  # (llama.cpp's grammar flags; a server's requests bring their own grammar)
        samp.add_argument("--grammar", default=None, help="a GBNF grammar the output must follow")
        samp.add_argument("--grammar-file", default=None, metavar="FNAME", help="--grammar from a file")
        samp.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                          help="a JSON schema the output must follow (JSON text)")
        samp.add_argument("-jf", "--json-schema-file", default=None, metavar="FILE", help="--json-schema from a file")


def _add_plan_command(sub) -> None:
    """`pydflash plan`: Model's arguments, the budgets to fit, --largest and --json."""
    plan_cmd = sub.add_parser("plan", help="the memory a configuration needs on each device and whether it fits "
                                           "(the GGUFs' metadata only: tensor data may be absent)")
    _model_file_arguments(plan_cmd, model_option=True)
    _draft_arguments(plan_cmd)
    plan_cmd.add_argument("-c", "--n-ctx", "--ctx-size", dest="n_ctx", type=int, default=4096)
    _kv_type_arguments(plan_cmd)
    plan_cmd.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=int, default=0,
                          help="-1: all layers and the head")
    _placement_arguments(plan_cmd)
    plan_cmd.add_argument("-ub", "--n-ubatch", "--ubatch-size", dest="n_ubatch", type=_int_or_auto, default="auto",
                          help="prefill micro-batch (default auto: the largest Model may choose)")
    plan_cmd.add_argument("--spec-mode", choices=("auto", "tree", "chain"), default="auto")
    plan_cmd.add_argument("--tree-budget", type=int, default=None)
    plan_cmd.add_argument("--draft-window", type=int, default=4096)
    plan_cmd.add_argument("--vram", default=None, help="GPU memory to fit in, e.g. 24GiB (default: the GPU's free "
                                                       "memory, when this machine has one)")
    plan_cmd.add_argument("--ram", default=None, help="system memory to fit in (default: what is available)")
    plan_cmd.add_argument("-np", "--parallel", type=int, default=1,
                          help="sessions serving at once over one copy of the weights (serve --parallel)")
    plan_cmd.add_argument("--largest", action="store_true",
                          help="when it fits, also find the largest context and tree budget that would")
    plan_cmd.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    plan_cmd.set_defaults(func=_plan)


class _Parser(argparse.ArgumentParser):
    """A command's parser: no abbreviated long flags either."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: llama.cpp's --chat-template must not be read as --chat-template-file
    parser = argparse.ArgumentParser(prog="pydflash", description="DFlash speculative decoding on GGUF models",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text in (("run", "one continuation of a prompt, streamed"),
                            ("generate", "the same as run, the prompt as a positional argument")):
        run = sub.add_parser(name, help=help_text)
        _model_arguments(run, max_tokens=128, model_option=name == "run")
        if name == "generate":
            run.add_argument("prompt_text", metavar="prompt")
        run.add_argument("-p", "--prompt", default=None, help="the text to continue")
        run.add_argument("-f", "--file", dest="prompt_file", default=None, metavar="FNAME",
                         help="a file holding the text to continue (as llama.cpp's: one final newline dropped)")
        _sampling_arguments(run, temp=0.0)
        llama_flags.add_run_flags(run)
        llama_flags.add_escape_flags(run)
        run.set_defaults(func=_run, **({"prompt_text": None} if name == "run" else {}))
    chat = sub.add_parser("chat", help="an interactive chat in the terminal (/reset, /exit or /quit; Ctrl-C stops "
                                       "an answer)")
    _model_arguments(chat, max_tokens=None)
    chat.add_argument("-sys", "--system", "--system-prompt", dest="system", default=None, help="a system message")
    chat.add_argument("--no-think", action="store_true", help="thinking off (enable_thinking=False)")
    _sampling_arguments(chat, temp=0.7)
    chat.set_defaults(func=_chat)
    bench = sub.add_parser("bench", help="plain vs speculative decoding on built-in prompts")
    _model_arguments(bench, max_tokens=96)
    bench.add_argument("--n-prompts", type=int, default=4)
    _sampling_arguments(bench, temp=0.0)
    llama_flags.add_run_flags(bench)
    bench.set_defaults(func=_bench)
    serve = sub.add_parser("serve", help="an OpenAI-compatible server: /v1/chat/completions, /v1/completions, "
                                         "/v1/models, /health")
    _model_arguments(serve, max_tokens=None)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=_port, default=8080)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or X-Api-Key: KEY) "
                                                       "on /v1 requests; several keys comma-separated")
    serve.add_argument("-np", "--parallel", type=int, default=1,
                       help="requests served at once, each in a session of its own over one copy of the weights")
    serve.add_argument("--max-queue", type=int, default=16,
                       help="requests that may wait for a slot; more get 503 (default 16)")
    serve.add_argument("-a", "--alias", default=None, help="the model id clients see (default: the file name)")
    serve.add_argument("--chat-template-file", default=None, metavar="FILE",
                       help="a Jinja chat template to render every chat with, instead of the GGUF's own")
    serve.add_argument("--chat-format", default=None, metavar="NAME",
                       help="a built-in chat template to render every chat with: chatml")
    serve.add_argument("--metrics", action="store_true",
                       help="serve GET /metrics (Prometheus text, llama-server's metric names)")
    serve.add_argument("--no-slots", action="store_true", help="do not serve GET /slots (each slot's state)")
    llama_flags.add_serve_flags(serve)
    _sampling_arguments(serve, temp=None)
    serve.set_defaults(func=_serve)
    _add_plan_command(sub)
    rpc = sub.add_parser("rpc-server", help="serve this machine's GPU (else its CPU) as a device for models "
                                            "elsewhere (--rpc); unauthenticated: trusted networks only")
    rpc.add_argument("-H", "--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    rpc.add_argument("-p", "--port", type=_port, default=50052)
    rpc.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (a CPU device)")
    rpc.add_argument("-d", "--device", choices=("auto", "cpu", "gpu"), default="auto")
    rpc.set_defaults(func=_rpc_server)
    demo = sub.add_parser("demo", help="speculative vs plain decoding on the embedded trained pair (no download)")
    demo.add_argument("prompt", nargs="?", default=None, help="a prompt (default: held-out code prompts)")
    demo.add_argument("-n", "--max-tokens", type=int, default=128)
    demo.add_argument("-p", "--n-prompts", type=int, default=8, help="how many embedded prompts to run")
    demo.add_argument("-b", "--block-size", type=int, default=None)
    demo.add_argument("-t", "--threads", type=int, default=None)
    demo.add_argument("--tiny-only", action="store_true", help="skip the cost-realistic copy of the pair")
    demo.add_argument("--cache-dir", type=Path, default=None,
                      help="where the cost-realistic target is built (default: $PYDFLASH_CACHE, else "
                           "$XDG_CACHE_HOME/pydflash, else ~/.cache/pydflash)")
    demo.set_defaults(func=_demo)
    return parser


class _LibraryLogLine(logging.Handler):
    """The library's log lines written as the command's own messages ("pydflash: warning: ..."), to whatever
    sys.stderr is when each comes (Python's fallback would print the bare message)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"pydflash: {record.levelname.lower()}: {self.format(record)}", file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging's own rule: a failing handler reports, never raises)
            self.handleError(record)


@contextlib.contextmanager
def _library_log_on_stderr() -> Iterator[None]:
    """For the command's run, unless the "pydflash" logger already has a handler (an application's)."""
    library = logging.getLogger("pydflash")
    handler = None if library.handlers else _LibraryLogLine()
    if handler:
        library.addHandler(handler)
    try:
        yield
    finally:
        if handler:
            library.removeHandler(handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        llama_flags.reconcile(args)
        with _library_log_on_stderr():
            return args.func(args)
    except Exception as e:  # a clear one-line message instead of a traceback for user errors
        from .errors import PydflashError

        # OSError: an RPC server that cannot be reached, a port that cannot be listened on
        if isinstance(e, (PydflashError, ValueError, TypeError, OSError)):
            print(f"pydflash: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
