"""Regression tests for the hardening issue: every hyper-parameter a file can set is checked at load (each case
below once crashed, hung or gave garbage in the first generate), RoPE scaling is applied as transformers applies
it or refused, layer patterns with no attention or no recurrent layer run, and every argument at its edges gets
a ValueError / TypeError naming it. Random mutants are covered by test_fuzz.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from export_pairs import pair_file
from gguf_edit import patch_tensor_info, rewrite

import pydflash
from pydflash import _core
from pydflash.errors import GGUFFormatError, ModelLoadError, PydflashError, UnsupportedModelError

T = gguf.GGUFValueType
NAN, INF = float("nan"), float("inf")


def target(kind: str):
    return pair_file(kind, "target", "f32")


def draft(kind: str):
    return pair_file(kind, "dflash", "f32")


def load_and_generate(target_path, draft_path):
    """what a user does first: load the pair and generate a couple of tokens, speculatively"""
    with pydflash.Model(target_path, draft_model_path=draft_path, n_ctx=64) as m:
        return m.generate("def f(x):", max_tokens=4).tokens


# (id, kind, which file is edited, rewrite arguments, error, message pattern)
BAD_HYPERPARAMETERS = [
    # block_count below the layers present crashed (tensor buffer not set); above them, a huge vector
    ("qwen3-block-count-0", "qwen3", "target", {"qwen3.block_count": (0, T.UINT32)}, GGUFFormatError,
     r"key 'qwen3\.block_count' = 0 but the file has tensors for 4 layers .*left unused"),
    ("qwen3-block-count-1", "qwen3", "target", {"qwen3.block_count": (1, T.UINT32)}, GGUFFormatError,
     r"'qwen3\.block_count' = 1 .*left unused"),
    ("qwen3-block-count-max", "qwen3", "target", {"qwen3.block_count": (0xFFFFFFFF, T.UINT32)}, GGUFFormatError,
     r"'qwen3\.block_count' = 4294967295, expected at most 4096 layers"),
    *[(f"qwen35-block-count-{n}", "qwen35", "target", {"qwen35.block_count": (n, T.UINT32)}, GGUFFormatError,
       rf"'qwen35\.block_count' = {n} .*left unused") for n in (1, 2, 3)],
    ("dflash-block-count-0", "qwen3", "draft", {"dflash.block_count": (0, T.UINT32)}, GGUFFormatError,
     r"'dflash\.block_count' = 0 but the file has tensors for 2 layers"),
    # eps: NaN and negative aborted in ggml; inf and 0 gave garbage
    *[(f"{arch}-eps-{v}", kind, role, {f"{arch}.attention.layer_norm_rms_epsilon": (v, T.FLOAT32)}, GGUFFormatError,
       rf"'{arch}\.attention\.layer_norm_rms_epsilon' = {v:g}, expected a finite value in \(0, 1\)")
      for arch, kind, role in (("qwen3", "qwen3", "target"), ("qwen35", "qwen35", "target"), ("dflash", "qwen3", "draft"))
      for v in (NAN, -1.0, INF, 0.0)],
    # M-RoPE sections beyond the head aborted; a rotary width of 0 hung the prefill
    ("qwen35-sections-100", "qwen35", "target",
     {"qwen35.rope.dimension_sections": ([100, 3, 2, 0], T.ARRAY, T.INT32)}, GGUFFormatError,
     r"'qwen35\.rope\.dimension_sections' = \[100, 3, 2, 0\]: expected entries >= 0 summing to 1\.\.64"),
    ("qwen35-rope-dims-0", "qwen35", "target", {"qwen35.rope.dimension_count": (0, T.UINT32)}, GGUFFormatError,
     r"'qwen35\.rope\.dimension_count' = 0, expected a value in \[2, 64\]"),
    ("qwen3-rope-dims-odd", "qwen3", "target", {"qwen3.rope.dimension_count": (7, T.UINT32)}, GGUFFormatError,
     r"qwen3\.rope\.dimension_count = 7 must be even"),
    # a RoPE base that is not a finite number above 1 gave garbage
    *[(f"{arch}-freq-base-{v}", arch, "target", {f"{arch}.rope.freq_base": (v, T.FLOAT32)}, GGUFFormatError,
       rf"'{arch}\.rope\.freq_base' = {v:g}, expected a finite value in \(1, 1e\+12\)")
      for arch in ("qwen3", "qwen35") for v in (0.0, -1.0, NAN, INF)],
    # a qwen35 layer pattern that does not match the tensors aborted
    ("qwen35-pattern-all-full", "qwen35", "target",
     {"qwen35.attention.recurrent_layers": ([False] * 4, T.ARRAY, T.BOOL)}, GGUFFormatError,
     r"missing required tensor 'blk\.0\.attn_q\.weight'"),
    ("qwen35-recurrent-layers-short", "qwen35", "target",
     {"qwen35.attention.recurrent_layers": ([True, True], T.ARRAY, T.BOOL)}, GGUFFormatError,
     r"key 'qwen35\.attention\.recurrent_layers' has 2 entries, expected 4"),
    # RoPE scaling the engine does not implement is refused instead of ignored
    ("qwen3-rope-longrope", "qwen3", "target",
     {"qwen3.rope.scaling.type": ("longrope", T.STRING), "qwen3.rope.scaling.factor": (4.0, T.FLOAT32)},
     UnsupportedModelError, r"qwen3\.rope\.scaling\.type = 'longrope' is not supported \(expected none, linear or yarn\)"),
    ("qwen3-rope-unknown", "qwen3", "target",
     {"qwen3.rope.scaling.type": ("banana", T.STRING), "qwen3.rope.scaling.factor": (4.0, T.FLOAT32)},
     UnsupportedModelError, r"'banana' is not supported"),
    ("qwen3-yarn-factor-below-1", "qwen3", "target",
     {"qwen3.rope.scaling.type": ("yarn", T.STRING), "qwen3.rope.scaling.factor": (0.5, T.FLOAT32)},
     GGUFFormatError, r"'qwen3\.rope\.scaling\.factor' = 0\.5 with YaRN scaling, expected a factor >= 1"),
    ("qwen3-block-count-5000", "qwen3", "target", {"qwen3.block_count": (5000, T.UINT32)}, GGUFFormatError,
     r"'qwen3\.block_count' = 5000, expected at most 4096 layers"),
    ("qwen3-rope-factor-nan", "qwen3", "target",
     {"qwen3.rope.scaling.type": ("linear", T.STRING), "qwen3.rope.scaling.factor": (NAN, T.FLOAT32)},
     GGUFFormatError, r"'qwen3\.rope\.scaling\.factor' = nan"),
]


@pytest.mark.parametrize("kind, role, set_keys, error, pattern",
                         [case[1:] for case in BAD_HYPERPARAMETERS], ids=[case[0] for case in BAD_HYPERPARAMETERS])
def test_bad_hyperparameter_is_a_typed_error_naming_the_key(tmp_path, kind, role, set_keys, error, pattern):
    src = target(kind) if role == "target" else draft(kind)
    bad = rewrite(src, tmp_path / "bad.gguf", set_keys=set_keys)
    with pytest.raises(error, match=pattern) as info:
        load_and_generate(bad, draft(kind)) if role == "target" else load_and_generate(target(kind), bad)
    assert str(bad) in str(info.value)


def test_the_unedited_pairs_load_and_generate():
    """the other side of every case above: the same files, unedited, work"""
    for kind in ("qwen3", "qwen35"):
        assert len(load_and_generate(target(kind), draft(kind))) == 4


@pytest.mark.parametrize("interval, missing", [(1, "blk.0.attn_q.weight"), (2, "blk.1.attn_q.weight"),
                                               (5, "blk.3.attn_qkv.weight")])
def test_qwen35_interval_that_does_not_match_the_tensors(tmp_path, interval, missing):
    bad = rewrite(target("qwen35"), tmp_path / "bad.gguf", drop_keys=["qwen35.attention.recurrent_layers"],
                  set_keys={"qwen35.full_attention_interval": (interval, T.UINT32)})
    with pytest.raises(GGUFFormatError, match=f"missing required tensor '{missing}'"):
        load_and_generate(bad, None)


def test_qwen35_interval_zero(tmp_path):
    bad = rewrite(target("qwen35"), tmp_path / "bad.gguf", drop_keys=["qwen35.attention.recurrent_layers"],
                  set_keys={"qwen35.full_attention_interval": (0, T.UINT32)})
    with pytest.raises(GGUFFormatError, match=r"'qwen35\.full_attention_interval' = 0, expected a value in \[1, "):
        load_and_generate(bad, None)


def test_qwen35_interval_without_the_list_matches_the_list(tmp_path):
    """the committed pair's list is the default pattern (interval 4): dropping it must change nothing"""
    derived = rewrite(target("qwen35"), tmp_path / "derived.gguf", drop_keys=["qwen35.attention.recurrent_layers"])
    assert load_and_generate(derived, draft("qwen35")) == load_and_generate(target("qwen35"), draft("qwen35"))


def test_invalid_utf8_architecture_names_the_key(tmp_path):
    bad = rewrite(target("qwen3"), tmp_path / "bad.gguf", arch=b"\xff\xfeqwen3")
    with pytest.raises(GGUFFormatError, match=r"key 'general\.architecture' is not valid UTF-8"):
        pydflash.Model(bad)


def test_invalid_utf8_in_a_string_the_tokenizer_reads(tmp_path):
    bad = rewrite(target("qwen3"), tmp_path / "bad.gguf",
                  set_keys={"tokenizer.ggml.pre": (b"qwen\xff2", T.STRING)})
    with pytest.raises(PydflashError, match=r"tokenizer\.ggml\.pre"):
        pydflash.Model(bad)


def test_a_malformed_header_says_what_ggml_found(tmp_path):
    """ggml's parser says what is wrong only in its log; the error carries it (before: 'malformed or truncated
    GGUF header/metadata' alone, whatever was wrong)"""
    bad = patch_tensor_info(target("qwen3"), tmp_path / "bad.gguf", "blk.0.ffn_up.weight", ggml_type=99)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: malformed or truncated GGUF header/metadata \(ggml: "
                                             r"tensor 'blk\.0\.ffn_up\.weight' has invalid ggml type 99"):
        pydflash.Model(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(target("qwen3").read_bytes()[:3000])  # inside the tokenizer's arrays
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: .*\(ggml: failed to read key-value pairs\)$"):
        pydflash.Model(cut)


@pytest.mark.parametrize("n_tokens", [2048, 4097])
def test_a_token_list_unlike_the_embedding_is_refused(tmp_path, n_tokens):
    """As llama.cpp refuses it (token_embd must be {n_embd, n_vocab}). A shorter list loaded before, then its ids
    past the list failed mid-generation (a bias, detokenize) and could be generated with no text."""
    reader = gguf.GGUFReader(target("qwen3"))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    kinds = reader.fields["tokenizer.ggml.token_type"].contents()
    grown = n_tokens - len(tokens)
    kept = set(tokens[:n_tokens])  # (and the merges among them: the tokenizer itself refuses any other)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if {*m.split(" "), m.replace(" ", "")} <= kept]
    bad = rewrite(target("qwen3"), tmp_path / "bad.gguf", set_keys={
        "tokenizer.ggml.tokens": (tokens[:n_tokens] + [f"[PAD{i}]" for i in range(grown)], T.ARRAY, T.STRING),
        "tokenizer.ggml.token_type": (kinds[:n_tokens] + [1] * grown, T.ARRAY, T.INT32),
        "tokenizer.ggml.merges": (merges, T.ARRAY, T.STRING)})
    with pytest.raises(GGUFFormatError, match=rf"bad\.gguf: tokenizer\.ggml\.tokens has {n_tokens} entries but "
                                              r"token_embd\.weight has 4096 rows"):
        pydflash.Model(bad)


def test_integer_weight_type_is_refused(tmp_path):
    """an I32 weight segfaulted in the first matmul (i32 is the integer type whose size matches the f32 data in
    the file; the others are refused earlier as a malformed file)"""
    type_id, name = 26, "i32"
    bad = patch_tensor_info(target("qwen35"), tmp_path / "bad.gguf", "blk.0.ffn_up.weight", ggml_type=type_id)
    with pytest.raises(UnsupportedModelError,
                       match=rf"tensor 'blk\.0\.ffn_up\.weight' has type {name}, expected a float or quantized type"):
        load_and_generate(bad, None)


# ---- layer patterns and RoPE scaling, against transformers ----

PROMPT = [3, 17, 200, 45, 9, 311, 77, 5, 128, 64, 400, 12, 90, 33, 250, 8, 61, 140, 22, 7, 500, 19, 2, 88, 300]
TOL = 1e-4  # relative to the largest |logit|, f32 weights and cache (measured ~1e-6)


def reference_logits(checkpoint_dir, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([tokens]), use_cache=False).logits[0].numpy()


def our_logits(gguf_path, tokens, **session_args):
    session = _core.Session(_core.Model(str(gguf_path)), n_ctx=128, type_k="f32", type_v="f32", **session_args)
    logits, _ = session.eval(np.array(tokens, dtype=np.int32), all_logits=True)
    return logits


def relative_error(ours, theirs):
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("layer_type", ["full_attention", "linear_attention"])
def test_qwen35_with_one_kind_of_layer_matches_transformers(qwen35_checkpoint, tmp_path, layer_type):
    """no recurrent layer (no recurrent state) and no attention layer (no KV cache) both run"""
    from pydflash.convert import convert_hf_to_gguf

    d = qwen35_checkpoint("k2v4_hd32", layer_types=[layer_type] * 4, seed=5)
    path = convert_hf_to_gguf(d, tmp_path / "m.gguf", outtype="f32", progress=False)
    rel = relative_error(our_logits(path, PROMPT), reference_logits(d, PROMPT))
    print(f"{layer_type}: max relative error vs transformers {rel:.2e}")
    assert rel <= TOL
    with pydflash.Model(path, n_ctx=64) as m:
        a = m.generate(PROMPT, max_tokens=6)
        assert m.generate(PROMPT, max_tokens=6).tokens == a.tokens  # the cached prompt gives the same answer


ROPE_SCALINGS = {
    "linear-4": {"rope_type": "linear", "factor": 4.0},
    "yarn-4": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-8-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                     "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-4-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                "attention_factor": 0.8},
}


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(qwen3_checkpoint, tmp_path, scaling):
    """the converter writes rope.scaling.*; the engine applies them as transformers does, over a prompt longer
    than the original context (16) so the scaled and unscaled frequencies disagree"""
    from pydflash.convert import convert_hf_to_gguf

    d = qwen3_checkpoint("gqa4x2_hd64", rope_scaling=ROPE_SCALINGS[scaling], max_position_embeddings=128, seed=7)
    path = convert_hf_to_gguf(d, tmp_path / "m.gguf", outtype="f32", progress=False)
    theirs = reference_logits(d, PROMPT)
    rel = relative_error(our_logits(path, PROMPT), theirs)
    print(f"{scaling}: max relative error vs transformers {rel:.2e}")
    assert rel <= TOL
    # the keys matter: without them the same weights miss transformers by far more than the tolerance
    keys = [k for k in gguf.GGUFReader(path).fields if k.startswith("qwen3.rope.scaling.")]
    assert keys
    unscaled = rewrite(path, tmp_path / "unscaled.gguf", drop_keys=keys)
    assert relative_error(our_logits(unscaled, PROMPT), theirs) > 100 * TOL


def test_rope_scaling_keys_llama_cpp_falls_back_on(qwen3_checkpoint, tmp_path):
    """as in llama.cpp: the legacy rope.scale_linear is the factor's old name, and YaRN's original context
    defaults to the training context"""
    from pydflash.convert import convert_hf_to_gguf

    linear_dir = qwen3_checkpoint("gqa4x2_hd64", rope_scaling=ROPE_SCALINGS["linear-4"], max_position_embeddings=128,
                                  seed=7)
    linear = convert_hf_to_gguf(linear_dir, tmp_path / "linear.gguf", outtype="f32", progress=False)
    legacy = rewrite(linear, tmp_path / "legacy.gguf", drop_keys=["qwen3.rope.scaling.type", "qwen3.rope.scaling.factor"],
                     set_keys={"qwen3.rope.scale_linear": (4.0, T.FLOAT32)})
    assert np.array_equal(our_logits(legacy, PROMPT), our_logits(linear, PROMPT))

    yarn_dir = qwen3_checkpoint("gqa4x2_hd64", rope_scaling=ROPE_SCALINGS["yarn-4"], max_position_embeddings=128,
                                seed=7)
    yarn = convert_hf_to_gguf(yarn_dir, tmp_path / "yarn.gguf", outtype="f32", progress=False)
    assert gguf.GGUFReader(yarn).fields["qwen3.rope.scaling.original_context_length"].contents() == 16
    from_training = rewrite(yarn, tmp_path / "from-training.gguf",
                            drop_keys=["qwen3.rope.scaling.original_context_length"],
                            set_keys={"qwen3.context_length": (16, T.UINT32)})
    assert np.array_equal(our_logits(from_training, PROMPT), our_logits(yarn, PROMPT))


# ---- the core's own entry points ----

@pytest.fixture(scope="module")
def core_pair():
    model = _core.Model(str(target("qwen3")))
    return model, _core.DraftSession(model, str(draft("qwen3")), n_ctx=256)


def test_draft_rejects_bad_positions_anchor_and_start(core_pair):
    """these tripped ggml asserts (positions, anchor) or wrote out of bounds (start)"""
    model, ds = core_pair
    feats = np.zeros((4, len(ds.capture_layers) * model.n_embd), dtype=np.float32)
    with pytest.raises(IndexError, match="position -3 is negative"):
        ds.draft(feats, np.array([-3, -2, -1, 0], dtype=np.int32), 5, 4)
    with pytest.raises(IndexError, match=rf"anchor token {model.n_vocab} is outside the vocabulary \[0, {model.n_vocab}\)"):
        ds.draft(feats, np.arange(4, dtype=np.int32), model.n_vocab, 4)
    with pytest.raises(ValueError, match=r"anchor = -1, expected a value in \[0, "):
        ds.draft(feats, np.arange(4, dtype=np.int32), -1, 4)
    with pytest.raises(ValueError, match=r"start = -1, expected a value in \[0, "):
        ds.draft(feats, np.arange(4, dtype=np.int32), 5, -1)
    with pytest.raises(TypeError, match="positions must be a 1-D sequence of integers"):
        ds.draft(feats, np.arange(4, dtype=np.float32), 5, 4)
    with pytest.raises(ValueError, match=r"positions = 4294967296, expected a value in"):
        ds.draft(feats, np.array([0, 1, 2, 2**32], dtype=np.int64), 5, 4)
    # still usable: a good call after the bad ones
    ids = ds.draft(feats, np.arange(4, dtype=np.int32), 5, 4)
    assert len(ids) == ds.block_size - 1


def test_session_arguments(core_pair):
    model, _ = core_pair
    with pytest.raises(ValueError, match=r"n_ctx = 2147483648, expected a value in \[1, 1073741824\]"):
        _core.Session(model, n_ctx=2**31)
    with pytest.raises(ValueError, match=r"n_rollback = -1, expected a value in"):
        _core.Session(model, n_ctx=64, n_rollback=-1)
    with pytest.raises(ValueError, match=r"n_rollback = 4294967295, expected a value in \[1, 65536\]"):
        model.recurrent_bytes_for(2**32 - 1)
    with pytest.raises(ValueError, match=r"quantize: rows of -32 values: expected at least 1"):
        _core.quantized_row_size(8, -32)
    s = _core.Session(model, n_ctx=64)
    with pytest.raises(ValueError, match="eval_slot: no evaluation is pending"):
        s.eval_slot(0)
    s.eval(np.array([1, 2, 3], dtype=np.int32))
    assert [s.eval_slot(i) for i in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"row = 3, expected a value in \[0, 2\]"):
        s.eval_slot(3)
    with pytest.raises(ValueError, match=r"tokens = 18446744073709551615, expected a value in"):
        s.eval(np.array([2**64 - 1], dtype=np.uint64))
    s.truncate(0)
    with pytest.raises(TypeError, match="tokens must be a 1-D sequence of integers"):
        s.eval(np.array([1.5, 2.0]))
    with pytest.raises(IndexError, match=rf"token id {model.n_vocab} at index 0 is outside the vocabulary"):
        s.eval(np.array([model.n_vocab], dtype=np.int32))
    with pytest.raises(ValueError, match=r"tokens = 1099511627776, expected a value in"):
        s.eval(np.array([2**40], dtype=np.int64))
    with pytest.raises(ValueError, match=r"max_tokens = -1, expected a value in"):
        s.generate([1, 2], max_tokens=-1)
    logits, _ = s.eval(np.array([1, 2], dtype=np.int32))
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("type_id, name", [(26, "i32"), (27, "i64"), (28, "f64"), (9, "q8_1"), (15, "q8_K")])
def test_quantize_refuses_types_weights_cannot_have(type_id, name):
    """quantize to I32 aborted inside ggml"""
    with pytest.raises(ValueError, match=f"quantize: {name} is not a type weights can be quantized to"):
        _core.quantize(np.zeros((1, 256), dtype=np.float32), type_id)
    with pytest.raises(ValueError, match=r"type = 99, expected a value in \[0, "):
        _core.quantize(np.zeros((1, 256), dtype=np.float32), 99)


# ---- Model / generate arguments at their edges ----

BAD_MODEL_ARGUMENTS = [
    (dict(n_threads=-1), ValueError, r"n_threads = -1, expected a value in \[1, "),
    (dict(n_threads=0), ValueError, r"n_threads = 0, expected a value in \[1, "),
    (dict(n_threads=2**31), ValueError, r"n_threads = 2147483648"),
    (dict(n_ctx=None), TypeError, r"n_ctx must be an int, got NoneType"),
    (dict(n_ctx=1.5), TypeError, r"n_ctx must be an int, got float"),
    (dict(n_ctx=True), TypeError, r"n_ctx must be an int, got bool"),
    (dict(n_ctx=-1), ValueError, r"n_ctx = -1, expected 0 \(the model's trained context\) or a value in \[1, 1073741824\]"),
    (dict(n_ctx=2**31), ValueError, r"n_ctx = 2147483648, expected a value in \[1, 1073741824\]"),
    (dict(n_gpu_layers=-2), ValueError, r"n_gpu_layers = -2, expected a value in \[-1, "),
    (dict(n_ubatch=0), ValueError, r"n_ubatch = 0, expected a value in \[1, "),
    (dict(block_size=0), ValueError, r"block_size = 0, expected a value in \[2, 256\]"),
    (dict(block_size=-1), ValueError, r"block_size = -1, expected a value in \[2, 256\]"),
    (dict(tree_budget=0), ValueError, r"tree_budget = 0, expected a value in \[1, 255\]"),
    (dict(verbose=1), TypeError, r"verbose must be True or False, got int"),
    (dict(kv_type="f8"), ValueError, r"kv_type='f8' is not one of f32, f16"),
]


@pytest.mark.parametrize("kwargs, error, pattern", BAD_MODEL_ARGUMENTS, ids=[str(a[0]) for a in BAD_MODEL_ARGUMENTS])
def test_bad_model_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        pydflash.Model(target("qwen3"), draft_model_path=draft("qwen3"), **kwargs)


def test_threads_beyond_the_cores_are_capped_with_a_warning(caplog):
    """100000 threads segfaulted in the OpenMP runtime; 5000 took 17 s for 2 tokens"""
    import os

    cores = len(os.sched_getaffinity(0))
    with pydflash.Model(target("qwen3"), n_ctx=64, n_threads=100000) as m:
        assert m.n_threads == cores
        assert m.generate("x", max_tokens=2).tokens
    assert f"n_threads = 100000 exceeds the {cores} usable cores; using {cores}" in caplog.text


def test_micro_batch_beyond_the_context_is_bounded():
    """n_ubatch = 10**6 with a draft allocated a 2.2 GiB feature ring: the micro-batch is bounded by n_ctx"""
    with pydflash.Model(target("qwen3"), draft_model_path=draft("qwen3"), n_ctx=256, n_ubatch=10**6) as m:
        assert m._draft.ring_capacity <= 256
        assert m._draft.ring_bytes <= 256 * len(m._draft.capture_layers) * m._model.n_embd * 4
        assert len(m.generate("def f(x):", max_tokens=4).tokens) == 4


@pytest.fixture(scope="module")
def model():
    with pydflash.Model(target("qwen3"), draft_model_path=draft("qwen3"), n_ctx=256) as m:
        yield m


BAD_GENERATE_ARGUMENTS = [
    (dict(prompt=[1.0, 2.0]), TypeError, r"prompt\[0\] must be an int token id, got float"),
    (dict(prompt=[1, True]), TypeError, r"prompt\[1\] must be an int token id, got bool"),
    (dict(prompt=[4096]), ValueError, r"prompt\[0\] = 4096 is outside the vocabulary \[0, 4096\)"),
    (dict(prompt=[5, -1]), ValueError, r"prompt\[1\] = -1 is outside the vocabulary"),
    (dict(stop=[""]), ValueError, r"stop\[0\] is an empty string"),
    (dict(stop=""), ValueError, r"stop\[0\] is an empty string"),
    (dict(stop=[None]), TypeError, r"stop\[0\] must be a string, got NoneType"),
    (dict(temperature=-1), ValueError, r"temperature = -1\.0, expected a finite value"),
    (dict(temperature=NAN), ValueError, r"temperature = nan, expected a finite value"),
    (dict(temperature=INF), ValueError, r"temperature = inf, expected a finite value"),
    (dict(max_tokens=-1), ValueError, r"max_tokens = -1, expected a value in \[0, "),
    (dict(max_tokens=2**31), ValueError, r"max_tokens = 2147483648"),
    (dict(max_tokens=1.0), TypeError, r"max_tokens must be an int, got float"),
]


@pytest.mark.parametrize("kwargs, error, pattern", BAD_GENERATE_ARGUMENTS,
                         ids=[str(a[0]) for a in BAD_GENERATE_ARGUMENTS])
def test_bad_generate_argument(model, kwargs, error, pattern):
    args = {"prompt": "def f(x):", "max_tokens": 4, **kwargs}
    with pytest.raises(error, match=pattern):
        model.generate(**args)
    with pytest.raises(error, match=pattern):
        "".join(model.stream(**args))


def test_numpy_integer_prompts_are_token_ids(model):
    ids = model.tokenize("def f(x):")
    want = model.generate(ids, max_tokens=4).tokens
    assert model.generate(np.array(ids, dtype=np.int64), max_tokens=4).tokens == want
    assert model.generate([np.int32(t) for t in ids], max_tokens=4).tokens == want


def test_max_tokens_none_runs_to_the_end_of_the_context():
    with pydflash.Model(target("qwen3"), draft_model_path=draft("qwen3"), n_ctx=48) as m:
        prompt = m.tokenize("def f(x):")
        c = m.generate(prompt, max_tokens=None)
        if c.finish_reason == "length":  # no end-of-generation token before the context filled up
            assert len(prompt) + len(c.tokens) == 48 + 1  # the last token is picked, not stored
        else:
            assert c.finish_reason == "stop" and len(prompt) + len(c.tokens) <= 48
        assert c.tokens == m.generate(prompt, max_tokens=None, speculative=False).tokens
