"""PyTorch reference for DFlash drafters and greedy speculative decoding (test/tooling only).

What is here, written from ../shared/reference/dflash-algorithm.md (§1, §2, §4):

- `DFlashDraftModel`: the drafter in z-lab's Hugging Face layout (`architectures: ["DFlashDraftModel"]`,
  Qwen3 config fields + `block_size` + `dflash_config = {mask_token_id, target_layer_ids}`; tensors
  `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`; no embedding, no LM head: both are the
  target's). One forward takes the block's noise embeddings and the target features of the context:
  `c = hidden_norm(fc(ctx))` enters every layer as extra K/V rows only ("KV injection"), `k_norm` on
  context and block keys alike, RoPE at absolute positions, non-causal inside the block.
- `block_train_batch` / `dflash_loss`: the training contract (random anchors, block mask "context strictly
  before the anchor, bidirectional inside the block, blocks invisible to each other", same-position
  labels `tokens[anchor + k]`, slot 0 without loss, weights `exp(-(k-1)/gamma_w)`).
- `greedy_generate`: plain greedy decoding of a target (the losslessness oracle).
- `spec_generate`: greedy chain speculative decoding (§2.1) with any proposer; `dflash_proposer` and
  `lookup_proposer` (prompt lookup / n-gram) plug into it. Rejected tokens are removed from the target
  state: attention caches are cropped; hybrid targets (Qwen3.5 gated delta net + conv state, which a
  crop cannot roll back) are restored from a copy taken before the verify pass and the accepted tokens
  are replayed (rollback method A, §6.2), so the output equals plain greedy decoding up to kernel
  numerics (exactly, in float64).
- `repeat_share`: share of generated tokens that close an n-gram seen earlier in prompt + output.

torch and transformers are needed (test-only dependencies of pydflash).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


# --------------------------------------------------------------------------------------------------
# drafter


def draft_value(config, name: str, default=None):
    """z-lab's lookup order: `dflash_config[name]`, then the top-level field."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def make_draft_config(target_config, *, n_layers: int, target_layer_ids: Sequence[int], mask_token_id: int,
                      block_size: int = 16, n_heads: int | None = None, n_kv_heads: int | None = None,
                      head_dim: int | None = None, intermediate_size: int | None = None,
                      rope_theta: float | None = None) -> Qwen3Config:
    """A drafter config for `target_config` (Qwen3 or Qwen3.5 text config): same hidden size and vocabulary,
    Qwen3 attention (full-dim NEOX RoPE, no partial rotary, no output gate)."""
    tc = target_config
    n_target = tc.num_hidden_layers
    ids = [int(i) for i in target_layer_ids]
    if any(i < 0 or i > n_target - 2 for i in ids):
        # id l is the output of layer l = the input of layer l+1, which exists only for l <= T-2 (§1.2)
        raise ValueError(f"target_layer_ids {ids} must lie in [0, {n_target - 2}] for a {n_target}-layer target")
    theta = rope_theta if rope_theta is not None else tc.rope_parameters["rope_theta"]
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads or tc.num_attention_heads,
        num_key_value_heads=n_kv_heads or tc.num_key_value_heads,
        head_dim=head_dim or tc.head_dim,
        hidden_act="silu",
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        architectures=["DFlashDraftModel"],
    )
    cfg.block_size = int(block_size)
    cfg.num_target_layers = int(n_target)
    cfg.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": ids}
    return cfg


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, L, head_dim]; cos/sin: [N, L, head_dim]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def sliding_window_mask(position_ids: torch.Tensor, q_len: int, window: int, causal: bool) -> torch.Tensor:
    """A sliding-window layer's mask, as z-lab's dflash 0.1.0 trains it (`_attention_mask`): a query at
    position q sees a key at p iff q - p < window, and p <= q (causal) or p - q < window (not). Positions are
    the given ones (context rows, then the block), so a context cut to its last rows keeps its positions.
    position_ids [N, C+Q] -> bool [N, 1, Q, C+Q], True = visible."""
    q = position_ids[:, -q_len:, None]
    k = position_ids[:, None, :]
    visible = (q - k) < window
    visible &= (k <= q) if causal else (k - q) < window
    return visible[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int = 0):
        super().__init__()
        # z-lab: a "sliding_attention" layer attends a window and is causal unless the config says is_causal
        types = getattr(config, "layer_types", None)
        sliding = bool(getattr(config, "use_sliding_window", False)) and types is not None and \
            types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        is_causal = getattr(config, "is_causal", None)
        self.swa_causal = True if is_causal is None else bool(is_causal)
        self.head_dim = config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # h: [N, Q, H] normed block states; ctx: [N, C, H] fused context; cos/sin: [N, C+Q, head_dim]
        n, q_len, _ = h.shape
        if self.sliding_window is not None:
            swa = sliding_window_mask(position_ids, q_len, self.sliding_window, self.swa_causal)
            mask = swa if mask is None else mask & swa
        c_len = ctx.shape[1]
        q = self.q_norm(self.q_proj(h).view(n, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=1)                                   # context rows first, then the block
        k = self.k_norm(self.k_proj(kv_in).view(n, c_len + q_len, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(n, c_len + q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = _rope(q, cos[:, c_len:], sin[:, c_len:])                          # queries: block positions only
        k = _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int = 0):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, mask, position_ids=None):
        # the input norm applies to the block only; ctx already went through hidden_norm
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, mask, position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """z-lab `DFlashDraftModel` (state-dict names `layers.*`, `fc`, `hidden_norm`, `norm`)."""

    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.target_layer_ids = list(draft_value(config, "target_layer_ids"))
        self.mask_token_id = int(draft_value(config, "mask_token_id"))
        self.block_size = int(draft_value(config, "block_size", 16))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """noise_embedding [N, Q, H] (target embeddings of the block tokens); target_hidden [N, C, n_ext*H]
        (raw extracted target features of the context rows); position_ids [N, C+Q] (context positions,
        then block positions); attention_mask None (inference: every block query sees every key) or bool
        [N, 1, Q, C+Q], True = visible. Returns the final-normed block states [N, Q, H]."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, attention_mask, position_ids)
        return self.norm(h)


class GroupedDynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over a block's rows (z-lab's GroupedDynamicCausalConv, written
    from its definition): base_kernel [2, K, H] and kernel_projection H -> 2*K*groups; side 0 convolves a sublayer's
    input, side 1 its output, both with coefficients computed from the input. Starts as the identity (speculators'
    initialisation: a base tap of 1 on the row itself, the projection 0)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, x.shape[-1] // self.group)

    def convolve(self, x: torch.Tensor, dyn: torch.Tensor, side: int, block: int) -> torch.Tensor:
        """x [N, A*block, H] (A blocks of `block` rows, each convolved on its own), dyn [N, A*block, 2, K, G]."""
        n, length, h = x.shape
        xb = x.reshape(n * (length // block), block, h)
        db = dyn[..., side, :, :].reshape(n * (length // block), block, self.kernel, -1)
        out = torch.zeros_like(xb)
        for o in range(self.kernel):
            xo = xb if o == 0 else F.pad(xb[:, :-o], (0, 0, o, 0))
            out = out + (self.base_kernel[side, o] + db[:, :, o].repeat_interleave(self.group, dim=-1)) * xo
        return out.view(n, length, h)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: Qwen3Config, layer_idx: int, kernel: int, group: int, block: int):
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedDynamicConv(config.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel, group)
        self.block = block

    def forward(self, h, ctx, cos, sin, mask, position_ids=None):
        def around(conv, x, sublayer):
            dyn = conv.coefficients(x)
            return conv.convolve(sublayer(conv.convolve(x, dyn, 0, self.block)), dyn, 1, self.block)

        h = h + around(self.attention_conv, self.input_layernorm(h),
                       lambda x: self.self_attn(x, ctx, cos, sin, mask, position_ids))
        return h + around(self.mlp_conv, self.post_attention_layernorm(h), self.mlp)


class CandidateSelector(nn.Module):
    """DFlash2's selector: score(j | i) = unary(j) + <prev[i] * W h, next[j]> over the unary top-k (codebooks and W
    start at N(0, 0.02), as speculators initialises them)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(0.02 * torch.randn(vocab, rank))
        self.successor_codebook = nn.Parameter(0.02 * torch.randn(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, pred: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """unary [..., V], hidden [..., H], pred [...] (the token before), cand [..., k] -> [..., k]."""
        pair = (self.predecessor_codebook[pred] * self.hidden_projection(hidden))[..., None, :]
        return unary.gather(-1, cand) + (pair * self.successor_codebook[cand]).sum(-1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlashDraftModel with DFlash2's convolutions around each layer's attention and MLP and its candidate selector
    (z-lab's DFlash2DraftModel state-dict names)."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        sizes = [int(draft_value(config, k)) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                       "selector_top_k")]
        self.layers = nn.ModuleList([DFlash2DecoderLayer(config, i, sizes[0], sizes[1], self.block_size)
                                     for i in range(config.num_hidden_layers)])
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, sizes[2], sizes[3])
        self.post_init()  # the layers' attention and MLP as DFlashDraftModel's; then DFlash2's own starting points
        with torch.no_grad():
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()


def selector_loss(selector: CandidateSelector, unary: torch.Tensor, hidden: torch.Tensor, anchors_tok: torch.Tensor,
                  labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """speculators' DFlash2 selector objective: teacher-forced K-way cross-entropy over the unary top-k, the label put
    in at rank K where it is missing; the predecessor of slot 1 is the anchor, of slot k the label of slot k-1; the
    slot weights of dflash_loss. unary [N, A, B-1, V], hidden [N, A, B-1, H], anchors_tok [N, A], labels [N, A, B-1]."""
    valid = labels != -100
    target = labels.clamp(min=0)
    cand = unary.detach().topk(selector.top_k, dim=-1).indices
    hit = cand.eq(target[..., None])
    contains = hit.any(-1)
    pos = torch.where(contains, hit.long().argmax(-1), torch.full_like(target, selector.top_k - 1))
    cand[..., -1] = torch.where(contains, cand[..., -1], target)
    pred = torch.cat([anchors_tok[..., None], target[..., :-1]], dim=-1)
    logits = selector.scores(unary, hidden, pred, cand)
    ce = F.cross_entropy(logits.flatten(0, 2), pos.flatten(), reduction="none").view(labels.shape)
    w = weights.to(ce.dtype)[None, None, :] * valid
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


def extract_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of target layers `layer_ids` (HF `hidden_states[l + 1]`)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


# --------------------------------------------------------------------------------------------------
# training contract


def loss_weights(block_size: int, gamma_w: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma_w) for slots k = 1..B-1 (paper eq. 4: gamma_w = 7 for B = 16)."""
    if gamma_w is None:
        gamma_w = {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, (block_size - 1) / 2))
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma_w)


def block_train_batch(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Inputs of one training forward.

    tokens [N, S] (full sequences whose target features are the context), anchors [N, A] (positions).
    Returns block_ids [N, A*B] (`[tok@anchor, MASK x (B-1)]` per block), position_ids [N, S + A*B],
    mask [N, 1, A*B, S + A*B] (block j sees context keys p < anchor_j and its own block), labels [N, A, B-1]
    (`tokens[anchor + k]`, -100 past the end of the sequence)."""
    n, s = tokens.shape
    a = anchors.shape[1]
    b = block_size
    offs = torch.arange(b)
    block_pos = anchors[:, :, None] + offs                                     # [N, A, B]
    block_ids = torch.full((n, a, b), mask_token_id, dtype=tokens.dtype)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    label_pos = block_pos[:, :, 1:]
    labels = tokens.gather(1, label_pos.clamp(max=s - 1).view(n, -1)).view(n, a, b - 1)
    labels = labels.masked_fill(label_pos >= s, -100)
    ctx_pos = torch.arange(s).expand(n, s)
    position_ids = torch.cat([ctx_pos, block_pos.view(n, a * b)], dim=1)
    q_anchor = anchors[:, :, None].expand(n, a, b).reshape(n, a * b)           # anchor of each query row
    ctx_visible = torch.arange(s)[None, None, :] < q_anchor[:, :, None]        # [N, A*B, S]
    q_block = torch.arange(a).repeat_interleave(b)
    blk_visible = (q_block[:, None] == q_block[None, :]).expand(n, a * b, a * b)
    mask = torch.cat([ctx_visible, blk_visible], dim=2)[:, None]
    return block_ids.view(n, a * b), position_ids, mask, labels


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """logits [N, A, B-1, V] (slots 1..B-1), labels [N, A, B-1]. Returns (weighted CE, per-slot accuracy [B-1],
    teacher-forced acceptance length: mean of 1 + number of leading correct slots)."""
    valid = labels != -100
    ce = F.cross_entropy(logits.flatten(0, 2), labels.clamp(min=0).flatten(), reduction="none").view(labels.shape)
    w = weights.to(ce.dtype)[None, None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        slot_acc = correct.sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1).float()
        full = valid.all(-1)                                                   # blocks with all labels present
        acc_len = 1.0 + correct.long().cumprod(-1).sum(-1).float()
        tau = acc_len[full].mean() if full.any() else torch.tensor(float("nan"))
    return loss, slot_acc, tau


# --------------------------------------------------------------------------------------------------
# decoding loops (batch 1, greedy)


def is_hybrid(target) -> bool:
    return "linear_attention" in (getattr(target.config, "layer_types", None) or [])


def _forward(target, ids: Sequence[int], cache, start: int, hidden: bool):
    x = torch.tensor([list(ids)], dtype=torch.long)
    pos = torch.arange(start, start + len(ids))[None]
    return target(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=hidden)


@torch.no_grad()
def greedy_generate(target, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding, one token per target forward. Returns the generated tokens."""
    cache = DynamicCache(config=target.config)
    out = _forward(target, prompt, cache, 0, False)
    gen: list[int] = []
    while True:
        tok = int(out.logits[0, -1].argmax())
        gen.append(tok)
        if tok in stop_ids or len(gen) >= max_new_tokens:
            return gen
        out = _forward(target, [tok], cache, len(prompt) + len(gen) - 1, False)


def _crop_to(cache, length: int) -> None:
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)            # transformers 5: crop() takes minus the number of tokens to drop


# proposer(tokens, start, feats, n) -> up to n draft tokens for positions start+1..start+n
Proposer = Callable[[list, int, "torch.Tensor | None", int], list]


@dataclass
class SpecResult:
    tokens: list[int]                                  # generated tokens (prompt excluded)
    accept_lengths: list[int] = field(default_factory=list)   # tokens committed per round, bonus included

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


@torch.no_grad()
def spec_generate(target, prompt: Sequence[int], max_new_tokens: int, propose: Proposer, *, block_size: int = 16,
                  layer_ids: Sequence[int] | None = None, stop_ids: Sequence[int] = ()) -> SpecResult:
    """Greedy chain speculative decoding (§2.1). `layer_ids` = the target layers the proposer reads (None: no
    features are kept). The first generated token comes from the prefill and counts as no round."""
    hybrid = is_hybrid(target)
    want = layer_ids is not None
    cache = DynamicCache(config=target.config)
    p = len(prompt)
    max_len = p + max_new_tokens
    out = _forward(target, prompt, cache, 0, want)
    tokens = list(prompt) + [int(out.logits[0, -1].argmax())]
    feats = extract_features(out.hidden_states, layer_ids) if want else None  # rows for positions < start
    res = SpecResult(tokens=[])
    start = p                                                                  # anchor position
    stopped = tokens[-1] in stop_ids
    while len(tokens) < max_len and not stopped:
        n = min(block_size - 1, max_len - len(tokens) - 1)
        drafts = [int(t) for t in propose(tokens, start, feats, n)][:n] if n > 0 else []
        block = [tokens[start]] + drafts
        snapshot = copy.deepcopy(cache) if hybrid and drafts else None
        out = _forward(target, block, cache, start, want)
        post = out.logits[0].argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == post[a]:
            a += 1
        commit = drafts[:a] + [post[a]]
        for i, t in enumerate(commit):
            if t in stop_ids:
                commit = commit[: i + 1]
                stopped = True
                break
        if a < len(drafts):                                                    # drop the rejected positions
            if hybrid:
                cache = snapshot
                out = _forward(target, block[: a + 1], cache, start, want)     # replay anchor + accepted
            else:
                _crop_to(cache, start + a + 1)
        if want:
            feats = torch.cat([feats, extract_features(out.hidden_states, layer_ids)[:, : a + 1]], dim=1)
        tokens += commit
        res.accept_lengths.append(len(commit))
        start += a + 1
    res.tokens = tokens[p:max_len]
    return res


def dflash_proposer(draft: DFlashDraftModel, target) -> Proposer:
    """Chain drafting: block `[tok[start], MASK x n]` at positions start..start+n over the context features of
    positions < start; drafts = argmax of the target LM head at slots 1..n (marginals, no shift)."""
    embed = target.get_input_embeddings()
    head = target.get_output_embeddings()

    def propose(tokens, start, feats, n):
        block = torch.tensor([[tokens[start]] + [draft.mask_token_id] * n])
        pos = torch.arange(start + n + 1)[None]                                # context 0..start-1, block start..
        h = draft(embed(block), feats[:, :start], pos)
        return head(h[:, 1:]).argmax(-1)[0].tolist()

    return propose


def lookup_proposer(max_ngram: int = 3, min_ngram: int = 1) -> Proposer:
    """Prompt lookup: find the latest earlier occurrence of the last g tokens (g = max_ngram..min_ngram) in
    prompt + output and propose the n tokens that followed it."""

    def propose(tokens, start, feats, n):
        seq = tokens[: start + 1]
        for g in range(max_ngram, min_ngram - 1, -1):
            if len(seq) <= g:
                continue
            pattern = seq[-g:]
            for i in range(len(seq) - g - 1, -1, -1):
                if seq[i:i + g] == pattern:
                    # copy what followed; a match that overlaps the end repeats with its period (LZ77-style)
                    out: list = []
                    for k in range(n):
                        j = i + g + k
                        out.append(seq[j] if j < len(seq) else out[j - len(seq)])
                    return out
        return []

    return propose


def repeat_share(prompt: Sequence[int], generated: Sequence[int], n: int = 4) -> float:
    """Share of generated tokens that close an n-gram already seen earlier in prompt + generated."""
    seq = list(prompt) + list(generated)
    seen = set()
    hits = 0
    for j in range(n - 1, len(seq)):
        gram = tuple(seq[j - n + 1:j + 1])
        if j >= len(prompt) and gram in seen:
            hits += 1
        seen.add(gram)
    return hits / max(1, len(generated))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default (§1.2): uniform from layer 1 to layer T-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))
