#!/usr/bin/env python3
"""Training a sparse-attention indexer with the streaming indexer loss.

A frozen teacher attention layer (MQA: all query heads share one key head, as in an absorbed
MLA layer) and a small *lightning indexer* read the same hidden states. The indexer has its own
query heads, one key head and a per-head, per-token weight (DeepSeek-V3.2's form):

    I[t, s] = sum_j weights[j, t] * relu(q_idx[j, t] . k_idx[s])

and learns, with Adam, to match the teacher's attention averaged over its heads:

    loss = indexer_kl(q.detach(), k.detach(), q_idx, k_idx, weights, causal=True, reduction="mean")

i.e. the mean over query rows of KL(p || softmax(I)) with p = (1/H) sum_h softmax(S_h). The
teacher is detached (its q, k get no gradient in any case); only the indexer trains. No
N x N score matrix is stored: on the GPU the default is 16K tokens.

    python examples/indexer.py                      # GPU: 16K tokens, bf16
    python examples/indexer.py --device cpu --tiny  # CPU, Triton interpreter: seconds

Prints the loss, the time of every step and the peak memory; the last line is machine-readable:
``initial_loss=<float> final_loss=<float>``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train a sparse-attention indexer with streamkl_gpu.indexer_kl.")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="cuda (default when a GPU is present) or cpu (Triton interpreter, slow: use --tiny)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny sizes (4 x 16 tokens, d_model 32, 16 steps): runs on CPU in seconds")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 16384; --tiny 16)")
    ap.add_argument("--batch", type=int, help="sequences per step (default 1; --tiny 4)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default 100; --tiny 16)")
    ap.add_argument("--lr", type=float, help="Adam learning rate (default 1e-3; --tiny 2e-2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tiny = dict(seq=16, batch=4, steps=16, lr=2e-2, d_model=32, vocab=32,
                heads=4, head_dim=16, idx_heads=2, idx_dim=8, teacher_sharpness=4.0)
    full = dict(seq=16384, batch=1, steps=100, lr=1e-3, d_model=2048, vocab=32000,
                heads=32, head_dim=128, idx_heads=16, idx_dim=64, teacher_sharpness=4.0)
    cfg = tiny if args.tiny else full
    for name in ("seq", "batch", "steps", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, cfg[name])
    args.cfg = cfg
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

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from streamkl_gpu import indexer_kl

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available (use --device cpu --tiny)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    cfg = args.cfg
    # bf16 on the GPU; fp32 under the interpreter (its bf16 tl.dot is not usable)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    class Teacher(nn.Module):
        """Embedding, LayerNorm and the q, k projections of one MQA attention layer (frozen)."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(cfg["vocab"], cfg["d_model"])
            self.ln = nn.LayerNorm(cfg["d_model"])
            self.wq = nn.Linear(cfg["d_model"], cfg["heads"] * cfg["head_dim"], bias=False)
            self.wk = nn.Linear(cfg["d_model"], cfg["head_dim"], bias=False)  # one key head
            with torch.no_grad():  # a sharper teacher than the default init gives (peaked heads)
                self.wq.weight.mul_(cfg["teacher_sharpness"])

        def forward(self, tokens):
            b, n = tokens.shape
            x = self.ln(self.emb(tokens))
            q = self.wq(x).view(b, n, cfg["heads"], cfg["head_dim"]).transpose(1, 2)  # [B, H, N, D]
            k = self.wk(x).view(b, n, 1, cfg["head_dim"]).transpose(1, 2)  # [B, 1, N, D]
            return x, q, k

    class Indexer(nn.Module):
        """The lightning indexer: H_I query heads, one key head, per-head weights from x."""

        def __init__(self):
            super().__init__()
            d, hi, di = cfg["d_model"], cfg["idx_heads"], cfg["idx_dim"]
            self.wq = nn.Linear(d, hi * di, bias=False)
            self.wk = nn.Linear(d, di, bias=False)
            self.ww = nn.Linear(d, hi, bias=False)
            self.weight_scale = hi ** -0.5 * di ** -0.5  # folded into weights, as DSA does

        def forward(self, x):
            b, n, _ = x.shape
            hi, di = cfg["idx_heads"], cfg["idx_dim"]
            q_idx = self.wq(x).view(b, n, hi, di).transpose(1, 2)  # [B, H_I, N, D_I]
            k_idx = self.wk(x).view(b, n, 1, di).transpose(1, 2)  # [B, 1, N, D_I]
            weights = (self.ww(x) * self.weight_scale).transpose(1, 2)  # [B, H_I, N]
            return q_idx, k_idx, weights

    teacher = Teacher().to(device).requires_grad_(False)
    indexer = Indexer().to(device)
    opt = torch.optim.Adam(indexer.parameters(), lr=args.lr)

    def loss_of(tokens):
        with torch.no_grad():
            x, q, k = teacher(tokens)
        q_idx, k_idx, weights = indexer(x.detach())
        return indexer_kl(q.to(dtype), k.to(dtype), q_idx.to(dtype), k_idx.to(dtype), weights.to(dtype),
                          causal=True, reduction="mean")

    print(f"device={device.type} dtype={str(dtype).removeprefix('torch.')} seq={args.seq} batch={args.batch} "
          f"teacher: heads={cfg['heads']} (MQA) head_dim={cfg['head_dim']}  "
          f"indexer: heads={cfg['idx_heads']} (one key head) head_dim={cfg['idx_dim']}", flush=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    eval_tokens = torch.randint(cfg["vocab"], (args.batch, args.seq), generator=gen).to(device)
    with torch.no_grad():
        initial = float(loss_of(eval_tokens))
    print(f"initial loss (mean per-row KL, nats): {initial:.6f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    total = 0.0
    for step in range(args.steps):
        tokens = torch.randint(cfg["vocab"], (args.batch, args.seq), generator=gen).to(device)
        start = time.perf_counter()
        loss = loss_of(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())  # synchronises
        elapsed = time.perf_counter() - start
        total += elapsed
        if not math.isfinite(value):
            print(f"step {step}: loss is {value}", file=sys.stderr)
            return 1
        print(f"step {step:4d}  loss {value:.6f}  time {elapsed * 1e3:.1f} ms", flush=True)
    with torch.no_grad():
        final = float(loss_of(eval_tokens))
    if device.type == "cuda":
        print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    else:
        import resource
        print(f"peak memory (process RSS): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB",
              flush=True)
    print(f"{args.steps} steps in {total:.1f} s ({total / max(args.steps, 1) * 1e3:.1f} ms per step)", flush=True)
    print(f"initial_loss={initial:.6f} final_loss={final:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
