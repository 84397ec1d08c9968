"""Cases: section names, the shape grids of the perf sections (``make_config``), the correctness
matrix (``check_cases``) and the small helpers that order and name N."""
from __future__ import annotations

# the sections the Runner runs in-process (delegated sections: delegated.DELEGATED)
CORE_SECTIONS = ["env", "check", "fwd", "bwd", "decode", "smallq", "long"]
# the inputs that get a gradient in each fwd+bwd setting
SETTINGS = {"s1": ("q2", "k2"), "s2": ("q1", "k1"), "both": ("q1", "k1", "q2", "k2")}

SECTION_DOC = {
    "env": "copy bandwidth + 8192^3 bf16 matmul",
    "check": "correctness vs float64 (fp32/fp16/bf16, settings, modes, GQA, D1!=D2, NQ!=NK, split-K, determinism)",
    "fwd": "forward N=1K..64K: ours, SDPA (default dispatch, flash backend), eager, chunked, compile",
    "bwd": "fwd+bwd N=1K..32K, s1/s2/both: ours fused/separate/auto, SDPA (default, flash), eager, compile",
    "decode": "N_Q in {1,16}, N_K 32K/128K forward + bandwidth floor",
    "smallq": "fused vs separate backward, N_Q 16..512, N_K 32K",
    "long": "512K tokens (H=8, causal) fwd and s1 fwd+bwd; peak extra memory vs N",
}


def make_config(a):
    K = 1024
    if a.tiny:
        c = dict(
            H=2, D=32, fwd_n=[64, 96], bwd_n=[64], compile_fwd_n=[96], compile_bwd_n=[64],
            compile_bwd_settings=["s1", "s2"], chunk=32,
            decode=[(1, 512), (4, 512)], smallq_nq=[4, 16], smallq_nk=256,
            long_h=2, long_n=[128, 256], long_bwd_n=[256], warmup_ms=5, rep_ms=20,
            budgets=dict(env=30, check=240, fwd=90, bwd=90, decode=30, smallq=30, long=30), total=600,
        )
    elif a.quick:
        c = dict(
            H=32, D=128, fwd_n=[2 * K, 8 * K, 32 * K], bwd_n=[2 * K, 8 * K], compile_fwd_n=[8 * K],
            compile_bwd_n=[8 * K], compile_bwd_settings=["s1", "s2"], chunk=1024,
            decode=[(1, 128 * K), (16, 128 * K), (1, 32 * K)], smallq_nq=[16, 512], smallq_nk=32 * K,
            long_h=8, long_n=[16 * K, 128 * K, 512 * K], long_bwd_n=[16 * K, 512 * K], warmup_ms=10, rep_ms=40,
            budgets=dict(env=10, check=40, fwd=50, bwd=60, decode=10, smallq=10, long=25), total=300,
        )
    else:
        c = dict(
            H=32, D=128, fwd_n=[1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K],
            bwd_n=[1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K], compile_fwd_n=[8 * K, 4 * K],
            compile_bwd_n=[8 * K, 4 * K], compile_bwd_settings=["s1", "s2", "both"], chunk=1024,
            decode=[(1, 128 * K), (16, 128 * K), (1, 32 * K)], smallq_nq=[16, 64, 256, 512], smallq_nk=32 * K,
            long_h=8, long_n=[4 * K, 16 * K, 64 * K, 128 * K, 256 * K, 512 * K], long_bwd_n=[4 * K, 64 * K, 512 * K],
            warmup_ms=25, rep_ms=100,
            budgets=dict(env=10, check=45, fwd=100, bwd=135, decode=10, smallq=20, long=30), total=460,
        )
    if a.compile_fwd_n:
        c["compile_fwd_n"] = [int(x) for x in a.compile_fwd_n.split(",") if x]
    if a.compile_bwd_n:
        c["compile_bwd_n"] = [int(x) for x in a.compile_bwd_n.split(",") if x]
    if a.budget_s is not None:
        c["total"] = a.budget_s
    return c


def check_cases(tiny, full):
    """The correctness matrix. Every dimension the brief lists is covered; the full product is
    not (each new constexpr combination is a Triton compile, ~1-3 s on the GPU host):
    core (N=197, D=64) = bf16 x causal x {fwd, s1, s2, both} fused + separate ('both'; s1, s2
    too when causal); fp16 and fp32 x causal x {fwd, both fused} (+ fp32 causal separate);
    features (bf16 unless noted) = fwd and 'both' fused (+ separate where the path differs) on
    GQA/MQA, D1 != D2 (128/64, 80/96), N_Q != N_K both ways, scales, N_Q = 1 and 5 (split-K),
    the deterministic GQA backward, D=128 N=2048 all settings. --full-check: the full product."""
    t = tiny
    cases = []
    n_core, d_core = (37, 16) if t else (197, 64)
    for dt in ("fp32", "fp16", "bf16"):
        for causal in (False, True):
            if full:
                settings, sep = ["fwd", "s1", "s2", "both"], ["s1", "s2", "both"]
            elif dt == "bf16":
                settings, sep = ["fwd", "s1", "s2", "both"], (["s1", "s2", "both"] if causal else ["both"])
            else:
                settings, sep = ["fwd", "both"], (["both"] if (dt == "fp32" and causal) else [])
            cases.append(dict(name=f"core_n{n_core}_d{d_core}", B=1 if t else 2, H=2 if t else 4, NQ=n_core,
                              NK=n_core, D1=d_core, D2=d_core, causal=causal, dtype=dt,
                              settings=settings, separate=sep))
    if t:
        sh = [dict(name="gqa_h4_hk2_hk1", H=4, HK1=2, HK2=1, NQ=40, NK=40, D1=16, D2=16, causal=True),
              dict(name="d32_16", NQ=33, NK=33, D1=32, D2=16, causal=True),
              dict(name="d24_40", NQ=30, NK=30, D1=24, D2=40, causal=False),
              dict(name="nq9_lt_nk50", NQ=9, NK=50, D1=16, D2=16, causal=True),
              dict(name="nq50_gt_nk9", NQ=50, NK=9, D1=16, D2=16, causal=True),
              dict(name="nq50_gt_nk9", NQ=50, NK=9, D1=16, D2=16, causal=False),
              dict(name="scales_tau", NQ=21, NK=21, D1=16, D2=16, causal=True, scale1=0.37, scale2=0.09),
              dict(name="nq1_nk150", NQ=1, NK=150, D1=16, D2=16, causal=False),
              dict(name="gqa_deterministic", H=4, HK1=2, HK2=1, NQ=24, NK=24, D1=16, D2=16, causal=True,
                   settings=["both"], separate=[], kw=dict(deterministic=True))]
    else:
        # D=64 cases keep N % 16 != 0 like the core, so they reuse its compiled kernels
        sh = [dict(name="gqa_h8_hk2_hk4", H=8, HK1=2, HK2=4, NQ=197, NK=197, D1=64, D2=64, causal=True),
              dict(name="mqa_h8_hk1_hk8", H=8, HK1=1, HK2=8, NQ=101, NK=101, D1=64, D2=64, causal=False,
                   separate=[]),
              dict(name="d128_64", NQ=200, NK=200, D1=128, D2=64, causal=True, separate=[]),
              dict(name="d80_96", NQ=150, NK=150, D1=80, D2=96, causal=True),
              dict(name="nq70_lt_nk333", NQ=70, NK=333, D1=64, D2=64, causal=True),
              dict(name="nq333_gt_nk70", NQ=333, NK=70, D1=64, D2=64, causal=True),
              dict(name="nq333_gt_nk70", NQ=333, NK=70, D1=64, D2=64, causal=False, separate=[]),
              dict(name="scales_tau", NQ=129, NK=129, D1=64, D2=64, causal=True, scale1=0.37, scale2=0.09),
              dict(name="nq1_nk1500", NQ=1, NK=1500, D1=64, D2=64, causal=False, separate=[]),
              dict(name="nq5_nk777", NQ=5, NK=777, D1=64, D2=64, causal=True),
              # D=128, N % 16 == 0: kernels the perf sections compile anyway
              dict(name="big_n2048", B=1, H=4, NQ=2048, NK=2048, D1=128, D2=128, causal=True,
                   settings=["fwd", "s1", "s2", "both"], separate=[]),
              dict(name="gqa_deterministic", H=8, HK1=2, HK2=4, NQ=197, NK=197, D1=64, D2=64, causal=True,
                   settings=["both"], separate=[], kw=dict(deterministic=True)),
              dict(name="d80_96", NQ=150, NK=150, D1=80, D2=96, causal=True, dtype="fp32", settings=["fwd"],
                   separate=[])]
        if full:
            sh += [dict(name="d128_64", NQ=200, NK=200, D1=128, D2=64, causal=False, dtype="fp16"),
                   dict(name="d80_96", NQ=150, NK=150, D1=80, D2=96, causal=False, dtype="fp32"),
                   dict(name="gqa_h8_hk2_hk4", H=8, HK1=2, HK2=4, NQ=256, NK=256, D1=64, D2=64, causal=False,
                        settings=["fwd", "s1", "s2", "both"], separate=["s1", "s2", "both"])]
            for c in sh:
                c["separate"] = [x for x in c.get("settings", ["fwd", "both"]) if x != "fwd"]
    for c in sh:
        c.setdefault("B", 1 if t else 2)
        c.setdefault("H", 2 if t else 4)
        c.setdefault("dtype", "bf16")
        c.setdefault("settings", ["fwd", "both"])
        c.setdefault("separate", ["both"])
        cases.append(c)
    return cases


def prio(ns, key=8192):
    """The summary's N first (compiles and autotuning land there), then larger, then smaller."""
    return sorted(n for n in ns if n >= key) + sorted((n for n in ns if n < key), reverse=True)


def fmt_n(n):
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def hash_str(s):
    h = 0
    for ch in s:
        h = (h * 131 + ord(ch)) % 1000003
    return h
