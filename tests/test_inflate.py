"""pydflash.convert.inflate: a target widened (FFN units) and deepened (appended layers) with zero output
projections computes exactly the original model's function at a larger model's cost. Checked against
transformers on the original checkpoint, and with the committed trained pairs, whose drafters must keep
drafting the same."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import make_qwen3_shape, make_qwen3moe_shape, make_qwen35_shape, make_qwen35moe_shape  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.convert.inflate import inflate_gguf  # noqa: E402
from pydflash.errors import ConversionError  # noqa: E402

from export_pairs import pair_file, prompt_rows  # noqa: E402
from near_ties import TIE, first_difference, tie_gap  # noqa: E402

PROMPT = [3, 17, 200, 45, 9, 311, 77, 5, 128, 64, 400, 12]


MAKERS = {"qwen3": make_qwen3_shape, "qwen35": make_qwen35_shape, "qwen3moe": make_qwen3moe_shape,
          "qwen35moe": make_qwen35moe_shape}
# the FFN tensors whose widths grow, the keys of those widths, the widths asked for
WIDENED = {"qwen3": {"ffn_down": ("feed_forward_length", 1024)},
           "qwen35": {"ffn_down": ("feed_forward_length", 1024)},
           "qwen3moe": {"ffn_down_exps": ("expert_feed_forward_length", 256)},
           "qwen35moe": {"ffn_down_exps": ("expert_feed_forward_length", 256),
                         "ffn_down_shexp": ("expert_shared_feed_forward_length", 192)}}


@pytest.mark.parametrize("arch,shape", [("qwen3", "gqa4x2_hd64"), ("qwen35", "k2v4_hd32"), ("qwen3moe", "x5k2_tied"),
                                        ("qwen35moe", "x8k4")])
def test_inflated_model_computes_the_original_function(tmp_path, arch, shape):
    hf = MAKERS[arch](tmp_path / "hf", shape, seed=4)
    small = convert_hf_to_gguf(hf, tmp_path / "small.gguf", outtype="f32", progress=False)
    big = inflate_gguf(small, tmp_path / "big.gguf", "f32", n_ff=1024, n_ff_exp=256, n_ff_shexp=192, extra_layers=5,
                       progress=False)
    reader = gguf.GGUFReader(big)
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    names = {t.name: t for t in reader.tensors}
    last = f"blk.{n_layer - 1}."
    for down, (key, width) in WIDENED[arch].items():
        assert int(reader.fields[f"{arch}.{key}"].contents()) == width
        assert names[f"blk.0.{down}.weight"].shape[0] == width  # ggml order: the units first
        assert not np.any(names[last + down + ".weight"].data)  # the appended layers add nothing to the residual
    mixer_out = last + ("attn_output.weight" if last + "attn_output.weight" in names else "ssm_out.weight")
    assert not np.any(names[mixer_out].data)
    if arch.endswith("moe"):  # the appended layers' routers are random, not the trained ones copied
        assert np.std(names[last + "ffn_gate_inp.weight"].data) > 0
        assert not np.array_equal(names[last + "ffn_gate_inp.weight"].data, names["blk.0.ffn_gate_inp.weight"].data)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0].numpy()
    model = _core.Model(str(big))
    assert model.n_layer == n_layer
    ours, _ = _core.Session(model, n_ctx=64, type_k="f32", type_v="f32").eval(np.array(PROMPT, dtype=np.int32))
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_inflated_pair_drafts_and_decodes_the_same(tmp_path, kind):
    """q4mix (q4_0 appended layers, q8_0 trained ones): the same greedy text and the same acceptance as the
    committed q8_0 pair, whose trained tensors are quantized the same way."""
    big = inflate_gguf(pair_file(kind, "target", "f32"), tmp_path / "big.gguf", "q4mix", n_ff=2048, extra_layers=3,
                       progress=False)
    types = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(big).tensors}
    assert types["blk.0.ffn_up.weight"] == "Q8_0" and types["blk.5.ffn_up.weight"] == "Q4_0"
    draft = pair_file(kind, "dflash", "q8_0")
    texts = [r["text"] for r in prompt_rows("code")[:3]]
    runs = {}
    for name, target in (("small", pair_file(kind, "target", "q8_0")), ("big", big)):
        with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, spec_mode="chain") as m:
            runs[name] = [m.generate(t, max_tokens=48) for t in texts]
    for text, a, b in zip(texts, runs["small"], runs["big"]):
        if a.tokens == b.tokens:
            assert a.timings["draft_n_accepted"] == b.timings["draft_n_accepted"]
            continue
        # the widened matmuls sum in another order (and n_ubatch="auto" may prefill in other micro-batches): a
        # parting is allowed at a near-tie of the target's logits only (seen: qwen3, the first prompt's 4th token,
        # logits 0.0093 apart)
        k = first_difference(a.tokens, b.tokens)
        with pydflash.Model(pair_file(kind, "target", "q8_0"), n_ctx=1024) as m:
            assert tie_gap(m, m.tokenize(text), a.tokens, b.tokens, k) < TIE, k


def test_inflate_refuses_what_it_cannot_keep(tmp_path):
    with pytest.raises(ConversionError, match="n_ff = 16 is smaller than the model's 512"):
        inflate_gguf(pair_file("qwen3", "target", "f32"), tmp_path / "x.gguf", "q8_0", n_ff=16, progress=False)
    from pydflash.convert.quantize import quantize_gguf

    q4 = quantize_gguf(pair_file("qwen3", "target", "f32"), tmp_path / "q4_0.gguf", "q4_0", progress=False)
    with pytest.raises(ConversionError, match="inflation needs an f32/f16/bf16/q8_0 source, got Q4_0"):
        inflate_gguf(q4, tmp_path / "x.gguf", "q8_0", n_ff=1024, progress=False)
    with pytest.raises(ConversionError, match="expected one of qwen3, qwen35, qwen3moe, qwen35moe"):
        inflate_gguf(pair_file("qwen3", "dflash", "f32"), tmp_path / "x.gguf", "q8_0", progress=False)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()


def test_a_q8_0_source_keeps_its_blocks(tmp_path):
    """A q8_0 target (the committed MoE pairs are q8_0 only) inflates to q8_0 with its trained tensors' blocks
    unchanged: dequantized and quantized again, each block's largest value gives back the same scale."""
    small = pair_file("qwen3", "target", "q8_0")
    big = inflate_gguf(small, tmp_path / "big.gguf", "q8_0", n_ff=1024, extra_layers=1, progress=False)
    theirs = {t.name: t for t in gguf.GGUFReader(big).tensors}
    for t in gguf.GGUFReader(small).tensors:
        if gguf.GGMLQuantizationType(t.tensor_type).name == "Q8_0" and "ffn_" not in t.name:
            assert np.array_equal(np.asarray(theirs[t.name].data), np.asarray(t.data)), t.name


@pytest.mark.parametrize("maker,shape", [(make_qwen35_shape, "k1v3_tied_mtp"), (make_qwen35moe_shape, "vl_x5k2_mtp")],
                         ids=["qwen35", "qwen35moe"])
def test_mtp_blocks_stay_last_and_draft_the_same(tmp_path, maker, shape):
    """A model with an MTP head: the appended layers go before it (renumbered last, its FFN widened), and the head
    drafts the same tokens with the same log-probabilities as in the original."""
    d = maker(tmp_path / "hf", shape, seed=2)
    small = convert_hf_to_gguf(d, tmp_path / "small.gguf", outtype="f32", progress=False)
    big = inflate_gguf(small, tmp_path / "big.gguf", "f32", n_ff=1024, n_ff_exp=256, n_ff_shexp=192, extra_layers=2,
                       progress=False)
    r = gguf.GGUFReader(big)
    arch = r.fields["general.architecture"].contents()
    n = int(r.fields[f"{arch}.block_count"].contents())
    assert int(r.fields[f"{arch}.nextn_predict_layers"].contents()) == 1 and n == 4 + 2 + 1
    assert [bool(x) for x in r.fields[f"{arch}.attention.recurrent_layers"].contents()][-3:] == [True, True, False]
    assert {t.name for t in r.tensors if t.name.startswith(f"blk.{n - 1}.nextn.")} == {
        f"blk.{n - 1}.nextn.{s}.weight" for s in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    drafts = []
    for path in (small, big):
        session = _core.Session(_core.Model(str(path)), n_ctx=128, type_k="f32", type_v="f32")
        drafts.append(_core.MtpDrafter(session, block_size=4, top_k=4).draft_after(session, np.array(PROMPT), 3))
    (a0, i0, l0), (a1, i1, l1) = drafts
    assert a0 == a1 and (i0 == i1).all() and np.abs(l0 - l1).max() <= 1e-4
