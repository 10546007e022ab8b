#!/usr/bin/env python3
"""Train a multi-token-prediction (MTP) head for a Qwen3.5 (or Qwen3.5-MoE) GGUF target that has none, and write the
target with it (issue 26): the committed pair's `tests/data/pairs/qwen35-target-mtp-q8_0.gguf` is made by

    python tools/train_mtp.py tests/data/pairs/qwen35-target-f32.gguf build/mtp/qwen35-target-mtp-f32.gguf
    pydflash-quantize build/mtp/qwen35-target-mtp-f32.gguf tests/data/pairs/qwen35-target-mtp-q8_0.gguf q8_0

and `qwen35moe-target-mtp-q8_0.gguf` the same way from `qwen35moe-target-q8_0.gguf` (a head with the target's MoE
FFN: 32 experts, top-4, a shared expert).

The head is the Qwen3.5 releases' (speculators' MTPLayerMixin over transformers' Qwen3_5DecoderLayer, a full
attention layer and the target's FFN kind): x = fc([pre_fc_norm_embedding(embed(t_p)) ‖ pre_fc_norm_hidden(h_{p-1})])
-> the layer -> norm = h'_p, whose logits under the target's (frozen, shared) LM head predict t_{p+1}; h_{p-1} is the
target's final normed hidden state at the position before. Trained the way the DFlash drafters were (tools/
train_pairs.py): self-distillation on the target's own greedy continuations of prompts from the training half of the
same corpus (the held-out documents the evaluation prompts come from are left out), the target's states computed by
pydflash itself. Two steps per position, as the head runs at inference: step 1 from the target's h, step 2 from the
head's own h' (FastMTP's recursive steps, weighted 1 and 0.6). AdamW, cosine schedule, fixed seeds and threads.
The head's tensors go into the GGUF as llama.cpp's converter writes a checkpoint's `mtp.*` (convert/mtp_head.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_pairs as TP  # noqa: E402

STEP_WEIGHTS = (1.0, 0.6)


def log(*a):
    print(*a, flush=True)


def _field(reader, key, default=None):
    return reader.fields[key].contents() if key in reader.fields else default


def _tensor(reader, name) -> np.ndarray:
    for t in reader.tensors:
        if t.name == name:
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
                [int(x) for x in reversed(t.shape)])
    raise KeyError(name)


def text_config(reader):
    """A one-layer Qwen3_5TextConfig (Qwen3_5MoeTextConfig for qwen35moe) with the target's attention, FFN and rotary
    sizes (the head's layer)."""
    arch = _field(reader, "general.architecture")
    a = arch + "."
    n_embd, head_dim = int(_field(reader, a + "embedding_length")), int(_field(reader, a + "attention.key_length"))
    sections = [int(x) for x in _field(reader, a + "rope.dimension_sections")]
    common = dict(
        vocab_size=int(reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")].shape[1]),
        hidden_size=n_embd, num_hidden_layers=1, num_attention_heads=int(_field(reader, a + "attention.head_count")),
        num_key_value_heads=int(_field(reader, a + "attention.head_count_kv")), head_dim=head_dim,
        rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon")), layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, a + "rope.freq_base")),
                         "partial_rotary_factor": int(_field(reader, a + "rope.dimension_count")) / head_dim,
                         "mrope_section": sections[:3], "mrope_interleaved": True})
    if arch == "qwen35":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(intermediate_size=int(_field(reader, a + "feed_forward_length")), **common)
    elif arch == "qwen35moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        cfg = Qwen3_5MoeTextConfig(num_experts=int(_field(reader, a + "expert_count")),
                                   num_experts_per_tok=int(_field(reader, a + "expert_used_count")),
                                   moe_intermediate_size=int(_field(reader, a + "expert_feed_forward_length")),
                                   shared_expert_intermediate_size=int(
                                       _field(reader, a + "expert_shared_feed_forward_length")), **common)
    else:
        raise SystemExit(f"general.architecture = {arch!r}: an MTP head is trained for qwen35 or qwen35moe targets")
    cfg._attn_implementation = "sdpa"
    return cfg


class MtpHead(torch.nn.Module):
    """speculators' MTP layer for Qwen3.5 (model_definitions.py: MTPLayerMixin), with the target's embedding and
    LM head frozen."""

    def __init__(self, cfg, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        if cfg.model_type.startswith("qwen3_5_moe"):
            import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as m

            layer, rotary, norm = m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeTextRotaryEmbedding, m.Qwen3_5MoeRMSNorm
        else:
            import transformers.models.qwen3_5.modeling_qwen3_5 as m

            layer, rotary, norm = m.Qwen3_5DecoderLayer, m.Qwen3_5TextRotaryEmbedding, m.Qwen3_5RMSNorm
        self.layer = layer(cfg, 0)
        # what PreTrainedModel._init_weights gives a MoE layer: its experts are allocated uninitialised and its
        # router at zero (every expert tied)
        for name, p in self.layer.named_parameters():
            if ".experts." in name or name == "mlp.gate.weight":
                torch.nn.init.normal_(p, mean=0.0, std=cfg.initializer_range)
        self.rotary = rotary(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.norm = (norm(h, eps=eps) for _ in range(3))
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] at positions [B, T] with the states before them h [B, T, E] -> h' [B, T, E] (causal)."""
        x = self.fc(torch.cat([self.enorm(self.embed[tokens]), self.hnorm(h)], -1))
        y = self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=None, position_ids=positions)
        return self.norm(y[0] if isinstance(y, tuple) else y)

    def tensors(self) -> dict[str, np.ndarray]:
        """The head in the Qwen3.5 checkpoints' names (`mtp.*`)."""
        out = {"mtp.fc.weight": self.fc.weight, "mtp.pre_fc_norm_embedding.weight": self.enorm.weight,
               "mtp.pre_fc_norm_hidden.weight": self.hnorm.weight, "mtp.norm.weight": self.norm.weight}
        out.update({f"mtp.layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return {k: v.detach().float().numpy() for k, v in out.items()}


def training_streams(tok) -> list[np.ndarray]:
    """The training half of train_pairs' corpus (its held-out documents left out), tokenized."""
    cfg, streams = TP.FULL, []
    for kind, docs in (("code", TP.code_documents()), ("prose", TP.prose_documents())):
        train, _ = TP.split_holdout(docs, cfg["holdout_pct"][kind])
        for _, text in TP.take_chars(train, cfg["train_chars"][kind]):
            ids = tok.tokenize(text, add_special=False)
            if len(ids) > 400:
                streams.append(np.asarray(ids, dtype=np.int32))
    return streams


def greedy_sequence(session, streams, rng, prompt_lens, seq_len: int):
    """(tokens, prompt length): a prompt window (of one of prompt_lens tokens, after a random offset of a random
    document) and the target's greedy continuation, seq_len tokens in all; tokens None when the target stopped
    early. The session is left empty."""
    s = streams[rng.integers(len(streams))]
    p = int(rng.choice(prompt_lens))
    o = int(rng.integers(0, len(s) - p))
    prompt = s[o:o + p]
    cont = session.generate(prompt, max_tokens=seq_len - p)["tokens"]
    seq = np.concatenate([prompt, np.asarray(cont, dtype=np.int32)])[:seq_len]
    session.truncate(0)
    return (seq if len(seq) == seq_len else None), p


def distill(target_path: str, streams, n_seq: int, seq_len: int, seed: int):
    """n_seq sequences of seq_len tokens (a prompt window, then the target's greedy continuation) and the target's
    final normed hidden states at every position, from pydflash."""
    from pydflash import _core

    model = _core.Model(target_path)
    session = _core.Session(model, n_ctx=seq_len + 8, type_k="f32", type_v="f32")
    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(target_path)
    arch = _field(reader, "general.architecture")
    out_norm = _tensor(reader, "output_norm.weight")
    eps = float(_field(reader, arch + ".attention.layer_norm_rms_epsilon"))
    toks, hs, t0 = [], [], time.time()
    for i in range(n_seq):
        seq, _ = greedy_sequence(session, streams, rng, [32, 48, 64, 96], seq_len)
        if seq is None:
            continue
        _, (last,) = session.eval(seq, capture_layers=[model.n_layer])
        h = last / np.sqrt((last.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * out_norm
        toks.append(seq)
        hs.append(h.astype(np.float16))
        if (i + 1) % 64 == 0:
            log(f"distill: {i + 1}/{n_seq} sequences  {time.time() - t0:5.0f}s")
    return torch.from_numpy(np.stack(toks).astype(np.int64)), torch.from_numpy(np.stack(hs))


def step_losses(head: MtpHead, toks: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
    """Cross-entropy of each step over a batch: step 1 rows p = 1..T-2 (token p, target h_{p-1}) predict t_{p+1};
    step 2 rows (token p+1, the head's h'_p) predict t_{p+2}."""
    B, T = toks.shape
    pos = torch.arange(1, T, dtype=torch.long)[None].expand(B, -1)
    h1 = head(toks[:, 1:], h[:, :-1].float(), pos)  # rows 1..T-1
    logits1 = h1[:, :-1] @ head.lm_head.T
    loss1 = F.cross_entropy(logits1.reshape(-1, logits1.shape[-1]), toks[:, 2:].reshape(-1))
    h2 = head(toks[:, 2:], h1[:, :-1], pos[:, 1:])  # rows 2..T-1, each from the head's state before it
    logits2 = h2[:, :-1] @ head.lm_head.T
    loss2 = F.cross_entropy(logits2.reshape(-1, logits2.shape[-1]), toks[:, 3:].reshape(-1))
    return [loss1, loss2]


def train(head: MtpHead, toks, h, steps: int, batch: int, lr: float, seed: int, n_val: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    val_t, val_h, tr_t, tr_h = toks[:n_val], h[:n_val], toks[n_val:], h[n_val:]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 *
                                              (1 + np.cos(np.pi * min(s, steps) / steps)))
    t0 = time.time()
    for step in range(steps):
        idx = torch.randint(0, len(tr_t), (batch,), generator=gen)
        losses = step_losses(head, tr_t[idx], tr_h[idx])
        loss = sum(w * x for w, x in zip(STEP_WEIGHTS, losses))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                v = step_losses(head.eval(), val_t, val_h)
                head.train()
            log(f"step {step:5d}  loss {losses[0].item():.3f} / {losses[1].item():.3f}  val {v[0].item():.3f} / "
                f"{v[1].item():.3f}  {time.time() - t0:5.0f}s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="a qwen35 or qwen35moe GGUF without an MTP head (f32, f16 or q8_0)")
    ap.add_argument("out", help="the GGUF to write: the target with the trained head")
    ap.add_argument("--sequences", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=192)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from pydflash.convert.mtp_head import append_mtp_head
    from pydflash.tokenizer import Tokenizer

    reader = gguf.GGUFReader(args.target)
    streams = training_streams(Tokenizer.from_gguf(args.target))
    log(f"corpus: {len(streams)} documents, {sum(len(s) for s in streams)} tokens")
    toks, h = distill(args.target, streams, args.sequences, args.seq_len, args.seed)
    embed = torch.from_numpy(_tensor(reader, "token_embd.weight"))
    names = {t.name for t in reader.tensors}
    lm_head = torch.from_numpy(_tensor(reader, "output.weight")) if "output.weight" in names else embed
    head = MtpHead(text_config(reader), embed, lm_head)
    train(head, toks, h, args.steps, args.batch, args.lr, args.seed, n_val=32)
    append_mtp_head(args.target, args.out, head.tensors())
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
