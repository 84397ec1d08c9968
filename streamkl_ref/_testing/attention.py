"""``check_attention_kl``: the attention-KL battery against any callable (claims, adapters, NaN
planting, forward and gradients against the float64 reference)."""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from .cases import PLANT_PAD, Case, _plant_masks, attention_cases, case_generator
from . import reference_cache, same_precision
from .report import (Report, Row, _hint, _row_adder, _keep_causal_hints_where_alignment_explains, _planted_quiet,
                     _raise_unless_passed, _raised, _ranges, _shape_hint)
from .tolerance import (ZERO_GRAD_TOL, _dtype_name, _to_numpy, kl_error_and_tolerance, kl_row_floor,
                        relative_error, tolerance)


GRAD_NAMES = ("dq1", "dk1", "dq2", "dk2")
INPUT_NAMES = ("q1", "k1", "q2", "k2")
SUPPORT_KEYS = {
    "gqa": "bool: H_K != H on either side (default True)",
    "d1_ne_d2": "bool: head dims of the two sides differ (default True)",
    "nq_ne_nk": "bool: N_Q != N_K (default True)",
    "causal": "bool: causal masking (default True)",
    "head_dims": "iterable of ints: the head dims it takes (default: any)",
    "dtypes": "iterable of dtype names: the input dtypes it takes (default: any)",
    "grad_inputs": "subset of ('q1','k1','q2','k2'): inputs it differentiates (default all four; "
                   "('q2','k2') for a frozen teacher)",
    "nan_isolation": "True (default), 'forward' (forward only) or False: NaN/inf in keys a row "
                     "cannot see never reach it",
}


def _check_supports(supports) -> dict:
    s = {"gqa": True, "d1_ne_d2": True, "nq_ne_nk": True, "causal": True, "head_dims": None,
         "dtypes": None, "grad_inputs": INPUT_NAMES, "nan_isolation": True}
    if supports is None:
        return s
    if not isinstance(supports, dict):
        raise ValueError(f"supports must be a dict or None, got {type(supports).__name__}")
    for key, value in supports.items():
        if key not in s:
            raise ValueError(f"supports: unknown claim {key!r}; known: {sorted(SUPPORT_KEYS)}")
        if key in ("head_dims", "dtypes") and value is not None:
            value = tuple(value)
        if key == "grad_inputs":
            value = tuple(value)
            bad = [v for v in value if v not in INPUT_NAMES]
            if bad:
                raise ValueError(f"supports['grad_inputs'] must name inputs of {INPUT_NAMES}, got {bad}")
        if key == "nan_isolation" and value not in (True, False, "forward"):
            raise ValueError(f"supports['nan_isolation'] must be True, False or 'forward', got {value!r}")
        s[key] = value
    return s


def _unsupported(case: Case, dtype: str, s: dict) -> str:
    """Why a case lies outside the claims ('' if it does not)."""
    f = case.features()
    for key, label in (("gqa", "GQA"), ("d1_ne_d2", "D1 != D2"), ("nq_ne_nk", "N_Q != N_K"),
                       ("causal", "causal")):
        if f[key] and not s[key]:
            return f"outside supports: {label}"
    if s["head_dims"] is not None and not set(f["head_dims"]) <= set(s["head_dims"]):
        return f"outside supports: head dims {f['head_dims']}"
    if s["dtypes"] is not None and dtype not in s["dtypes"]:
        return f"outside supports: dtype {dtype}"
    if case.plant is not None and s["nan_isolation"] is False:
        return "outside supports: NaN isolation not claimed"
    return ""


LAYOUTS = ("bhnd", "bnhd")
CAUSAL_ALIGNS = ("bottom-right", "top-left")
RETURNS = ("rows", "sum", "mean")


def _check_adapters(layout, causal_align, returns, dtypes):
    """The adapter arguments of the check functions, validated; returns the dtype names."""
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {causal_align!r}")
    if returns not in RETURNS:
        raise ValueError(f"returns must be one of {RETURNS}, got {returns!r}")
    if isinstance(dtypes, (str, torch.dtype)):
        dtypes = (dtypes,)
    return [_dtype_name(d) for d in dtypes]


def check_attention_kl(fn: Callable, *, device="cpu", dtypes=("float32",), grads=True, quick=False,
                       layout="bhnd", causal_align="bottom-right", returns="rows", supports=None,
                       cases=None, seed=0) -> Report:
    """Run the battery against ``fn(q1, k1, q2, k2, *, causal, scale1, scale2)``; return a :class:`Report`.

    Args:
        fn: the implementation under test (see the module docstring for its contract).
        device: where its inputs live (``"cpu"``, ``"cuda"``, ...); the battery has larger cases
            on ``cuda``.
        dtypes: input dtypes to run (names or torch dtypes).
        grads: also check ``dq1, dk1, dq2, dk2`` (by ``backward`` with a random upstream
            gradient per row for ``returns="rows"``, ``1`` for a sum, ``1/n`` for a mean).
        quick: the quick subset of the battery.
        layout: ``"bhnd"`` (``[B, H, N, D]``) or ``"bnhd"`` (flash-attn's ``[B, N, H, D]``).
        causal_align: what ``causal=True`` means to ``fn``: ``"bottom-right"`` (streamkl's,
            FlashAttention's) or ``"top-left"`` (SDPA's ``is_causal``). With ``"top-left"`` a
            causal case with ``N_Q == N_K`` is sent as it is (both masks agree); one with
            ``N_Q < N_K`` is translated: the queries are front-padded with ``N_K − N_Q`` zero
            rows (top-left on ``N_K × N_K`` then equals bottom-right on the real rows; zero query
            rows give ``KL = 0`` and contribute nothing to any gradient) and only the real rows
            are compared; one with ``N_Q > N_K`` cannot be expressed and is reported skipped.
        returns: ``"rows"`` (``[B, H, N_Q]``; ``[B, N_Q, H]`` for ``layout="bnhd"``), ``"sum"`` or
            ``"mean"`` (a scalar over all ``B·H·N_Q`` rows).
        supports: the claims of ``fn`` (keys and meanings in :data:`SUPPORT_KEYS`); cases and
            quantities outside them are reported ``skipped``, never ``pass``.
        cases: ``"default"`` (the battery for ``device``: :data:`ATTENTION_CASES` on CPU, with
            :data:`LARGE_ATTENTION_CASES` added on ``cuda``), ``"large"`` (the large cases only),
            ``"all"`` (both, on any device), or your own sequence of :class:`Case`.
            ``quick=True`` keeps the quick ones of the chosen set.
        seed: of the inputs (a non-negative int). Each case draws its inputs from its own torch
            CPU generator, seeded by ``seed`` and the case's name (:func:`case_generator`): the
            same inputs for every dtype, and whichever other cases run. A correct kernel passes
            at every seed.

    Rows that pass compare the output (``kl``) and each gradient with the float64 reference
    (``streamkl_ref.attention_kl``/``attention_kl_grad``) under :func:`tolerance`. A failing row's
    ``why`` says what went wrong; an exception in ``fn`` fails the case with its message.
    """
    import torch

    dnames = _check_adapters(layout, causal_align, returns, dtypes)
    claims = _check_supports(supports)
    if cases is None or isinstance(cases, str):
        cases = attention_cases(device, quick, which=cases or "default")
    cases = tuple(cases)
    report = Report(options={
        "device": str(device), "dtypes": dnames, "grads": bool(grads), "quick": bool(quick),
        "layout": layout, "causal_align": causal_align, "returns": returns, "seed": seed,
        "supports": {k: (list(v) if isinstance(v, tuple) else v) for k, v in claims.items()},
        "fn": getattr(fn, "__qualname__", repr(fn)),
    })
    t0 = time.time()
    for case in cases:
        report.cases[case.name] = case.to_dict()
        gen = case_generator(seed, case)
        base = [case.amplitude * torch.randn(*shape, generator=gen, dtype=torch.float64)
                for shape in case.shapes.values()]
        g_rows = torch.randn(case.B, case.H, case.NQ, generator=gen, dtype=torch.float64)
        for dname in dnames:
            _run_case(fn, case, dname, base, g_rows, report, device=device, grads=grads,
                      layout=layout, causal_align=causal_align, returns=returns, claims=claims)
    _keep_causal_hints_where_alignment_explains(report, cases)
    report.elapsed_s = time.time() - t0
    return report


def _check_reduction(add, case, returns, got, red, same_red, red_floor, dname):
    """One row for a scalar ("sum"/"mean") result: skipped for planted cases (the reduction mixes
    the planted rows in), else its error against the reference under the tolerance rule."""
    if case.plant is not None:
        add(f"kl {returns}", math.nan, math.nan, "skipped",
            f"a {returns} mixes the planted rows in: NaN isolation of the forward is checked with returns='rows'")
        return
    err, tol = kl_error_and_tolerance(got, red, same_red, red_floor, dname)
    add(f"kl {returns}", err, tol, "pass" if err <= tol else "fail",
        "" if err <= tol else f"got {got.item():.9g}, reference {float(red):.9g}")


def _run_case(fn, case, dname, base, g_rows, report, *, device, grads, layout, causal_align, returns, claims):
    import torch

    import streamkl_ref

    add = _row_adder(report, case, dname, claims, causal_align)

    why = _unsupported(case, dname, claims)
    if why:
        add("(all)", math.nan, math.nan, "skipped", why)
        return
    translate = False
    if case.causal and causal_align == "top-left" and case.NQ != case.NK:
        if case.NQ > case.NK:
            add("(all)", math.nan, math.nan, "skipped",
                "top-left causal cannot express bottom-right with N_Q > N_K")
            return
        translate = True
    dtype = getattr(torch, dname)
    xs = [x.to(dtype) for x in base]  # the exact inputs fn sees (rounded to its dtype)
    x64 = [x.double().numpy() for x in xs]
    kw = dict(causal=case.causal, scale1=case.scale1, scale2=case.scale2)
    n_rows = case.B * case.H * case.NQ
    g = {"rows": g_rows, "sum": torch.ones_like(g_rows), "mean": torch.full_like(g_rows, 1.0 / n_rows)}[returns]
    rows_ok, keys_ok = _plant_masks(case) if case.plant else (np.ones(case.NQ, bool), None)

    # float64 reference (on the clean inputs: planted values are invisible to what is compared)
    ref_kl, ref_lse1, ref_lse2 = reference_cache.call(streamkl_ref.attention_kl, *x64, return_lse=True, **kw)
    row_floor = kl_row_floor(ref_lse1, ref_lse2, ref_kl, dname)
    ref_grad = reference_cache.call(streamkl_ref.attention_kl_grad, *x64, g.numpy(), **kw) if grads else None
    # the same math at the inputs' precision: the tolerance scale (kept by the reference cache)
    want_grad = set(claims["grad_inputs"]) if grads else set()
    same = same_precision.call(same_precision.attention_kl_same, *x64, g.numpy() if want_grad else None,
                               dtype=dname, grad_inputs=tuple(n for n in INPUT_NAMES if n in want_grad), **kw)
    same_kl = torch.from_numpy(same["kl"]).to(dtype)  # its values exactly, for the sum or mean below

    # ---- call fn
    leaves, views = _user_inputs(xs, case, layout, translate, device, want_grad)
    call_kw = dict(kw)
    try:
        with _planted_quiet(case):
            out = fn(*views, **call_kw)
    except Exception as exc:  # noqa: BLE001 (reported as the case's failure)
        add("(call)", math.nan, math.nan, "fail", _raised("fn", exc))
        return
    if not isinstance(out, torch.Tensor):
        add("(call)", math.nan, math.nan, "fail", f"fn returned {type(out).__name__}, not a torch tensor")
        return
    rows_sel = (slice(None), slice(None), rows_ok)  # on [B, H, N_Q] (NumPy)

    # ---- forward
    if returns == "rows":
        got = out
        want_shape = (case.B, case.H, case.NQ + (case.NK - case.NQ if translate else 0))
        if layout == "bnhd":
            want_shape = (want_shape[0], want_shape[2], want_shape[1])
        if tuple(out.shape) != want_shape:
            add("kl", math.nan, math.nan, "fail", f"returned shape {list(out.shape)}, expected {list(want_shape)} "
                                              f"({'[B, N_Q, H]' if layout == 'bnhd' else '[B, H, N_Q]'})",
                _shape_hint(out.shape, want_shape, layout))
            return
        if layout == "bnhd":
            got = got.transpose(1, 2)
        if translate:
            got = got[:, :, case.NK - case.NQ:]
        got = _to_numpy(got)
        err, tol = kl_error_and_tolerance(got[rows_sel], ref_kl[rows_sel], _to_numpy(same_kl)[rows_sel],
                                          row_floor[rows_sel], dname)
        qname = "kl" if case.plant is None else f"kl of rows {_ranges(rows_ok)} (unreached)"
        add(qname, err, tol, "pass" if err <= tol else "fail", _why_kl(got, ref_kl, rows_ok, err, tol))
        if case.causal and case.NQ > case.NK:
            empty = got[:, :, : case.NQ - case.NK]
            ok = bool((empty == 0).all())
            add("kl of empty rows == 0", 0.0 if ok else 1.0, 0.0, "pass" if ok else "fail",
                "" if ok else f"rows 0-{case.NQ - case.NK - 1} see no key; got max |KL| "
                              f"{np.abs(empty).max():.3e}")
    else:
        if out.numel() != 1:
            add(returns, math.nan, math.nan, "fail", f"returns={returns!r} but fn returned shape {list(out.shape)}",
                "fn returns rows: returns='rows' (the default; streamkl verify: drop --returns)")
            return
        red = ref_kl.sum() if returns == "sum" else ref_kl.mean()
        same_red = same_kl.sum() if returns == "sum" else same_kl.mean()
        red_floor = row_floor.sum() if returns == "sum" else row_floor.mean()
        got = out.reshape(())
        if translate and returns == "mean":  # fn averaged over N_K rows, N_K - N_Q of them zero
            got = got * (case.NK / case.NQ)
        _check_reduction(add, case, returns, got, red, same_red, red_floor, dname)

    if not grads:
        return
    if case.plant is not None and claims["nan_isolation"] == "forward":
        add("(gradients)", math.nan, math.nan, "skipped", "outside supports: NaN isolation claimed for the forward only")
        return
    # ---- backward
    try:
        if returns == "rows":
            gu = g.to(out.dtype)
            if translate:
                gu = torch.cat([torch.zeros(case.B, case.H, case.NK - case.NQ, dtype=gu.dtype), gu], dim=-1)
            if layout == "bnhd":
                gu = gu.transpose(1, 2)
            with _planted_quiet(case):
                out.backward(gu.to(out.device))
        else:
            scale = (case.NQ / case.NK) if (translate and returns == "mean") else 1.0
            with _planted_quiet(case):
                (out.reshape(()) * scale).backward()
    except Exception as exc:  # noqa: BLE001
        add("(backward)", math.nan, math.nan, "fail", _raised("backward", exc))
        return
    grads_got = _user_grads(leaves, case, layout, translate)
    for name, gname in zip(INPUT_NAMES, GRAD_NAMES):
        if name not in want_grad:
            add(gname, math.nan, math.nan, "skipped", f"outside supports: grad_inputs {list(claims['grad_inputs'])}")
            continue
        got_g = grads_got[name]
        ref_g = ref_grad[gname]
        same_g = same[gname]
        if got_g is None:
            add(gname, math.inf, 0.0, "fail", f"no gradient reached {name}")
            continue
        sel, label = _grad_selection(case, name, rows_ok, keys_ok)
        if sel is None:
            continue
        if case.plant is not None:
            gname_q = f"{gname} of {label} (unreached)"
        else:
            gname_q = gname
        ref_sel, got_sel, same_sel = ref_g[sel], _to_numpy(got_g)[sel], _to_numpy(same_g)[sel]
        if not np.any(ref_sel):
            # exactly zero gradient (one key per row): relative error is undefined
            err = float(np.max(np.abs(got_sel))) if got_sel.size else 0.0
            ok = err <= ZERO_GRAD_TOL
            add(f"{gname_q} max|.|", err, ZERO_GRAD_TOL, "pass" if ok else "fail",
                "reference gradient is exactly 0" + ("" if ok else "; got non-zero"))
            continue
        err = relative_error(got_sel, ref_sel)
        tol = tolerance(relative_error(same_sel, ref_sel), dname)
        add(gname_q, err, tol, "pass" if err <= tol else "fail",
            "" if err <= tol else ("not finite" if math.isinf(err) else ""))


def _grad_selection(case, name, rows_ok, keys_ok):
    """Index of the gradient entries to compare, and a label (None: nothing comparable)."""
    if case.plant is None:
        return (Ellipsis,), ""
    if name.startswith("q"):
        return (slice(None), slice(None), rows_ok), f"rows {_ranges(rows_ok)}"
    if case.plant == "queries" and keys_ok.any():
        return (slice(None), slice(None), keys_ok), f"keys {_ranges(keys_ok)}"
    return None, ""  # a NaN key reaches every dk through the rows that see it


def _why_kl(got, ref, rows_ok, err, tol) -> str:
    if err <= tol:
        return ""
    a = _to_numpy(got)[..., rows_ok]
    r = np.asarray(ref)[..., rows_ok]
    bad = ~np.isfinite(a)
    if bad.any():
        return f"{int(bad.sum())} of {a.size} rows not finite"
    d = np.abs(a - r)
    worst = np.unravel_index(int(np.argmax(d)), d.shape)
    row = np.flatnonzero(rows_ok)[worst[-1]]
    return f"worst [b={worst[0]}, h={worst[1]}, row={row}]: got {a[worst]:.6g}, reference {r[worst]:.6g}"


def _user_inputs(xs, case, layout, translate, device, want_grad):
    """Leaf tensors (what gradients accumulate on) and the views handed to fn, in fn's layout."""
    import torch

    pad_n, pad_d = PLANT_PAD
    leaves, views = {}, []
    for name, x in zip(INPUT_NAMES, xs):
        x = x.clone()
        if translate and name.startswith("q"):  # front-pad N_K - N_Q zero query rows
            x = torch.cat([torch.zeros(x.shape[0], x.shape[1], case.NK - case.NQ, x.shape[3], dtype=x.dtype), x], 2)
        if case.plant == "keys" and name == "k1":
            x[:, :, case.plant_at] = float("nan")
        if case.plant == "keys" and name == "k2":
            x[:, :, case.plant_at + 3] = float("inf")
        if case.plant == "queries" and name.startswith("q"):
            x[:, :, case.plant_at] = float("nan")
        if layout == "bnhd":
            x = x.transpose(1, 2)
        if case.plant is not None:  # a view into a NaN-filled buffer longer in N and wider in D
            n_axis = 2 if layout == "bhnd" else 1
            shape = list(x.shape)
            shape[n_axis] += pad_n
            shape[3] += pad_d
            buf = torch.full(shape, float("nan"), dtype=x.dtype)
            idx = [slice(None)] * 4
            idx[n_axis] = slice(0, x.shape[n_axis])
            idx[3] = slice(0, x.shape[3])
            buf[tuple(idx)] = x
            buf = buf.to(device).requires_grad_(name in want_grad)
            leaves[name] = (buf, tuple(idx))
            views.append(buf[tuple(idx)])
        else:
            leaf = x.contiguous().to(device).requires_grad_(name in want_grad)
            leaves[name] = (leaf, (Ellipsis,))
            views.append(leaf)
    return leaves, views


def _user_grads(leaves, case, layout, translate):
    """Gradients back in ``[B, H, N, D]`` on the real rows (None where none reached a leaf)."""
    out = {}
    for name, (leaf, idx) in leaves.items():
        gr = leaf.grad
        if gr is None:
            out[name] = None
            continue
        gr = gr[idx].detach().to("cpu")
        if layout == "bnhd":
            gr = gr.transpose(1, 2)
        if translate and name.startswith("q"):
            gr = gr[:, :, case.NK - case.NQ:]
        out[name] = gr
    return out


def assert_attention_kl_conforms(fn: Callable, **options) -> Report:
    """:func:`check_attention_kl`, raising ``AssertionError`` with a table of the failing rows.

    Also raises when nothing passed (every case skipped: the claims leave nothing to check).
    Returns the report when it passes.
    """
    report = check_attention_kl(fn, **options)
    _raise_unless_passed(report, "attention KL")
    return report
