"""The report of a check (:class:`Row`, :class:`Report`: table and JSON) and the diagnosis a
failing row carries (hints, the exception of a call that raised, the case's purpose)."""
from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

import numpy as np

from .tolerance import TOLERANCE_RULE


@dataclass
class Row:
    case: str
    dtype: str
    quantity: str
    error: float
    tolerance: float
    status: str  # "pass" | "fail" | "skipped"
    why: str = ""  # what went wrong (or why skipped)
    hint: str = ""  # for a failure: what the symptom usually means and the option that fixes it

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class Report:
    """The outcome of a check: ``passed`` is True iff no row failed and at least one passed."""

    rows: list = field(default_factory=list)
    cases: dict = field(default_factory=dict)  # name -> Case.to_dict()
    options: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def failed(self) -> list:
        return [r for r in self.rows if r.status == "fail"]

    @property
    def skipped(self) -> list:
        return [r for r in self.rows if r.status == "skipped"]

    @property
    def passed(self) -> bool:
        return not self.failed and any(r.status == "pass" for r in self.rows)

    def summary(self) -> str:
        n_pass = sum(r.status == "pass" for r in self.rows)
        return f"{n_pass} passed, {len(self.failed)} failed, {len(self.skipped)} skipped"

    def purpose(self, case_name: str) -> str:
        """What a case is there to catch (its ``why``; '' if the report does not know the case)."""
        case = self.cases.get(case_name)
        return (case.get("why") or "") if isinstance(case, dict) else ""

    def table(self, rows: Optional[Iterable[Row]] = None) -> str:
        """Fixed-width text table, one line per row, ``why`` last. A failing row's ``why`` also
        carries its hint and, after ``case:``, what the case is there to catch; an error or
        tolerance that does not apply (a call that raised, a skipped case) reads ``-``."""
        rows = list(self.rows if rows is None else rows)
        if not rows:
            return "(no rows)"
        w_case = max(4, *(len(r.case) for r in rows))
        w_q = max(8, *(len(r.quantity) for r in rows))
        lines = [f"{'case':<{w_case}}  {'dtype':<8}  {'quantity':<{w_q}}  {'error':>9}  {'tolerance':>9}  status   why"]
        hinted = set()  # a hint is printed once per case and dtype
        for r in rows:
            err = "-" if math.isnan(r.error) else f"{r.error:9.2e}"
            tol = "-" if math.isnan(r.tolerance) else f"{r.tolerance:9.2e}"
            why = r.why
            if r.status == "fail":
                purpose = self.purpose(r.case)
                hint = f"hint: {r.hint}" if r.hint and (r.case, r.dtype, r.hint) not in hinted else ""
                hinted.add((r.case, r.dtype, r.hint))
                why = "; ".join(x for x in (r.why, hint, f"case: {purpose}" if purpose else "") if x)
            lines.append(f"{r.case:<{w_case}}  {r.dtype:<8}  {r.quantity:<{w_q}}  {err:>9}  {tol:>9}  "
                         f"{r.status:<7}  {why}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        def num(x):
            return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))

        return {
            "passed": self.passed,
            "summary": self.summary(),
            "tolerance_rule": TOLERANCE_RULE,
            "options": self.options,
            "cases": self.cases,
            "rows": [{**asdict(r), "error": num(r.error), "tolerance": num(r.tolerance),
                      "pass": r.status == "pass"} for r in self.rows],
            "elapsed_s": self.elapsed_s,
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        """Standard JSON (non-finite errors as the strings ``"inf"``, ``"nan"``)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.summary()


@contextlib.contextmanager
def _planted_quiet(case):
    """A planted case computes with NaN and inf on purpose: NumPy's RuntimeWarnings from it (the
    Triton interpreter runs kernels in NumPy) are expected, not news; what reaches the compared
    rows is judged by the report. Other cases keep their warnings."""
    if case.plant is None:
        yield
        return
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _raised(what: str, exc: BaseException) -> str:
    """``fn raised TypeError: ... (at file.py:12 in my_kl)``: the exception and its innermost frame."""
    import traceback

    text = f"{what} raised {type(exc).__name__}: {str(exc)[:300]}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        text += f" (at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name})"
    return text


def _shape_hint(shape, want, layout) -> str:
    shape, want = tuple(shape), tuple(want)
    if len(shape) == 0 or (len(shape) == 1 and shape[0] == 1):
        return "fn returns a scalar: returns='sum' or returns='mean' (streamkl verify: --returns sum|mean)"
    if len(shape) == len(want) == 3 and shape == (want[0], want[2], want[1]):
        other = "bhnd" if layout == "bnhd" else "bnhd"
        return f"the rows are in the other order: layout={other!r} (streamkl verify: --layout {other})"
    return ""


def _row_adder(report, case, dname, claims, causal_align):
    """``add(quantity, error, tol, status, why="", hint="")`` for one case and dtype: appends a
    Row to the report, a failing row without a hint of its own getting :func:`_hint`'s."""
    def add(quantity, error, tol, status, why="", hint=""):
        row = Row(case.name, dname, quantity, float(error), float(tol), status, why, hint)
        if status == "fail" and not hint:
            row.hint = _hint(case, row, claims, causal_align)
        report.rows.append(row)
    return add


def _hint(case, row, claims, causal_align) -> str:
    """What a failing row's symptom usually means, and the option that expresses it ('' if none)."""
    not_finite = "not finite" in row.why
    if case.plant is not None and not_finite:
        if row.quantity.startswith("kl"):
            return ("a value this row cannot see reached it (0 * NaN); not isolating NaN at all: "
                    "supports={'nan_isolation': False}")
        if claims.get("nan_isolation") is True:
            return ("NaN isolated in the forward only (autograd's matmul backward multiplies masked zeros "
                    "by it): supports={'nan_isolation': 'forward'}, --supports '{\"nan_isolation\": \"forward\"}'")
    if not_finite and case.causal and case.NQ > case.NK:
        return "a row that sees no key must give KL 0 and gradient 0 (an all -inf row gives NaN)"
    if case.causal and case.NQ != case.NK and row.quantity.startswith(("kl", "d")):
        if causal_align == "bottom-right":
            return ("causal is bottom-right aligned (j <= i + N_K - N_Q); for a top-left fn (SDPA's "
                    "is_causal): causal_align='top-left', --causal-align top-left")
        return "with causal_align='top-left' the queries are front-padded with N_K - N_Q zero rows"
    return ""


def _keep_causal_hints_where_alignment_explains(report, cases) -> None:
    """The causal-alignment hint stays only when the failures are confined to causal cases with
    N_Q != N_K (where the two alignments differ): a fn that fails elsewhere has another bug."""
    by_name = {c.name: c for c in cases}
    differs = {n for n, c in by_name.items() if c.causal and c.NQ != c.NK}
    if any(r.case not in differs for r in report.failed):
        for r in report.failed:
            if r.case in differs and r.hint.startswith(("causal is bottom-right", "with causal_align")):
                r.hint = ""


def _ranges(mask) -> str:
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return "none"
    parts, start, prev = [], idx[0], idx[0]
    for i in list(idx[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def _raise_unless_passed(report: Report, what: str) -> None:
    if report.passed:
        return
    if report.failed:
        raise AssertionError(f"{what} does not conform: {report.summary()}\n{report.table(report.failed)}")
    raise AssertionError(f"{what}: no row passed ({report.summary()}): the claims in `supports` leave nothing to check")
