"""``check_indexer_kl``: the indexer-loss battery against any callable (the same rule, claims and
adapters as the attention battery; the teacher is a constant)."""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from .attention import _check_adapters, _check_reduction
from .cases import (INDEXER_GRADS, INDEXER_INPUTS, PLANT_PAD, IndexerCase, _plant_masks, case_generator,
                    indexer_cases)
from . import reference_cache, same_precision
from .report import (Report, Row, _hint, _row_adder, _keep_causal_hints_where_alignment_explains, _planted_quiet,
                     _raise_unless_passed, _raised, _ranges, _shape_hint)
from .tolerance import (KL_ROUNDING_ULPS, ROW_STAT_EPS, ZERO_GRAD_TOL, _dtype_name, _to_numpy,
                        kl_error_and_tolerance, relative_error, tolerance)


INDEXER_SUPPORT_KEYS = {
    "gqa": "bool: H_K != H or H_KI != H_I (default True)",
    "nq_ne_nk": "bool: N_Q != N_K (default True)",
    "causal": "bool: causal masking (default True)",
    "no_relu": "bool: relu=False (default True)",
    "head_dims": "iterable of ints: the head dims D and D_I it takes (default: any)",
    "dtypes": "iterable of dtype names (default: any)",
    "grad_inputs": "subset of ('q_idx','k_idx','weights') (default all three)",
    "nan_isolation": "True (default), 'forward' or False",
}


def _check_indexer_supports(supports) -> dict:
    s = {"gqa": True, "nq_ne_nk": True, "causal": True, "no_relu": True, "head_dims": None, "dtypes": None,
         "grad_inputs": tuple(INDEXER_GRADS), "nan_isolation": True}
    if supports is None:
        return s
    if not isinstance(supports, dict):
        raise ValueError(f"supports must be a dict or None, got {type(supports).__name__}")
    for key, value in supports.items():
        if key not in s:
            raise ValueError(f"supports: unknown claim {key!r}; known: {sorted(INDEXER_SUPPORT_KEYS)}")
        if key in ("head_dims", "dtypes", "grad_inputs") and value is not None:
            value = tuple(value)
        if key == "grad_inputs" and any(v not in INDEXER_GRADS for v in value):
            raise ValueError(f"supports['grad_inputs'] must name inputs of {tuple(INDEXER_GRADS)}, got {list(value)}")
        if key == "nan_isolation" and value not in (True, False, "forward"):
            raise ValueError(f"supports['nan_isolation'] must be True, False or 'forward', got {value!r}")
        s[key] = value
    return s


def _indexer_unsupported(case: IndexerCase, dtype: str, s: dict) -> str:
    f = case.features()
    for key, label in (("gqa", "GQA"), ("nq_ne_nk", "N_Q != N_K"), ("causal", "causal"), ("no_relu", "relu=False")):
        if f[key] and not s[key]:
            return f"outside supports: {label}"
    if s["head_dims"] is not None and not set(f["head_dims"]) <= set(s["head_dims"]):
        return f"outside supports: head dims {f['head_dims']}"
    if s["dtypes"] is not None and dtype not in s["dtypes"]:
        return f"outside supports: dtype {dtype}"
    if case.plant is not None and s["nan_isolation"] is False:
        return "outside supports: NaN isolation not claimed"
    return ""


def check_indexer_kl(fn: Callable, *, device="cpu", dtypes=("float32",), grads=True, quick=False,
                     layout="bhnd", causal_align="bottom-right", returns="rows", supports=None,
                     cases=None, seed=0) -> Report:
    """Run the indexer battery against ``fn(q, k, q_idx, k_idx, weights, *, causal, scale, relu)``.

    ``fn`` returns the per-row loss ``[B, N_Q]`` (``returns="rows"``), its sum, or its mean over
    the rows with at least one visible key (``"mean"``: Megatron's reduction). The teacher
    (``q``, ``k``) is a constant: it gets no ``requires_grad``; ``q_idx``, ``k_idx``, ``weights``
    do when ``grads=True``. ``layout="bnhd"``: the four 4-D tensors as ``[B, N, H, D]`` and
    ``weights`` as ``[B, N_Q, H_I]``. ``causal_align``, ``supports`` (keys:
    :data:`INDEXER_SUPPORT_KEYS`), ``cases`` and ``seed`` as in :func:`check_attention_kl` (with
    ``"top-left"``, a causal case with ``N_Q < N_K`` is sent with ``N_K − N_Q`` zero query rows and
    zero weights in front: the student's logits there are 0 and the teacher's uniform, so those
    rows give KL 0 and no gradient). The reference is ``streamkl_ref.indexer_kl`` /
    ``indexer_kl_grad`` in float64; the tolerance :func:`tolerance` against
    :func:`indexer_kl_torch` at the inputs' precision.
    """
    import torch

    dnames = _check_adapters(layout, causal_align, returns, dtypes)
    claims = _check_indexer_supports(supports)
    if cases is None or isinstance(cases, str):
        cases = indexer_cases(device, quick, which=cases or "default")
    cases = tuple(cases)
    report = Report(options={
        "loss": "indexer", "device": str(device), "dtypes": dnames, "grads": bool(grads), "quick": bool(quick),
        "layout": layout, "causal_align": causal_align, "returns": returns, "seed": seed,
        "supports": {k: (list(v) if isinstance(v, tuple) else v) for k, v in claims.items()},
        "fn": getattr(fn, "__qualname__", repr(fn)),
    })
    t0 = time.time()
    for case in cases:
        report.cases[case.name] = case.to_dict()
        gen = case_generator(seed, case)
        base = []
        for name, shape in case.shapes.items():
            amp = case.weight_amplitude if name == "weights" else case.amplitude
            base.append(amp * torch.randn(*shape, generator=gen, dtype=torch.float64))
        g_rows = torch.randn(case.B, case.NQ, generator=gen, dtype=torch.float64)
        for dname in dnames:
            _run_indexer_case(fn, case, dname, base, g_rows, report, device=device, grads=grads, layout=layout,
                              causal_align=causal_align, returns=returns, claims=claims)
    _keep_causal_hints_where_alignment_explains(report, cases)
    report.elapsed_s = time.time() - t0
    return report


def _run_indexer_case(fn, case, dname, base, g_rows, report, *, device, grads, layout, causal_align, returns, claims):
    import torch

    import streamkl_ref

    add = _row_adder(report, case, dname, claims, causal_align)

    why = _indexer_unsupported(case, dname, claims)
    if why:
        add("(all)", math.nan, math.nan, "skipped", why)
        return
    translate = case.causal and causal_align == "top-left" and case.NQ != case.NK
    if translate and case.NQ > case.NK:
        add("(all)", math.nan, math.nan, "skipped", "top-left causal cannot express bottom-right with N_Q > N_K")
        return
    pad_rows = case.NK - case.NQ if translate else 0
    dtype = getattr(torch, dname)
    xs = [x.to(dtype) for x in base]
    x64 = [x.double().numpy() for x in xs]
    kw = dict(causal=case.causal, scale=case.scale, relu=case.relu)
    off = case.NK - case.NQ
    n_keyed = case.B * int(np.sum(np.minimum(np.arange(case.NQ) + off + 1, case.NK) > 0)) if case.causal \
        else case.B * case.NQ  # rows with at least one visible key (Megatron's mean)
    g = {"rows": g_rows, "sum": torch.ones_like(g_rows),
         "mean": torch.full_like(g_rows, 1.0 / max(n_keyed, 1))}[returns]
    rows_ok, keys_ok = _plant_masks(case) if case.plant else (np.ones(case.NQ, bool), None)

    ref_kl, ref_lse_idx, ref_lse_teacher = reference_cache.call(streamkl_ref.indexer_kl, *x64, return_lse=True, **kw)
    row_floor = indexer_row_floor(ref_lse_idx, ref_lse_teacher, ref_kl, case, dname)
    want_grad = set(claims["grad_inputs"]) if grads else set()
    ref_grad = reference_cache.call(streamkl_ref.indexer_kl_grad, *x64, g.numpy(), **kw) if want_grad else None
    # the same math at the inputs' precision: the tolerance scale (kept by the reference cache)
    same = same_precision.call(same_precision.indexer_kl_same, *x64, g.numpy() if want_grad else None, dtype=dname,
                               grad_inputs=tuple(n for n in INDEXER_INPUTS if n in want_grad), **kw)
    same_kl = torch.from_numpy(same["kl"]).to(dtype)  # its values exactly, for the sum or mean below

    leaves, views = {}, []
    pad_n, pad_d = PLANT_PAD
    for name, x in zip(INDEXER_INPUTS, xs):
        x = x.clone()
        row_input = name in ("q", "q_idx", "weights")
        if pad_rows and row_input:  # front-pad zero query rows (and zero weights) for top-left
            x = torch.cat([torch.zeros(*x.shape[:2], pad_rows, *x.shape[3:], dtype=x.dtype), x], 2)
        if case.plant == "keys" and name == "k":
            x[:, :, case.plant_at] = float("nan")
        if case.plant == "keys" and name == "k_idx":
            x[:, :, case.plant_at + 3] = float("inf")
        if case.plant == "queries" and name in ("q", "q_idx"):
            x[:, :, pad_rows + case.plant_at] = float("nan")
        if layout == "bnhd":
            x = x.transpose(1, 2)
        requires = name in want_grad
        if case.plant is not None:  # a view into a NaN-filled buffer longer in N (and wider in D)
            n_axis = 2 if layout == "bhnd" else 1
            shape = list(x.shape)
            shape[n_axis] += pad_n
            idx = [slice(None)] * x.ndim
            idx[n_axis] = slice(0, x.shape[n_axis])
            if x.ndim == 4:
                shape[3] += pad_d
                idx[3] = slice(0, x.shape[3])
            buf = torch.full(shape, float("nan"), dtype=x.dtype)
            buf[tuple(idx)] = x
            buf = buf.to(device).requires_grad_(requires)
            leaves[name] = (buf, tuple(idx))
            views.append(buf[tuple(idx)])
        else:
            leaf = x.contiguous().to(device).requires_grad_(requires)
            leaves[name] = (leaf, (Ellipsis,))
            views.append(leaf)
    try:
        with _planted_quiet(case):
            out = fn(*views, **kw)
    except Exception as exc:  # noqa: BLE001
        add("(call)", math.nan, math.nan, "fail", _raised("fn", exc))
        return
    if not isinstance(out, torch.Tensor):
        add("(call)", math.nan, math.nan, "fail", f"fn returned {type(out).__name__}, not a torch tensor")
        return
    rows_sel = (slice(None), rows_ok)
    if returns == "rows":
        want_shape = (case.B, case.NQ + pad_rows)
        if tuple(out.shape) != want_shape:
            add("kl", math.nan, math.nan, "fail", f"returned shape {list(out.shape)}, expected {list(want_shape)} "
                                              "([B, N_Q])", _shape_hint(out.shape, want_shape, layout))
            return
        got = _to_numpy(out)[:, pad_rows:]
        err, tol = kl_error_and_tolerance(got[rows_sel], ref_kl[rows_sel], _to_numpy(same_kl)[rows_sel],
                                          row_floor[rows_sel], dname)
        qname = "kl" if case.plant is None else f"kl of rows {_ranges(rows_ok)} (unreached)"
        add(qname, err, tol, "pass" if err <= tol else "fail", _why_indexer(got, ref_kl, rows_ok, err, tol))
        if case.causal and case.NQ > case.NK:
            empty = got[:, : case.NQ - case.NK]
            ok = bool((empty == 0).all())
            add("kl of empty rows == 0", 0.0 if ok else 1.0, 0.0, "pass" if ok else "fail",
                "" if ok else f"rows 0-{case.NQ - case.NK - 1} see no key; got max |KL| {np.abs(empty).max():.3e}")
    else:
        if out.numel() != 1:
            add(returns, math.nan, math.nan, "fail", f"returns={returns!r} but fn returned shape {list(out.shape)}",
                "fn returns rows: returns='rows' (the default; streamkl verify: drop --returns)")
            return
        red = ref_kl.sum() if returns == "sum" else ref_kl.sum() / max(n_keyed, 1)
        same_red = same_kl.sum() if returns == "sum" else same_kl.sum() / max(n_keyed, 1)
        red_floor = row_floor.sum() if returns == "sum" else row_floor.sum() / max(n_keyed, 1)
        got = out.reshape(())
        if pad_rows and returns == "mean":  # fn averaged over the padded rows too (all have keys)
            got = got * ((case.NQ + pad_rows) * case.B / max(n_keyed, 1))
        _check_reduction(add, case, returns, got, red, same_red, red_floor, dname)
    if not grads:
        return
    if case.plant is not None and claims["nan_isolation"] == "forward":
        add("(gradients)", math.nan, math.nan, "skipped", "outside supports: NaN isolation claimed for the forward only")
        return
    try:
        if returns == "rows":
            gu = g.to(out.dtype)
            if pad_rows:
                gu = torch.cat([torch.zeros(case.B, pad_rows, dtype=gu.dtype), gu], dim=-1)
            with _planted_quiet(case):
                out.backward(gu.to(out.device))
        else:
            scale = (max(n_keyed, 1) / ((case.NQ + pad_rows) * case.B)) if (pad_rows and returns == "mean") else 1.0
            with _planted_quiet(case):
                (out.reshape(()) * scale).backward()
    except Exception as exc:  # noqa: BLE001
        add("(backward)", math.nan, math.nan, "fail", _raised("backward", exc))
        return
    for name in INDEXER_INPUTS:
        if name not in INDEXER_GRADS:
            continue
        gname = INDEXER_GRADS[name]
        if name not in want_grad:
            add(gname, math.nan, math.nan, "skipped", f"outside supports: grad_inputs {list(claims['grad_inputs'])}")
            continue
        leaf, idx = leaves[name]
        if leaf.grad is None:
            add(gname, math.inf, 0.0, "fail", f"no gradient reached {name}")
            continue
        gr = leaf.grad[idx].detach().to("cpu")
        if layout == "bnhd":
            gr = gr.transpose(1, 2)
        if pad_rows and name in ("q_idx", "weights"):
            gr = gr[:, :, pad_rows:]
        if case.plant is None:
            sel, label = (Ellipsis,), gname
        elif name == "k_idx":
            if case.plant != "queries" or not keys_ok.any():
                continue  # a planted key reaches every dk_idx through the rows that see it
            sel, label = (slice(None), slice(None), keys_ok), f"{gname} of keys {_ranges(keys_ok)} (unreached)"
        else:
            sel, label = (slice(None), slice(None), rows_ok), f"{gname} of rows {_ranges(rows_ok)} (unreached)"
        ref_sel, got_sel, same_sel = ref_grad[gname][sel], _to_numpy(gr)[sel], same[gname][sel]
        if not np.any(ref_sel):
            err = float(np.max(np.abs(got_sel))) if got_sel.size else 0.0
            ok = err <= ZERO_GRAD_TOL
            add(f"{label} max|.|", err, ZERO_GRAD_TOL, "pass" if ok else "fail",
                "reference gradient is exactly 0" + ("" if ok else "; got non-zero"))
            continue
        err = relative_error(got_sel, ref_sel)
        tol = tolerance(relative_error(same_sel, ref_sel), dname)
        add(label, err, tol, "pass" if err <= tol else "fail", "" if err <= tol else ("not finite" if math.isinf(err) else ""))


def indexer_row_floor(lse_idx, lse_teacher, kl, case, dtype) -> np.ndarray:
    """Per-row absolute allowance of an indexer KL row (as :func:`kl_row_floor`): the loss is
    ``sum p ln p − sum p I + LSE_I``, its terms bounded by ``|LSE_I|``, the teacher's
    ``max_h |LSE_h|`` (inside ``ln p``), ``|E_p I| <= |LSE_I| + KL + ln N_K``; hence
    ``KL_ROUNDING_ULPS * u * (1 + 2|LSE_I| + max_h |LSE_h| + KL + ln N_K)``, 0 for rows with no key."""
    lse_idx, lse_t, kl = (np.asarray(x, dtype=np.float64) for x in (lse_idx, lse_teacher, kl))
    with np.errstate(invalid="ignore"):
        mag = 1.0 + 2.0 * np.abs(lse_idx) + np.abs(lse_t).max(axis=1) + np.abs(kl) + math.log(max(case.NK, 1))
    seen = np.isfinite(lse_idx) & np.isfinite(lse_t).all(axis=1)
    return np.where(seen, KL_ROUNDING_ULPS * ROW_STAT_EPS[_dtype_name(dtype)] * mag, 0.0)


def _why_indexer(got, ref, rows_ok, err, tol) -> str:
    if err <= tol:
        return ""
    a, r = got[:, rows_ok], np.asarray(ref)[:, rows_ok]
    bad = ~np.isfinite(a)
    if bad.any():
        return f"{int(bad.sum())} of {a.size} rows not finite"
    d = np.abs(a - r)
    b, t = np.unravel_index(int(np.argmax(d)), d.shape)
    return f"worst [b={b}, row={np.flatnonzero(rows_ok)[t]}]: got {a[b, t]:.6g}, reference {r[b, t]:.6g}"


def assert_indexer_kl_conforms(fn: Callable, **options) -> Report:
    """:func:`check_indexer_kl`, raising ``AssertionError`` with a table of the failing rows (or
    when nothing passed). Returns the report when it passes."""
    report = check_indexer_kl(fn, **options)
    _raise_unless_passed(report, "indexer KL")
    return report
