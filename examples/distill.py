#!/usr/bin/env python3
"""Attention distillation with streaming attention KL: a student learns a teacher's attention.

A teacher and a smaller student (plain PyTorch pre-LN transformer blocks, random init; the
student has fewer key/value heads (GQA) and a smaller head dim) read the same tokens. Every
attention layer hands out its queries and keys; the loss is

    sum over layers of  mean( attention_kl(q_teacher.detach(), k_teacher.detach(),
                                           q_student, k_student, causal=True) )

i.e. KL(P_teacher || P_student) per query row (setting 1: the teacher's distribution is fixed,
gradients go to the student's queries and keys only), minimised with Adam on the student.
No N x N attention matrix is ever stored, so the sequence can be long: the GPU defaults use
16K tokens, where materialising the two 16K x 16K score matrices per head and layer in fp32
(plus log-softmax and autograd copies) would need several hundred GB.

    pip install -e ".[examples]"                  # torch, triton (the gpu extra) and tqdm
    python examples/distill.py                    # GPU: 16K tokens, bf16 autocast
    python examples/distill.py --device cpu --tiny  # CPU, Triton interpreter: seconds

The last line of output is machine-readable: ``initial_loss=<float> final_loss=<float>``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Attention distillation with streamkl_gpu.attention_kl.")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="cuda (default when a GPU is present) or cpu (Triton interpreter, slow: use --tiny)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny model and sequence (seq 32, d_model 32, 2 layers, 20 steps): runs on CPU in seconds")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 16384; --tiny 32)")
    ap.add_argument("--batch", type=int, help="sequences per step (default 1; --tiny 2)")
    ap.add_argument("--layers", type=int, help="transformer blocks in each model (default 4; --tiny 2)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default 200; --tiny 20)")
    ap.add_argument("--lr", type=float, help="Adam learning rate (default 1e-3; --tiny 1e-2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar (print the loss every 10%% of steps)")
    args = ap.parse_args(argv)
    tiny = dict(seq=32, batch=2, layers=2, steps=20, lr=1e-2,
                teacher=dict(d_model=32, heads=4, kv_heads=4, vocab=128),   # head dim 8
                student=dict(d_model=16, heads=4, kv_heads=2, vocab=128))   # head dim 4, GQA 4:2
    full = dict(seq=16384, batch=1, layers=4, steps=200, lr=1e-3,
                teacher=dict(d_model=1024, heads=16, kv_heads=16, vocab=32000),  # head dim 64
                student=dict(d_model=512, heads=16, kv_heads=4, vocab=32000))    # head dim 32, GQA 16:4
    cfg = tiny if args.tiny else full
    for name in ("seq", "batch", "layers", "steps", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, cfg[name])
    args.teacher, args.student = cfg["teacher"], cfg["student"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import shutil
        args.device = "cuda" if shutil.which("nvidia-smi") else "cpu"
    if args.device == "cpu":
        # must be set before anything defines a Triton kernel, i.e. before importing streamkl_gpu
        os.environ["TRITON_INTERPRET"] = "1"

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from tqdm import tqdm

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from streamkl_gpu import attention_kl

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available (use --device cpu --tiny)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    class Attention(nn.Module):
        """Causal self-attention that also returns its queries and keys ([B, H, N, D], [B, H_K, N, D])."""

        def __init__(self, d_model, heads, kv_heads):
            super().__init__()
            assert d_model % heads == 0 and heads % kv_heads == 0
            self.h, self.hk, self.d = heads, kv_heads, d_model // heads
            self.wq = nn.Linear(d_model, heads * self.d, bias=False)
            self.wk = nn.Linear(d_model, kv_heads * self.d, bias=False)
            self.wv = nn.Linear(d_model, kv_heads * self.d, bias=False)
            self.wo = nn.Linear(heads * self.d, d_model, bias=False)

        def forward(self, x):
            b, n, _ = x.shape
            q = self.wq(x).view(b, n, self.h, self.d).transpose(1, 2)
            k = self.wk(x).view(b, n, self.hk, self.d).transpose(1, 2)
            v = self.wv(x).view(b, n, self.hk, self.d).transpose(1, 2)
            rep = self.h // self.hk
            kk, vv = (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
            # N_Q = N_K, so SDPA's top-left is_causal equals streamkl's bottom-right causal
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            return self.wo(o.transpose(1, 2).reshape(b, n, self.h * self.d)), q, k

    class Block(nn.Module):
        def __init__(self, d_model, heads, kv_heads):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.attn = Attention(d_model, heads, kv_heads)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x):
            a, q, k = self.attn(self.ln1(x))
            x = x + a
            return x + self.mlp(self.ln2(x)), q, k

    class Model(nn.Module):
        """Token embedding + blocks; returns the (q, k) of every layer."""

        def __init__(self, d_model, heads, kv_heads, vocab, layers):
            super().__init__()
            self.emb = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads) for _ in range(layers))

        def forward(self, tokens):
            x = self.emb(tokens)
            qk = []
            for blk in self.blocks:
                x, q, k = blk(x)
                qk.append((q, k))
            return qk

    teacher = Model(layers=args.layers, **args.teacher).to(device).eval().requires_grad_(False)
    student = Model(layers=args.layers, **args.student).to(device)
    opt = torch.optim.Adam(student.parameters(), lr=args.lr)
    vocab = args.teacher["vocab"]
    # fp32 weights; on the GPU the matmuls (and so q, k) run in bf16 under autocast
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

    def distill_loss(tokens):
        with autocast:
            with torch.no_grad():
                t_qk = teacher(tokens)
            s_qk = student(tokens)
            loss = 0.0
            for (qt, kt), (qs, ks) in zip(t_qk, s_qk):
                # setting 1: the teacher side is detached, so gradients reach q_s and k_s only
                kl = attention_kl(qt.detach(), kt.detach(), qs, ks, causal=True)
                loss = loss + kl.mean()
        return loss

    t, s = args.teacher, args.student
    print(f"device={device.type} seq={args.seq} batch={args.batch} layers={args.layers} "
          f"teacher: d_model={t['d_model']} heads={t['heads']}/{t['kv_heads']} head_dim={t['d_model'] // t['heads']}  "
          f"student: d_model={s['d_model']} heads={s['heads']}/{s['kv_heads']} head_dim={s['d_model'] // s['heads']}",
          flush=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    # a fixed evaluation batch measures the loss before and after training on the same tokens
    eval_tokens = torch.randint(vocab, (args.batch, args.seq), generator=gen).to(device)
    with torch.no_grad():
        initial = float(distill_loss(eval_tokens))
    print(f"initial loss (sum over {args.layers} layers of the mean per-row KL, nats): {initial:.6f}", flush=True)

    start = time.perf_counter()
    bar = tqdm(range(args.steps), disable=args.no_progress, desc="distill", file=sys.stderr)
    every = max(1, args.steps // 10)
    for step in bar:
        tokens = torch.randint(vocab, (args.batch, args.seq), generator=gen).to(device)
        loss = distill_loss(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            print(f"step {step}: loss is {value}", file=sys.stderr)
            return 1
        bar.set_postfix(loss=f"{value:.4f}")
        if args.no_progress and (step % every == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {value:.6f}", flush=True)
    bar.close()
    with torch.no_grad():
        final = float(distill_loss(eval_tokens))
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    print(f"{args.steps} steps in {elapsed:.1f} s", flush=True)
    print(f"initial_loss={initial:.6f} final_loss={final:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
