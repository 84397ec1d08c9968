"""``bench/bwd_gpu.py OUT --sweep [--quick]``: the Triton backward's tile space and timing probes
(issue 14), at the issue's weakest point, B=1 H=32 N=8K D=128 bf16 non-causal, settings 1 and 2.

1. prewarm: every kernel below compiled once in parallel worker processes (N = 2048: the same
   Triton specialisations as 8K), each reporting its registers and spills.
2. sweep: the fused dK kernel ``tma+trans+fold+rows+reduce`` over (BLOCK_M, BLOCK_N, warps,
   stages), and the separate pair (dK ``tma+trans+fold+rows`` + dQ ``tma+fold``), each config
   launched directly (not through the tuner) with the host work of ``_launch.backward`` (fp32 dQ
   zeros, rows pre-pass, dQ cast): the timed backward. Configs that spill are pruned before timing.
   Every timed config's gradients are compared with the old fused kernels' (through attention_kl,
   ``STREAMKL_BWD_VARIANT=ptr``) at 8K; the best of each setting also against float64 (small shape).
3. probes (``_bwd.PROBE_*``, wrong gradients, timing only) of the session-4 winner config (and,
   without --quick, of the sweep's best): no exp2, one score product, both, no dQ (the separate dK
   kernel), and all of them with no dK product (what is left: loads, one product, dS arithmetic).
4. fused vs separate at 8K causal, the session-4 configs (the ``auto_bwd_mode`` re-measure; the
   non-causal pair is in the sweep).
5. baselines in the same run: SDPA fwd, fwd+bwd (backward = difference), torch.compile fwd+bwd of
   setting 1 (last: its worker compiles while the sweep runs), our forward through attention_kl
   (for fwd+bwd = ours fwd + best backward).
CSV rows go to the Run's rows (bwd_gpu.csv); the table is printed last.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time
import traceback

K = 1024
FUSED = "tma+trans+fold+rows+reduce"
SEP_DK = "tma+trans+fold+rows"
SEP_DQ = "tma+fold"
# the backward variants' winners (bench/results/2026-12-01_h200_2a98499/bwd_variants.log)
REF_FUSED = (64, 128, 8, 3)
REF_SEP_DK, REF_SEP_DQ = (64, 128, 8, 3), (128, 64, 8, 3)  # run r5c's best separate pair (s2: 5.80 ms)
# --quick: the spaces cut to the best of run r5c (bench/results/2026-12-01_h200_121408f/: the whole spaces' timings there;
# fused 4-warp and 32-query tiles were 1.2-2.6x slower)
QUICK_FUSED = [(64, 128, 8, 3)]
QUICK_SEP_DK = [(64, 128, 8, 3), (64, 128, 8, 4)]
QUICK_SEP_DQ = [(128, 64, 8, 3), (64, 64, 4, 2)]
QUICK_PROBES = ("atomicdq",)  # the others measured in r5c (NOTES: probes)
# (NO_DK alone is left out: without the dK accumulators the compiler pipelines deeper, 331 KB of
# shared memory at 64x128x8x3 in the offline sm_90 compile, more than an SM has)
PROBES = (("noexp", 1), ("onescore", 2), ("noexp+onescore", 3), ("nodq", 0), ("noexp+onescore+nodk+nodq", 7),
          ("atomicdq", 0))  # atomicdq: right, the fused dQ by per-element fp32 atomics instead of the TMA reduce
SETTINGS = ("s1", "s2")
# CompiledKernel.n_spills (local memory / 4 bytes) above which a config is not timed: the
# session-4 winner of setting 2 (64x128x8x3) has 4 (16 bytes, 3 STL in the offline SASS)
SPILL_LIMIT = 16
CHECK_SHAPE, CHECK_SHAPE_TINY = (16, 384, 128), (2, 32, 32)  # (H, N, D) of the float64 checks
TINY = False  # --tiny: CPU smoke run under the interpreter (configure())


def configure(tiny):
    """--tiny: interpreter-sized configs (the same code paths, tiles of 16 and 32), fp16 inputs."""
    global TINY, REF_FUSED, REF_SEP_DK, REF_SEP_DQ
    if tiny:
        TINY = True
        REF_FUSED, REF_SEP_DK, REF_SEP_DQ = (16, 32, 1, 1), (16, 32, 1, 1), (32, 16, 1, 1)
SET_TRAIN = {"s1": ("q2", "k2"), "s2": ("q1", "k1")}


# The offline sm_90 compile of every launch below (bench/bwd_sweep_sm90.json, triton 3.6: ``python
# bench/bwd_sweep.py --offline``): configs that spill more than OFFLINE_STACK_LIMIT bytes or need
# more shared memory than an SM has are not compiled on the GPU at all; the rest are tried in
# the order of SASS instructions per score of their whole-tile loop (fewest first).
OFFLINE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bwd_sweep_sm90.json")
OFFLINE_STACK_LIMIT = 64  # bytes (16 spills: the setting-2 winner has 16 bytes)
SMEM_LIMIT = 227 * 1024


def _offline():
    try:
        with open(OFFLINE_FILE) as f:
            return json.load(f)["kernels"]
    except (OSError, ValueError, KeyError):
        return {}


OFFLINE = _offline()


def offline_key(kind, setting, cfg, probe=0):
    return f"{kind}:{setting}:{'x'.join(map(str, cfg))}:p{probe}"


def viable(kind, setting, cfg, probe=0):
    """(ok, why): False for a config the offline compile shows spilling or over the shared memory
    (one the table does not have is tried)."""
    k = OFFLINE.get(offline_key(kind, setting, cfg, probe))
    if k is None:
        return True, "not in the offline table"
    if k["stack"] > OFFLINE_STACK_LIMIT:
        return False, f"offline: {k['stack']} bytes of spills"
    if k["smem"] > SMEM_LIMIT:
        return False, f"offline: {k['smem'] // 1024} KB of shared memory"
    return True, ""


def _ordered(kind, setting, cfgs, ref):
    """``ref`` first, then the viable configs, fewest offline SASS instructions per score first."""
    def cost(c):
        k = OFFLINE.get(offline_key(kind, setting, c))
        return (k["loop_instr"] / (c[0] * c[1])) if k and k.get("loop_instr") else float("inf")
    rest = sorted((c for c in cfgs if c != ref and viable(kind, setting, c)[0]), key=cost)
    return [ref] + rest


def fused_space(quick, setting="s1"):
    """(BLOCK_M = query tile, BLOCK_N = key tile, warps, stages) of the fused key-major dK kernel."""
    if TINY:
        return [REF_FUSED, (32, 16, 1, 1)]
    if quick:
        return QUICK_FUSED
    cfgs = [(bm, bn, w, st) for bn in (64, 128) for bm in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    return _ordered("fused", setting, cfgs, REF_FUSED)


def sep_dk_space(quick, setting="s1"):
    if TINY:
        return [REF_SEP_DK]
    if quick:
        return QUICK_SEP_DK
    return _ordered("sepdk", setting, [(bm, 128, 8, st) for bm in (32, 64, 128) for st in (2, 3, 4)], REF_SEP_DK)


def sep_dq_space(quick, setting="s1"):
    """(BLOCK_M = query tile held in registers, BLOCK_N = key tile, warps, stages) of the dQ kernel."""
    if TINY:
        return [REF_SEP_DQ]
    if quick:
        return QUICK_SEP_DQ
    cfgs = [(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    return _ordered("sepdq", setting, cfgs, REF_SEP_DQ)


def jobs(quick):
    """Every launch of the sweep: dicts with kind (fused / sepdk / sepdq), setting, cfg, probe."""
    out = []
    for s in SETTINGS:  # priority order: the reference configs and probes first
        out.append(dict(kind="fused", setting=s, cfg=REF_FUSED, probe=0))
        for pname, p in PROBES:
            if p and not (quick and pname not in QUICK_PROBES):
                out.append(dict(kind="fused", setting=s, cfg=REF_FUSED, probe=p))
        out.append(dict(kind="sepdk", setting=s, cfg=REF_FUSED, probe=0))  # the "nodq" probe
        out.append(dict(kind="fusedatomic", setting=s, cfg=REF_FUSED, probe=0))  # the "atomicdq" variant
    # then the spaces, both settings side by side (what the prewarm limit cuts off is the tail)
    def zipped(space, kind, skip=()):  # both settings' spaces, entry by entry
        lists = [[dict(kind=kind, setting=s, cfg=c, probe=0) for c in space(quick, s) if c not in skip]
                 for s in SETTINGS]
        return [j for pair in itertools.zip_longest(*lists) for j in pair if j is not None]
    out += zipped(fused_space, "fused", (REF_FUSED,))
    out += zipped(sep_dq_space, "sepdq")
    out += zipped(sep_dk_space, "sepdk", (REF_FUSED,))
    for j in out:
        j["cfg"] = list(j["cfg"])
    return out


def job_key(j):
    return (j["kind"], j["setting"], tuple(j["cfg"]), j["probe"]) + (("causal",) if j.get("causal") else ())


# The fused-vs-separate re-measure (``_tuning.auto_bwd_mode``): (label, N_Q, N_K, causal) with the
# best configs of run r5c (8K non-causal): fused 64x128x8x3 (causal: 64x128x8x2, 8x3 needs 242 KB of
# shared memory there), separate 64x128x8x3 + 128x64x8x3; then attention_kl's own choice ("auto",
# tuned) at 8K, fwd+bwd - fwd.
MODE_SHAPES = [("N=8K", 8 * K, 8 * K, False), ("N=8K causal", 8 * K, 8 * K, True), ("N=16K", 16 * K, 16 * K, False),
               ("N=16K causal", 16 * K, 16 * K, True), ("nq512 nk32K", 512, 32 * K, False), ("N=4K", 4 * K, 4 * K, False),
               ("nq2K nk32K", 2 * K, 32 * K, False)]
MODE_FUSED, MODE_FUSED_CAUSAL = (64, 128, 8, 3), (64, 128, 8, 2)
# the Gluon backward (folded in from bench/gluon_bwd_gpu.py for the last run): the default kernel and
# the lagged dQ (_gluon_bwd DQ_LAG), checked against each other and float64, timed alone at 8K
GLUON_CONFIGS = {"default": None, "dq_lag": dict(DQ_LAG=True), "dq_lag_bufs3": dict(DQ_LAG=True, DS_BUFS=3)}
MODE_SEP = ((64, 128, 8, 3), (128, 64, 8, 3))


def mode_cfgs(causal):
    """(fused config, (separate dK config, dQ config)) of the mode re-measure."""
    if TINY:
        return REF_FUSED, (REF_SEP_DK, REF_SEP_DQ)
    return (MODE_FUSED_CAUSAL if causal else MODE_FUSED), MODE_SEP


def mode_jobs():
    out = []
    for s in SETTINGS:
        for c in (False, True):
            cf, csep = mode_cfgs(c)
            out += [dict(kind="fused", setting=s, cfg=list(cf), probe=0, causal=c),
                    dict(kind="sepdk", setting=s, cfg=list(csep[0]), probe=0, causal=c),
                    dict(kind="sepdq", setting=s, cfg=list(csep[1]), probe=0, causal=c)]
        out += [dict(kind="apiauto", setting=s, cfg=[0, 0, 0, 0], probe=0, causal=c) for c in (False, True)]
    return out


class Direct:
    """The backward of one setting launched with given configs (``_launch.backward``'s host work,
    without its tuner and plan cache), for inputs ``d`` and the forward's saved ``fwd``."""

    def __init__(self, torch, d, fwd, setting, causal=False):
        from streamkl_gpu._core import checks as _checks
        self.torch, self.d, self.setting, self.causal = torch, d, setting, causal
        self.kl, self.lse1, self.lse2 = (t.contiguous() for t in fwd)
        q1, k1, q2, k2 = d["q1"], d["k1"], d["q2"], d["k2"]
        self.dims = _checks.check_tensors(q1, k1, q2, k2, None, None)
        self.g = d["g"].to(torch.float32).contiguous()
        self.train1, self.train2 = setting in ("s2", "both"), setting in ("s1", "both")
        self.last = {}  # kind -> CompiledKernel of the last launch (registers, spills)

    def _common(self):
        dims = self.dims
        return (dims.H, dims.NQ, dims.NK, dims.D1, dims.D2, dims.group1, dims.group2)

    def dk(self, cfg, fused, probe=0, dq=None, reduce=True, opts=None, rows=True):
        """One dK launch (fused: dQ reduce-added into the fp32 ``dq`` buffer, by one TMA reduce per
        tile, or with ``reduce=False`` by per-element atomics). Returns (dq, dk)."""
        import triton

        from streamkl_gpu.attention.triton import bwd as _bwd
        from streamkl_gpu._core.checks import head_pad, strides
        from streamkl_gpu.attention.launch import _desc, _row_constants
        from streamkl_gpu._core.runtime import LOG2E
        torch, dims, d = self.torch, self.dims, self.d
        q1, k1, q2, k2 = d["q1"], d["k1"], d["q2"], d["k2"]
        block_m, block_n, warps, stages = cfg
        d1p, d2p = head_pad(dims.D1), head_pad(dims.D2)
        BH = dims.B * dims.H
        dev = q1.device
        dk1 = torch.empty_like(k1) if self.train1 else None
        dk2 = torch.empty_like(k2) if self.train2 else None
        if fused and dq is None:
            q = q1 if self.train1 else q2
            dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
        dq1 = dq if self.train1 else None
        dq2 = dq if self.train2 else None
        dummy = self.kl
        t = [x if x is not None else dummy for x in (dk1, dk2, dq1, dq2)]

        def s3(x):
            return (x.stride(0), x.stride(1), x.stride(2)) if x.dim() == 4 else (0, 0, 0)
        descs = dict(Q1_DESC=_desc(q1, block_m, d1p), K1_DESC=_desc(k1, block_n, d1p),
                     Q2_DESC=_desc(q2, block_m, d2p), K2_DESC=_desc(k2, block_n, d2p))
        if rows:  # rows="pack": the packed layout (ROWS_PACKED)
            descs["ROWS_DESC"] = _row_constants(dims, self.g, self.kl, self.lse1, self.lse2, block_m, rows == "pack",
                                                self.train1 and self.train2, dev)
        reduce_dq = fused and reduce and not TINY  # the interpreter has no TMA reduce-add: per-element atomics there
        if reduce_dq:
            descs.update(DQ1_DESC=_desc(dq1, block_m, d1p) if dq1 is not None else None,
                         DQ2_DESC=_desc(dq2, block_m, d2p) if dq2 is not None else None)
        k = _bwd._kl_bwd_dk_kernel[(triton.cdiv(dims.NK, block_n), BH, 1)](
            q1, k1, q2, k2, self.lse1, self.lse2, self.kl, self.g, *t,
            *strides(q1), *strides(k1), *strides(q2), *strides(k2),
            *s3(t[0]), *s3(t[1]), *s3(t[2]), *s3(t[3]),
            *self._common(), dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2,
            BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1p, D2_PAD=d2p, CAUSAL=self.causal,
            TRAIN1=self.train1, TRAIN2=self.train2, FUSED_DQ=fused, DK1_ATOMIC=False, DK2_ATOMIC=False,
            IEEE1=False, IEEE2=False, USE_TMA=True, TRANS=True, FOLD=True, DQ_REDUCE=reduce_dq, ROWS=bool(rows),
            ROWS_PACKED=rows == "pack",
            PROBE=probe, num_warps=warps, num_stages=stages, **descs, **(opts or {}))
        self.last["sepdk" if not fused else "fused" if reduce else "fusedatomic"] = k
        return dq, (dk1 if self.train1 else dk2)

    def dq(self, cfg, opts=None):
        """One launch of the separate dQ kernel (``tma+fold``). Returns dq in the input dtype."""
        import triton

        from streamkl_gpu.attention.triton import bwd as _bwd
        from streamkl_gpu._core.checks import head_pad, strides
        from streamkl_gpu.attention.launch import _desc
        from streamkl_gpu._core.runtime import LOG2E
        torch, dims, d = self.torch, self.dims, self.d
        q1, k1, q2, k2 = d["q1"], d["k1"], d["q2"], d["k2"]
        block_m, block_n, warps, stages = cfg
        d1p, d2p = head_pad(dims.D1), head_pad(dims.D2)
        BH = dims.B * dims.H
        dq1 = torch.empty_like(q1) if self.train1 else None
        dq2 = torch.empty_like(q2) if self.train2 else None
        t = [x if x is not None else self.kl for x in (dq1, dq2)]

        def s3(x):
            return (x.stride(0), x.stride(1), x.stride(2)) if x.dim() == 4 else (0, 0, 0)
        descs = dict(Q1_DESC=_desc(q1, block_m, d1p), K1_DESC=_desc(k1, block_n, d1p),
                     Q2_DESC=_desc(q2, block_m, d2p), K2_DESC=_desc(k2, block_n, d2p))
        k = _bwd._kl_bwd_dq_kernel[(triton.cdiv(dims.NQ, block_m), BH, 1)](
            q1, k1, q2, k2, self.lse1, self.lse2, self.kl, self.g, *t,
            *strides(q1), *strides(k1), *strides(q2), *strides(k2), *s3(t[0]), *s3(t[1]),
            *self._common(), dims.scale1 * LOG2E, dims.scale2 * LOG2E, dims.scale1, dims.scale2,
            BLOCK_M=block_m, BLOCK_N=block_n, D1_PAD=d1p, D2_PAD=d2p, CAUSAL=self.causal,
            TRAIN1=self.train1, TRAIN2=self.train2, IEEE1=False, IEEE2=False, USE_TMA=True, FOLD=True,
            num_warps=warps, num_stages=stages, **descs, **(opts or {}))
        self.last["sepdq"] = k
        return dq1 if self.train1 else dq2

    def fused_bwd(self, cfg, probe=0, reduce=True):
        """(dq, dk) of the trained side, as _launch.backward returns them (dq cast to the input dtype)."""
        dq, dk = self.dk(cfg, True, probe, reduce=reduce)
        return dq.to(self.d["q1"].dtype), dk

    def separate_bwd(self, cfg_dk, cfg_dq):
        _, dk = self.dk(cfg_dk, False)
        return self.dq(cfg_dq), dk

    def run_job(self, j):
        cfg = tuple(j["cfg"])
        if j["kind"] == "fused":
            out = self.fused_bwd(cfg, j["probe"])
        elif j["kind"] == "fusedatomic":
            out = self.fused_bwd(cfg, j["probe"], reduce=False)
        elif j["kind"] == "sepdk":
            out = self.dk(cfg, False)
        else:
            out = self.dq(cfg)
        k = self.last[j["kind"]]
        return out, k


def resources(k):
    """(registers, spills) of a CompiledKernel (None where this Triton does not say)."""
    return getattr(k, "n_regs", None), getattr(k, "n_spills", None)


def inputs(torch, dev, H, N, D, seed=0, dtype=None):
    gen = torch.Generator(device=dev)
    gen.manual_seed(4321 + seed)
    dtype = dtype or (torch.float16 if TINY else torch.bfloat16)  # bf16 dots are garbage in the interpreter
    d = {n: torch.randn((1, H, N, D), generator=gen, device=dev, dtype=dtype) for n in ("q1", "k1", "q2", "k2")}
    d["g"] = torch.randn((1, H, N), generator=gen, device=dev, dtype=torch.float32)
    return d


def forward(r, d):
    from streamkl_gpu.attention import launch as _launch
    return _launch.forward(d["q1"], d["k1"], d["q2"], d["k2"], False, None, None, None)


# -- prewarm worker ---------------------------------------------------------------------------------
def worker(r, joblist):
    """Compile (and run once at N = 2048) each job; print its registers and spills."""
    torch = r.torch
    configure(r.a.tiny)
    n = 64 if r.a.tiny else 2048
    d = inputs(torch, r.dev, r.H, n, r.D)
    # the compile needs no real forward: saved values of the right shapes (zeros) run the kernels
    fwd = tuple(torch.zeros((1, r.H, n), device=r.dev, dtype=torch.float32) for _ in range(3))
    directs = {(s, c): Direct(torch, d, fwd, s, c) for s in SETTINGS for c in (False, True)}
    for j in joblist:
        t = time.perf_counter()
        try:
            if j["kind"] == "compile":  # the torch.compile baseline (inductor's caches)
                dd = inputs(torch, r.dev, 32, 8 * K, 128)
                comp = r.prov.compiled_kl()
                d2 = {k: (v.detach().requires_grad_(k in SET_TRAIN["s1"]) if k != "g" else v) for k, v in dd.items()}
                r.prov.f_eager_fb(False, "s1", comp)(d2)
                r.prov.f_eager_fwd(False, comp)(dd)
                regs = spills = None
            elif j["kind"] == "fwd":  # our forward at the timed shape (the Gluon one at 8K: no tuning)
                os.environ["STREAMKL_AUTOTUNE"] = "1"
                dd = inputs(torch, r.dev, r.H, 64 if r.a.tiny else 8 * K, r.D)
                r.ak(dd["q1"], dd["k1"], dd["q2"], dd["k2"])
                r.ak(dd["q1"], dd["k1"], dd["q2"], dd["k2"], causal=True)  # the mode re-measure's
                del dd
                regs = spills = None
            elif j["kind"] == "fwdmode":  # the forward of one mode re-measure shape (tuned, as run there)
                os.environ["STREAMKL_AUTOTUNE"] = "1"
                _, nq, nk, causal = MODE_SHAPES[j["cfg"][0]]
                dd = inputs_qk(torch, r.dev, r.H, nq, nk, r.D)
                r.ak(dd["q1"], dd["k1"], dd["q2"], dd["k2"], causal=causal)
                del dd
                regs = spills = None
            elif j["kind"] == "gluon":  # the Gluon backward, default or lagged dQ (compile only)
                from streamkl_gpu.experimental import attention_bwd_sm90 as _gluon_bwd
                sc = 1.0 / math.sqrt(r.D)
                _gluon_bwd.gluon_backward(d["g"], d["q1"], d["k1"], d["q2"], d["k2"], *fwd, False, sc, sc,
                                          2 if j["setting"] == "s1" else 1, config=GLUON_CONFIGS[j["cfg"][0]])
                regs = spills = None
            elif j["kind"] == "apiauto":  # attention_kl's default (auto mode, tuned): every candidate,
                # at 4K (8K's mode under auto_bwd_mode: 2K would pick fused; the same specialisations)
                da = inputs(torch, r.dev, r.H, 64 if r.a.tiny else 4 * K, r.D)
                r.ours_fb(da, bool(j.get("causal")), j["setting"], "auto", None, tuned=True)
                regs = spills = None
            elif j["kind"] == "api":  # the old fused kernels through attention_kl (the gradient reference),
                # at check_best's shape (its forward: the untuned Triton one; the backward: the same
                # specialisation as at 8K)
                H, n_c, D = CHECK_SHAPE_TINY if r.a.tiny else CHECK_SHAPE
                r.ours_fb(inputs(torch, r.dev, H, n_c, D), bool(j.get("causal")), j["setting"], "fused", "ptr")
                regs = spills = None
            else:
                _, k = directs[(j["setting"], bool(j.get("causal")))].run_job(j)
                regs, spills = resources(k)
            r.sync()
            print(f"SWEEP ok {json.dumps(j)} regs={regs} spills={spills} {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as exc:
            print(f"SWEEP fail {json.dumps(j)} {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 0


def prewarm(r, limit_s):
    """Worker processes compile every sweep job; returns {job_key: (regs, spills)} of those that
    compiled, and the set of keys that failed."""
    import subprocess
    import sys
    quick = r.a.quick
    js = jobs(quick)
    extra = [dict(kind="compile", setting="s1", cfg=[0, 0, 0, 0], probe=0)] if not r.a.no_compile else []
    rest = [dict(kind="fwd", setting="s1", cfg=[0, 0, 0, 0], probe=0)]
    rest += [dict(kind="api", setting=s, cfg=[0, 0, 0, 0], probe=0, causal=c) for c in (False, True)
             for s in SETTINGS]
    gl_jobs = [] if r.a.tiny else [dict(kind="gluon", setting=s_, cfg=[name, 0, 0, 0], probe=0)
                                   for name in GLUON_CONFIGS for s_ in SETTINGS]
    fwd_jobs = [] if r.a.tiny else [dict(kind="fwdmode", setting="s1", cfg=[i, 0, 0, 0], probe=0)
                                    for i in range(len(MODE_SHAPES))]
    mj = mode_jobs()  # attention_kl's tuned auto path first (the longest: every candidate), then in run order
    rest += [j for j in mj if j["kind"] == "apiauto"] + fwd_jobs + [j for j in mj if j["kind"] != "apiauto"]
    rest += gl_jobs + js
    allj = extra + rest
    nw = r.a.workers or max(1, min(15, (os.cpu_count() or 4) - 2))
    nw = min(nw, len(allj))
    # the torch.compile job (the longest) alone on worker 0, the rest round robin in priority order
    plans = [[] for _ in range(nw)]
    spread = nw - 1 if extra and nw > 1 else nw
    if extra and nw > 1:
        plans[0] = extra
    else:
        rest = allj
    for i, j in enumerate(rest):
        plans[nw - spread + i % spread].append(j)
    tmp = os.path.join(r.a.out, "prewarm_sweep")
    os.makedirs(tmp, exist_ok=True)
    procs = []
    for i, p in enumerate(plans):
        jf = os.path.join(tmp, f"jobs_{i}.json")
        with open(jf, "w") as f:
            json.dump(p, f)
        lf = open(os.path.join(tmp, f"worker_{i}.out"), "w")
        args = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bwd_gpu.py"),
                r.a.out, "--sweep", "--_worker", jf] + (["--quick"] if quick else []) + (["--tiny"] if r.a.tiny else [])
        procs.append((subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True), lf))
    r.log(f"sweep prewarm: {len(allj)} jobs on {nw} workers (limit {limit_s:.0f} s)")
    end = time.perf_counter() + limit_s
    compile_proc = None
    if extra and nw > 1:  # the torch.compile worker may go on past the limit (mostly CPU; see run())
        compile_proc = procs.pop(0)
        r.compile_proc = (compile_proc[0], compile_proc[1], os.path.join(tmp, "worker_0.out"))
    for p, lf in procs:
        try:
            p.wait(timeout=max(0.1, end - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()  # a worker this script started, by its own handle
            p.wait()
        lf.close()
    res, failed = {}, set()
    for i in range(1 if compile_proc else 0, len(plans)):
        with open(os.path.join(tmp, f"worker_{i}.out")) as f:
            for line in f:
                if not line.startswith("SWEEP "):
                    continue
                status, rest = line[6:].split(" ", 1)
                jtxt = rest[:rest.index("}") + 1]
                j = json.loads(jtxt)
                if status == "ok":
                    tail = rest[len(jtxt):].split()
                    regs = tail[0].split("=")[1]
                    spills = tail[1].split("=")[1]
                    res[job_key(j)] = (None if regs == "None" else int(regs), None if spills == "None" else int(spills))
                    if j["kind"] == "compile":
                        r.compile_warm = True
                else:
                    failed.add(job_key(j))
                    r.log(f"sweep prewarm FAIL {line.strip()[:300]}")
    r.log(f"sweep prewarm: {len(res)} ok, {len(failed)} failed, {len(allj) - len(res) - len(failed)} not finished")
    return res, failed


# -- the main process --------------------------------------------------------------------------------
def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / max(b.norm().item(), 1e-30)).item()


def cfg_s(c):
    return "x".join(map(str, c))


def run(r):
    """The whole sweep (prewarm, baselines, sweep, probes, checks); prints the table last."""
    torch = r.torch
    configure(r.a.tiny)
    quick = r.a.quick
    res, failed = prewarm(r, 30.0 if r.a.tiny else min(45.0, 0.45 * r.budget) if quick else 150.0)
    for key, (regs, spills) in sorted(res.items(), key=lambda kv: str(kv[0])):
        if key[0] in ("fused", "sepdk", "sepdq"):
            r.row("regs", f"{key[0]}/{key[1]}/p{key[3]}" + ("/causal" if len(key) > 4 else ""), cfg_s(key[2]), regs if regs is not None else float("nan"),
                  "regs", f"spills={spills}")
    n = 64 if r.a.tiny else 8 * K
    H, D = r.H, r.D
    shape = f"N={n // K}K" if n >= K else f"N={n}"
    d = inputs(torch, r.dev, H, n, D, seed=n)
    out = dict(sdpa=None, compile=None, fwd=None)
    # baselines: SDPA, our forward, torch.compile (s1)
    try:
        r.prov.prep_sdpa_bwd([d])
        f_fwd, f_fb = r.prov.f_sdpa(False), r.prov.f_sdpa(False, backward=True)
        t_f, t_fb = r.bench(lambda: f_fwd(d), n), r.bench(lambda: f_fb(d), n)
        out["sdpa"] = t_fb - t_f
        r.row("fwd", "sdpa", shape, t_f, "ms")
        r.row("fwd+bwd", "sdpa", shape, t_fb, "ms")
        r.row("bwd", "sdpa", shape, t_fb - t_f, "ms", "fwd+bwd - fwd")
        r.log(f"{shape} sdpa fwd {t_f:.3f} fwd+bwd {t_fb:.3f} bwd {t_fb - t_f:.3f} ms")
    except Exception as exc:
        r.log(f"sdpa: ERROR {type(exc).__name__}: {str(exc)[:300]}")
    try:
        os.environ["STREAMKL_AUTOTUNE"] = "1"
        out["fwd"] = r.bench(lambda: r.ak(d["q1"], d["k1"], d["q2"], d["k2"]), n)
        r.row("fwd", "ours", shape, out["fwd"], "ms", "attention_kl, tuned")
        r.log(f"{shape} ours fwd {out['fwd']:.3f} ms")
    except Exception as exc:
        r.log(f"ours fwd: ERROR {type(exc).__name__}: {str(exc)[:300]}")
    modes = {}
    try:  # first: the fused-vs-separate question decides the default
        modes = mode_measure(r, res, failed, n)
    except Exception as exc:
        r.log(f"mode re-measure: ERROR {type(exc).__name__}: {str(exc)[:300]}")
        r.logf.write(traceback.format_exc())
    gl = {}
    if not r.a.tiny:
        try:
            gl = gluon_lag(r, res, failed)
        except Exception as exc:
            r.log(f"gluon lag: ERROR {type(exc).__name__}: {str(exc)[:300]}")
            r.logf.write(traceback.format_exc())
    out["gluon"] = gl
    checks = check_best(r, {})  # the defaults (before the sweep: the budget may end in it)
    fwd = forward(r, d)
    best = {}  # setting -> (ms, label)
    timed = {}  # (setting, label) -> ms
    reserve = 15.0 if quick else 60.0  # for the checks and torch.compile
    for idx, s in enumerate(SETTINGS):
        left_after = len(SETTINGS) - idx - 1  # the budget shared between the settings still to sweep
        floor = reserve + (r.left() - reserve) * left_after / (left_after + 1)
        try:
            best.update(sweep_setting(r, d, fwd, s, res, failed, timed, shape, floor))
        except Exception as exc:
            r.log(f"sweep {s}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
            r.logf.write(traceback.format_exc())
    if not r.a.no_compile and not r.a.tiny:  # last: its worker may still be compiling
        del d
        torch.cuda.empty_cache()
        if wait_compile(r):
            tcb = {}
            r.time_compile(tcb)
            out["compile"] = tcb.get(("N=8K s1", "torch.compile fwd+bwd"))
        else:
            r.log("torch.compile: skipped (its worker did not finish within the budget)")
    table(r, out, best, timed, checks, shape, modes)


def wait_compile(r):
    """Wait (within the budget, 12 s kept for the timing) for the torch.compile worker; True if it
    compiled (inductor's caches are warm: the timing's own compile is then short)."""
    import subprocess
    got = getattr(r, "compile_proc", None)
    if got is None:
        return r.compile_warm
    p, lf, path = got
    try:
        p.wait(timeout=max(0.1, r.left() - 12))
    except subprocess.TimeoutExpired:
        p.kill()  # the worker this script started, by its own handle
        p.wait()
    lf.close()
    with open(path) as f:
        ok = any(line.startswith("SWEEP ok") and '"compile"' in line for line in f)
    r.log(f"torch.compile worker: {'compiled' if ok else 'did not finish'}")
    return ok


def mode_measure(r, res, failed, n):
    """Fused vs separate (direct launches) at MODE_SHAPES, both settings: {(label, setting): (fused
    ms, separate ms, rel. gradient difference)}; then attention_kl's auto choice at 8K."""
    torch = r.torch
    out = {}
    for label, nq, nk, causal in MODE_SHAPES if not r.a.tiny else [("N=64", 64, 64, False), ("N=64 causal", 64, 64, True)]:
        if r.left() < 8:
            r.log(f"mode {label}: skipped (budget)")
            continue
        try:
            d = inputs_qk(torch, r.dev, r.H, nq, nk, r.D, seed=nq + nk)
            os.environ["STREAMKL_AUTOTUNE"] = "1"  # the forward as the prewarm compiled it (tuned)
            fwd = _launch_forward(d, causal)
            for s in SETTINGS:
                cf, csep = mode_cfgs(causal)
                keys = [("fused", s, cf, 0), ("sepdk", s, csep[0], 0), ("sepdq", s, csep[1], 0)]
                keys = [k + (("causal",) if causal else ()) for k in keys]
                if any(k in failed or (r.a.quick and k not in res) for k in keys):
                    r.log(f"mode {label} {s}: skipped (not prewarmed or failed)")
                    continue
                direct = Direct(torch, d, fwd, s, causal=causal)
                gf = direct.fused_bwd(cf)
                gs = direct.separate_bwd(*csep)
                r.sync()
                diff = max(rel(a, b) for a, b in zip(gs, gf))
                del gf, gs
                tf = r.bench(lambda: direct.fused_bwd(cf), nk)
                ts = r.bench(lambda: direct.separate_bwd(*csep), nk)
                ok = diff <= 2e-2
                out[(label, s)] = (tf, ts, diff)
                for prov, t in ((f"fused {cfg_s(cf)}", tf), (f"separate {cfg_s(csep[0])}+{cfg_s(csep[1])}", ts)):
                    r.row("bwd_mode", prov, f"{label} {s}", t, "ms", f"sep_vs_fused_grad={diff:.2e}" + ("" if ok else " MISMATCH"))
                r.log(f"mode {label:13s} {s}: fused {tf:8.3f} separate {ts:8.3f} ms ({ts / tf:.3f}x)  grad sep vs fused "
                      f"{diff:.1e}{'' if ok else ' MISMATCH'}")
            del d, fwd
            if not r.a.tiny:
                torch.cuda.empty_cache()
        except Exception as exc:
            r.log(f"mode {label}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
            r.logf.write(traceback.format_exc())
    # attention_kl's own choice (auto_bwd_mode, tuned candidates): backward = fwd+bwd - fwd
    from bwd_gpu import plan_of
    n = 64 if r.a.tiny else 8 * K
    for causal in (False, True):
        if r.left() < 8:
            r.log("mode auto: skipped (budget)")
            break
        d = inputs_qk(torch, r.dev, r.H, n, n, r.D, seed=5)
        try:
            os.environ["STREAMKL_AUTOTUNE"] = "1"
            t_f = r.bench(lambda: r.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal), n)
            for s in SETTINGS:
                if (r.a.quick and ("apiauto", s, (0, 0, 0, 0), 0) + (("causal",) if causal else ()) not in res):
                    r.log(f"mode auto {s}: skipped (not prewarmed)")
                    continue
                r.ours_fb(d, causal, s, "auto", None, tuned=True)  # tunes
                t = r.bench(lambda: r.ours_fb(d, causal, s, "auto", None, tuned=True), n)
                plan = plan_of(None, "auto", True)
                label = f"N={n // K}K{' causal' if causal else ''}" if n >= K else f"N={n}{' causal' if causal else ''}"
                out[(label, s, "auto")] = (t - t_f, plan)
                r.row("bwd", "auto", f"{label} {s}", t - t_f, "ms", f"fwd+bwd - fwd; plan={plan}")
                r.log(f"mode auto {label} {s}: fwd+bwd {t:.3f} - fwd {t_f:.3f} = bwd {t - t_f:.3f} ms  plan {plan}")
        except Exception as exc:
            r.log(f"mode auto: ERROR {type(exc).__name__}: {str(exc)[:300]}")
            r.logf.write(traceback.format_exc())
        del d
    return out


def gluon_lag(r, res, failed):
    """{(setting, config): ms} of the Gluon backward alone at 8K non-causal, each config first checked
    at CHECK_SHAPE against float64 and the default kernel (lag <= 2 x default + 2e-3, lag vs default
    <= 2e-2); a config whose check fails or errs is not timed."""
    torch = r.torch
    from streamkl_bench.providers import dense_kl

    from streamkl_gpu.experimental import attention_bwd_sm90 as _gluon_bwd
    sc = 1.0 / math.sqrt(r.D)
    out = {}
    for s in SETTINGS:
        train = 2 if s == "s1" else 1
        names = SET_TRAIN[s]
        usable = [c for c in GLUON_CONFIGS if ("gluon", s, (c, 0, 0, 0), 0) in res]
        if r.a.quick and "default" not in usable:
            r.log(f"gluon {s}: skipped (not prewarmed)")
            continue
        H_c, n_c, _ = CHECK_SHAPE  # the shape whose (untuned Triton) forward the prewarm compiled
        os.environ["STREAMKL_AUTOTUNE"] = "0"
        d = inputs_qk(torch, r.dev, H_c, n_c, n_c, r.D, seed=3)
        fwd = _launch_forward(d, False)
        x64 = {k: d[k].detach().double().requires_grad_(k in names) for k in ("q1", "k1", "q2", "k2")}
        kl64 = dense_kl(x64["q1"], x64["k1"], x64["q2"], x64["k2"], causal=False, cdt=torch.float64)
        ref = torch.autograd.grad(kl64, [x64[k] for k in names], d["g"].double())
        got = {}
        for c in usable:
            try:
                got[c] = _gluon_bwd.gluon_backward(d["g"], d["q1"], d["k1"], d["q2"], d["k2"], *fwd, False, sc, sc,
                                                   train, config=GLUON_CONFIGS[c])
            except Exception as exc:
                r.log(f"gluon {s} {c} check: ERROR {type(exc).__name__}: {str(exc)[:200]}")
        r.sync()
        ok_cfgs = []
        if "default" in got:
            e_b = max(rel(a, b) for a, b in zip(got["default"], ref))
            for c, gr in got.items():
                e = max(rel(a, b) for a, b in zip(gr, ref))
                vs = max(rel(a, b) for a, b in zip(gr, got["default"]))
                ok = math.isfinite(e) and e <= 2 * e_b + 2e-3 and vs <= 2e-2
                r.row("check_err_vs_f64", f"gluon:{c}", f"{s} H={H_c} N={n_c}", e, "rel", f"vs_default={vs:.2e}"
                      + ("" if ok else " FAIL"))
                r.log(f"check gluon {s} {c:14s} err {e:.2e} (default {e_b:.2e}) vs default {vs:.2e} {'ok' if ok else 'FAIL'}")
                if ok:
                    ok_cfgs.append(c)
        n = 8 * K
        d = inputs_qk(torch, r.dev, r.H, n, n, r.D, seed=9)
        fwd = _launch_forward(d, False)
        for c in ok_cfgs:
            if r.left() < 20:
                r.log(f"gluon {s} {c}: skipped (budget)")
                continue
            try:
                t = r.bench(lambda c=c: _gluon_bwd.gluon_backward(d["g"], d["q1"], d["k1"], d["q2"], d["k2"], *fwd,
                                                                  False, sc, sc, train, config=GLUON_CONFIGS[c]), n)
                out[(s, c)] = t
                r.row("bwd_alone", f"gluon:{c}", f"N=8K {s}", t, "ms", "_gluon_bwd.gluon_backward alone")
                r.log(f"N=8K {s} gluon {c:14s} bwd alone {t:8.3f} ms")
            except Exception as exc:
                r.log(f"gluon {s} {c}: ERROR {type(exc).__name__}: {str(exc)[:200]}")
        del d, fwd
    return out


def inputs_qk(torch, dev, H, NQ, NK, D, seed=0):
    gen = torch.Generator(device=dev)
    gen.manual_seed(77 + seed)
    dt = torch.float16 if TINY else torch.bfloat16
    d = {n: torch.randn((1, H, NQ if n[0] == "q" else NK, D), generator=gen, device=dev, dtype=dt)
         for n in ("q1", "k1", "q2", "k2")}
    d["g"] = torch.randn((1, H, NQ), generator=gen, device=dev, dtype=torch.float32)
    return d


def _launch_forward(d, causal):
    from streamkl_gpu.attention import launch as _launch
    return _launch.forward(d["q1"], d["k1"], d["q2"], d["k2"], causal, None, None, None)


def _fwd_causal(d):
    from streamkl_gpu.attention import launch as _launch
    return _launch.forward(d["q1"], d["k1"], d["q2"], d["k2"], True, None, None, None)


def sweep_setting(r, d, fwd, s, res, failed, timed, shape, floor=0.0):
    """One setting's sweep, timing while more than ``floor`` seconds of the budget are left."""
    torch = r.torch
    n = d["q1"].shape[2]
    direct = Direct(torch, d, fwd, s)
    # the gradient reference: the old fused kernels through attention_kl
    try:
        ref = r.ours_fb(d, False, s, "fused", "ptr")
    except Exception as exc:
        ref = None
        r.log(f"{s} reference (old fused): ERROR {type(exc).__name__}: {str(exc)[:200]}")
    finally:
        os.environ.pop("STREAMKL_BWD_VARIANT", None)
    def usable(kind, cfg, probe=0):
        key = (kind, s, tuple(cfg), probe)
        if key in failed:
            return False, "compile failed"
        if key not in res:
            return (not r.a.quick), "not prewarmed"
        regs, spills = res[key]
        if spills and spills > SPILL_LIMIT and tuple(cfg) not in (REF_FUSED, REF_SEP_DK, REF_SEP_DQ):
            return False, f"spills {spills}"
        return True, ""

    def time_one(label, fn, check=True):
        if r.left() < floor:
            r.log(f"{s} {label}: skipped (budget)")
            return None
        try:
            gr = fn()
            r.sync()
            diff = float("nan")
            if check and ref is not None:
                diff = max(rel(a, b) for a, b in zip(gr, ref))
            del gr
            t = r.bench(fn, n)
            ok = (not check) or (ref is None) or diff <= 2e-2
            timed[(s, label)] = t
            r.row("bwd_direct", label, f"{shape} {s}", t, "ms", f"grad_vs_old={diff:.2e}" + ("" if ok else " MISMATCH"))
            r.log(f"{shape} {s} {label:44s} {t:8.3f} ms  grad vs old {diff:.1e}{'' if ok else ' MISMATCH'}")
            return t if ok else None
        except Exception as exc:
            r.row("bwd_direct", label, f"{shape} {s}", float("nan"), "ms", f"ERROR {type(exc).__name__}")
            r.log(f"{s} {label}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
            return None

    def probes(c):
        for pname, p in PROBES:
            if r.a.quick and pname not in QUICK_PROBES:
                continue
            kind = {"nodq": "sepdk", "atomicdq": "fusedatomic"}.get(pname, "fused")
            ok, why = usable(kind, c, p)
            if not ok:
                r.log(f"{s} probe {pname} {cfg_s(c)}: skipped ({why})")
                continue
            if pname == "nodq":
                fn = (lambda c=c: direct.dk(c, False))
            elif pname == "atomicdq":
                fn = (lambda c=c: direct.fused_bwd(c, 0, reduce=False))
            else:
                fn = (lambda c=c, p=p: direct.fused_bwd(c, p))
            time_one(f"probe {pname} {cfg_s(c)}", fn, check=(pname == "atomicdq"))

    got = {}  # Direct returns (dq, dk) of the trained side: the reference's (SET_TRAIN) order
    # the session-4 config and its probes, then the fused space
    fused_t = {}
    for c in fused_space(r.a.quick, s):
        ok, why = usable("fused", c)
        if not ok:
            r.log(f"{s} fused {cfg_s(c)}: pruned ({why})")
            continue
        t = time_one(f"fused {cfg_s(c)}", lambda c=c: direct.fused_bwd(c))
        if t is not None:
            fused_t[c] = t
        if c == REF_FUSED:
            probes(c)
    # the separate pair: the dK kernel alone and the dQ kernel alone, then the best pair together
    dk_t, dq_t = {}, {}
    for c in sep_dk_space(r.a.quick, s):
        ok, why = usable("sepdk", c)
        if ok:
            t = time_one(f"sep-dK-only {cfg_s(c)}", lambda c=c: direct.dk(c, False), check=False)
            if t is not None:
                dk_t[c] = t
        else:
            r.log(f"{s} sepdk {cfg_s(c)}: pruned ({why})")
    for c in sep_dq_space(r.a.quick, s):
        ok, why = usable("sepdq", c)
        if ok:
            t = time_one(f"sep-dQ-only {cfg_s(c)}", lambda c=c: direct.dq(c), check=False)
            if t is not None:
                dq_t[c] = t
        else:
            r.log(f"{s} sepdq {cfg_s(c)}: pruned ({why})")
    sep_best = None
    if dk_t and dq_t:
        cdk, cdq = min(dk_t, key=dk_t.get), min(dq_t, key=dq_t.get)
        t = time_one(f"separate {cfg_s(cdk)}+{cfg_s(cdq)}", lambda: direct.separate_bwd(cdk, cdq))
        if t is not None:
            sep_best = (t, ("separate", cdk, cdq))
    if fused_t:
        cf = min(fused_t, key=fused_t.get)
        got[s] = (fused_t[cf], ("fused", cf, None))
        r.log(f"{s} best fused {cfg_s(cf)} {fused_t[cf]:.3f} ms (session-4 config {cfg_s(REF_FUSED)}: "
              f"{fused_t.get(REF_FUSED, float('nan')):.3f})")
    if sep_best and (s not in got or sep_best[0] < got[s][0]):
        got[s] = sep_best
    # the probes of the best fused config too, where it is another one (its probe kernels were not
    # prewarmed: compiled here, so only without --quick)
    if fused_t and min(fused_t, key=fused_t.get) != REF_FUSED and not r.a.quick:
        probes(min(fused_t, key=fused_t.get))
    return got


def check_best(r, best):
    """vs float64 and vs the old kernels at a small shape (CHECK_SHAPE: the same Triton
    specialisations): the session-4 fused config, the separate pair the auto rule now takes
    (MODE_SEP, causal and not), and the sweep's best of each setting."""
    torch = r.torch
    out = []
    H, n, D = CHECK_SHAPE_TINY if r.a.tiny else CHECK_SHAPE
    from streamkl_bench.providers import dense_kl
    for causal in (False, True):
        for s in SETTINGS:
            cf, csep = mode_cfgs(causal)
            plans = [("separate",) + tuple(csep)]
            if not causal:
                plans = [("fused", REF_FUSED, None)] + plans + (
                    [best[s][1]] if s in best and best[s][1] not in [("fused", REF_FUSED, None), ("separate",) + tuple(csep)]
                    else [])
            os.environ["STREAMKL_AUTOTUNE"] = "0"  # the forward the prewarm compiled at this shape
            d = inputs(torch, r.dev, H, n, D, seed=7)
            names = SET_TRAIN[s]
            x64 = {k: d[k].detach().double().requires_grad_(k in names) for k in ("q1", "k1", "q2", "k2")}
            kl64 = dense_kl(x64["q1"], x64["k1"], x64["q2"], x64["k2"], causal=causal, cdt=torch.float64)
            ref64 = torch.autograd.grad(kl64, [x64[k] for k in names], d["g"].double())
            try:
                old = r.ours_fb(d, causal, s, "fused", "ptr")
                old_err = max(rel(a, b) for a, b in zip(old, ref64))
            except Exception as exc:
                r.log(f"check {s} old: ERROR {type(exc).__name__}: {str(exc)[:200]}")
                old, old_err = None, None
            finally:
                os.environ.pop("STREAMKL_BWD_VARIANT", None)
            fwd = _launch_forward(d, causal)
            direct = Direct(torch, d, fwd, s, causal=causal)
            for plan in plans:
                label = (plan[0] + " " + cfg_s(plan[1]) + (f"+{cfg_s(plan[2])}" if plan[2] else "")
                         + (" causal" if causal else ""))
                try:
                    gr = direct.fused_bwd(plan[1]) if plan[0] == "fused" else direct.separate_bwd(plan[1], plan[2])
                    r.sync()
                    err = max(rel(a, b) for a, b in zip(gr, ref64))
                    vs_old = max(rel(a, b) for a, b in zip(gr, old)) if old is not None else float("nan")
                    tol = 1.5 * old_err + 1e-3 if old_err is not None else 3e-2
                    ok = math.isfinite(err) and err <= tol
                    out.append((s, label, err, tol, vs_old, ok))
                    r.row("check_err_vs_f64", label, f"{s} H={H} N={n}", err, "rel",
                          f"tol={tol:.2e} vs_old={vs_old:.2e}" + ("" if ok else " FAIL"))
                    r.log(f"check {s} {label:38s} err {err:.2e} (tol {tol:.2e}) vs old {vs_old:.2e} "
                          f"{'ok' if ok else 'FAIL'}")
                except Exception as exc:
                    out.append((s, label, float("nan"), float("nan"), float("nan"), False))
                    r.log(f"check {s} {label}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
    return out


def table(r, out, best, timed, checks, shape, modes=None):
    sd, tc, fwd = out["sdpa"], out["compile"], out["fwd"]
    lines = ["", f"sweep: direct backward ms at {shape} B=1 H={r.H} D={r.D} bf16 non-causal "
             f"(SDPA bwd {sd if sd else float('nan'):.3f} ms = fwd+bwd - fwd; our fwd {fwd if fwd else float('nan'):.3f};"
             f" torch.compile s1 fwd+bwd {tc if tc else float('nan'):.3f})"]
    for s in SETTINGS:
        rows = sorted(((t, lab) for (ss, lab), t in timed.items() if ss == s and lab.startswith(("fused", "separate"))))
        lines.append(f"{s}: top configs" + ("" if rows else " (none timed)"))
        for t, lab in rows[:6]:
            lines.append(f"  {lab:40s} {t:8.3f} ms" + (f" = {t / sd:.2f}x sdpa" if sd else ""))
        ref = timed.get((s, f"fused {cfg_s(REF_FUSED)}"))
        if ref:
            lines.append(f"  probes (fused {cfg_s(REF_FUSED)} = {ref:.3f} ms; saving when removed):")
            for pname, _ in PROBES:
                t = timed.get((s, f"probe {pname} {cfg_s(REF_FUSED)}"))
                if t is not None:
                    lines.append(f"    {pname:28s} {t:8.3f} ms  (saves {ref - t:+.3f})")
        if s in best and fwd:
            b = best[s][0]
            lines.append(f"  best {best[s][1][0]} {b:.3f} ms" + (f" = {b / sd:.2f}x sdpa ({'meets' if b <= 1.4 * sd else 'misses'} 1.4x)" if sd else "")
                         + (f"; fwd+bwd {fwd + b:.3f} ms = {tc / (fwd + b):.2f}x faster than torch.compile" if tc and s == "s1" else ""))
    if modes:
        lines.append("fused vs separate (direct launches; separate/fused), and attention_kl's auto choice (fwd+bwd - fwd):")
    for key, v in (modes or {}).items():
        if len(key) == 2:
            tf, ts, diff = v
            lines.append(f"  {key[0]:13s} {key[1]}: fused {tf:8.3f} separate {ts:8.3f} ms ({ts / tf:.3f}x)"
                         + (f" = {ts / sd:.2f}x sdpa-8K" if sd and key[0] == "N=8K" else "")
                         + ("" if diff <= 2e-2 else " MISMATCH"))
        else:
            lines.append(f"  auto {key[0]:13s} {key[1]}: {v[0]:8.3f} ms  {v[1]}"
                         + (f" = {v[0] / sd:.2f}x sdpa" if sd and key[0] == "N=8K" else ""))
    gl = out.get("gluon") or {}
    for s in SETTINGS:
        row = {c: t for (ss, c), t in gl.items() if ss == s}
        if row:
            base = row.get("default")
            lines.append(f"gluon backward alone N=8K {s}: " + ", ".join(
                f"{c} {t:.3f} ms" + (f" ({t / base:.3f}x default)" if base and c != "default" else "")
                for c, t in row.items()) + (f" = {min(row.values()) / sd:.2f}x sdpa (best)" if sd else ""))
    lines.append("checks vs float64 (small shape): " + ", ".join(f"{c[0]} {c[1]} {'ok' if c[5] else 'FAIL'}" for c in checks))
    text = "\n".join(lines)
    with open(os.path.join(r.a.out, "bwd_sweep_table.txt"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)


# -- the offline table (no GPU) -------------------------------------------------------------------
def offline_main():
    """Compile every sweep launch for sm_90 on CPU (bench/bwd_sass.py's recorder and compiler) and
    print the JSON of OFFLINE_FILE. Run with the GPU image's triton on PYTHONPATH."""
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(0, os.path.dirname(here))
    import bwd_sass as bs  # sets STREAMKL_* for recording, imports triton
    import torch
    import triton

    from streamkl_gpu.attention.triton import bwd as _bwd
    from streamkl_gpu._core import checks as _checks
    from streamkl_ref._checks import check_inputs
    for n in ("_kl_bwd_dk_kernel", "_kl_bwd_dq_kernel", "_kl_bwd_rows_kernel"):
        setattr(_bwd, n, bs._Rec(n, getattr(_bwd, n)))
    _checks.check_tensors = lambda q1, k1, q2, k2, s1, s2: check_inputs(q1, k1, q2, k2, scale1=s1, scale2=s2)
    H, N, D = 2, 1024, 128
    d = {k: torch.empty(1, H, N, D, dtype=torch.bfloat16) for k in ("q1", "k1", "q2", "k2")}
    d["g"] = torch.zeros(1, H, N)
    fwd = tuple(torch.zeros(1, H, N) for _ in range(3))
    global OFFLINE
    OFFLINE = {}  # every config of the spaces, none pruned
    js = jobs(False) + [dict(kind="fused", setting=s, cfg=list(REF_FUSED), probe=p) for s in SETTINGS for p in (3, 4)]
    out, seen = {}, set()
    for j in js:
        key = offline_key(j["kind"], j["setting"], j["cfg"], j["probe"])
        if key in seen:
            continue
        seen.add(key)
        bs.records.clear()
        try:
            Direct(torch, d, fwd, j["setting"]).run_job(j)
        except Exception:
            pass  # the recorder returns no kernel: the bookkeeping after the recorded launch fails
        recs = [rec for rec in bs.records if "BLOCK_M" in rec[3]]
        try:
            r = bs.analyse(bs.compile_rec(recs[-1]))
        except Exception as exc:
            print(f"{key}: FAILED {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            continue
        loop = r["loops"][0] if r["loops"] else (None, None)
        out[key] = dict(regs=r["reg"], stack=r["stack"], smem=r["smem"], stl=r["stl"], loop_instr=loop[0],
                        loop_hgmma=loop[1])
        print(f"{key}: {out[key]}", file=sys.stderr, flush=True)
    about = (f"offline sm_90 compile (triton {triton.__version__}) of the bench/bwd_sweep.py launches, B=1 H=2 "
             "N=1024 D=128 bf16 non-causal: registers, stack bytes (spills), shared memory bytes, STL count, SASS "
             "instructions and HGMMA of the whole-tile loop; regenerate with: PYTHONPATH=<triton 3.6> python "
             "bench/bwd_sweep.py --offline > bench/bwd_sweep_sm90.json")
    items = sorted(out.items())
    print("{\n" + f'"about": {json.dumps(about)},\n"kernels": {{')
    print(",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items))
    print("}\n}")


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--offline"]:
        offline_main()
    else:
        print("usage: python bench/bwd_gpu.py OUT --sweep [--quick]   |   python bench/bwd_sweep.py --offline")
