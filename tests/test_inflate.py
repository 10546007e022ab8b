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
@pytest.mark.parametrize("copies", [1, 3], ids=["width_kept", "width_x3"])
def test_inflated_model_computes_the_original_function(tmp_path, arch, shape, copies):
    hf = MAKERS[arch](tmp_path / "hf", shape, seed=4)
    small = convert_hf_to_gguf(hf, tmp_path / "small.gguf", outtype="f32", progress=False)
    n_embd = int(gguf.GGUFReader(small).fields[f"{arch}.embedding_length"].contents())
    big = inflate_gguf(small, tmp_path / "big.gguf", "f32", n_ff=1024, n_ff_exp=256, n_ff_shexp=192, extra_layers=5,
                       n_embd=copies * n_embd, progress=False)
    reader = gguf.GGUFReader(big)
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    names = {t.name: t for t in reader.tensors}
    assert int(reader.fields[f"{arch}.embedding_length"].contents()) == copies * n_embd
    assert names["token_embd.weight"].shape[0] == copies * n_embd
    if copies > 1:  # the stream's copies: the appended layers' attention reads the first one only
        assert names[f"blk.{n_layer - 1}.attn_norm.weight"].shape[0] == copies * n_embd
        assert "output.weight" in names  # (a tied head would read every copy)
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


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_a_widened_pair_drafts_and_decodes_the_same(tmp_path, kind, drafter):
    """A target and its drafter both widened to 4x the hidden width (the drafter borrows the target's embedding
    and LM head, so they widen together; DFlash2's convolutions and selector with them): the same greedy text with
    the same drafts accepted as the committed f32 pair. (The qwen3 target's LM head is tied to its embedding.)"""
    target = inflate_gguf(pair_file(kind, "target", "f32"), tmp_path / "t.gguf", "f32", n_ff=1024, extra_layers=2,
                          n_embd=768, progress=False)
    draft = inflate_gguf(pair_file(kind, drafter, "f32"), tmp_path / "d.gguf", "f32", n_embd=768, progress=False)
    r = gguf.GGUFReader(draft)
    assert int(r.fields["dflash.embedding_length"].contents()) == 768
    assert {t.name: t.shape[0] for t in r.tensors}["fc.weight"] == 3 * 768  # three captured target layers
    texts = [r["text"] for r in prompt_rows("code")[:2]]
    runs = {}
    for name, pair in (("small", (pair_file(kind, "target", "f32"), pair_file(kind, drafter, "f32"))),
                       ("wide", (target, draft))):
        with pydflash.Model(pair[0], draft_model_path=pair[1], n_ctx=512, spec_mode="chain") as m:
            runs[name] = [m.generate(t, max_tokens=40) for t in texts]
    for a, b in zip(runs["small"], runs["wide"]):
        assert a.tokens == b.tokens
        assert a.timings["draft_n_accepted"] == b.timings["draft_n_accepted"] > 0


def test_a_drafter_widens_alone_and_the_width_by_whole_copies(tmp_path):
    with pytest.raises(ConversionError, match="a DFlash drafter takes no appended layers"):
        inflate_gguf(pair_file("qwen3", "dflash", "f32"), tmp_path / "x.gguf", "f32", extra_layers=2,
                     progress=False)
    with pytest.raises(ConversionError, match="n_embd = 512 is not a multiple of the model's hidden width 192"):
        inflate_gguf(pair_file("qwen3", "target", "f32"), tmp_path / "x.gguf", "f32", n_embd=512, progress=False)
    with pytest.raises(ConversionError, match="n_embd = 96 is not a multiple of the model's hidden width 192"):
        inflate_gguf(pair_file("qwen3", "dflash", "f32"), tmp_path / "x.gguf", "f32", n_embd=96, progress=False)
    small = convert_hf_to_gguf(make_qwen35_shape(tmp_path / "hf", "k1v3_tied_mtp", seed=1), tmp_path / "s.gguf",
                               outtype="f32", progress=False)  # hidden width 48
    with pytest.raises(ConversionError, match="n_embd = 144 is not a multiple of 32"):
        inflate_gguf(small, tmp_path / "x.gguf", "q8_0", n_embd=144, progress=False)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()


def test_inflate_refuses_what_it_cannot_keep(tmp_path):
    with pytest.raises(ConversionError, match="n_ff = 16 is smaller than the model's 512"):
        inflate_gguf(pair_file("qwen3", "target", "f32"), tmp_path / "x.gguf", "q8_0", n_ff=16, progress=False)
    from pydflash.convert.quantize import quantize_gguf

    q4 = quantize_gguf(pair_file("qwen3", "target", "f32"), tmp_path / "q4_0.gguf", "q4_0", progress=False)
    with pytest.raises(ConversionError, match="inflation needs an f32/f16/bf16/q8_0 source, got Q4_0"):
        inflate_gguf(q4, tmp_path / "x.gguf", "q8_0", n_ff=1024, progress=False)
    other = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    other.add_block_count(1)
    other.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    other.write_header_to_file(), other.write_kv_data_to_file(), other.write_tensors_to_file(), other.close()
    with pytest.raises(ConversionError, match="expected one of qwen3, qwen35, qwen3moe, qwen35moe, dflash"):
        inflate_gguf(tmp_path / "llama.gguf", tmp_path / "x.gguf", "q8_0", progress=False)
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
@pytest.mark.parametrize("copies", [1, 2], ids=["width_kept", "width_x2"])
def test_mtp_blocks_stay_last_and_draft_the_same(tmp_path, maker, shape, copies):
    """A model with an MTP head: the appended layers go before it (renumbered last, its FFN widened; its eh_proj
    reading two streams when the hidden width grows), and the head drafts the same tokens with the same
    log-probabilities as in the original."""
    d = maker(tmp_path / "hf", shape, seed=2)
    small = convert_hf_to_gguf(d, tmp_path / "small.gguf", outtype="f32", progress=False)
    arch = gguf.GGUFReader(small).fields["general.architecture"].contents()
    n_embd = int(gguf.GGUFReader(small).fields[f"{arch}.embedding_length"].contents())
    big = inflate_gguf(small, tmp_path / "big.gguf", "f32", n_ff=1024, n_ff_exp=256, n_ff_shexp=192, extra_layers=2,
                       n_embd=copies * n_embd, progress=False)
    r = gguf.GGUFReader(big)
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
