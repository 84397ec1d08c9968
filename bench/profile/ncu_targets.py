"""One warm call of a target, between cudaProfilerStart/Stop (and an NVTX range "profile"), for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        PYTHONPATH=. python bench/profile/ncu_targets.py CASE

CASE: fwd8k (attention_kl forward, B=1 H=32 N=8K D=128 bf16, non-causal, automatic backend),
fwd8k_causal (the same, causal), bwd8k (setting 1's backward, q2/k2 trained, of the same shape: the
forward runs outside the range), bwd8k_both (both sides trained),
idx_dsa8k (indexer_kl forward, DSA-like config, 8K causal, ``lse`` given), idx_gqa8k (GQA-like).
Every case first runs the call twice outside the range (compiles, tuning), so the profiled call
is a warm one. ``bench/profile/ncu_run.sh`` drives it and writes the reports' text.
"""
import argparse

import torch

import streamkl_gpu  # the installed package or the repository root on PYTHONPATH

DSA = dict(H=128, D=576, HK=1, HI=64, DI=128, HKI=1, scale=192 ** -0.5)
GQA = dict(H=32, D=128, HK=8, HI=16, DI=64, HKI=1, scale=None)


def attention_case(backward: bool, causal: bool = False, both: bool = False):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 32, 8192, 128)
    q1, k1, q2, k2 = (torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
    if not backward:
        return lambda: streamkl_gpu.attention_kl(q1, k1, q2, k2, causal=causal)
    trained = [t.requires_grad_(True) for t in ((q1, k1, q2, k2) if both else (q2, k2))]  # setting 1: side 2
    kl = streamkl_gpu.attention_kl(q1, k1, q2, k2, causal=causal)
    loss = kl.sum()

    def run():
        torch.autograd.grad(loss, trained, retain_graph=True)
    return run


def indexer_case(cfg):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 8192

    def rnd(*s):
        return torch.randn(s, generator=g, device="cuda").to(torch.bfloat16)
    q, k = rnd(1, cfg["H"], n, cfg["D"]), rnd(1, cfg["HK"], n, cfg["D"])
    q_idx, k_idx = rnd(1, cfg["HI"], n, cfg["DI"]), rnd(1, cfg["HKI"], n, cfg["DI"])
    w = torch.rand(1, cfg["HI"], n, generator=g, device="cuda") / cfg["HI"]
    scale = cfg["scale"] or cfg["D"] ** -0.5
    # the teacher's LSEs as a trainer gets them from FlashAttention (natural log, fp32)
    kk = k.repeat_interleave(cfg["H"] // cfg["HK"], dim=1)
    lse = torch.empty(1, cfg["H"], n, device="cuda")
    for h in range(cfg["H"]):
        s = (q[:, h].float() @ kk[:, h].float().transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        lse[:, h] = torch.logsumexp(s, dim=-1)
    del kk
    return lambda: streamkl_gpu.indexer_kl(q, k, q_idx, k_idx, w, causal=True, scale=cfg["scale"], lse=lse)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=["fwd8k", "fwd8k_causal", "bwd8k", "bwd8k_both", "idx_dsa8k", "idx_gqa8k"])
    a = p.parse_args()
    fn = {"fwd8k": lambda: attention_case(False), "fwd8k_causal": lambda: attention_case(False, causal=True),
          "bwd8k": lambda: attention_case(True), "bwd8k_both": lambda: attention_case(True, both=True),
          "idx_dsa8k": lambda: indexer_case(DSA), "idx_gqa8k": lambda: indexer_case(GQA)}[a.case]()
    fn(), fn()
    torch.cuda.synchronize()
    # cudaProfilerStart/Stop are process-wide (autograd runs the backward's kernels on its own
    # thread, which a thread-local NVTX push/pop range does not cover)
    torch.cuda.profiler.start()
    torch.cuda.nvtx.range_push("profile")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    print(f"{a.case}: profiled call done", flush=True)


if __name__ == "__main__":
    main()
