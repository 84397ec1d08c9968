"""Section ``peers``: the conformance suite against code no one here wrote: PyTorch's ``F.kl_div`` on
attention log-probabilities (eager and ``torch.compile``), flash-linear-attention's
``FusedKLDivLoss`` and Liger-Kernel's ``LigerKLDIVLoss`` (materialised logits through a few lines
of glue), and streamkl's kernels for comparison.

    python bench/bench_gpu.py --sections peers                 # on the GPU
    PYTHONPATH=bench:.:.device/peers python -m streamkl_bench.conformance_peers OUT_DIR --device cpu

The peers come from ``.device/peers`` (the section puts it on the child's PYTHONPATH when it
exists: ``pip install --no-deps --no-compile --target .device/peers liger-kernel==0.8.5
flash-linear-attention==0.6.0 fla-core==0.6.0 einops``, then carry it) or the environment.
Writes ``conformance_peers.{json,csv,md}`` (every report; one line per peer; the docs table) and
prints a short table last. A peer that cannot be imported or run is a row with the reason.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="directory for the JSON and CSV results")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--quick", action="store_true", help="the quick subset of the battery")
    p.add_argument("--peers", help="comma list of peers to run (default: all)")
    return p.parse_args()


# glue: materialised logits, as a user feeding a row-wise KL loss would write it
def _scores(q, k, scale, h):
    import torch

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k
    return scale * torch.matmul(q.float(), k.float().transpose(-1, -2))


def _masked(s, causal, fill):
    """Bottom-right causal mask; ``fill``: ``-inf`` or the dtype's most negative finite number."""
    import torch

    nq, nk = s.shape[-2:]
    if not causal:
        return s, None
    i = torch.arange(nq, device=s.device)[:, None]
    j = torch.arange(nk, device=s.device)[None, :]
    vis = j <= i + (nk - nq)
    empty = ~vis.any(-1)
    vis = vis | empty[:, None]  # a row with no key: computed unmasked, zeroed after
    return s.masked_fill(~vis, fill), empty


def torch_kl_div(q1, k1, q2, k2, *, causal, scale1, scale2, fill=-math.inf):
    """``F.kl_div(log P2, log P1, log_target=True)`` summed over keys: rows ``[B, H, N_Q]``."""
    import torch
    import torch.nn.functional as F

    h = q1.shape[1]
    s1, empty = _masked(_scores(q1, k1, scale1, h), causal, fill)
    s2, _ = _masked(_scores(q2, k2, scale2, h), causal, fill)
    kl = F.kl_div(torch.log_softmax(s2, -1), torch.log_softmax(s1, -1), log_target=True, reduction="none").sum(-1)
    return kl if empty is None else kl.masked_fill(empty, 0.0)


def torch_kl_div_finite_mask(q1, k1, q2, k2, *, causal, scale1, scale2):
    return torch_kl_div(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2,
                        fill=-3.4028234663852886e38)  # float32's most negative finite number


def fla_fused_kl_div(q1, k1, q2, k2, *, causal, scale1, scale2):
    """flash-linear-attention's FusedKLDivLoss(x, target_x, weight, target_weight): logits are
    ``x @ weight.T``, so per (batch, head) ``x = scale2 * q2``, ``weight = k2`` of its GQA group;
    the teacher is frozen (it must not require grad). No mask: non-causal only. Returns the sum
    over rows (its 'batchmean' times N_Q)."""
    from fla.modules.fused_kl_div import FusedKLDivLoss

    if causal:
        raise NotImplementedError("FusedKLDivLoss has no mask")
    loss_fn = FusedKLDivLoss(reduction="batchmean")
    B, H, NQ, D1 = q1.shape
    D2 = q2.shape[-1]
    sc1 = 1.0 / math.sqrt(D1) if scale1 is None else scale1
    sc2 = 1.0 / math.sqrt(D2) if scale2 is None else scale2
    g1, g2 = H // k1.shape[1], H // k2.shape[1]
    total = 0.0
    for b in range(B):
        for h in range(H):
            total = total + NQ * loss_fn(sc2 * q2[b, h], (sc1 * q1[b, h]).detach(), k2[b, h // g2],
                                         k1[b, h // g1].detach())
    return total


def liger_kl_div(q1, k1, q2, k2, *, causal, scale1, scale2, fill=-3.4028234663852886e38):
    """Liger-Kernel's LigerKLDIVLoss(log_target=True, reduction='none') on the materialised
    log-probabilities ``[B*H*N_Q, N_K]``; its backward gives the input (student) only."""
    import torch
    from liger_kernel.transformers import LigerKLDIVLoss

    h = q1.shape[1]
    s1, empty = _masked(_scores(q1, k1, scale1, h), causal, fill)
    s2, _ = _masked(_scores(q2, k2, scale2, h), causal, fill)
    nk = s1.shape[-1]
    lp1 = torch.log_softmax(s1, -1).reshape(-1, nk).contiguous()
    lp2 = torch.log_softmax(s2, -1).reshape(-1, nk).contiguous()
    kl = LigerKLDIVLoss(reduction="none", log_target=True)(lp2, lp1).sum(-1).reshape(s1.shape[:-1])
    return kl if empty is None else kl.masked_fill(empty, 0.0)


def liger_kl_div_inf_mask(q1, k1, q2, k2, *, causal, scale1, scale2):
    return liger_kl_div(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, fill=-math.inf)


def streamkl_kernels(q1, k1, q2, k2, *, causal, scale1, scale2):
    import streamkl_gpu

    return streamkl_gpu.attention_kl(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2)


FWD = {"nan_isolation": "forward"}
STUDENT = {"grad_inputs": ("q2", "k2")}
# name -> (callable or factory, check options, what it is)
PEERS = {
    "torch_kl_div_inf_mask": (lambda: torch_kl_div, {"supports": FWD},
                              "torch.nn.functional.kl_div(log_softmax(S2), log_softmax(S1), log_target=True), masked with -inf"),
    "torch_kl_div_finite_mask": (lambda: torch_kl_div_finite_mask, {"supports": FWD},
                                 "the same, masked with float32's most negative finite number"),
    "torch_compile_inductor": (lambda: __import__("torch").compile(torch_kl_div_finite_mask, dynamic=True),
                               {"supports": FWD}, "torch.compile (inductor) of the finite-mask F.kl_div formula"),
    "fla_fused_kl_div": (lambda: fla_fused_kl_div,
                         {"returns": "sum", "supports": {"causal": False, **STUDENT}},
                         "flash-linear-attention FusedKLDivLoss, per (batch, head), frozen teacher"),
    "liger_kl_div": (lambda: liger_kl_div, {"supports": {**FWD, **STUDENT}},
                     "Liger-Kernel LigerKLDIVLoss(log_target=True) on materialised log-probs, finite mask"),
    "liger_kl_div_inf_mask": (lambda: liger_kl_div_inf_mask, {"supports": {**FWD, **STUDENT}},
                              "the same, masked with -inf"),
    "streamkl_gpu": (lambda: streamkl_kernels, {}, "streamkl_gpu.attention_kl (this project)"),
}


def summary_line(name: str, data: dict, seconds) -> dict:
    """One CSV line from a report dict: counts, and the failing rows with the first reason."""
    rows = data["rows"]
    failed = [r for r in rows if r["status"] == "fail"]
    names = sorted({f"{r['case']}:{r['quantity']}" for r in failed})
    note = ""
    if failed:
        note = "; ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
        first = next((r["why"] for r in failed if r["why"]), "")
        if first:
            note += f" [first: {first[:110]}]"
    return {"peer": name, "passed": data["passed"], "pass": sum(r["status"] == "pass" for r in rows),
            "fail": len(failed), "skipped": sum(r["status"] == "skipped" for r in rows), "seconds": seconds,
            "note": note}


def render_markdown(csv_path) -> str:
    """The docs table (docs/_generated/conformance_peers.md) from a results CSV."""
    with open(csv_path, newline="") as fh:
        lines = list(csv.DictReader(fh))
    out = ["| peer | passed | pass | fail | skipped | failing rows (case:quantity) |", "|---|---|---|---|---|---|"]
    for ln in lines:
        note = ln["note"].replace("|", "\\|") or "—"
        out.append(f"| `{ln['peer']}` | {ln['passed'] or '—'} | {ln['pass']} | {ln['fail']} | {ln['skipped']} | {note} |")
    return "\n".join(out) + "\n"


def main() -> int:
    args = _parse()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from streamkl_ref.testing import check_attention_kl

    dtypes = ("float32",) if device == "cpu" else ("float32", "bfloat16")
    names = args.peers.split(",") if args.peers else list(PEERS)
    results, lines = {}, []
    for name in names:
        factory, options, what = PEERS[name]
        t0 = time.time()
        try:
            fn = factory()
            report = check_attention_kl(fn, device=device, dtypes=dtypes, quick=args.quick, **options)
        except Exception as exc:  # noqa: BLE001 (a peer that cannot run is a result)
            results[name] = {"what": what, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-3000:]}
            lines.append({"peer": name, "passed": "", "pass": 0, "fail": 0, "skipped": 0,
                          "seconds": round(time.time() - t0, 1), "note": f"could not run: {type(exc).__name__}: {str(exc)[:160]}"})
            continue
        data = report.to_dict()
        data["what"] = what
        results[name] = data
        lines.append(summary_line(name, data, round(time.time() - t0, 1)))
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "python": platform.python_version(), "dtypes": list(dtypes), "quick": args.quick}
    for mod in ("triton", "liger_kernel", "fla"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            env[mod] = f"not importable: {type(exc).__name__}"
    with open(out / "conformance_peers.json", "w") as fh:
        json.dump({"env": env, "peers": results}, fh, indent=2, allow_nan=False)
    with open(out / "conformance_peers.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(lines[0]))
        w.writeheader()
        w.writerows(lines)
    (out / "conformance_peers.md").write_text(render_markdown(out / "conformance_peers.csv"))
    print(json.dumps(env))
    print(f"{'peer':<26} {'passed':<7} {'pass':>5} {'fail':>5} {'skip':>5} {'s':>6}  failing rows")
    for ln in lines:
        print(f"{ln['peer']:<26} {str(ln['passed']):<7} {ln['pass']:>5} {ln['fail']:>5} {ln['skipped']:>5} "
              f"{ln['seconds']:>6}  {ln['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
