"""llama-server's fill-in-the-middle completion (`POST /infill`, llama.vscode's and other editors' code completion):
its request (/completion's fields and input_prefix, input_suffix, input_extra, a prompt that goes on from the
prefix) laid out as its repo-level FIM prompt (llama.cpp's tools/server/server-common.cpp format_prompt_infill,
after arXiv 2409.12186), then answered as /completion answers:

    [FIM_REP]myproject\\n [FIM_SEP]filename\\n extra chunk ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

The prefix keeps its last 3/4 of a batch (the server's n_batch, llama-server's -b, 2048 by default), the suffix
what fits in the last quarter; the extra chunks (each [FIM_SEP]its filename, or llama-server's "--- snippet ---"
separator without that token) fill what the context leaves. A model without the FIM prefix, suffix and middle
tokens is refused (501, as there). n_indent and t_max_predict_ms end a completion as there (_Limits: a line
indented less than n_indent is cut after its indentation; past t_max_predict_ms, it ends at a newline)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Union

from pydantic import BaseModel, ConfigDict, Field

from .native_completion import NativeRequest, native_completion

if TYPE_CHECKING:
    from .model import Model

N_BATCH = 2048  # llama-server's default -b
# llama-server's separator of extra chunks where the vocabulary has no FIM file separator
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


class InfillChunk(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    text: str
    filename: str = "tmp"


class InfillRequest(NativeRequest):
    """/infill's fields over /completion's."""
    prompt: str = ""  # (text after the prefix, before the suffix)
    input_prefix: Union[str, list[Union[int, str]]]
    input_suffix: Union[str, list[Union[int, str]]]
    input_extra: list[InfillChunk] = []
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = Field(0, ge=0)


class InfillUnsupported(ValueError):
    """The model has no fill-in-the-middle tokens (the server answers 501)."""


def _mixed(model: "Model", value: str | list) -> list[int]:
    """Text (no special tokens read in it) or ids and texts mixed, as llama-server's tokenize_mixed."""
    parts = [value] if isinstance(value, str) else value
    return [t for part in parts for t in (model.tokenize(part, add_special=False, parse_special=False)
                                          if isinstance(part, str) else [part])]


def fim_token_ids(model: "Model") -> dict[str, int | None]:
    """The model's FIM tokens; InfillUnsupported where it lacks the prefix, suffix or middle one."""
    ids = model.tokenizer.fim_token_ids()
    missing = [name for name in ("pre", "suf", "mid") if ids[name] is None]
    if missing:
        raise InfillUnsupported(f"infill is not supported by this model: it has no FIM {', '.join(missing)} token"
                                f"{'s' if len(missing) > 1 else ''}")
    return ids


def _extra_tokens(model: "Model", req: InfillRequest, ids: dict[str, int | None]) -> list[int]:
    """The repository part: the repo token and name, each extra chunk after its file separator and name (or the
    snippet separator), and the current file's separator."""
    def text(s: str) -> list[int]:
        return model.tokenize(s, add_special=False, parse_special=False)

    out = [ids["rep"], *text("myproject\n")] if ids["rep"] is not None else []
    for chunk in req.input_extra:
        out += [ids["sep"], *text(chunk.filename + "\n")] if ids["sep"] is not None else text(SNIPPET_SEPARATOR)
        out += text(chunk.text)
    return out + ([ids["sep"], *text("filename\n")] if ids["sep"] is not None else [])


def infill_tokens(model: "Model", req: InfillRequest, n_batch: int = N_BATCH, n_predict: int = -1) -> list[int]:
    """The FIM prompt of a request: llama-server's layout and its cuts (`n_predict`: the server's -n)."""
    ids = fim_token_ids(model)
    prefix, suffix = _mixed(model, req.input_prefix), _mixed(model, req.input_suffix)
    prompt = model.tokenize(req.prompt, add_special=False, parse_special=True)
    extra = _extra_tokens(model, req, ids)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, model.n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [ids["pre"], *prefix[len(prefix) - n_prefix:], *prompt]
    bos = [model.tokenizer.bos_token_id] if model.tokenizer.add_bos else []
    return [*extra[len(extra) - n_extra:], *bos, *head, ids["suf"], *suffix[:n_suffix], ids["mid"]]


class _Limits:
    """llama-server's n_indent and t_max_predict_ms, applied token by token as its process_token applies them:
    once a newline has come, each token checks the line at last_nl_pos (a line indented less than n_indent is
    cut after its indentation) and moves last_nl_pos to the next line's start; past t_max_predict_ms, a token
    holding a newline ends the completion."""

    def __init__(self, req: InfillRequest):
        self.n_indent, self.t_max_predict_ms = req.n_indent, req.t_max_predict_ms
        self.has_new_line, self.last_nl_pos = False, 0

    def __call__(self, text: str, token_text: str, elapsed_ms: float) -> tuple[int, bool]:
        """(where the completion `text` (the token's text its end) ends, whether it ends there)."""
        if self.has_new_line and self.n_indent > 0:
            if self.last_nl_pos > 0:
                pos = self.last_nl_pos
                while pos < len(text) and text[pos] in " \t":
                    pos += 1
                if pos < len(text) and pos - self.last_nl_pos < self.n_indent:
                    return pos, True
            at = text.find("\n", self.last_nl_pos)
            if at >= 0:
                self.last_nl_pos = at + 1
        if "\n" in token_text:
            self.has_new_line = True
            if 0 < self.t_max_predict_ms < elapsed_ms:
                return len(text), True
        return len(text), False


def infill(model: "Model", req: InfillRequest, n_batch: int = N_BATCH, n_predict: int = -1) -> dict | Iterator[dict]:
    """The answer to an /infill request (/completion's shape), or with stream its chunks (`n_batch`, `n_predict`:
    the server's -b and -n)."""
    native = req.model_copy(update={"prompt": infill_tokens(model, req, n_batch, n_predict)})
    if req.n_indent == 0 and req.t_max_predict_ms == 0:
        return native_completion(model, native)
    return native_completion(model, native, cut=_Limits(req))
