"""Offline sm_90 compile of the training step's new kernels, no GPU needed: the teacher-LSE pass
(``indexer/teacher_lse.py``, every GPU candidate) at the DSA-like and GQA-like anchors, and the chunk
design's kernels for a GQA teacher (the storing forward ``indexer/triton/fwd_gqa_store.py``, its TMA and
pointer stores of p, the teacher-free gradient kernel) at the GQA-like anchor (H=32, D=128,
H_K=8; H_I=16, D_I=64); bf16, causal, 8K: shared memory, registers and spills of each.

    python bench/indexer_training_aot.py              # the chunk design's first candidates (its untuned choice)
    CONFIGS="64,64,64,64,4,3,1,48,gqa-band" python bench/indexer_training_aot.py   # other storing forwards

The launches are intercepted (CPU tensors; TMA reported available) and compiled with
triton.compile for GPUTarget("cuda", 90) (bench/idx_gqa_aot.py's compile_rec).
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import idx_gqa_aot as aot  # noqa: E402  (sets STREAMKL_AUTOTUNE=0, TMA available, 132 SMs)
import torch  # noqa: E402

from streamkl_gpu.indexer import configs as idx_configs  # noqa: E402
from streamkl_gpu.indexer import teacher_lse as _indexer_teacher_lse  # noqa: E402
from streamkl_gpu.indexer.training import chunk as idx_chunk  # noqa: E402
from streamkl_gpu.indexer.triton import bwd as _indexer_bwd  # noqa: E402
from streamkl_gpu.indexer.triton import fwd as _indexer_fwd  # noqa: E402
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa  # noqa: E402
from streamkl_gpu.indexer.triton import fwd_gqa_store as _indexer_gqa_store  # noqa: E402
from streamkl_ref._checks import check_indexer_inputs  # noqa: E402

ANCHORS = {"dsa": (128, 1, 576, 64, 1, 128, 192 ** -0.5), "gqa": (32, 8, 128, 16, 1, 64, 128 ** -0.5)}


def lse_pass(N):
    """Every GPU candidate of the teacher-LSE pass at both anchors."""
    real = _indexer_fwd._teacher_lse_kernel
    _indexer_fwd._teacher_lse_kernel = aot.Rec(real)
    cands = idx_configs._candidates
    try:
        for name, (H, HK, D, HI, HKI, DI, scale) in ANCHORS.items():
            bf = torch.bfloat16
            xs = [torch.empty(1, H, N, D, dtype=bf), torch.empty(1, HK, N, D, dtype=bf),
                  torch.empty(1, HI, N, DI, dtype=bf), torch.empty(1, HKI, N, DI, dtype=bf),
                  torch.empty(1, HI, N, dtype=bf)]
            for cfg in cands("lse", False, check_indexer_inputs(*xs)):
                aot.records.clear()
                idx_configs._candidates = lambda kind, *a, _c=cfg, **k: [_c]
                try:
                    _indexer_teacher_lse.teacher_lse_bits(*xs, True, scale)
                    fn, grid, args, kw = aot.records[0]
                    smem, regs = aot.compile_rec(fn, args, kw)
                    print(f"{'_teacher_lse_kernel ' + name:34s} {str(cfg):44s} grid={grid} smem={smem} {regs}",
                          flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"lse {name} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:1500]}", flush=True)
    finally:
        idx_configs._candidates = cands
        _indexer_fwd._teacher_lse_kernel = real


def main():
    N = int(os.environ.get("N", "8192"))
    H, HK, D, HI, HKI, DI = 32, 8, 128, 16, 1, 64
    bf = torch.bfloat16
    xs = [torch.empty(1, H, N, D, dtype=bf), torch.empty(1, HK, N, D, dtype=bf), torch.empty(1, HI, N, DI, dtype=bf),
          torch.empty(1, HKI, N, DI, dtype=bf), torch.empty(1, HI, N, dtype=bf)]
    lse = torch.zeros(1, H, N)
    lse_pass(N)
    dims = check_indexer_inputs(*xs)
    fwd = aot.parse(os.environ["CONFIGS"]) if os.environ.get("CONFIGS") else idx_configs._candidates("pstore", False, dims)[:1]
    bcfg = idx_configs._candidates("bwd", False, dims, teacher=False)[0]
    _indexer_gqa_store._indexer_fwd_gqa_store_kernel = aot.Rec(_indexer_gqa_store._indexer_fwd_gqa_store_kernel)
    _indexer_bwd._indexer_bwd_dq_kernel = aot.Rec(_indexer_bwd._indexer_bwd_dq_kernel)
    _indexer_fwd_gqa.MERGE_KERNEL = False  # (the host merge of CPU tensors: no launch)
    for p_tma in (True, False):
        _indexer_gqa_store.P_TMA_STORE = p_tma
        for cfg in fwd:
            aot.records.clear()
            try:
                idx_chunk._forward_full_with(cfg, bcfg, *xs, lse, True, D ** -0.5, True)
                seen = set()
                for fn, grid, args, kw in aot.records:
                    stage = kw.get("STAGES", "-")
                    if (fn, stage) in seen:  # one compile per kernel and stage (chunks repeat them)
                        continue
                    seen.add((fn, stage))
                    smem, regs = aot.compile_rec(fn, args, kw)
                    name = fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__
                    shown = bcfg if name == "_indexer_bwd_dq_kernel" else cfg
                    print(f"{name:34s} {str(shown):44s} p_tma={p_tma} STAGES={stage} grid={grid} smem={smem} {regs}",
                          flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{cfg}: FAILED {type(exc).__name__}: {str(exc)[:1500]}", flush=True)


if __name__ == "__main__":
    main()
