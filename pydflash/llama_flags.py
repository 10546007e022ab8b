"""llama.cpp's command-line spellings, beyond the names the commands share with it (cli.py): flags that mean the
same here in another form (--spec-type, -n -1, -c 0, -ub, -to, --api-key lists), flags accepted because they say
what pydflash always does (--jinja, -fa, --no-mmap, -cb), and flags with no counterpart here, refused with what
to use instead. Without the last, argparse would read an unknown short flag as a known one with its value
attached (-fa as -f a, -mg 0 as -m g) and fail far from the cause."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# llama.cpp's --spec-type names and the proposer each is here ("none": no speculation)
SPEC_TYPES = {"draft-dflash": "dflash", "draft-mtp": "mtp", "ngram-simple": "ngram", "ngram-map-k": "ngram",
              "ngram-map-k4v": "ngram", "ngram-mod": "ngram", "ngram-cache": "ngram", "none": None}
NOT_SPEC_TYPES = {"draft-simple": "a small language model as drafter is not supported here (a DFlash drafter with -md "
                                  "is, and --spec-type draft-mtp)",
                  "draft-eagle3": "EAGLE-3 drafters are not supported here",
                  "draft-dspark": "DSpark drafters are not supported here"}

# (flags, takes a value, what to do instead) for llama.cpp's flags that have no counterpart in any command here
_REFUSED_EVERYWHERE = [
    (("-mg", "--main-gpu"), True, "-ts/--tensor-split sets each device's share of the -ngl layers"),
    (("-sm", "--split-mode"), True, "layers are split across devices by -ts/--tensor-split; rows are not split"),
    (("-tb", "--threads-batch"), True, "one pool of -t threads evaluates prompts and generates alike"),
    (("-nkvo", "--no-kv-offload"), False, "each layer's KV cache lives where -ngl puts the layer"),
    (("-ot", "--override-tensor"), True, "-ncmoe/--n-cpu-moe N (or -cmoe) keeps MoE experts in system memory"),
    (("-hf", "-hfr", "--hf-repo"), True, "pydflash downloads nothing: give the GGUF's path"),
    (("--lora",), True, "LoRA adapters are not supported"),
    (("--mirostat", "--samplers", "--sampling-seq"), True,
     "the samplers are llama.cpp's default chain (top-k, typical, top-p, min-p, temperature)"),
    (("-dev", "--device"), True, "-ngl offloads to the GPU (or the first --rpc server); -ts splits across devices"),
    (("-cnv", "--conversation", "-no-cnv", "--no-conversation", "-st", "--single-turn"), False,
     "`pydflash chat` is the conversation, `pydflash run` one continuation"),
    (("--no-jinja",), False,
     "chat templates are always rendered with Jinja here (serve: --chat-format chatml for ChatML)"),
]
_REFUSED_IN_SERVE = [
    (("-nocb", "--no-cont-batching"), False, "slots generating at the same time are always batched"),
    (("--ssl-key-file", "--ssl-cert-file"), True, "serve plain HTTP behind a TLS proxy"),
    (("--embedding", "--embeddings", "--reranking", "--rerank"), False, "pydflash serves completions only"),
    (("--path",), True, "pydflash serves no web UI"),
    (("--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file"), True,
     "each request's grammar, json_schema or response_format constrains it"),
]


class _Refuse(argparse.Action):
    """Records a flag with no counterpart here; reconcile() refuses it by name (a one-line error, exit 1)."""

    def __init__(self, option_strings, dest, instead: str = "", takes_value: bool = True, **kwargs):
        self.instead = instead
        kwargs.pop("default", None)  # (the parser's set_defaults(refused=None))
        super().__init__(option_strings, dest, nargs="?" if takes_value else 0, default=None,
                         help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if namespace.refused is None:
            namespace.refused = f"{option_string} is llama.cpp's, with no counterpart here: {self.instead}"


def _add_refused(p: argparse.ArgumentParser, table) -> None:
    p.set_defaults(refused=None)
    for flags, takes_value, instead in table:
        p.add_argument(*flags, dest="refused", action=_Refuse, instead=instead, takes_value=takes_value)


def _on_off_auto(text: str) -> str:
    if text not in ("on", "off", "auto"):
        raise argparse.ArgumentTypeError(f"expected on, off or auto, got {text!r}")
    return text


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every command that opens a model (run, generate, chat, bench, serve)."""
    p.add_argument("-ub", "--ubatch-size", "--n-ubatch", dest="n_ubatch", type=int, default=None, metavar="N",
                   help="prefill micro-batch (default: the fastest on this machine, measured at the first long "
                        "prompt)")
    p.add_argument("-b", "--batch-size", dest="n_batch", type=int, default=None, metavar="N",
                   help="llama.cpp's logical batch: serve's /infill cuts its prefix and suffix to it (2048 by "
                        "default); prompts are evaluated in -ub micro-batches here")
    p.add_argument("--spec-type", default=None, metavar="TYPES",
                   help="llama.cpp's speculation types, comma-separated: draft-dflash (with -md), draft-mtp, "
                        "ngram-* (prompt lookup), none; the same as --proposers dflash / mtp / ngram")
    p.add_argument("-fa", "--flash-attn", type=_on_off_auto, default=None, metavar="on|off|auto",
                   help="accepted: pydflash chooses the attention kernel by the attended window")
    p.add_argument("--jinja", action="store_true", help="accepted: chat templates are always rendered with Jinja")
    p.add_argument("--no-mmap", action="store_true", help="accepted: weights are always read into memory")
    p.add_argument("--log-disable", action="store_true",
                   help="llama.cpp's: serve writes no start or request lines (warnings and errors still); the other "
                        "commands log only warnings unless -v")
    _add_refused(p, _REFUSED_EVERYWHERE)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """run, generate and bench: llama-cli's --ignore-eos; run and generate: its escapes in the prompt."""
    p.add_argument("--ignore-eos", action="store_true",
                   help="never stop at an end-of-generation token (those tokens are banned), as llama.cpp's")


def add_escape_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-e", "--escape", dest="escape", action="store_true", default=True,
                   help="read \\n, \\r, \\t, \\', \\\", \\\\ and \\xHH in the prompt (-p, -f) as the characters "
                        "they stand for, as llama.cpp does (the default)")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take the prompt's backslashes as "
                                                                            "they are")


_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}


def process_escapes(text: str) -> str:
    """llama.cpp's escapes in a prompt (common.cpp string_process_escapes): \\n, \\r, \\t, \\', \\", \\\\ and
    \\xHH (a byte); any other backslash stays as it is. Bytes that \\xHH makes into invalid UTF-8 become U+FFFD."""
    raw, out, i = text.encode("utf-8"), bytearray(), 0
    while i < len(raw):
        if raw[i] == ord("\\") and i + 1 < len(raw):
            code = raw[i + 1]
            if code in _ESCAPES:
                out += _ESCAPES[code]
                i += 2
                continue
            digits = raw[i + 2:i + 4]
            if code == ord("x") and len(digits) == 2 and all(chr(c) in "0123456789abcdefABCDEF" for c in digits):
                out.append(int(digits, 16))
                i += 4
                continue
            out += raw[i:i + 2]
            i += 2
            continue
        out.append(raw[i])
        i += 1
    return out.decode("utf-8", errors="replace")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """llama-server's flags for serve beyond the model's."""
    p.add_argument("--api-key-file", default=None, metavar="FNAME",
                   help="a file of API keys, one per line ('#' lines are comments), as llama-server's")
    p.add_argument("-to", "--timeout", dest="read_timeout", type=float, default=30.0, metavar="SECONDS",
                   help="seconds a request body may take to arrive (408 after; llama-server's read timeout)")
    p.add_argument("--read-timeout", dest="read_timeout", type=float, help=argparse.SUPPRESS)
    p.add_argument("-cb", "--cont-batching", action="store_true",
                   help="accepted: slots generating at the same time are always batched")
    p.add_argument("--chat-template", default=None, metavar="JINJA_TEMPLATE",
                   help="a Jinja chat template's text, or a built-in template's name (chatml), for every chat")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="the template's arguments for every chat a request does not set, e.g. "
                        "'{\"enable_thinking\": false}'")
    p.add_argument("-rea", "--reasoning", type=_on_off_auto, default="auto", metavar="on|off|auto",
                   help="thinking on or off for chats that do not set enable_thinking (auto: the template's "
                        "default)")
    _add_refused(p, _REFUSED_IN_SERVE)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def reconcile(args: argparse.Namespace) -> None:
    """The llama.cpp spellings of a parsed command line as pydflash's options (a ValueError naming the flag where
    one is refused or out of range)."""
    if getattr(args, "refused", None):
        raise ValueError(args.refused)
    draft = getattr(args, "draft", None)
    if draft is not None and draft.isdigit() and not Path(draft).exists():
        raise ValueError(f"--draft {draft}: no such file; --draft is the draft model here (llama.cpp's older "
                         f"--draft N, drafts a round, is --spec-draft-n-max N)")
    if getattr(args, "spec_type", None) is not None:
        args.proposers = _spec_type(args.spec_type, args.proposers)
    for flag, name in (("-ub/--ubatch-size", "n_ubatch"), ("-b/--batch-size", "n_batch")):
        value = getattr(args, name, None)
        if isinstance(value, int) and value < 1:  # (plan's -ub may be "auto")
            raise ValueError(f"{flag} = {value}, expected at least 1")
    if hasattr(args, "max_tokens") and args.max_tokens is not None and args.max_tokens < 0:
        if args.max_tokens != -1:
            raise ValueError(f"-n/--predict = {args.max_tokens}, expected a count >= 0, or -1 (until the end of the "
                             f"text or the context)")
        args.max_tokens = None
    if getattr(args, "n_ctx", None) is not None and args.n_ctx < 0:
        raise ValueError(f"-c/--ctx-size = {args.n_ctx}, expected a size >= 1, or 0 (the model's trained context)")
    if getattr(args, "read_timeout", None) is not None and not args.read_timeout > 0:
        raise ValueError(f"-to/--timeout = {args.read_timeout:g}, expected seconds > 0")
    if hasattr(args, "api_key_file"):
        args.api_keys = api_keys(args.api_key, args.api_key_file)
    _shared_spellings(args)


def _shared_spellings(args: argparse.Namespace) -> None:
    """Reconciles llama.cpp's spellings with ours after parsing (a ValueError naming both when they disagree):
    -m with the positional model, -ctk / -ctv with --kv-type, --spec-draft-n-max with --block-size."""
    if hasattr(args, "model_option"):
        if args.model is not None and args.model_option is not None and args.model != args.model_option:
            raise ValueError(f"two models: {args.model!r} and -m {args.model_option!r}")
        args.model = args.model if args.model is not None else args.model_option
        if args.model is None:
            raise ValueError("no model: pass the GGUF's path (or -m FNAME)")
    if hasattr(args, "cache_type_k"):
        # llama.cpp's default for each is f16; one type for both here
        k = args.cache_type_k or args.kv_type or "f16"
        v = args.cache_type_v or args.kv_type or "f16"
        given = {name: value for name, value in (("--kv-type", args.kv_type), ("-ctk", args.cache_type_k),
                                                 ("-ctv", args.cache_type_v)) if value is not None}
        if len(given) == 1 and k != v:
            (name, value), = given.items()
            raise ValueError(f"{name} {value} alone: the K and V caches share one type here, and llama.cpp's default "
                             f"for the other is f16: give -ctk {value} -ctv {value}, or --kv-type {value}")
        if len(set(given.values())) > 1:
            shown = ", ".join(f"{name} {value}" for name, value in given.items())
            raise ValueError(f"{shown} disagree: the K and V caches share one type here: give -ctk and -ctv the "
                             f"same type, or --kv-type alone")
        args.kv_type = k
    if getattr(args, "spec_draft_n_max", None) is not None:
        n = args.spec_draft_n_max
        if n < 1:
            raise ValueError(f"--spec-draft-n-max must be at least 1, got {n}")
        if args.block_size is not None and args.block_size != n + 1:
            raise ValueError(f"--spec-draft-n-max {n} drafts {n} tokens a round (block size {n + 1}), but "
                             f"--block-size is {args.block_size}")
        args.block_size = n + 1


def _spec_type(text: str, proposers: tuple[str, ...] | None) -> tuple[str, ...]:
    """The proposers that --spec-type's comma-separated names mean (none: no proposer, plain decoding)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name in NOT_SPEC_TYPES:
            raise ValueError(f"--spec-type {name}: {NOT_SPEC_TYPES[name]}")
        if name not in SPEC_TYPES:
            raise ValueError(f"--spec-type {name!r}, expected one of {', '.join(SPEC_TYPES)}")
    chosen = tuple(dict.fromkeys(SPEC_TYPES[n] for n in names if SPEC_TYPES[n]))
    if not names or "none" in names and chosen:
        raise ValueError(f"--spec-type {text!r}: expected none, or speculation types")
    if proposers is not None and sorted(proposers) != sorted(chosen):
        raise ValueError(f"--spec-type {text} means --proposers {','.join(chosen) or '(none)'}, but --proposers is "
                         f"{','.join(proposers)}")
    return chosen


def api_keys(api_key: str | None, key_file: str | None) -> list[str]:
    """llama-server's keys: --api-key's comma-separated list and --api-key-file's lines ('#' lines skipped)."""
    keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {key_file}: cannot be read ({e})") from None
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {key_file}: holds no key")
    return keys
