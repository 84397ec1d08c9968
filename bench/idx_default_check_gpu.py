"""The indexer loss's training path through the public API on the GPU (reduction "mean", lse
given, bf16, gradients): since session 7 the chunk design for single-key-head teachers, the
accumulating one for GQA teachers. Odd shapes (ragged tiles, batch 2, N_Q < N_K and N_Q > N_K
causal, not causal, a DSA-like small problem, a GQA teacher) against float64 (streamkl_ref), by
FlashAttention's rule: error <= 3 x the materialised bf16 form's error + 1e-2.

    python bench/idx_default_check_gpu.py OUT_DIR      # one H200: ~1 min, compiles included
    TRITON_INTERPRET=1 python bench/idx_default_check_gpu.py /tmp/x --device cpu   (fp16 there)
"""
import argparse
import csv
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import streamkl_gpu  # noqa: E402
import streamkl_ref  # noqa: E402
from streamkl_gpu.indexer import api as idx_api  # noqa: E402
from streamkl_gpu.indexer.training import choice as idx_choice  # noqa: E402
from streamkl_gpu.indexer import host as idx_host  # noqa: E402
from streamkl_ref.testing import relative_error as rel_err  # noqa: E402

# (name, B, H, HK, NQ, NK, D, HI, DI, causal)
CASES = [
    ("ragged causal", 1, 8, 1, 100, 100, 64, 4, 32, True),
    ("batch 2, nq<nk causal", 2, 16, 1, 77, 130, 96, 8, 64, True),
    ("nq>nk causal (empty rows)", 1, 4, 1, 130, 60, 64, 4, 32, True),
    ("not causal", 1, 8, 1, 50, 200, 64, 4, 32, False),
    ("dsa-like small", 1, 128, 1, 300, 300, 576, 64, 128, True),
    ("gqa teacher", 1, 16, 4, 150, 150, 128, 8, 64, True),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float16
    rows, failed = [], 0
    for name, B, H, HK, NQ, NK, D, HI, DI, causal in CASES:
        if a.device != "cuda" and H * D > 64 * 64:
            continue  # the interpreter: small cases only
        g = torch.Generator().manual_seed(hash(name) % 1000)
        rnd = lambda *s, std=1.0: (std * torch.randn(s, generator=g)).to(dtype)  # noqa: E731
        xs = [rnd(B, H, NQ, D), rnd(B, HK, NK, D), rnd(B, HI, NQ, DI), rnd(B, 1, NK, DI),
              rnd(B, HI, NQ, std=(HI * DI) ** -0.5)]
        x64 = [x.double().numpy() for x in xs]
        kl_ref, _, lse_t = streamkl_ref.indexer_kl(*x64, return_lse=True, causal=causal)
        n_rows = B * (min(NQ, NK) if causal else NQ)
        grads_ref = streamkl_ref.indexer_kl_grad(*x64, np.full(kl_ref.shape, 1.0 / n_rows), causal=causal)
        loss_ref = kl_ref.sum() / n_rows
        same = [x.clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
        same_loss = idx_api.indexer_kl_naive(*same, causal=causal, compute_dtype=dtype).sum() / n_rows
        same_grads = torch.autograd.grad(same_loss, same[2:])
        dims = idx_host.check_indexer_inputs(*xs)
        design = idx_choice.pstore_mode(dims)
        ins = [x.to(a.device).requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
        loss = streamkl_gpu.indexer_kl(*ins, lse=torch.from_numpy(lse_t).float().to(a.device), causal=causal,
                                       reduction="mean")
        grads = torch.autograd.grad(loss, ins[2:])
        for q, got, want, base in [("loss", loss, loss_ref, rel_err(same_loss, loss_ref))] + [
                (n, gr, grads_ref[n], rel_err(s, grads_ref[n])) for n, gr, s in zip(("dq_idx", "dk_idx", "dweights"),
                                                                                      grads, same_grads)]:
            err, tol = rel_err(got, want), 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2
            ok = err <= tol
            failed += not ok
            rows.append(dict(case=name, design={"chunk": "chunk", "0": "accumulate", "1": "store"}[design],
                             quantity=q, err=f"{err:.3e}", tol=f"{tol:.3e}", status="ok" if ok else "FAIL"))
            print(f"{name:28s} {rows[-1]['design']:10s} {q:9s} err {err:.2e} tol {tol:.2e} {rows[-1]['status']}",
                  flush=True)
    with open(os.path.join(a.out_dir, "idx_default_check.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{failed} failed of {len(rows)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
