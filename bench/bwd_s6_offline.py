"""Offline sm_90 compile (no GPU) of the separate backward kernels' candidate launches of session 6
(bench/bwd_s6.py times them): registers, spills, shared memory and the whole-tile loop's SASS.

    PYTHONPATH=/tmp/t36 python bench/bwd_s6_offline.py [NAME ...]     # the GPU image's triton 3.6

CTAs per SM follow from registers x threads (65536 per SM) and shared memory (228 KB per SM, 1 KB
reserved per CTA): printed as ``ctas``.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bwd_sass as bs  # noqa: E402  (sets the recording environment, imports triton)
import torch  # noqa: E402
import triton  # noqa: E402

import bwd_s6  # noqa: E402
import bwd_sweep  # noqa: E402
from streamkl_gpu.attention.triton import bwd as _bwd  # noqa: E402
from streamkl_gpu._core import checks as _checks
from streamkl_ref._checks import check_inputs  # noqa: E402


def ctas(regs, warps, smem):
    by_regs = 65536 // (max(regs, 1) * 32 * warps) if regs else 0
    by_smem = (228 * 1024) // (smem + 1024)
    return min(by_regs, by_smem, 64 // warps)


def main(names):
    for n in ("_kl_bwd_dk_kernel", "_kl_bwd_dq_kernel", "_kl_bwd_rows_kernel"):
        setattr(_bwd, n, bs._Rec(n, getattr(_bwd, n)))
    _checks.check_tensors = lambda q1, k1, q2, k2, s1, s2: check_inputs(q1, k1, q2, k2, scale1=s1, scale2=s2)
    H, N, D = 2, 1024, 128
    d = {k: torch.empty(1, H, N, D, dtype=torch.bfloat16) for k in ("q1", "k1", "q2", "k2")}
    d["g"] = torch.zeros(1, H, N)
    fwd = tuple(torch.zeros(1, H, N) for _ in range(3))
    print(f"triton {triton.__version__}; kernel setting cfg opts: regs stack smem ctas/SM | loop instr hgmma ex2 fp32")
    for c in bwd_s6.CANDIDATES:
        if names and c.name not in names:
            continue
        for s in bwd_s6.SETTINGS:
            for causal in (False, True) if c.kind == "dq" and c.opts.get("HEAVY_FIRST") else (False,):
                bs.records.clear()
                direct = bwd_sweep.Direct(torch, d, fwd, s, causal=causal)
                try:
                    c.launch(direct)
                except Exception:
                    pass  # the recorder returns no kernel: the bookkeeping after the launch fails
                recs = [r for r in bs.records if "BLOCK_M" in r[3]]
                try:
                    r = bs.analyse(bs.compile_rec(recs[-1]))
                except Exception as exc:
                    print(f"{c.name:34s} {s}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                loop = r["loops"][0] if r["loops"] else (None,) * 4
                print(f"{c.name:34s} {s}{' causal' if causal else ''}: regs {r['reg']} stack {r['stack']} "
                      f"smem {r['smem']} ctas {ctas(r['reg'], c.cfg[2], r['smem'])} | loop {loop}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
