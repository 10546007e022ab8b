#!/usr/bin/env python3
"""Train the small target + DFlash drafter pairs pydflash tests and demos use (issue 3).

    python tools/train_pairs.py                          # full run -> build/pairs/ (~1 h on 2 cores)
    python tools/train_pairs.py --prompts-dir tests/data # ... and (re)write the committed held-out prompts
    python tools/train_pairs.py --quick --out build/pairs-quick   # smoke test, ~1-2 min

Everything is made here, offline, on the CPU, with torch + transformers + tokenizers (no downloads):

1. Corpus. Code: the Python standard library sources of the running interpreter (tests, `encodings`
   and `pydoc_data` excluded). Prose: Python's own documentation text (`pydoc_data/topics.py`), the GNU
   info manuals in /usr/share/info, /usr/share/common-licenses and README/*.txt/*.md/*.rst files under
   /usr/share/doc (changelogs and copyright files excluded; duplicates dropped). About 3% of the
   documents, picked by a hash of their name, are held out: the evaluation prompts come from them and
   nothing of them is seen by the tokenizer or the models. `corpus.json` lists what was used. The corpus
   depends on what is installed on the machine; the run is deterministic for a given machine (fixed
   seeds, fixed step counts, fixed thread count), not across machines.
2. Tokenizer. A byte-level BPE trained with `tokenizers` with the Qwen2 pre-tokenizer (Split on the
   Qwen2 regex + ByteLevel), so a GGUF converter recognises `tokenizer.ggml.pre = qwen2`; added tokens
   `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special), `<think>`, `</think>` (user-defined) and
   `<|MASK|>` (special; the drafter's mask token). Model vocabularies are padded past the tokenizer to a
   multiple of 64, like Qwen's (151936 rows for 151669 tokens).
3. Targets, trained from scratch on the corpus (code and prose windows, half each):
   `qwen3`  Qwen3ForCausalLM, tied embeddings (like Qwen3-0.6B/4B);
   `qwen35` Qwen3_5ForCausalLM (text config): layer_types linear_attention x3 + full_attention,
            linear_num_value_heads > linear_num_key_heads (exercises the converter's V-head reorder),
            head_dim 64 with partial_rotary_factor 0.25 -> 16 rotary dims, mrope_section [3, 3, 2]
            (sums to the rotary half-dim), untied LM head.
4. Self-distillation data: greedy continuations by each target of prompts drawn from the training text
   (fixed total length, prompt lengths varied); the target features of those sequences (outputs of
   `target_layer_ids`) are computed once and kept in memory (float16).
5. Drafters (`DFlashDraftModel`, tools/dflash_ref.py; algorithm reference §1 and §4): block size 16,
   `fc` + `hidden_norm` fusion of the extracted layers, KV injection, the target's embedding and LM head
   shared and frozen, random anchors among the continuation positions, block mask (context strictly
   before the anchor, bidirectional inside the block, blocks invisible to each other), same-position
   labels, loss weights exp(-(k-1)/7), AdamW + cosine schedule. The loss curve also prints the
   teacher-forced acceptance length on continuations kept out of training (a close proxy of tau).
6. Measurement with the reference loops of tools/dflash_ref.py on the held-out prompts (greedy, block 16):
   tau of the DFlash drafter, tau of a prompt-lookup drafter (n-gram 3..1) on the same prompts, the share
   of generated tokens that close a 4-gram seen earlier, and whether each speculative output equals plain
   greedy decoding (the Qwen3.5 loop restores the gated-delta-net state and replays accepted tokens).
   Printed as a table and written to `results.json`.

Output (`--out`, default build/pairs/, git-ignored):
    tokenizer/                      tokenizer.json + tokenizer_config.json (ChatML chat_template)
    qwen3/target/, qwen35/target/   save_pretrained + tokenizer files (Hugging Face layout)
    qwen3/draft/,  qwen35/draft/    config.json (architectures ["DFlashDraftModel"], block_size,
                                    dflash_config {mask_token_id, target_layer_ids}, num_target_layers)
                                    + model.safetensors (layers.*, fc.weight, hidden_norm.weight, norm.weight)
    prompts_code.jsonl, prompts_prose.jsonl   held-out prompts ({"id", "source", "text"} per line;
                                    written to --prompts-dir instead when given)
    results.json, train_log.json, corpus.json

Phases whose outputs exist are redone unless `--reuse` is given (then an existing tokenizer, target or
draft folder is loaded instead of trained; e.g. to retrain only the drafters, delete qwen*/draft).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
# OpenMP threads that spin while waiting make torch 10-30x slower when other processes share the cores;
# passive waiting costs little on an idle machine. Must be set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dflash_ref as R  # noqa: E402
from export_pairs import read_jsonl  # noqa: E402
from qwen2_bpe import ENDOFTEXT, IM_END, IM_START, train_qwen2_bpe, write_tokenizer_files  # noqa: E402

MASK = "<|MASK|>"
# --------------------------------------------------------------------------------------------------
# configuration

FULL = dict(
    vocab=4096,                 # tokenizer size incl. added tokens is a bit less; model rows = 4096
    holdout_pct={"code": 4, "prose": 7},
    train_chars={"code": 600_000, "prose": 600_000},
    seq_len=256, target_batch=8, target_lr=3e-3, amp=True, unlikelihood=1.0,
    seq_ul_steps=150, seq_ul_prompt=48, seq_ul_new=64,
    qwen3=dict(hidden=192, layers=4, heads=3, kv_heads=1, head_dim=64, ffn=512, steps=450),
    qwen35=dict(hidden=192, layers=4, heads=3, kv_heads=1, head_dim=64, ffn=512, steps=280,
                lin_k_heads=2, lin_v_heads=4, lin_head_dim=32),
    # MoE: 32 experts, top-4, each an eighth of the dense width (active FFN = half the dense one); qwen35moe adds a
    # shared expert of that width. k/X = 1/8 as Qwen3-30B-A3B's 8 of 128: a verify of N rows reads about as many
    # more experts than one decode step as theirs does (uniform routing: 5.2x at 8 rows, theirs 6.5x)
    qwen3moe=dict(hidden=192, layers=4, heads=3, kv_heads=1, head_dim=64, ffn=512, steps=450,
                  experts=32, top_k=4, expert_ffn=64),
    qwen35moe=dict(hidden=192, layers=4, heads=3, kv_heads=1, head_dim=64, ffn=512, steps=280,
                   lin_k_heads=2, lin_v_heads=4, lin_head_dim=32, experts=32, top_k=4, expert_ffn=64,
                   shared_ffn=64),
    target_layer_ids=[0, 1, 2],
    draft_layers=2,
    cont_len=256, cont_prompt_lens=[48, 64, 96, 128], n_cont=5120, n_cont_val=64, gen_batch=128,
    draft_steps=2000, draft_batch=8, anchors=16, draft_lr=1e-3,
    n_prompts=32, eval_prompts=24, eval_tokens=128,
    log_every=25,
)
QUICK = dict(
    FULL, train_chars={"code": None, "prose": None},
    vocab=512, max_docs=60, holdout_pct={"code": 10, "prose": 20},
    seq_len=64, target_batch=8, seq_ul_steps=20, seq_ul_prompt=16, seq_ul_new=24,
    qwen3=dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, ffn=128, steps=150),
    qwen35=dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=64, ffn=128, steps=120,
                lin_k_heads=2, lin_v_heads=4, lin_head_dim=16),
    qwen3moe=dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, ffn=128, steps=150, experts=4, top_k=2,
                  expert_ffn=32),
    qwen35moe=dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=64, ffn=128, steps=120,
                   lin_k_heads=2, lin_v_heads=4, lin_head_dim=16, experts=4, top_k=2, expert_ffn=32, shared_ffn=32),
    cont_len=64, cont_prompt_lens=[16, 24], n_cont=128, n_cont_val=16, gen_batch=64,
    draft_steps=120, draft_batch=8, anchors=8,
    n_prompts=4, eval_prompts=3, eval_tokens=32,
    log_every=30,
)
BLOCK_SIZE = 16


def log(*a):
    print(*a, flush=True)


def stable_hash(s: str) -> int:
    return int.from_bytes(hashlib.sha1(s.encode("utf-8")).digest()[:8], "big")


# --------------------------------------------------------------------------------------------------
# 1. corpus

DOC_PACKAGE_CAP = 300_000      # characters of /usr/share/doc text per package
_CODE_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
                   "__pycache__"}


_LETTERS = re.compile(r"[A-Za-z ]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f]")


def _mostly_text(s: str) -> bool:
    """Plain text: almost no control characters, at most 5% non-ASCII."""
    if not s.strip():
        return False
    n_ascii = len(s.encode("ascii", "ignore"))
    return n_ascii / len(s) > 0.95 and len(_CONTROL.findall(s)) / len(s) < 0.02


def code_documents() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if _CODE_SKIP_DIRS.intersection(rel.parts[:-1]) or p.stat().st_size > 300_000:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > 200 and _mostly_text(text):
            docs.append((f"stdlib/{rel.as_posix()}", text))
    return docs


def _read_maybe_gz(p: Path) -> str | None:
    try:
        data = gzip.open(p).read() if p.suffix == ".gz" else p.read_bytes()
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None


def prose_documents() -> list[tuple[str, str]]:
    docs: list[tuple[str, str]] = []
    # Python's documentation text shipped with the interpreter (help() topics)
    topics_py = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    if topics_py.exists():
        ns: dict = {}
        exec(compile(topics_py.read_text(encoding="utf-8"), str(topics_py), "exec"), ns)
        for k in sorted(ns.get("topics", {})):
            docs.append((f"pydoc/{k}", ns["topics"][k]))
    # GNU info manuals, one document per node
    for p in sorted(Path("/usr/share/info").glob("*.info*")):
        text = _read_maybe_gz(p)
        if text is None:
            continue
        for i, node in enumerate(text.split("\x1f")):
            lines = node.strip("\n").split("\n")
            if lines and lines[0].startswith("File: "):
                lines = lines[1:]
            body = "\n".join(lines).strip("\n")
            if body.startswith(("Tag Table:", "Indirect:")) or "Local Variables:" in body[:40] or len(body) < 200:
                continue
            docs.append((f"info/{p.name}#{i}", body + "\n"))
    # license texts
    for p in sorted(Path("/usr/share/common-licenses").glob("*")):
        if p.is_file():
            text = _read_maybe_gz(p)
            if text:
                docs.append((f"licenses/{p.name}", text))
    # package documentation
    doc_root = Path("/usr/share/doc")
    pat = re.compile(r"^(readme[^/]*|[^/]+\.(txt|md|rst))(\.gz)?$", re.I)
    for p in sorted(doc_root.rglob("*")):
        name = p.name.lower()
        if not p.is_file() or p.is_symlink() or not pat.match(name) or "changelog" in name or "copyright" in name:
            continue
        text = _read_maybe_gz(p)
        if text is None or not 500 <= len(text) <= 200_000:
            continue
        docs.append((f"doc/{p.relative_to(doc_root).as_posix()}", text))
    out, seen, per_pkg = [], set(), {}
    for key, text in docs:
        if key.startswith("doc/"):                     # a few packages (nodejs, git) would dominate otherwise
            pkg = key.split("/")[1]
            if per_pkg.get(pkg, 0) + len(text) > DOC_PACKAGE_CAP:
                continue
            per_pkg[pkg] = per_pkg.get(pkg, 0) + len(text)
        text = text.replace("\r\n", "\n")
        h = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if h in seen or not _mostly_text(text) or len(text) < 200 or len(_LETTERS.findall(text)) < 0.75 * len(text):
            continue
        seen.add(h)
        out.append((key, text))
    return out


def take_chars(docs, limit: int | None):
    """The documents, in a fixed hash order, until `limit` characters (None: all)."""
    if limit is None:
        return docs
    out, n = [], 0
    for key, text in sorted(docs, key=lambda kv: stable_hash("train:" + kv[0])):
        if n + len(text) > limit:
            continue
        out.append((key, text))
        n += len(text)
    return sorted(out)


def split_holdout(docs, pct: int):
    train, held = [], []
    for key, text in docs:
        (held if stable_hash(key) % 100 < pct else train).append((key, text))
    return train, held


# --------------------------------------------------------------------------------------------------
# held-out prompts


def code_prompts(held, n: int, min_chars: int = 240, max_chars: int = 480) -> list[dict]:
    """Prompts that open at a `def`/`class` line and end at a line end, ~min_chars long."""
    out = []
    for key, text in sorted(held, key=lambda kv: stable_hash("prompt:" + kv[0])):
        lines = text.split("\n")
        taken = 0
        for i, line in enumerate(lines):
            if taken >= 2 or len(out) >= n:
                break
            s = line.lstrip(" ")
            if not (s.startswith(("def ", "class ")) and len(line) - len(s) <= 8):
                continue
            buf = ""
            for ln in lines[i:]:
                if len(buf) >= min_chars or len(ln) > 100:
                    break
                buf += ln + "\n"
            if min_chars <= len(buf) <= max_chars and buf.isascii():
                out.append({"source": key, "text": buf})
                taken += 1
        if len(out) >= n:
            break
    return [{"id": f"code-{i:02d}", **p} for i, p in enumerate(out)]


_PROSE_BAD = re.compile(r"[<>=|#*$@{}\[\]_\\/`~^]")


def _running_text(para: str) -> bool:
    """A paragraph of sentences: hard-wrapped lines of 40+ characters, no indented examples, no markup."""
    lines = [ln for ln in para.split("\n") if ln.strip()]
    if len(lines) < 3 or not para.isascii() or _PROSE_BAD.search(para):
        return False
    if any(len(ln) - len(ln.lstrip(" ")) > 4 for ln in lines[1:]) or ". " not in para:
        return False
    if sum(len(ln) >= 40 for ln in lines[:-1]) < len(lines[:-1]) - 1:
        return False
    return sum(c.isalpha() or c == " " for c in para) / len(para) > 0.9


def prose_prompts(held, n: int, min_chars: int = 200, max_chars: int = 280) -> list[dict]:
    """Prompts that open a paragraph of running text and stop mid-paragraph at a word boundary."""
    out = []
    for key, text in sorted(held, key=lambda kv: stable_hash("prompt:" + kv[0])):
        taken = 0
        for para in re.split(r"\n\s*\n", text):
            para = para.strip("\n")
            if taken >= 2 or len(out) >= n:
                break
            if len(para) < max_chars + 60 or not _running_text(para):
                continue
            cut = para.rfind(" ", min_chars, max_chars)
            if cut < 0:
                continue
            out.append({"source": key, "text": para[:cut].rstrip()})
            taken += 1
        if len(out) >= n:
            break
    return [{"id": f"prose-{i:02d}", **p} for i, p in enumerate(out)]


def attach_reference(prompts: list[dict], held) -> None:
    """Store the real text that follows each prompt in its document (first 600 characters), for the
    repeat-share baseline of natural text."""
    docs = dict(held)
    for p in prompts:
        doc = docs[p["source"]]
        i = doc.find(p["text"])
        p["reference"] = doc[i + len(p["text"]):i + len(p["text"]) + 600] if i >= 0 else ""


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# 2. tokenizer


def train_tokenizer(texts: list[str], vocab: int):
    return train_qwen2_bpe(texts, vocab - 32, length=len(texts), extra_special=(MASK,))


def save_tokenizer(tok, path: Path) -> None:
    write_tokenizer_files(path, json.loads(tok.to_str()), eos_token=ENDOFTEXT, mask_token=MASK)


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


class Ids:
    def __init__(self, tok):
        self.eot = tok.token_to_id(ENDOFTEXT)
        self.im_start = tok.token_to_id(IM_START)
        self.im_end = tok.token_to_id(IM_END)
        self.mask = tok.token_to_id(MASK)
        self.n_tokens = tok.get_vocab_size(with_added_tokens=True)
        self.n_model = (self.n_tokens + 63) // 64 * 64


def encode_stream(tok, docs, eot: int) -> np.ndarray:
    """All documents, each followed by <|endoftext|>, as one uint16 stream."""
    parts = []
    for i in range(0, len(docs), 256):
        for enc in tok.encode_batch([t for _, t in docs[i:i + 256]], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


# --------------------------------------------------------------------------------------------------
# 3. targets


# kind -> (config class, model class), all in transformers
TARGET_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
                  "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                  "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}


def make_target(kind: str, c: dict, ids: Ids):
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in TARGET_CLASSES[kind])
    common = dict(vocab_size=ids.n_model, hidden_size=c["hidden"], intermediate_size=c["ffn"],
                  num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                  head_dim=c["head_dim"], hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                  attention_bias=False, bos_token_id=ids.eot, eos_token_id=ids.eot, pad_token_id=ids.eot,
                  architectures=[model_class])
    if kind.endswith("moe"):
        # llama.cpp's MoE graphs always renormalise the top-k router probabilities (Qwen3.5-MoE always does)
        common.update(num_experts=c["experts"], num_experts_per_tok=c["top_k"], moe_intermediate_size=c["expert_ffn"])
        common.update(dict(norm_topk_prob=True) if kind == "qwen3moe" else
                      dict(shared_expert_intermediate_size=c["shared_ffn"]))
    if kind in ("qwen3", "qwen3moe"):
        cfg = config_class(**common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                           tie_word_embeddings=True)
        return model_class(cfg)
    assert c["layers"] % 4 == 0 and c["lin_v_heads"] > c["lin_k_heads"]
    rot_half = int(c["head_dim"] * 0.25) // 2
    section = [rot_half // 3 + (j < rot_half % 3) for j in range(3)]   # e.g. [3, 3, 2]: sums to the rotary half-dim
    cfg = config_class(
        **common, tie_word_embeddings=False,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (c["layers"] // 4),
        linear_conv_kernel_dim=4, linear_num_key_heads=c["lin_k_heads"], linear_num_value_heads=c["lin_v_heads"],
        linear_key_head_dim=c["lin_head_dim"], linear_value_head_dim=c["lin_head_dim"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": section, "mrope_interleaved": True},
    )
    return model_class(cfg)


def load_target(path: Path):
    import transformers

    cfg = json.loads((Path(path) / "config.json").read_text())
    return getattr(transformers, cfg["architectures"][0]).from_pretrained(path, dtype=torch.float32).eval()


class WindowSampler:
    """Random training windows, code and prose half each (deterministic given the generator)."""

    def __init__(self, streams: dict[str, np.ndarray], seq_len: int, gen: torch.Generator):
        self.streams = {k: torch.from_numpy(v.astype(np.int64)) for k, v in streams.items() if len(v) > seq_len + 1}
        self.names = sorted(self.streams)
        self.seq_len = seq_len
        self.gen = gen

    def batch(self, n: int) -> torch.Tensor:
        rows = []
        for i in range(n):
            s = self.streams[self.names[i % len(self.names)]]
            o = int(torch.randint(0, len(s) - self.seq_len - 1, (1,), generator=self.gen))
            rows.append(s[o:o + self.seq_len + 1])
        return torch.stack(rows)


def param_groups(model, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim == 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def eval_lm_loss(model, streams: dict[str, np.ndarray], seq_len: int, n_windows: int = 8) -> dict[str, float]:
    out = {}
    for name, s in sorted(streams.items()):
        if len(s) <= seq_len + 1:
            continue
        starts = np.linspace(0, len(s) - seq_len - 2, n_windows).astype(np.int64)
        x = torch.stack([torch.from_numpy(s[o:o + seq_len + 1].astype(np.int64)) for o in starts])
        logits = model(input_ids=x[:, :-1]).logits
        out[name] = float(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))
    return out


def unlikelihood_loss(logp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al. 2019, "Neural text generation with unlikelihood training"):
    -sum log(1 - p(c)) over the candidates c = tokens already in the context that are not the next token.
    With the sequence-level term below, it keeps greedy decoding of a briefly trained small model out of
    repetition loops. logp [N, T, V]: log-probabilities for the tokens x[:, 1:] of x [N, T+1]."""
    inp, y = x[:, :-1], x[:, 1:]
    n, t = inp.shape
    pos = torch.arange(t)
    total = logp.new_zeros(())
    for r in range(n):
        uniq, inv = torch.unique(inp[r], return_inverse=True)                    # the row's distinct tokens
        first = torch.full((len(uniq),), t, dtype=torch.long).scatter_reduce(0, inv, pos, reduce="amin")
        cand = (first[None, :] <= pos[:, None]) & (uniq[None, :] != y[r][:, None])   # [T, U]
        lp = logp[r][:, uniq]
        total = total - ((-lp.exp()).log1p().clamp(min=-20.0) * cand).sum()
    return total / (n * t)


def repeated_ngram_mask(seq: list[int], start: int, n: int = 4) -> list[bool]:
    """True for the tokens at or after `start` that belong to an n-gram seen earlier in `seq`."""
    seen, mask = set(), [False] * len(seq)
    for j in range(n - 1, len(seq)):
        g = tuple(seq[j - n + 1:j + 1])
        if j >= start and g in seen:
            for k in range(max(start, j - n + 1), j + 1):
                mask[k] = True
        seen.add(g)
    return mask


SEQ_UL_STATS: list[float] = []     # repeated share of the sequence-unlikelihood generations (for the log)


def sequence_unlikelihood_loss(model, prompts: torch.Tensor, n_new: int, amp: bool) -> torch.Tensor:
    """Sequence-level unlikelihood (Welleck et al. 2019): continue `prompts` greedily with the model itself,
    then push down the probability of every generated token that repeats an earlier 4-gram."""
    was_training = model.training
    model.eval()
    cont = greedy_batch(model, prompts, n_new)
    model.train(was_training)
    seq = torch.cat([prompts, cont], dim=1)
    p = prompts.shape[1]
    mask = torch.tensor([repeated_ngram_mask(row, p) for row in seq.tolist()])[:, 1:]   # targets of positions 0..
    SEQ_UL_STATS.append(float(mask.sum()) / (seq.shape[0] * n_new))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=seq[:, :-1]).logits
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, seq[:, 1:, None])[..., 0]
    one_minus_p = (-logp.exp()).log1p().clamp(min=-20.0)
    return -(one_minus_p * mask).sum() / (seq.shape[0] * n_new)


def train_target(kind, c, ids, cfg, train_streams, held_streams, seed, log_rows):
    torch.manual_seed(seed)
    model = make_target(kind, c, ids).float().train()
    SEQ_UL_STATS.clear()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[{kind}] target: {n_params / 1e6:.2f}M parameters, {c['steps']} steps x {cfg['target_batch']} x "
        f"{cfg['seq_len']} tokens")
    gen = torch.Generator().manual_seed(seed + 1)
    sampler = WindowSampler(train_streams, cfg["seq_len"], gen)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=cfg["target_lr"], betas=(0.9, 0.95), eps=1e-8,
                            fused=True)
    steps = c["steps"]
    warmup = max(1, steps // 20)
    t0 = time.time()
    run = 0.0
    for step in range(steps):
        lr = R.cosine_lr(step, steps, cfg["target_lr"], warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sampler.batch(cfg["target_batch"])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["amp"]):
            logits = model(input_ids=x[:, :-1]).logits
        logp = F.log_softmax(logits.float(), dim=-1)
        loss = F.nll_loss(logp.flatten(0, 1), x[:, 1:].flatten())
        ce = loss.detach()
        if cfg["unlikelihood"] > 0:
            loss = loss + cfg["unlikelihood"] * unlikelihood_loss(logp, x)
        if step >= steps - cfg["seq_ul_steps"]:
            loss = loss + sequence_unlikelihood_loss(model, x[:, :cfg["seq_ul_prompt"]], cfg["seq_ul_new"], cfg["amp"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run = ce.item() if step == 0 else 0.9 * run + 0.1 * ce.item()
        if (step + 1) % cfg["log_every"] == 0 or step + 1 == steps:
            el = time.time() - t0
            rep = f"  own-continuation repeat4 {np.mean(SEQ_UL_STATS[-cfg['log_every']:]):.2f}" if SEQ_UL_STATS else ""
            log(f"[{kind}] step {step + 1:5d}/{steps}  loss {run:.3f}  lr {lr:.2e}  "
                f"{(step + 1) * x.numel() / el:6.0f} tok/s  {el:6.0f}s{rep}")
            log_rows.append({"phase": f"{kind}-target", "step": step + 1, "loss": round(run, 4), "lr": lr,
                             "elapsed_s": round(el, 1)})
    model.eval()
    val = eval_lm_loss(model, held_streams, cfg["seq_len"])
    log(f"[{kind}] held-out loss: " + "  ".join(f"{k} {v:.3f}" for k, v in val.items()))
    log_rows.append({"phase": f"{kind}-target", "held_out_loss": val, "train_s": round(time.time() - t0, 1)})
    return model


def save_target(model, tok, ids: Ids, path: Path) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=ids.eot, eos_token_id=[ids.eot, ids.im_end],
                                               pad_token_id=ids.eot, do_sample=False)
    model.save_pretrained(path)
    save_tokenizer(tok, path)


# --------------------------------------------------------------------------------------------------
# 4. self-distillation data


@torch.no_grad()
def greedy_batch(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, P] (no padding needed) -> [B, n_new]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
    toks = [out.logits[:, -1].argmax(-1)]
    for _ in range(n_new - 1):
        out = model(input_ids=toks[-1][:, None], past_key_values=cache, use_cache=True)
        toks.append(out.logits[:, -1].argmax(-1))
    return torch.stack(toks, dim=1)


def line_start_tokens(tok, n_model: int) -> np.ndarray:
    ok = np.zeros(n_model, dtype=bool)
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        ok[i] = "\n" in tok.decode([i], skip_special_tokens=False)
    return ok


@torch.no_grad()
def make_distill_data(kind, model, tok, ids, cfg, train_streams, layer_ids, n_seq, seed, tag):
    """n_seq sequences of cont_len tokens: a prompt window from the training text (starting after a newline
    token, length cycling through cont_prompt_lens), then the target's greedy continuation."""
    gen = torch.Generator().manual_seed(seed)
    nl = line_start_tokens(tok, ids.n_model)
    names = sorted(train_streams)
    s_len = cfg["cont_len"]
    toks, plens, feats = [], [], []
    t0 = time.time()
    bs = cfg["gen_batch"]
    for b0 in range(0, n_seq, bs):
        nb = min(bs, n_seq - b0)
        p = cfg["cont_prompt_lens"][(b0 // bs) % len(cfg["cont_prompt_lens"])]
        rows = []
        for i in range(nb):
            s = train_streams[names[(b0 + i) % len(names)]]
            o = int(torch.randint(0, len(s) - 4 * p - 2, (1,), generator=gen))
            while o < len(s) - p - 1 and not nl[s[o]]:
                o += 1
            rows.append(torch.from_numpy(s[o + 1:o + 1 + p].astype(np.int64)))
        prompts = torch.stack(rows)
        cont = greedy_batch(model, prompts, s_len - p)
        seq = torch.cat([prompts, cont], dim=1)
        out = model(input_ids=seq, output_hidden_states=True, logits_to_keep=1)
        feats.append(R.extract_features(out.hidden_states, layer_ids).to(torch.float16))
        toks.append(seq)
        plens += [p] * nb
        log(f"[{kind}] {tag}: {b0 + nb}/{n_seq} continuations  {time.time() - t0:6.0f}s")
    return torch.cat(toks), torch.tensor(plens), torch.cat(feats)


def sample_anchors(plens: torch.Tensor, s_len: int, n_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """n_anchors distinct positions in [prompt_len, s_len - 2] per row (the first anchor at inference is
    the first generated token, so labels are always target outputs)."""
    rows = []
    for p in plens.tolist():
        cand = torch.arange(p, s_len - 1)
        pick = torch.randperm(len(cand), generator=gen)[:n_anchors]
        rows.append(cand[pick].sort().values)
    return torch.stack(rows)


def draft_step(draft, target, toks, feats, anchors, weights, amp=False):
    embed = target.get_input_embeddings()
    head = target.get_output_embeddings()
    block_ids, pos, mask, labels = R.block_train_batch(toks, anchors, draft.block_size, draft.mask_token_id)
    with torch.no_grad():
        noise = embed(block_ids)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        h = draft(noise, feats.float(), pos, mask)
        n, a = anchors.shape
        h = h.view(n, a, draft.block_size, -1)[:, :, 1:]
        logits = head(h)
    return R.dflash_loss(logits.float(), labels, weights)


@torch.no_grad()
def draft_eval(draft, target, toks, feats, anchors, weights, chunk: int = 16):
    parts = [draft_step(draft, target, toks[i:i + chunk], feats[i:i + chunk], anchors[i:i + chunk], weights)
             for i in range(0, len(toks), chunk)]
    n = torch.tensor([min(chunk, len(toks) - i) for i in range(0, len(toks), chunk)], dtype=torch.float32)
    w = n / n.sum()
    return (sum(p[0] * wi for p, wi in zip(parts, w)), sum(p[1] * wi for p, wi in zip(parts, w)),
            sum(p[2] * wi for p, wi in zip(parts, w)))


def train_draft(kind, target, ids, cfg, data, val, seed, log_rows):
    toks, plens, feats = data
    torch.manual_seed(seed)
    dcfg = R.make_draft_config(target.config, n_layers=cfg["draft_layers"], target_layer_ids=cfg["target_layer_ids"],
                               mask_token_id=ids.mask, block_size=BLOCK_SIZE)
    draft = R.DFlashDraftModel(dcfg).float().train()
    for p in target.parameters():
        p.requires_grad_(False)
    n_params = sum(p.numel() for p in draft.parameters())
    steps = cfg["draft_steps"]
    log(f"[{kind}] draft: {n_params / 1e6:.2f}M parameters, {cfg['draft_layers']} layers, target_layer_ids "
        f"{cfg['target_layer_ids']}, {len(toks)} sequences, {steps} steps x {cfg['draft_batch']} seq x "
        f"{cfg['anchors']} anchors")
    opt = torch.optim.AdamW(param_groups(draft, 0.01), lr=cfg["draft_lr"], betas=(0.9, 0.95), fused=True)
    weights = R.loss_weights(BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed + 1)
    vgen = torch.Generator().manual_seed(seed + 2)
    v_toks, v_plens, v_feats = val
    v_anchors = sample_anchors(v_plens, v_toks.shape[1], cfg["anchors"], vgen)
    warmup = max(1, steps // 25)
    order = torch.randperm(len(toks), generator=gen)
    cursor = 0
    t0 = time.time()
    run_loss, run_tau = 0.0, 0.0
    for step in range(steps):
        lr = R.cosine_lr(step, steps, cfg["draft_lr"], warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        if cursor + cfg["draft_batch"] > len(order):
            order = torch.randperm(len(toks), generator=gen)
            cursor = 0
        idx = order[cursor:cursor + cfg["draft_batch"]]
        cursor += cfg["draft_batch"]
        anchors = sample_anchors(plens[idx], toks.shape[1], cfg["anchors"], gen)
        loss, _, tau = draft_step(draft, target, toks[idx], feats[idx], anchors, weights, cfg["amp"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run_loss = loss.item() if step == 0 else 0.9 * run_loss + 0.1 * loss.item()
        run_tau = tau.item() if step == 0 else 0.9 * run_tau + 0.1 * tau.item()
        if (step + 1) % cfg["log_every"] == 0 or step + 1 == steps:
            el = time.time() - t0
            row = {"phase": f"{kind}-draft", "step": step + 1, "loss": round(run_loss, 4),
                   "train_tau": round(run_tau, 3), "lr": lr, "elapsed_s": round(el, 1)}
            msg = (f"[{kind}] draft step {step + 1:5d}/{steps}  loss {run_loss:.3f}  tau(train) {run_tau:.2f}  "
                   f"lr {lr:.2e}  {el:6.0f}s")
            if (step + 1) % (4 * cfg["log_every"]) == 0 or step + 1 == steps:
                draft.eval()
                vl, vacc, vtau = draft_eval(draft, target, v_toks, v_feats, v_anchors, weights)
                draft.train()
                row.update(val_loss=round(vl.item(), 4), val_tau=round(vtau.item(), 3),
                           val_slot_acc=[round(a, 3) for a in vacc.tolist()])
                msg += f"  | val loss {vl.item():.3f} tau {vtau.item():.2f} acc@1..4 " + \
                       " ".join(f"{a:.2f}" for a in vacc[:4].tolist())
            log(msg)
            log_rows.append(row)
    draft.eval()
    return draft


# --------------------------------------------------------------------------------------------------
# 6. measurement


@torch.no_grad()
def evaluate_pair(kind, target, draft, tok, ids, prompts: dict[str, list[dict]], n_tokens: int):
    stop = [ids.eot]
    rows = {}
    for genre, plist in prompts.items():
        acc_d, acc_l, rep, same_d, same_l, n_gen, per = [], [], [], 0, 0, 0, []
        t0 = time.time()
        for pr in plist:
            p_ids = tok.encode(pr["text"], add_special_tokens=False).ids
            greedy = R.greedy_generate(target, p_ids, n_tokens, stop)
            d = R.spec_generate(target, p_ids, n_tokens, R.dflash_proposer(draft, target), block_size=BLOCK_SIZE,
                                layer_ids=draft.target_layer_ids, stop_ids=stop)
            lk = R.spec_generate(target, p_ids, n_tokens, R.lookup_proposer(), block_size=BLOCK_SIZE, stop_ids=stop)
            acc_d += d.accept_lengths
            acc_l += lk.accept_lengths
            rep.append(R.repeat_share(p_ids, greedy, 4))
            same_d += d.tokens == greedy
            same_l += lk.tokens == greedy
            n_gen += len(greedy)
            per.append({"id": pr["id"], "prompt_tokens": len(p_ids), "generated": len(greedy),
                        "tau_dflash": round(d.tau, 3), "tau_lookup": round(lk.tau, 3),
                        "repeat4_share": round(rep[-1], 3), "dflash_equals_greedy": d.tokens == greedy,
                        "accept_lengths": d.accept_lengths, "greedy_tokens": greedy})
            if len(per) <= 2:
                log(f"[{kind}] {pr['id']} tau {d.tau:.2f} (lookup {lk.tau:.2f}) continuation: "
                    + json.dumps(tok.decode(greedy)[:300]))
        ref = []
        for pr in plist:
            p_ids = tok.encode(pr["text"], add_special_tokens=False).ids
            r_ids = tok.encode(pr.get("reference", ""), add_special_tokens=False).ids[:n_tokens]
            if r_ids:
                ref.append(R.repeat_share(p_ids, r_ids, 4))
        rows[genre] = {
            "prompts": len(plist),
            "generated_tokens": n_gen,
            "tau_dflash": round(sum(acc_d) / max(1, len(acc_d)), 3),
            "tau_lookup": round(sum(acc_l) / max(1, len(acc_l)), 3),
            "repeat4_share": round(float(np.mean(rep)) if rep else 0.0, 3),
            "repeat4_share_real_text": round(float(np.mean(ref)) if ref else 0.0, 3),
            "dflash_equals_greedy": f"{same_d}/{len(plist)}",
            "lookup_equals_greedy": f"{same_l}/{len(plist)}",
            "eval_s": round(time.time() - t0, 1),
        }
        log(f"[{kind}] eval {genre}: " + json.dumps(rows[genre]))
        rows[genre]["per_prompt"] = per
    return rows


def print_table(results: dict) -> None:
    log("")
    log(f"{'pair':8s} {'genre':6s} {'tau DFlash':>10s} {'tau lookup':>10s} {'repeat4':>8s} {'==greedy':>9s}")
    for kind, rows in results.items():
        for genre, r in rows.items():
            log(f"{kind:8s} {genre:6s} {r['tau_dflash']:10.2f} {r['tau_lookup']:10.2f} {r['repeat4_share']:8.2f} "
                f"{r['dflash_equals_greedy']:>9s}")
    log("")


# --------------------------------------------------------------------------------------------------
# driver


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "pairs")
    ap.add_argument("--prompts-dir", type=Path, default=None,
                    help="write the held-out prompt files here (default: the output folder)")
    ap.add_argument("--quick", action="store_true", help="tiny corpus, models and step counts (smoke test)")
    ap.add_argument("--pairs", default="qwen3,qwen35")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2; --quick: 1)")
    ap.add_argument("--prompts-only", action="store_true", help="write the held-out prompt files and stop")
    ap.add_argument("--reuse", action="store_true", help="load existing tokenizer/target/draft folders")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a setting, e.g. --set draft_steps=50 --set qwen3.steps=20")
    args = ap.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.quick else 2
    return args


def settings(args) -> dict:
    """FULL (or QUICK) with the --set overrides applied (KEY: dotted path into the settings)."""
    cfg = json.loads(json.dumps(QUICK if args.quick else FULL))
    for kv in args.set:
        k, v = kv.split("=", 1)
        d = cfg
        *head, last = k.split(".")
        for h in head:
            d = d[h]
        d[last] = json.loads(v)
    return cfg


def build_corpus(cfg: dict, out: Path, pdir: Path):
    """Training documents and held-out ones (code, prose); writes the held-out prompt files and corpus.json.
    Returns (train, held, prompts), each a dict by genre."""
    code, prose = code_documents(), prose_documents()
    if "max_docs" in cfg:
        code = sorted(code, key=lambda kv: stable_hash(kv[0]))[: cfg["max_docs"] * 4]
        prose = sorted(prose, key=lambda kv: stable_hash(kv[0]))[: cfg["max_docs"] * 4]
    code_train, code_held = split_holdout(code, cfg["holdout_pct"]["code"])
    prose_train, prose_held = split_holdout(prose, cfg["holdout_pct"]["prose"])
    if "max_docs" in cfg:
        code_train, prose_train = code_train[: cfg["max_docs"]], prose_train[: cfg["max_docs"]]
    code_train = take_chars(code_train, cfg["train_chars"]["code"])
    prose_train = take_chars(prose_train, cfg["train_chars"]["prose"])
    prompts = {"code": code_prompts(code_held, cfg["n_prompts"]), "prose": prose_prompts(prose_held, cfg["n_prompts"])}
    attach_reference(prompts["code"], code_held)
    attach_reference(prompts["prose"], prose_held)
    write_jsonl(pdir / "prompts_code.jsonl", prompts["code"])
    write_jsonl(pdir / "prompts_prose.jsonl", prompts["prose"])
    corpus_info = {
        "python": sys.version.split()[0],
        "code": {"train_docs": len(code_train), "held_docs": len(code_held),
                 "train_chars": sum(len(t_) for _, t_ in code_train)},
        "prose": {"train_docs": len(prose_train), "held_docs": len(prose_held),
                  "train_chars": sum(len(t_) for _, t_ in prose_train)},
        "held_out": sorted(k for k, _ in code_held + prose_held),
        "train_sha1": hashlib.sha1("".join(k + "\0" + hashlib.sha1(t_.encode()).hexdigest() for k, t_ in
                                           code_train + prose_train).encode()).hexdigest(),
    }
    (out / "corpus.json").write_text(json.dumps(corpus_info, indent=1))
    log(f"corpus: code {len(code_train)} docs / {corpus_info['code']['train_chars'] / 1e6:.1f} MB, prose "
        f"{len(prose_train)} docs / {corpus_info['prose']['train_chars'] / 1e6:.1f} MB; held out "
        f"{len(code_held)} + {len(prose_held)} docs -> {len(prompts['code'])} code + {len(prompts['prose'])} "
        f"prose prompts in {pdir}")
    return {"code": code_train, "prose": prose_train}, {"code": code_held, "prose": prose_held}, prompts


def tokenizer_for(train: dict, cfg: dict, tok_dir: Path, reuse: bool):
    """The tokenizer trained on the training documents (or, with reuse, the one saved in tok_dir)."""
    if reuse and (tok_dir / "tokenizer.json").exists():
        return load_tokenizer(tok_dir)
    tok = train_tokenizer([t_ for _, t_ in train["code"] + train["prose"]], cfg["vocab"])
    save_tokenizer(tok, tok_dir)
    return tok


def target_for(kind: str, c: dict, tok, ids, cfg: dict, streams, seed: int, log_rows: list, pair_dir: Path,
               reuse: bool):
    """The pair's target, trained (evaluated as saved: loaded back) or, with reuse, loaded; frozen."""
    if reuse and (pair_dir / "target" / "config.json").exists():
        target = load_target(pair_dir / "target")
        log(f"[{kind}] target loaded from {pair_dir / 'target'}")
    else:
        target = train_target(kind, c, ids, cfg, streams["train"], streams["held"], seed, log_rows)
        save_target(target, tok, ids, pair_dir / "target")
        target = load_target(pair_dir / "target")       # evaluate exactly what was saved
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def draft_for(kind: str, target, tok, ids, cfg: dict, streams, seed: int, log_rows: list, pair_dir: Path,
              reuse: bool, timings: dict):
    """The pair's DFlash drafter, distilled from the target's continuations (or, with reuse, loaded); its phases'
    times go into timings."""
    t = time.time()
    if reuse and (pair_dir / "draft" / "config.json").exists():
        draft = R.DFlashDraftModel.from_pretrained(pair_dir / "draft", dtype=torch.float32).eval()
        log(f"[{kind}] draft loaded from {pair_dir / 'draft'}")
        timings[f"{kind}-distill-data"] = 0.0
        timings[f"{kind}-draft"] = time.time() - t
        return draft
    data = make_distill_data(kind, target, tok, ids, cfg, streams["train"], cfg["target_layer_ids"],
                             cfg["n_cont"], seed + 10, "train")
    val = make_distill_data(kind, target, tok, ids, cfg, streams["train"], cfg["target_layer_ids"],
                            cfg["n_cont_val"], seed + 20, "val")
    timings[f"{kind}-distill-data"] = time.time() - t
    t = time.time()
    rep = float(np.mean([R.repeat_share(s[:p].tolist(), s[p:].tolist(), 4)
                         for s, p in zip(data[0][:256], data[1][:256].tolist())]))
    log(f"[{kind}] continuations: repeat4 share {rep:.2f} (first 256)")
    draft = train_draft(kind, target, ids, cfg, data, val, seed + 30, log_rows)
    del data, val
    draft.save_pretrained(pair_dir / "draft")
    draft = R.DFlashDraftModel.from_pretrained(pair_dir / "draft", dtype=torch.float32).eval()
    timings[f"{kind}-draft"] = time.time() - t
    return draft


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = settings(args)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)        # AdamW second moments go denormal; that costs ~2x on CPU
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    timings: dict[str, float] = {}
    log_rows: list[dict] = []
    log(f"settings: {json.dumps(cfg)}")

    # 1. corpus
    t = time.time()
    train, held, prompts = build_corpus(cfg, out, args.prompts_dir or out)
    if args.prompts_only:
        return 0
    # 2. tokenizer
    tok = tokenizer_for(train, cfg, out / "tokenizer", args.reuse)
    ids = Ids(tok)
    streams = {split: {g: encode_stream(tok, docs[g], ids.eot) for g in ("code", "prose")}
               for split, docs in (("train", train), ("held", held))}
    timings["corpus+tokenizer"] = time.time() - t
    log(f"tokenizer: {ids.n_tokens} tokens (model rows {ids.n_model}), mask {ids.mask}, eot {ids.eot}; train "
        f"tokens code {len(streams['train']['code'])}, prose {len(streams['train']['prose'])}  "
        f"({timings['corpus+tokenizer']:.0f}s)")

    results: dict[str, dict] = {}
    for i, kind in enumerate(p for p in args.pairs.split(",") if p):
        seed = args.seed + 1000 * (i + 1)
        pair_dir = out / kind
        # 3. target
        t = time.time()
        target = target_for(kind, cfg[kind], tok, ids, cfg, streams, seed, log_rows, pair_dir, args.reuse)
        timings[f"{kind}-target"] = time.time() - t
        # 4.+5. drafter
        draft = draft_for(kind, target, tok, ids, cfg, streams, seed, log_rows, pair_dir, args.reuse, timings)
        # 6. measurement
        t = time.time()
        eval_prompts = {g: p[: cfg["eval_prompts"]] for g, p in prompts.items()}
        results[kind] = evaluate_pair(kind, target, draft, tok, ids, eval_prompts, cfg["eval_tokens"])
        timings[f"{kind}-eval"] = time.time() - t
        print_table(results)

    timings["total"] = time.time() - t_all
    print_table(results)
    log("phase times (s): " + json.dumps({k: round(v, 1) for k, v in timings.items()}))
    summary = {
        "block_size": BLOCK_SIZE, "eval_tokens": cfg["eval_tokens"], "threads": args.threads, "quick": args.quick,
        "seed": args.seed, "settings": cfg, "results": results,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "train_log.json").write_text(json.dumps(log_rows, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
