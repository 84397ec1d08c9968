"""Providers: the eager baselines and the closures the perf sections time.

``dense_kl`` is the eager baseline of the anchors (and, in float64, the correctness reference);
``chunked_kl`` is it over query chunks. ``ProvidersMixin`` builds ``f(d)`` closures over one input
set ``d`` (q1, k1, q2, k2, g): ours (streamkl_gpu.attention_kl), eager, torch.compile, SDPA with
PyTorch's default dispatch and forced to the flash backend.
"""
from __future__ import annotations

import math

from .cases import SETTINGS


# the math the baselines and the float64 reference share
def dense_kl(q1, k1, q2, k2, causal=False, scale1=None, scale2=None, cdt=None, diag=None):
    """Eager attention KL: materialised log_softmax of both score matrices in `cdt` (default fp32).

    Scores: matmul in the input dtype, cast to cdt, times the scale. causal is bottom-right:
    key j visible to query i iff j <= i + diag, diag = N_K - N_Q unless given (query chunks).
    Masked entries: -inf before log_softmax, then log-probs set to 0 so 0*log(0/0) = 0 and no NaN
    reaches the values or the gradients; rows with no visible key give KL = 0 and gradient 0.
    """
    import torch
    cdt = cdt or torch.float32
    H, NQ, NK = q1.shape[1], q1.shape[2], k1.shape[2]
    sc1 = scale1 if scale1 is not None else 1.0 / math.sqrt(q1.shape[-1])
    sc2 = scale2 if scale2 is not None else 1.0 / math.sqrt(q2.shape[-1])
    if k1.shape[1] != H:
        k1 = k1.repeat_interleave(H // k1.shape[1], dim=1)
    if k2.shape[1] != H:
        k2 = k2.repeat_interleave(H // k2.shape[1], dim=1)
    if not causal:
        lp1 = torch.log_softmax(torch.matmul(q1, k1.transpose(-1, -2)).to(cdt) * sc1, dim=-1)
        lp2 = torch.log_softmax(torch.matmul(q2, k2.transpose(-1, -2)).to(cdt) * sc2, dim=-1)
        return (lp1.exp() * (lp1 - lp2)).sum(-1)
    if diag is None:
        diag = NK - NQ
    dev = q1.device
    hidden = torch.arange(NK, device=dev)[None, :] > (torch.arange(NQ, device=dev)[:, None] + diag)
    empty_rows = diag < 0  # row 0 sees keys j <= diag: none when diag < 0

    def logp(q, k, sc):
        s = torch.matmul(q, k.transpose(-1, -2)).to(cdt) * sc
        s = s.masked_fill_(hidden, -math.inf)
        if empty_rows:
            s = s.masked_fill_(hidden.all(-1, keepdim=True), 0.0)
        return torch.log_softmax(s, dim=-1).masked_fill(hidden, 0.0)

    lp1 = logp(q1, k1, sc1)
    lp2 = logp(q2, k2, sc2)
    return (lp1.exp() * (lp1 - lp2)).sum(-1)


def chunked_kl(q1, k1, q2, k2, causal=False, chunk=1024):
    """Eager over query chunks (what users do today to avoid the N^2 OOM)."""
    import torch
    NQ, NK = q1.shape[2], k1.shape[2]
    outs = []
    for i0 in range(0, NQ, chunk):
        i1 = min(NQ, i0 + chunk)
        outs.append(dense_kl(q1[:, :, i0:i1], k1, q2[:, :, i0:i1], k2, causal=causal, diag=i0 + NK - NQ))
    return torch.cat(outs, dim=2)


class ProvidersMixin:
    """Closures over an input set; needs self.torch, self.ak (None when streamkl_gpu is missing)
    and self.get (report)."""

    def f_ours_fwd(self, causal, split_k=None):
        if self.ak is None:
            return None
        ak = self.ak
        return lambda d: ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal, split_k=split_k)

    def f_ours_fb(self, causal, setting, bwd_mode):
        if self.ak is None:
            return None
        ak, names, torch = self.ak, SETTINGS[setting], self.torch

        def f(d):
            kl = ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal, bwd_mode=bwd_mode)
            return torch.autograd.grad(kl, [d[n] for n in names], d["g"])
        return f

    def f_eager_fwd(self, causal, compiled=None):
        fn = compiled or dense_kl
        return lambda d: fn(d["q1"], d["k1"], d["q2"], d["k2"], causal)

    def f_eager_fb(self, causal, setting, compiled=None):
        fn, names, torch = compiled or dense_kl, SETTINGS[setting], self.torch

        def f(d):
            kl = fn(d["q1"], d["k1"], d["q2"], d["k2"], causal)
            return torch.autograd.grad(kl, [d[n] for n in names], d["g"])
        return f

    # SDPA providers: "sdpa" = PyTorch's default backend dispatch (no context; cuDNN on the H200),
    # "sdpa_flash" = forced to the FlashAttention backend (on CPU: torch's CPU flash kernel).
    SDPA_PROVIDERS = (("sdpa", "default"), ("sdpa_flash", "flash"))

    def sdpa_ctx(self, backend):
        if backend == "default":
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        return lambda: sdpa_kernel([be])

    def sdpa_best(self, kernel, mode, causal, nq, nk=None):
        """The faster of the SDPA providers measured in this run: (ms, which, note) or (None, None, "")."""
        got = [(self.get(kernel, p, mode, causal, nq, nk), b) for p, b in self.SDPA_PROVIDERS]
        meas = [(t, b) for t, b in got if t]
        if not meas:
            return None, None, ""
        t, b = min(meas)
        missing = [b2 for t2, b2 in got if not t2]
        return t, b, (f"; {','.join(missing)} not measured" if missing else "")

    def prep_sdpa_bwd(self, sets):
        """Leaves (sharing storage with q1, k1, k2) and dO for SDPA fwd+bwd, made before timing."""
        for d in sets:
            d["_sdpa"] = [d[n].detach().requires_grad_(True) for n in ("q1", "k1", "k2")]
            d["_do"] = self.torch.randn_like(d["q1"])
        return sets

    def f_sdpa(self, causal, backward=False):
        """SDPA at the same shape: q = q1, k = k1, v = k2 (contents do not matter for speed)."""
        F = self.torch.nn.functional
        torch = self.torch

        if not backward:
            return lambda d: F.scaled_dot_product_attention(d["q1"], d["k1"], d["k2"], is_causal=causal)

        def f(d):
            q, k, v = d["_sdpa"]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(o, (q, k, v), d["_do"])
        return f

    def compiled_kl(self):
        torch = self.torch
        import torch._dynamo as dyn
        dyn.reset()
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dyn.config, name):
                try:
                    setattr(dyn.config, name, 256)
                except Exception:
                    pass
        return torch.compile(dense_kl, dynamic=False)

    # ------------------------------------------------------------------------------------------
    # sections
