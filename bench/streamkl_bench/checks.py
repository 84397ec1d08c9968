"""The correctness section: streamkl_gpu.attention_kl against a float64 reference.

Tolerance, FlashAttention style: err(ours) <= C * err(eager at the same dtype) + floor, err the max
abs difference against dense_kl in float64 on the same rounded inputs (gradients by autograd).
Also split-K against one pass, bitwise determinism, and the bench's float64 reference against
streamkl_ref.attention_kl. One check.csv row per compared tensor (report.crow)."""

import contextlib
import os
import time
import traceback
from unittest import mock

from .cases import SETTINGS, check_cases, hash_str
from .providers import dense_kl

# FlashAttention-style tolerance: err(ours) <= C * err(eager, same dtype) + floor.
C_FWD, C_BWD = 2.0, 3.0


class ChecksMixin:
    def check_cases(self):
        """The correctness matrix of this run (cases.check_cases)."""
        return check_cases(self.a.tiny, self.a.full_check)

    @contextlib.contextmanager
    def tf32(self, on):
        torch = self.torch
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = on
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    def maxerr(self, a, b):
        torch = self.torch
        if a.shape != b.shape:
            return float("nan")
        d = (a.double() - b.double()).abs()
        if d.numel() == 0:
            return 0.0
        v = d.max().item()
        if torch.isnan(a).any().item():
            return float("nan")
        return v

    def run_case(self, c):
        torch = self.torch
        dtype = c["dtype"]
        causal = c["causal"]
        case = f"{c['name']}{'/causal' if causal else ''}"
        kw = dict(causal=causal, scale1=c.get("scale1"), scale2=c.get("scale2"))
        base = self.inputs(c["B"], c["H"], c["NQ"], c["NK"], c["D1"], c["D2"], dtype, HK1=c.get("HK1"),
                           HK2=c.get("HK2"), seed=hash_str(case + dtype))[0]
        names = ("q1", "k1", "q2", "k2")

        def leaf(d, req, cast=None):
            return {n: (d[n].detach().to(cast) if cast else d[n].detach()).requires_grad_(n in req) for n in names}

        def eager_run(req, tf32):
            x = leaf(base, req)
            with self.tf32(tf32):
                kl = dense_kl(*(x[n] for n in names), **kw)
                gr = torch.autograd.grad(kl, [x[n] for n in req], base["g"]) if req else []
            return kl.detach(), [t.detach() for t in gr]

        for setting in c["settings"]:
            req = () if setting == "fwd" else SETTINGS[setting]
            # float64 reference (same rounded inputs, materialised log_softmax in float64)
            x64 = leaf(base, req, torch.float64)
            kl64 = dense_kl(*(x64[n] for n in names), cdt=torch.float64, **kw)
            g64 = torch.autograd.grad(kl64, [x64[n] for n in req], base["g"].double()) if req else []
            kl64 = kl64.detach()
            # the same eager math at this dtype; fp32 inputs: TF32 matmul allowed (the looser of the two)
            e_kl, e_gr = eager_run(req, tf32=(dtype == "fp32"))
            strict = eager_run(req, tf32=False) if (dtype == "fp32" and self.cuda) else None
            okw = dict(c.get("kw", {}))
            if setting == "fwd":
                modes = [None]
            elif okw.get("deterministic"):
                modes = ["deterministic"]
            else:
                modes = ["fused"] + (["separate"] if setting in c["separate"] else [])
            for bm in modes:
                label = case if bm is None else f"{case}/{bm}"
                try:
                    x = leaf(base, req)
                    if bm in ("fused", "separate"):
                        okw["bwd_mode"] = bm
                    kl = self.ak(*(x[n] for n in names), **kw, **okw)
                    gr = torch.autograd.grad(kl, [x[n] for n in req], base["g"]) if req else []
                except Exception as e:
                    self.crow(label, dtype, setting, "", "", False, "all", detail=f"{type(e).__name__}: {e}")
                    self.log(traceback.format_exc(), stdout=False)
                    continue
                if setting == "fwd":
                    ok_api = kl.dtype == torch.float32 and tuple(kl.shape) == (c["B"], c["H"], c["NQ"])
                    self.crow(label, dtype, "api", 0.0 if ok_api else 1.0, 0.0, ok_api, "kl dtype/shape",
                              detail=f"{kl.dtype} {tuple(kl.shape)}")
                outs = [("kl", kl.detach(), kl64, e_kl, strict[0] if strict else None, C_FWD)]
                if bm == "separate":
                    outs = []  # the forward does not depend on the mode: compared once (fused run)
                outs += [(f"d{n}", gr[i], g64[i], e_gr[i], strict[1][i] if strict else None, C_BWD)
                         for i, n in enumerate(req)]
                for tname, ours, ref, eag, eag_strict, cmul in outs:
                    err = self.maxerr(ours, ref)
                    eerr = self.maxerr(eag, ref)
                    amax = ref.abs().max().item() if ref.numel() else 0.0
                    floor = (2e-5 * max(1.0, amax)) if tname == "kl" else (2e-5 * amax + 1e-7)
                    tol = cmul * eerr + floor
                    detail = ""
                    if eag_strict is not None:
                        serr = self.maxerr(eag_strict, ref)
                        detail = f"eager_fp32_strict_err={serr:.3g}"
                        if err > cmul * serr + floor:
                            detail += " (ours at TF32-level precision)"
                    if ours.dtype != ref.dtype and tname != "kl" and ours.dtype != base["q1"].dtype:
                        detail += f" grad dtype {ours.dtype}"
                    self.crow(label, dtype, setting, err, tol, err <= tol, tname, eerr, detail)

    def check_splitk(self):
        torch = self.torch
        t = self.a.tiny
        shapes = ([dict(B=1, H=2, NQ=1, NK=200, D1=16, D2=16, causal=False, dtype="fp32", splits=[None, 2, 3]),
                   dict(B=1, H=2, NQ=4, NK=150, D1=16, D2=16, causal=True, dtype="bf16", splits=[3])] if t else
                  [dict(B=1, H=4, NQ=1, NK=32768, D1=128, D2=128, causal=False, dtype="bf16", splits=[None, 2, 5, 16]),
                   dict(B=2, H=4, HK1=2, NQ=16, NK=4099, D1=128, D2=64, causal=True, dtype="bf16", splits=[None, 3, 8]),
                   dict(B=1, H=4, NQ=3, NK=2000, D1=64, D2=64, causal=False, dtype="fp32", splits=[None, 4])])
        for s in shapes:
            case = f"splitk_nq{s['NQ']}_nk{s['NK']}{'/causal' if s['causal'] else ''}"
            d = self.inputs(s["B"], s["H"], s["NQ"], s["NK"], s["D1"], s["D2"], s["dtype"], HK1=s.get("HK1"),
                            seed=hash_str(case), g=False)[0]
            args = (d["q1"], d["k1"], d["q2"], d["k2"])
            ref = dense_kl(*(a.double() for a in args), s["causal"], cdt=torch.float64)
            with self.tf32(s["dtype"] == "fp32"):
                eerr = self.maxerr(dense_kl(*args, s["causal"]), ref)
            tol = C_FWD * eerr + 2e-5 * max(1.0, ref.abs().max().item())
            try:
                one = self.ak(*args, causal=s["causal"], split_k=1)
                self.crow(case, s["dtype"], "fwd", self.maxerr(one, ref), tol, self.maxerr(one, ref) <= tol,
                          "kl(split_k=1 vs fp64)", eerr)
                for k in s["splits"]:
                    sk = self.ak(*args, causal=s["causal"], split_k=k)
                    e1 = self.maxerr(sk, one)
                    self.crow(f"{case}/split_k={k}", s["dtype"], "fwd", e1, tol, e1 <= tol, "kl(split vs one-pass)", eerr)
                    e2 = self.maxerr(sk, ref)
                    self.crow(f"{case}/split_k={k}", s["dtype"], "fwd", e2, tol, e2 <= tol, "kl(split vs fp64)", eerr)
            except Exception as e:
                self.crow(case, s["dtype"], "fwd", "", "", False, "split", detail=f"{type(e).__name__}: {e}")
                self.log(traceback.format_exc(), stdout=False)

    def check_determinism(self):
        torch = self.torch
        t = self.a.tiny
        fwd_shapes = ([dict(B=1, H=2, NQ=40, NK=40, causal=True), dict(B=1, H=2, NQ=1, NK=300, causal=False)] if t else
                      [dict(B=2, H=4, NQ=1000, NK=1000, causal=True), dict(B=1, H=4, NQ=1, NK=32768, causal=False)])
        D = 16 if t else 64
        for s in fwd_shapes:
            case = f"determinism_fwd_nq{s['NQ']}_nk{s['NK']}{'/causal' if s['causal'] else ''}"
            d = self.inputs(s["B"], s["H"], s["NQ"], s["NK"], D, D, "bf16", seed=hash_str(case), g=False)[0]
            try:
                a = self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=s["causal"])
                b = self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=s["causal"])
                same = bool(torch.equal(a, b))
                self.crow(case, "bf16", "fwd", self.maxerr(a, b), 0.0, same, "kl bitwise")
            except Exception as e:
                self.crow(case, "bf16", "fwd", "", "", False, "kl bitwise", detail=f"{type(e).__name__}: {e}")
        s = (dict(B=1, H=4, HK1=2, HK2=1, N=40) if t else dict(B=2, H=8, HK1=2, HK2=4, N=1000))
        for bm in ("fused", "separate"):
            case = f"determinism_bwd_n{s['N']}_gqa/causal/{bm}"
            d = self.inputs(s["B"], s["H"], s["N"], s["N"], D, D, "bf16", HK1=s["HK1"], HK2=s["HK2"],
                            req=SETTINGS["both"], seed=hash_str(case))[0]
            try:
                runs = []
                for _ in range(2):
                    kl = self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=True, bwd_mode=bm, deterministic=True)
                    runs.append(torch.autograd.grad(kl, [d[n] for n in SETTINGS["both"]], d["g"]))
                for i, n in enumerate(SETTINGS["both"]):
                    same = bool(torch.equal(runs[0][i], runs[1][i]))
                    self.crow(case, "bf16", "both", self.maxerr(runs[0][i], runs[1][i]), 0.0, same,
                              f"d{n} bitwise (deterministic=True)")
            except Exception as e:
                self.crow(case, "bf16", "both", "", "", False, "bitwise", detail=f"{type(e).__name__}: {e}")
                self.log(traceback.format_exc(), stdout=False)

    def check_vs_streamkl_ref(self):
        """Our float64 torch reference against the project's NumPy reference, tiny shapes."""
        torch = self.torch
        try:
            import streamkl_ref
            ref_fn = streamkl_ref.attention_kl
        except Exception as e:
            self.log(f"  (streamkl_ref.attention_kl unavailable: {type(e).__name__}; dense-reference cross-check skipped)")
            return
        for causal, (nq, nk) in ((False, (7, 13)), (True, (13, 7)), (True, (6, 19))):
            case = f"dense_ref_vs_streamkl_ref_nq{nq}_nk{nk}{'/causal' if causal else ''}"
            d = self.inputs(1, 4, nq, nk, 8, 12, "fp32", HK1=2, HK2=1, seed=hash_str(case), g=False)[0]
            x = [d[n].detach().cpu().double() for n in ("q1", "k1", "q2", "k2")]
            mine = dense_kl(*x, causal, scale1=0.7, scale2=0.3, cdt=torch.float64)
            try:
                theirs = torch.as_tensor(ref_fn(*(t.numpy() for t in x), causal=causal, scale1=0.7, scale2=0.3),
                                         dtype=torch.float64)
                err = self.maxerr(mine, theirs.reshape(mine.shape))
                self.crow(case, "fp64", "fwd", err, 1e-9, err <= 1e-9, "kl(bench dense ref vs streamkl_ref)")
            except Exception as e:
                self.crow(case, "fp64", "fwd", "", "", False, "kl", detail=f"{type(e).__name__}: {e}")

    def sec_check(self):
        # streamkl_gpu tunes launch configs per shape bucket on first use (each candidate a compile);
        # correctness needs one config per shape, so take the first candidate unless asked not to.
        with mock.patch.dict(os.environ, {} if self.a.check_autotune else {"STREAMKL_AUTOTUNE": "0"}):
            self._sec_check()

    def _sec_check(self):
        if self.ak is None:
            self.crow("import", "-", "-", "", "", False, "streamkl_gpu.attention_kl", detail=self.ak_error)
            return
        cases = self.check_cases()
        for i, c in enumerate(cases):
            tc = time.perf_counter()
            n0 = len(self.checks)
            try:
                self.run_case(c)
            except Exception as e:
                self.crow(c["name"], c["dtype"], "-", "", "", False, "case", detail=f"{type(e).__name__}: {e}")
                self.log(traceback.format_exc(), stdout=False)
            self.free()
            new = self.checks[n0:]
            nf = sum(not r["pass"] for r in new)
            self.log(f"check {i + 1}/{len(cases)} {c['name']}{'/causal' if c['causal'] else ''} {c['dtype']}: "
                     f"{len(new) - nf}/{len(new)} pass ({time.perf_counter() - tc:.1f}s)", stdout=self.a.verbose or nf > 0)
        for f in (self.check_splitk, self.check_determinism, self.check_vs_streamkl_ref):
            tc = time.perf_counter()
            n0 = len(self.checks)
            f()
            new = self.checks[n0:]
            nf = sum(not r["pass"] for r in new)
            self.log(f"check {f.__name__}: {len(new) - nf}/{len(new)} pass ({time.perf_counter() - tc:.1f}s)",
                     stdout=self.a.verbose or nf > 0)
        nf = sum(not r["pass"] for r in self.checks)
        self.log(f"check: {len(self.checks) - nf}/{len(self.checks)} rows pass")
