"""mpmath finite differences and gradient tolerances shared by the streamkl_ref gradient tests."""
import mpmath
import numpy as np

from streamkl_ref.strategies import EPS64, logit_scale
from streamkl_ref import attention_kl_mp
from streamkl_ref._dense import dense_scores, kl_from_log_probs, masked_log_softmax

NAMES = ("q1", "k1", "q2", "k2")
GRADS = ("dq1", "dk1", "dq2", "dk2")
DPS = 50
STEP = mpmath.mpf("1e-20")  # central differences at 50 digits: truncation ~1e-40, rounding ~1e-30


def mp_objects(arrays):
    out = []
    for x in arrays:
        obj = np.empty(x.shape, dtype=object)
        for idx in np.ndindex(x.shape):
            obj[idx] = mpmath.mpf(float(x[idx]))
        out.append(obj)
    return out


def mp_loss(objs, g, kw):
    kl = attention_kl_mp(*objs, **kw, dps=DPS, return_mpf=True)
    with mpmath.workdps(DPS):
        return mpmath.fsum(mpmath.mpf(float(gi)) * ki for gi, ki in zip(g.ravel(), kl.ravel()))


def fd_gradient(problem, g, which):
    """``∂(Σ g·KL)/∂x`` for input ``which`` (0..3), element by element, in mpmath."""
    objs = mp_objects(problem.inputs)
    target = objs[which]
    out = np.empty(target.shape)
    for idx in np.ndindex(target.shape):
        orig = target[idx]
        with mpmath.workdps(DPS):
            target[idx] = orig + STEP
        up = mp_loss(objs, g, problem.kw)
        with mpmath.workdps(DPS):
            target[idx] = orig - STEP
        down = mp_loss(objs, g, problem.kw)
        target[idx] = orig
        with mpmath.workdps(DPS):
            out[idx] = float((up - down) / (2 * STEP))
    return out


def log_ratio_scale(problem):
    """``max |log P1 − log P2 − KL|`` over the visible entries (0 if none): the factor by which
    setting 2 multiplies ``P1``."""
    s1, s2, mask = dense_scores(*problem.inputs, problem.dims, problem.causal)
    log_p1, _ = masked_log_softmax(s1, mask)
    log_p2, _ = masked_log_softmax(s2, mask)
    kl = kl_from_log_probs(log_p1, log_p2, mask)[..., None]
    return float(np.max(np.where(mask, np.abs(log_p1 - log_p2 - kl), 0.0), initial=0.0))


def grad_scales(problem, g):
    """Per gradient, the size its rounding errors are measured against (never the gradient itself,
    which may vanish by cancellation).

    ``P_t = exp(S_t − LSE_t)`` carries a relative error of a few ulps of ``(1 + max|S|)``.
    Setting 1: ``dS2 = g·(P2 − P1)`` errs by ``ulps·(1 + max|S|)·|g|·(P1 + P2)``. Setting 2:
    ``dS1 = g·P1·(log r − KL)`` errs by ``ulps·(1 + max|S|)·|g|·P1·(1 + |log r − KL|)`` (the error
    of ``P1`` times the factor, plus the error of the factor). The ``P`` of a row sum to 1, so
    ``dQ_t = σ_t·dS_t·K_t`` errs by that times ``σ_t·max|K_t|``, and ``dK_t``, a sum over the
    ``(H/H_Kt)·N_Q`` query rows reading a key, by that many times ``σ_t·max|Q_t|``.
    """
    d = problem.dims
    smax = float(logit_scale(problem).max(initial=0.0))
    base = (1 + smax) * float(np.abs(g).max(initial=0.0))
    side1 = base * (1 + log_ratio_scale(problem))
    side2 = 2 * base
    q1, k1, q2, k2 = (float(np.abs(x).max(initial=0.0)) for x in problem.inputs)
    return {
        "dq1": side1 * d.scale1 * k1,
        "dk1": side1 * d.scale1 * q1 * d.group1 * d.NQ,
        "dq2": side2 * d.scale2 * k2,
        "dk2": side2 * d.scale2 * q2 * d.group2 * d.NQ,
    }


def grad_tolerance(problem, g, gname, ulps=64, eps=EPS64):
    return ulps * eps * grad_scales(problem, g)[gname]


def fd_noise(problem, g):
    """The rounding of the mpmath loss (``DPS`` digits on terms of size ``(1 + max|S|)·|g|``),
    divided by the step: the accuracy floor of the finite differences themselves."""
    smax = float(logit_scale(problem).max(initial=0.0))
    return 10.0 ** (2 - DPS) * (1 + smax) * float(np.abs(g).sum()) / float(STEP)


def directional_fd(problem, g, which, v):
    """``d/dt (Σ g·KL)(x + t·v)`` at ``t = 0`` for input ``which``, by a central difference in mpmath."""
    objs = mp_objects(problem.inputs)
    base = objs[which].copy()
    vs = mp_objects([v])[0]
    with mpmath.workdps(DPS):
        objs[which] = base + STEP * vs
    up = mp_loss(objs, g, problem.kw)
    with mpmath.workdps(DPS):
        objs[which] = base - STEP * vs
    down = mp_loss(objs, g, problem.kw)
    with mpmath.workdps(DPS):
        return float((up - down) / (2 * STEP))


def directional_tolerance(problem, g, gname, grad, v):
    """``|⟨err, v⟩| <= max|err|·Σ|v|``, plus the rounding of the dot product and the FD floor."""
    return (grad_tolerance(problem, g, gname) * float(np.abs(v).sum())
            + v.size * EPS64 * float(np.abs(grad * v).sum()) + fd_noise(problem, g))
