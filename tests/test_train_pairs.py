"""tools/train_pairs.py --quick end to end, and the reference DFlash loop of tools/dflash_ref.py.

The quick run trains tiny qwen3 / qwen35 targets and drafters (~1 min on 2 cores) into a temporary folder;
the tests check the Hugging Face layout of what it saved and that the reference speculative loops are
lossless (their output equals plain greedy decoding of the target, in float64) for both targets,
including the Qwen3.5 gated-delta-net rollback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"

import dflash_ref as R  # noqa: E402

KINDS = ("qwen3", "qwen35")
DRAFT_TENSORS = {"fc.weight", "hidden_norm.weight", "norm.weight"}
DRAFT_LAYER_TENSORS = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pairs")
    proc = subprocess.run([sys.executable, str(TOOLS / "train_pairs.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread avoids OpenMP spin-waits, which are very slow on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _load_target(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _prompts(pairs: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pairs / "tokenizer" / "tokenizer.json"))
    rows = []
    for genre in ("code", "prose"):
        lines = (pairs / f"prompts_{genre}.jsonl").read_text(encoding="utf-8").splitlines()
        assert lines, genre
        rows += [tok.encode(json.loads(ln)["text"], add_special_tokens=False).ids for ln in lines[:2]]
    return rows


def test_outputs_and_results(pairs):
    for name in ("tokenizer/tokenizer.json", "results.json", "train_log.json", "corpus.json",
                 "prompts_code.jsonl", "prompts_prose.jsonl"):
        assert (pairs / name).is_file(), name
    res = json.loads((pairs / "results.json").read_text())
    for kind in KINDS:
        for genre in ("code", "prose"):
            r = res["results"][kind][genre]
            assert 1.0 <= r["tau_dflash"] <= 16.0 and 1.0 <= r["tau_lookup"] <= 16.0
            n = r["prompts"]
            assert r["dflash_equals_greedy"] == f"{n}/{n}" and r["lookup_equals_greedy"] == f"{n}/{n}"
    stdout = (pairs / "stdout.txt").read_text()
    assert "tau DFlash" in stdout and "loss" in stdout
    corpus = json.loads((pairs / "corpus.json").read_text())
    held = set(corpus["held_out"])
    for genre in ("code", "prose"):
        for line in (pairs / f"prompts_{genre}.jsonl").read_text().splitlines():
            assert json.loads(line)["source"] in held      # prompts come from held-out documents only


def test_tokenizer_layout(pairs):
    from transformers import AutoTokenizer

    tj = json.loads((pairs / "qwen3" / "target" / "tokenizer.json").read_text())
    pre = tj["pre_tokenizer"]["pretokenizers"]
    assert pre[0]["type"] == "Split" and "\\p{L}" in pre[0]["pattern"]["Regex"] and pre[1]["type"] == "ByteLevel"
    added = {t["content"]: t for t in tj["added_tokens"]}
    for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"):
        assert added[name]["special"], name
    tok = AutoTokenizer.from_pretrained(pairs / "qwen3" / "target")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("def f(x):\n    return x", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "def f(x):\n    return x"


@pytest.mark.parametrize("kind", KINDS)
def test_hf_layout(pairs, kind):
    from safetensors import safe_open

    tdir, ddir = pairs / kind / "target", pairs / kind / "draft"
    target = _load_target(tdir)
    tc = json.loads((tdir / "config.json").read_text())
    n_tokens = len(json.loads((tdir / "tokenizer.json").read_text())["model"]["vocab"]) + 6
    assert tc["vocab_size"] % 64 == 0 and tc["vocab_size"] >= n_tokens
    if kind == "qwen3":
        assert tc["architectures"] == ["Qwen3ForCausalLM"] and tc["model_type"] == "qwen3"
        assert tc["tie_word_embeddings"] is True
    else:
        assert tc["architectures"] == ["Qwen3_5ForCausalLM"]
        assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert tc["linear_num_value_heads"] > tc["linear_num_key_heads"]
        rp = tc["rope_parameters"]
        assert sum(rp["mrope_section"]) == int(tc["head_dim"] * rp["partial_rotary_factor"]) // 2
    assert (tdir / "tokenizer_config.json").is_file() and "chat_template" in json.loads(
        (tdir / "tokenizer_config.json").read_text())

    dc = json.loads((ddir / "config.json").read_text())
    assert dc["architectures"] == ["DFlashDraftModel"] and dc["block_size"] == 16
    assert dc["hidden_size"] == tc["hidden_size"] and dc["vocab_size"] == tc["vocab_size"]
    mask_id = dc["dflash_config"]["mask_token_id"]
    tok_added = {t["content"]: t["id"] for t in json.loads((tdir / "tokenizer.json").read_text())["added_tokens"]}
    assert mask_id == tok_added["<|MASK|>"] < tc["vocab_size"]
    ids = dc["dflash_config"]["target_layer_ids"]
    assert ids and all(0 <= i <= tc["num_hidden_layers"] - 2 for i in ids)
    assert dc["num_target_layers"] == tc["num_hidden_layers"]
    with safe_open(str(ddir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (tc["hidden_size"], len(ids) * tc["hidden_size"])
    want = DRAFT_TENSORS | {f"layers.{i}.{n}" for i in range(dc["num_hidden_layers"]) for n in DRAFT_LAYER_TENSORS}
    assert names == want                                   # no embedding, no lm_head, no model. prefix
    draft = R.DFlashDraftModel.from_pretrained(ddir)
    assert draft.target_layer_ids == ids and draft.mask_token_id == mask_id and draft.block_size == 16
    assert target.get_input_embeddings().weight.shape[0] > mask_id


def _scramble(model, seed: int) -> None:
    """Re-draw the weights with wide spreads so greedy decoding depends on the whole state (the tiny quick
    targets mostly repeat a few tokens, which would hide a missing rollback)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "A_log" in name or "dt_bias" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_loop_is_lossless(pairs, kind):
    torch.manual_seed(0)
    target = _load_target(pairs / kind / "target", torch.float64)
    draft = R.DFlashDraftModel.from_pretrained(pairs / kind / "draft", dtype=torch.float64).eval()
    n_new = 32
    for prompt in _prompts(pairs):
        greedy = R.greedy_generate(target, prompt, n_new)
        d = R.spec_generate(target, prompt, n_new, R.dflash_proposer(draft, target), layer_ids=draft.target_layer_ids)
        assert d.tokens == greedy
        assert sum(d.accept_lengths) == n_new - 1 and max(d.accept_lengths) <= 16
        lk = R.spec_generate(target, prompt, n_new, R.lookup_proposer())
        assert lk.tokens == greedy

    # a target whose output depends on its whole state, and drafts that are right for a random number of
    # slots: every acceptance length, hence every crop / gated-delta-net rollback position, gets exercised
    _scramble(target, 1)
    gen = torch.Generator().manual_seed(2)
    seen = set()
    for prompt in _prompts(pairs)[:2]:
        greedy = R.greedy_generate(target, prompt, n_new)
        assert len(set(greedy)) >= 8
        truth = list(prompt) + greedy

        def noisy_oracle(tokens, start, feats, n):
            good = int(torch.randint(0, n + 1, (1,), generator=gen))
            return truth[start + 1:start + 1 + good] + [(t + 1) % 100 for t in truth[start + 1 + good:start + 1 + n]]

        res = R.spec_generate(target, prompt, n_new, noisy_oracle)
        assert res.tokens == greedy
        seen.update(res.accept_lengths)
        d = R.spec_generate(target, prompt, n_new, R.dflash_proposer(draft, target), layer_ids=draft.target_layer_ids)
        assert d.tokens == greedy
    assert len(seen) >= 5


def test_train_and_inference_contract_agree(pairs):
    """The training forward (many blocks, block mask) and the inference forward (one block over the context
    rows before its anchor) give the same drafter outputs."""
    target = _load_target(pairs / "qwen3" / "target", torch.float64)
    draft = R.DFlashDraftModel.from_pretrained(pairs / "qwen3" / "draft", dtype=torch.float64).eval()
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, draft.mask_token_id, (2, 48), generator=gen)
    with torch.no_grad():
        feats = R.extract_features(target(input_ids=toks, output_hidden_states=True).hidden_states,
                                   draft.target_layer_ids)
        anchors = torch.tensor([[3, 17, 40], [0, 25, 31]])
        block_ids, pos, mask, labels = R.block_train_batch(toks, anchors, 16, draft.mask_token_id)
        embed = target.get_input_embeddings()
        h = draft(embed(block_ids), feats, pos, mask).view(2, 3, 16, -1)
        for n in range(2):
            for j in range(3):
                a = int(anchors[n, j])
                block = torch.tensor([[int(toks[n, a])] + [draft.mask_token_id] * 15])
                h1 = draft(embed(block), feats[n:n + 1, :a], torch.arange(a + 16)[None])
                torch.testing.assert_close(h1[0], h[n, j], rtol=1e-9, atol=1e-9)
                want = [int(toks[n, a + k]) if a + k < 48 else -100 for k in range(1, 16)]
                assert labels[n, j].tolist() == want
