#!/usr/bin/env python3
"""Train a DFlash2 drafter for a committed target GGUF (issue 25), and, with --dflash1, a DFlash drafter the same way
(the baseline DFlash2 is measured against):

    python tools/train_dflash2.py tests/data/pairs/qwen35-target-f32.gguf tests/data/pairs/qwen35-dflash-f32.gguf \\
        build/dflash2/qwen35-dflash2-f32.gguf
    python tools/train_dflash2.py ... build/dflash2/qwen35-dflash1-f32.gguf --dflash1

The recipe is tools/train_pairs.py's for the committed DFlash drafters: the drafter's shape and keys taken from the
committed drafter GGUF (the second argument: 2 layers, the same target layers, block 16, MASK token, tokenizer),
self-distillation on the target's own greedy continuations of prompts from the training half of the corpus
(continuations and target features computed by pydflash), random anchors, dflash_loss's slot weights, AdamW with
a cosine schedule. DFlash2 adds z-lab's grouped dynamic causal convolutions around each layer's attention and MLP
(starting as the identity) and the candidate selector (codebooks from N(0, 0.02)), trained with speculators'
DFlash2 objective: the unary DFlash loss plus the selector's teacher-forced K-way cross-entropy (tools/dflash_ref.py
selector_loss). The GGUF written keeps the committed drafter's metadata, with the trained tensors (and DFlash2's four
dflash.* sizes), under the names llama.cpp's converter gives them (pydflash.convert.dflash.gguf_tensor_name).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import dflash_ref as R  # noqa: E402
import train_mtp as TM  # noqa: E402
import train_pairs as TP  # noqa: E402

BLOCK = 16
SIZES = dict(conv_kernel_size=4, conv_group_size=16, selector_rank=32, selector_top_k=8)


def log(*a):
    print(*a, flush=True)


def draft_config(draft: gguf.GGUFReader, n_target: int, dflash2: bool):
    """The committed drafter's shape as a Qwen3Config for tools/dflash_ref.py (target_layers are layer inputs:
    HF ids = GGUF ids - 1)."""
    from transformers import Qwen3Config

    f = lambda k: TM._field(draft, k)  # noqa: E731
    cfg = Qwen3Config(vocab_size=len(f("tokenizer.ggml.tokens")), hidden_size=int(f("dflash.embedding_length")),
                      intermediate_size=int(f("dflash.feed_forward_length")),
                      num_hidden_layers=int(f("dflash.block_count")),
                      num_attention_heads=int(f("dflash.attention.head_count")),
                      num_key_value_heads=int(f("dflash.attention.head_count_kv")),
                      head_dim=int(f("dflash.attention.key_length")),
                      rms_norm_eps=float(f("dflash.attention.layer_norm_rms_epsilon")),
                      rope_parameters={"rope_type": "default", "rope_theta": float(f("dflash.rope.freq_base"))},
                      attention_bias=False, tie_word_embeddings=False)
    cfg.block_size = int(f("dflash.block_size"))
    cfg.num_target_layers = n_target
    cfg.dflash_config = {"mask_token_id": int(f("tokenizer.ggml.mask_token_id")),
                         "target_layer_ids": [int(i) - 1 for i in f("dflash.target_layers")],
                         **(SIZES if dflash2 else {})}
    return cfg


def distill(target_path: str, capture: list[int], streams, n_seq: int, seq_len: int, seed: int):
    """n_seq sequences of seq_len tokens (a prompt window of 48-128 tokens, then the target's greedy continuation,
    train_pairs' prompt lengths) and the target's features at the drafter's capture layers, from pydflash."""
    from pydflash import _core

    model = _core.Model(target_path)
    session = _core.Session(model, n_ctx=seq_len + 8, type_k="f32", type_v="f32")
    rng = np.random.default_rng(seed)
    toks, feats, plens, t0 = [], [], [], time.time()
    while len(toks) < n_seq:
        seq, p = TM.greedy_sequence(session, streams, rng, [48, 64, 96, 128], seq_len)
        if seq is None:
            continue
        _, captured = session.eval(seq, capture_layers=capture)
        session.truncate(0)
        toks.append(seq)
        feats.append(np.concatenate(captured, axis=-1).astype(np.float16))
        plens.append(p)
        if len(toks) % 256 == 0:
            log(f"distill: {len(toks)}/{n_seq} sequences  {time.time() - t0:5.0f}s")
    return (torch.from_numpy(np.stack(toks).astype(np.int64)), torch.tensor(plens),
            torch.from_numpy(np.stack(feats)))


def losses(draft, embed, head, toks, feats, anchors, weights):
    """The unary DFlash loss and (DFlash2) the selector's, and the teacher-forced tau, over one batch."""
    block_ids, pos, mask, labels = R.block_train_batch(toks, anchors, draft.block_size, draft.mask_token_id)
    with torch.no_grad():
        noise = embed[block_ids]
    h = draft(noise, feats.float(), pos, mask)
    n, a = anchors.shape
    h = h.view(n, a, draft.block_size, -1)[:, :, 1:]
    logits = h @ head.T
    loss, _, tau = R.dflash_loss(logits, labels, weights)
    if isinstance(draft, R.DFlash2DraftModel):
        loss = loss + R.selector_loss(draft.candidate_selector, logits, h, toks.gather(1, anchors), labels, weights)
    return loss, tau


def train(draft, embed, head, data, steps: int, batch: int, n_anchors: int, lr: float, seed: int):
    toks, plens, feats = data
    opt = torch.optim.AdamW(TP.param_groups(draft, 0.01), lr=lr, betas=(0.9, 0.95))
    weights = R.loss_weights(draft.block_size)
    gen = torch.Generator().manual_seed(seed + 1)
    order, cursor, t0, run = torch.randperm(len(toks), generator=gen), 0, time.time(), None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = R.cosine_lr(step, steps, lr, max(1, steps // 25))
        if cursor + batch > len(order):
            order, cursor = torch.randperm(len(toks), generator=gen), 0
        idx = order[cursor:cursor + batch]
        cursor += batch
        anchors = TP.sample_anchors(plens[idx], toks.shape[1], n_anchors, gen)
        loss, tau = losses(draft, embed, head, toks[idx], feats[idx], anchors, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        run = (loss.item(), tau.item()) if run is None else (0.9 * run[0] + 0.1 * loss.item(),
                                                             0.9 * run[1] + 0.1 * tau.item())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"step {step + 1:5d}/{steps}  loss {run[0]:.3f}  tau(train) {run[1]:.2f}  {time.time() - t0:5.0f}s")


def write_gguf(template: str, out: str, draft, dflash2: bool) -> None:
    """The committed drafter's keys (and DFlash2's sizes) with the trained tensors."""
    from pydflash.convert.dflash import gguf_tensor_name

    reader = gguf.GGUFReader(template)
    writer = gguf.GGUFWriter(out, "dflash")
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for k, v in (SIZES.items() if dflash2 else ()):
        writer.add_uint32(f"dflash.{k}", v)
    n_layer = len(draft.layers)
    for name, p in sorted(draft.state_dict().items()):
        if name.startswith("rotary_emb"):
            continue
        writer.add_tensor(gguf_tensor_name(name, n_layer, dflash2), np.ascontiguousarray(p.detach().float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="the target GGUF (f32, f16 or q8_0)")
    ap.add_argument("template", help="the committed DFlash drafter GGUF whose shape and keys the new one takes")
    ap.add_argument("out", help="the drafter GGUF to write")
    ap.add_argument("--dflash1", action="store_true", help="a DFlash drafter (no convolutions, no selector)")
    ap.add_argument("--sequences", type=int, default=TP.FULL["n_cont"])
    ap.add_argument("--seq-len", type=int, default=TP.FULL["cont_len"])
    ap.add_argument("--steps", type=int, default=TP.FULL["draft_steps"])
    ap.add_argument("--batch", type=int, default=TP.FULL["draft_batch"])
    ap.add_argument("--anchors", type=int, default=TP.FULL["anchors"])
    ap.add_argument("--lr", type=float, default=TP.FULL["draft_lr"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", type=Path, default=None, help="cache the distilled data here (reused when present)")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    from pydflash.tokenizer import Tokenizer

    target, template = gguf.GGUFReader(args.target), gguf.GGUFReader(args.template)
    n_target = int(TM._field(target, TM._field(target, "general.architecture") + ".block_count"))
    cfg = draft_config(template, n_target, not args.dflash1)
    capture = [int(i) for i in TM._field(template, "dflash.target_layers")]
    if args.data and args.data.exists():
        data = torch.load(args.data)
    else:
        streams = TM.training_streams(Tokenizer.from_gguf(args.target))
        data = distill(args.target, capture, streams, args.sequences, args.seq_len, args.seed)
        if args.data:
            torch.save(data, args.data)
    embed = torch.from_numpy(TM._tensor(target, "token_embd.weight"))
    names = {t.name for t in target.tensors}
    head = torch.from_numpy(TM._tensor(target, "output.weight")) if "output.weight" in names else embed
    torch.manual_seed(args.seed)
    draft = (R.DFlashDraftModel if args.dflash1 else R.DFlash2DraftModel)(cfg).float().train()
    log(f"{'DFlash' if args.dflash1 else 'DFlash2'} drafter: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M "
        f"parameters, {len(data[0])} sequences, {args.steps} steps x {args.batch} x {args.anchors} anchors")
    train(draft, embed, head, data, args.steps, args.batch, args.anchors, args.lr, args.seed)
    write_gguf(args.template, args.out, draft.eval(), not args.dflash1)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
