"""The target's own multi-token-prediction head (Qwen3.5's MTP block, GGUF nextn) as a proposer: its drafts and
log-probabilities against the reference (transformers' Qwen3_5DecoderLayer / Qwen3_5MoeDecoderLayer under
speculators' MTPLayerMixin glue), speculative == plain (greedy and same-seed sampling, chain and auto, on qwen35 and
qwen35moe, with drafts accepted on the trained head), prompt-cache reuse, the default choice, the engine's
arguments, typed errors for bad files, and the GGUF tools/train_mtp.py writes against our converter's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf_edit import rewrite  # noqa: E402
from hf_models import make_qwen35_shape, make_qwen35moe_shape  # noqa: E402

import gguf  # noqa: E402
import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.errors import GGUFFormatError, UnsupportedModelError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "tests" / "data" / "pairs"
TRAINED = PAIRS / "qwen35-target-mtp-q8_0.gguf"
TRAINED_MOE = PAIRS / "qwen35moe-target-mtp-q8_0.gguf"
PROMPT = [3, 17, 200, 45, 9, 311, 77, 5, 128, 64, 400, 12]
U32 = gguf.GGUFValueType.UINT32

# (maker, shape): one MTP block and a tied head; the multimodal layout with two (the first is the head); MoE
SHAPES = {"qwen35-tied": (make_qwen35_shape, "k1v3_tied_mtp"), "qwen35-vl-mtp2": (make_qwen35_shape, "vl_k2v4_mtp2"),
          "qwen35moe-vl": (make_qwen35moe_shape, "vl_x5k2_mtp")}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    make, shape = SHAPES[request.param]
    d = make(tmp_path_factory.mktemp(request.param) / "hf", shape, seed=3)
    return d, convert_hf_to_gguf(d, d.parent / "m.gguf", outtype="f32", progress=False)


def _mtp_state(d: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(d.glob("*.safetensors")):
        state.update({k: v for k, v in load_file(str(f)).items() if k.startswith("mtp.")})
    return state


def _fused_experts(layer_state: dict) -> dict:
    """Per-expert MoE tensors (as saved) in the layout the decoder layer holds (experts.gate_up_proj, down_proj)."""
    per = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out, experts = {}, {}
    for k, v in layer_state.items():
        if (m := per.match(k)) is not None:
            experts.setdefault(m[2], {})[int(m[1])] = v
        else:
            out[k] = v
    if experts:
        stack = {p: torch.stack([e[i] for i in range(len(e))]) for p, e in experts.items()}
        out["mlp.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out["mlp.experts.down_proj"] = stack["down_proj"]
    return out


def mtp_reference(d: Path, prompt: list[int], n_steps: int, top_k: int):
    """The reference MTP chain after `prompt`: the target's greedy next token (the anchor), then per step the head's
    top_k (ids, log-probabilities). The head is speculators' MTPLayerMixin (models/mtp/model_definitions.py) over
    transformers' decoder layer: fc([pre_fc_norm_embedding(embed(t)) ‖ pre_fc_norm_hidden(h)]) -> layer -> norm;
    row p holds token p and the trunk's final normed hidden state at p - 1, step i's row the head's own h' of step
    i - 1; every step recomputes the whole causal sequence of rows."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    cfg = ref.config
    mod = sys.modules[type(ref).__module__]
    layer_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("DecoderLayer"))
    norm_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RMSNorm") and "Gated" not in n)
    cfg._attn_implementation = "eager"
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"][-1]
    layer = layer_cls(cfg, full).eval()
    mtp = _mtp_state(d)
    layer.load_state_dict(_fused_experts({k[len("mtp.layers.0."):]: v for k, v in mtp.items()
                                          if k.startswith("mtp.layers.0.")}))

    def norm(name):
        m = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        m.weight.data.copy_(mtp[name])
        return m

    enorm, hnorm, fnorm = norm("mtp.pre_fc_norm_embedding.weight"), norm("mtp.pre_fc_norm_hidden.weight"), \
        norm("mtp.norm.weight")
    emb, head = ref.get_input_embeddings().weight, ref.get_output_embeddings().weight
    with torch.no_grad():
        h = ref.model(torch.tensor([prompt])).last_hidden_state[0]
        anchor = int((h[-1] @ head.T).argmax())
        toks, hs, ids, lps = list(prompt[1:]) + [anchor], [h[i] for i in range(len(prompt))], [], []
        for _ in range(n_steps):
            x = torch.cat([enorm(emb[torch.tensor(toks)]), hnorm(torch.stack(hs))], -1) @ mtp["mtp.fc.weight"].T
            pos = torch.arange(1, len(toks) + 1)[None]
            mask = torch.full((len(toks), len(toks)), float("-inf")).triu(1)[None, None]
            y = layer(x[None], position_embeddings=ref.model.rotary_emb(x[None], pos), attention_mask=mask,
                      position_ids=pos)
            out = fnorm((y[0] if isinstance(y, tuple) else y)[0])
            v, i = torch.log_softmax(out[-1] @ head.T, -1).topk(top_k)
            ids.append(i.tolist())
            lps.append(v.tolist())
            toks.append(int(i[0]))
            hs.append(out[-1])
    return anchor, np.array(ids), np.array(lps)


def test_drafts_and_logprobs_match_the_reference(checkpoint):
    d, path = checkpoint
    anchor, ids, lps = mtp_reference(d, PROMPT, n_steps=3, top_k=5)
    session = _core.Session(_core.Model(str(path)), n_ctx=256, type_k="f32", type_v="f32")
    head = _core.MtpDrafter(session, block_size=4, top_k=5)
    ours_anchor, ours_ids, ours_lps = head.draft_after(session, np.array(PROMPT, dtype=np.int32), 3)
    print(f"max |logprob difference|: {np.abs(ours_lps - lps).max():.2e}")
    assert ours_anchor == anchor
    assert (ours_ids == ids).all()
    assert np.abs(ours_lps - lps).max() <= 1e-3


def test_a_longer_prompt_through_queued_and_appended_rows(checkpoint):
    """A prompt longer than one append graph (64 rows) and a small prefill micro-batch: the head's rows go through
    the append graphs and the round's own graph, as the reference's single pass computes them."""
    d, path = checkpoint
    prompt = [(7 * i + 3) % 700 for i in range(150)]
    anchor, ids, lps = mtp_reference(d, prompt, n_steps=2, top_k=3)
    session = _core.Session(_core.Model(str(path)), n_ctx=512, n_ubatch=32, type_k="f32", type_v="f32")
    head = _core.MtpDrafter(session, block_size=3, top_k=3)
    a, i, lp = head.draft_after(session, np.array(prompt, dtype=np.int32), 2)
    assert a == anchor and (i == ids).all() and np.abs(lp - lps).max() <= 1e-3


def test_fewer_steps_than_the_block_holds(checkpoint, tmp_path):
    """draft_after with fewer steps than the head's block gives the reference's drafts and writes nothing past the
    arrays it returns (it copied the head's whole block into them: the heap after them corrupt, a segfault at the
    next garbage collection). Run in a subprocess, whose crash the test sees."""
    d, path = checkpoint
    anchor, ids, lps = mtp_reference(d, PROMPT, n_steps=1, top_k=5)
    code = f"""
import gc, json, numpy as np
from pydflash import _core
session = _core.Session(_core.Model({str(path)!r}), n_ctx=256, type_k="f32", type_v="f32")
head = _core.MtpDrafter(session, block_size=16, top_k=5)
drafts = [head.draft_after(session, np.array({PROMPT!r}, dtype=np.int32), 1) for _ in range(3)]
gc.collect()
a, i, lp = drafts[-1]
print(json.dumps([int(a), i.tolist(), lp.tolist()]))
"""
    # (from outside the checkout, whose source tree would shadow an installed pydflash)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    a, i, lp = json.loads(out.stdout.strip().splitlines()[-1])
    assert a == anchor and np.array(i).shape == (1, 5) and (np.array(i) == ids).all()
    assert np.abs(np.array(lp) - lps).max() <= 1e-3


# --------------------------------------------------------------------------------------------------
# speculative == plain

def _plain(path, prompt, n, sampling=None):
    s = _core.Session(_core.Model(str(path)), n_ctx=512, type_k="f32", type_v="f32")
    return s.generate(np.array(prompt, dtype=np.int32), max_tokens=n, sampling=sampling)["tokens"]


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_speculative_equals_plain_on_random_heads(checkpoint, mode):
    _, path = checkpoint
    s = _core.Session(_core.Model(str(path)), n_ctx=512, type_k="f32", type_v="f32")
    head = _core.MtpDrafter(s, block_size=4, spec_mode=mode)
    r = s.generate(np.array(PROMPT, dtype=np.int32), max_tokens=40, mtp=head)
    assert r["tokens"] == _plain(path, PROMPT, 40)
    assert r["timings"]["proposer"] == "mtp"
    if mode != "auto":
        assert r["timings"]["draft_n"] > 0
    sampling = {"temperature": 0.9, "seed": 5}
    assert s.generate(np.array(PROMPT, dtype=np.int32), max_tokens=30, mtp=head, sampling=sampling)["tokens"] == \
        _plain(path, PROMPT, 30, sampling)


def _code_prompts(m, n):
    from export_pairs import prompt_rows

    return [m.tokenize(row["text"]) for row in prompt_rows("code")[:n]]


@pytest.mark.parametrize("target", [TRAINED, TRAINED_MOE], ids=["qwen35", "qwen35moe"])
@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_trained_head_is_accepted_and_lossless(mode, target):
    """The committed trained heads (tools/train_mtp.py) on the committed qwen35 and qwen35moe targets: drafts are
    accepted, and greedy and sampled outputs are plain decoding's."""
    with pydflash.Model(target, n_ctx=1024, spec_mode=mode) as m:
        assert m.proposers == ("mtp",)
        accepted = drafted = 0
        for tokens in _code_prompts(m, 3):
            r = m._session.generate(tokens, max_tokens=64, stop_tokens=[], mtp=m._mtp)
            plain = m._session.generate(tokens, max_tokens=64, stop_tokens=[])
            assert r["tokens"] == plain["tokens"]
            accepted += r["timings"]["draft_n_accepted"]
            drafted += r["timings"]["draft_n"]
            for seed in (1, 2):
                sampling = {"temperature": 0.8, "seed": seed}
                assert m._session.generate(tokens, max_tokens=32, stop_tokens=[], mtp=m._mtp, sampling=sampling)[
                    "tokens"] == m._session.generate(tokens, max_tokens=32, stop_tokens=[], sampling=sampling)["tokens"]
        print(f"{mode}: {accepted} of {drafted} drafts accepted")
        assert accepted > {"chain": 0.6, "tree": 0.2, "auto": 0.0}[mode] * drafted and accepted > 0


def test_prompt_cache_reuse_continues_the_head():
    """A second turn whose prompt extends the first (the cache reused up to the last whole micro-batch) and the
    same prompt again (reused whole) draft from the rows kept, and give a fresh session's tokens."""
    with pydflash.Model(TRAINED, n_ctx=1024, n_ubatch=16, spec_mode="chain") as m:
        first = _code_prompts(m, 1)[0]
        r1 = m._session.generate(first, max_tokens=24, stop_tokens=[], mtp=m._mtp)
        again = m._session.generate(first, max_tokens=24, stop_tokens=[], mtp=m._mtp)
        longer = first + r1["tokens"] + first[:20]
        r2 = m._session.generate(longer, max_tokens=40, stop_tokens=[], mtp=m._mtp)
    assert again["timings"]["cached_n"] == len(first) and again["tokens"] == r1["tokens"]
    assert 0 < r2["timings"]["cached_n"] < len(longer)
    assert again["timings"]["draft_n_accepted"] == r1["timings"]["draft_n_accepted"]
    with pydflash.Model(TRAINED, n_ctx=1024, n_ubatch=16, spec_mode="chain") as fresh:
        r3 = fresh._session.generate(longer, max_tokens=40, stop_tokens=[], mtp=fresh._mtp)
    assert r2["tokens"] == r3["tokens"]
    assert r2["timings"]["draft_n_accepted"] == r3["timings"]["draft_n_accepted"]


# --------------------------------------------------------------------------------------------------
# the default, the engine's arguments, typed errors

def test_model_speculates_with_its_head_by_default(checkpoint):
    _, path = checkpoint
    with pydflash.Model(path, n_ctx=256) as m:
        assert m.proposers == ("mtp",) and m.block_size == 8  # (auto; a chain's default is 4)
        spec = m.create_completion("hello", max_tokens=12, temperature=0.0)
        plain = m.create_completion("hello", max_tokens=12, temperature=0.0, speculative=False)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert m.memory()["draft"]["cpu"] > 0 and m.memory()["ring"]["cpu"] > 0
    with pydflash.Model(path, n_ctx=256, proposers=("ngram",)) as m:
        assert m.proposers == ("ngram",)
    with pydflash.Model(path, n_ctx=256, spec_mode="tree") as m:
        assert m.proposers == ("mtp",) and m._mtp.top_k == 8 and m.tree_budget == 28  # four blocks' worth
    plan = pydflash.plan(path, n_ctx=256)
    assert plan.config["proposers"] == ("mtp",) and "mtp round" in plan.graphs
    with pydflash.Model(path, n_ctx=256) as m:
        m.create_completion("hello there", max_tokens=12, temperature=0.0)
        used = m.memory()
    for category in ("draft", "ring"):  # the head's cache and trunk-state ring, planned as a load allocates them
        assert plan.bytes[category] == used[category] and used[category]["cpu"] > 0, category
    assert plan.bytes["compute"]["cpu"] >= used["compute"]["cpu"]


def test_engine_arguments_are_checked(checkpoint):
    _, path = checkpoint
    with pytest.raises(ValueError, match="an MTP chain drafts at most block_size - 1 = 3"):
        pydflash.Model(path, proposers=("mtp",), spec_mode="chain", block_size=4, tree_budget=5)
    with pytest.raises(ValueError, match=r"drafts with the model's own MTP head, without the drafter"):
        pydflash.Model(path, proposers=("mtp",), draft_model_path=PAIRS / "qwen35-dflash-q8_0.gguf")
    with pytest.raises(ValueError, match="top_k >= 2"):
        _core.MtpDrafter(_core.Session(_core.Model(str(path)), n_ctx=64), spec_mode="tree", top_k=1)
    with pytest.raises(UnsupportedModelError, match=r"qwen3-target-q8_0\.gguf.*no multi-token-prediction head"):
        pydflash.Model(PAIRS / "qwen3-target-q8_0.gguf", proposers=("mtp",))
    with pytest.raises(UnsupportedModelError, match=r"nextn_predict_layers is 0 or absent"):
        _core.MtpDrafter(_core.Session(_core.Model(str(PAIRS / "qwen35-target-q8_0.gguf")), n_ctx=64))


def _n_layer(path):
    return int(gguf.GGUFReader(path).fields["qwen35.block_count"].contents()) - 1


def test_a_file_without_its_mtp_tensors_has_no_head(tmp_path):
    """nextn_predict_layers > 0 with the MTP block left out: the model loads and decodes plainly; asking for the
    head names the file and the tensor it lacks."""
    n = _n_layer(TRAINED)
    names = [t.name for t in gguf.GGUFReader(TRAINED).tensors if t.name.startswith(f"blk.{n}.")]
    path = rewrite(TRAINED, tmp_path / "no-mtp.gguf", drop_tensors=names)
    with pydflash.Model(path, n_ctx=256) as m:
        assert m.proposers == ()
    with pytest.raises(UnsupportedModelError, match=rf"no-mtp\.gguf: qwen35\.nextn_predict_layers = 1 but the file "
                                                    rf"has no tensor of MTP block {n} \(missing 'blk\.{n}\.nextn\."
                                                    rf"eh_proj\.weight'"):
        pydflash.Model(path, proposers=("mtp",))


@pytest.mark.parametrize("edit, match", [
    (dict(drop_tensors=("blk.4.nextn.hnorm.weight",)), r"blk\.4\.nextn\.hnorm\.weight"),
    (dict(drop_tensors=("blk.4.attn_q.weight",)), r"blk\.4\.attn_q\.weight"),
    # (q8_0 rows in bytes: 34 per 32 values)
    (dict(reshape={"blk.4.nextn.eh_proj.weight": (192, 204)}),
     r"tensor 'blk\.4\.nextn\.eh_proj\.weight' has shape \{192, 192\}, expected \{384, 192\}"),
    (dict(reshape={"blk.4.ffn_up.weight": (256, 204)}),
     r"tensor 'blk\.4\.ffn_up\.weight' has shape \{192, 256\}, expected \{192, 512\}"),
    (dict(set_keys={"qwen35.nextn_predict_layers": (5, U32)}), r"block_count.*5"),
], ids=["no-hnorm", "no-attn-q", "eh-proj-shape", "ffn-shape", "more-mtp-than-layers"])
def test_a_bad_mtp_block_is_a_typed_error(tmp_path, edit, match):
    path = rewrite(TRAINED, tmp_path / "bad.gguf", **edit)
    with pytest.raises(GGUFFormatError, match=match):
        pydflash.Model(path, n_ctx=256)


@pytest.mark.parametrize("maker, shape, extra", [(make_qwen35_shape, "k1v3_tied_mtp", {}),
                                                 (make_qwen35moe_shape, "x4k1", {"mtp_layers": 1})],
                         ids=["qwen35", "qwen35moe"])
def test_appended_head_is_what_the_converter_writes(tmp_path, maker, shape, extra):
    """convert/mtp_head.py (what tools/train_mtp.py writes with) appends a checkpoint's mtp.* tensors as our
    converter (tested against llama.cpp's) converts a checkpoint that holds them: every key and tensor alike (a MoE
    head's experts given per expert, as saved)."""
    from pydflash.convert.mtp_head import append_mtp_head

    d = maker(tmp_path / "hf", shape, seed=4, **extra)
    whole = convert_hf_to_gguf(d, tmp_path / "whole.gguf", outtype="f32", progress=False)
    mtp = {k: v.float().numpy() for k, v in _mtp_state(d).items()}
    (d / "model-mtp.safetensors").unlink()
    index = d / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    trunk = convert_hf_to_gguf(d, tmp_path / "trunk.gguf", outtype="f32", progress=False)
    appended = append_mtp_head(trunk, tmp_path / "appended.gguf", mtp)
    a, b = gguf.GGUFReader(whole), gguf.GGUFReader(appended)
    keys = lambda r: {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}  # noqa: E731
    assert keys(a) == keys(b)
    ta, tb = {t.name: np.array(t.data) for t in a.tensors}, {t.name: np.array(t.data) for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert np.array_equal(ta[name], tb[name]), name


def test_fused_experts_are_written_as_per_expert_ones():
    """A MoE head as transformers holds it (experts.gate_up_proj [X, 2F, E], experts.down_proj [X, E, F]: what
    tools/train_mtp.py saves) gives the GGUF tensors the same head saved per expert gives."""
    from pydflash.convert.mtp_head import head_tensors

    rng = np.random.default_rng(0)
    X, F, E = 3, 4, 5
    gate, up, down = rng.standard_normal((X, F, E)), rng.standard_normal((X, F, E)), rng.standard_normal((X, E, F))
    p = "mtp.layers.0.mlp.experts."
    per = {f"{p}{x}.{n}.weight": a[x] for x in range(X) for n, a in (("gate_proj", gate), ("up_proj", up),
                                                                     ("down_proj", down))}
    fused = {p + "gate_up_proj": np.concatenate([gate, up], axis=1), p + "down_proj": down}
    a, b = dict(head_tensors(per, 4, "qwen35moe")), dict(head_tensors(fused, 4, "qwen35moe"))
    assert sorted(a) == ["blk.4.ffn_down_exps.weight", "blk.4.ffn_gate_exps.weight", "blk.4.ffn_up_exps.weight"]
    assert all(np.array_equal(a[k], b[k]) for k in a)
