"""The Gluon backward's schedule, replayed in PyTorch on CPU (Gluon does not run here).

``_replay`` mirrors ``_gluon_bwd._gluon_kl_bwd_kernel`` step by step (keep them in step): per
128-key block the query-tile range (``m_lo``, the masked band, the unmasked rest), per 64-row
tile and 64-key warpgroup the dS formula of the trained side with the row constants, the masks
and the finite copies, dK accumulated per block and dQ added per tile. It checks that the tile
skipping never drops a visible (row, key) pair and never leaves one invisible pair unmasked, and
that the result equals the float64 autograd gradient, for ragged N, N_Q != N_K, causal or not.
"""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamkl_gpu.naive import attention_kl_naive

LOG2E = 1.4426950408889634
EMPTY_LSE = 1e30
BLOCK_N, WG_N, BLOCK_M = 128, 64, 64


def _cdiv(a, b):
    return -(-a // b)


def _tile_range(start_n, N_Q, N_K, causal):
    """(m_lo, n_masked, n_tiles): the kernel's prologue."""
    n_q_tiles = _cdiv(N_Q, BLOCK_M)
    m_lo, n_masked = 0, 0
    if causal:
        diag = N_K - N_Q
        first = min(max(start_n - diag, 0) // BLOCK_M, n_q_tiles)
        m_lo = first * BLOCK_M
        full = _cdiv(max(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M)
        n_masked = max(min(full, n_q_tiles) - first, 0)
    n_tiles = n_q_tiles - m_lo // BLOCK_M
    if start_n + BLOCK_N > N_K:
        n_masked = n_tiles
    return m_lo, n_masked, n_tiles


def _finite(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _replay(g, q1, k1, q2, k2, lse1, lse2, kl, causal, train, scale1, scale2):
    """dQ_t, dK_t as the kernel computes them (float64 arithmetic, one (b, h))."""
    N_Q, D = q1.shape
    N_K = k1.shape[0]
    diag = N_K - N_Q
    pad_q, pad_k = _cdiv(N_Q, BLOCK_M) * BLOCK_M, _cdiv(N_K, BLOCK_N) * BLOCK_N

    def padded(x, n):  # TMA zero fill
        return torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])

    Q1, Q2, K1, K2 = padded(q1, pad_q), padded(q2, pad_q), padded(k1, pad_k), padded(k2, pad_k)
    Qt, Kt = (Q1, K1) if train == 1 else (Q2, K2)
    dq = torch.zeros(pad_q, D, dtype=torch.float64)
    dk = torch.zeros(pad_k, D, dtype=torch.float64)
    coef = scale2 if train == 2 else scale1 * math.log(2.0)
    rows_all = torch.arange(pad_q)
    for start_n in range(0, N_K, BLOCK_N):
        m_lo, n_masked, n_tiles = _tile_range(start_n, N_Q, N_K, causal)
        keys_blk = torch.arange(start_n, start_n + BLOCK_N)
        # tiles skipped before m_lo see no key of the block
        if causal and m_lo > 0:
            assert not (keys_blk[None, :] <= rows_all[:m_lo, None] + diag).any()
        kq = _finite(Kt) if causal else Kt  # the dQ product's finite copy
        for i in range(n_tiles):
            masked = i < n_masked
            r = slice(m_lo + i * BLOCK_M, m_lo + (i + 1) * BLOCK_M)
            rows = rows_all[r]
            row_ok = rows < N_Q
            l1 = torch.full((BLOCK_M,), -math.inf, dtype=torch.float64)
            l2, kk, gg = l1.clone(), torch.zeros(BLOCK_M, dtype=torch.float64), torch.zeros(BLOCK_M, dtype=torch.float64)
            l1[row_ok], l2[row_ok] = lse1[rows[row_ok]], lse2[rows[row_ok]]
            kk[row_ok], gg[row_ok] = kl[rows[row_ok]], g[rows[row_ok]]
            empty = l1 == -math.inf
            l1 = torch.where(empty, EMPTY_LSE, l1)
            l2 = torch.where(empty, EMPTY_LSE, l2)
            gg = torch.where(empty, 0.0, gg) * coef
            kk = torch.where(empty, 0.0, kk * LOG2E)
            ds_halves = []
            for wg in range(2):
                keys = keys_blk[wg * WG_N:(wg + 1) * WG_N]
                vis = (keys[None, :] < N_K).expand(BLOCK_M, WG_N)
                if causal:
                    vis = vis & (keys[None, :] <= rows[:, None] + diag)
                if not masked:  # the unmasked stage: every real row sees every key
                    assert vis[row_ok].all(), (start_n, i)
                s1 = Q1[r] @ K1[keys].T * (scale1 * LOG2E)
                s2 = Q2[r] @ K2[keys].T * (scale2 * LOG2E)
                x1 = s1 - l1[:, None]
                x2 = s2 - l2[:, None]
                if train == 2:
                    if masked:
                        x1 = torch.where(vis, x1, -math.inf)
                        x2 = torch.where(vis, x2, -math.inf)
                    ds = (torch.exp2(x2) - torch.exp2(x1)) * gg[:, None]
                else:
                    ratio = x1 - x2 - kk[:, None]
                    if masked:
                        x1 = torch.where(vis, x1, -math.inf)
                    ds = torch.exp2(x1) * ratio * gg[:, None]
                if masked:
                    ds = torch.where(vis, ds, torch.zeros_like(ds))
                qd = _finite(Qt[r]) if (masked and causal) else Qt[r]
                dk[keys] += ds.T @ qd
                ds_halves.append(ds)
            dq[r] += torch.cat(ds_halves, dim=1) @ kq[keys_blk]
    return dq[:N_Q], dk[:N_K]


def _forward64(q1, k1, q2, k2, causal, scale1, scale2):
    """kl (nats), lse1, lse2 (bits) in float64, -inf for rows with no visible key."""
    out = []
    for q, k, sc in ((q1, k1, scale1), (q2, k2, scale2)):
        s = sc * q @ k.T
        if causal:
            i = torch.arange(q.shape[0])[:, None]
            j = torch.arange(k.shape[0])[None, :]
            s = s.masked_fill(~(j <= i + (k.shape[0] - q.shape[0])), -math.inf)
        out.append(torch.logsumexp(s, dim=-1) / math.log(2.0))
    kl = attention_kl_naive(q1[None, None], k1[None, None], q2[None, None], k2[None, None], causal=causal,
                            scale1=scale1, scale2=scale2, compute_dtype=torch.float64)[0, 0]
    return kl, out[0], out[1]


def _reference(g, xs, causal, train, scale1, scale2):
    leaves = [x.clone().requires_grad_(n // 2 + 1 == train) for n, x in enumerate(xs)]
    kl = attention_kl_naive(*(x[None, None] for x in leaves), causal=causal, scale1=scale1, scale2=scale2,
                            compute_dtype=torch.float64)[0, 0]
    (kl * g).sum().backward()
    return (leaves[0].grad, leaves[1].grad) if train == 1 else (leaves[2].grad, leaves[3].grad)


@settings(max_examples=8, deadline=None)
@given(n_q=st.integers(1, 300), n_k=st.integers(1, 300), causal=st.booleans(), train=st.sampled_from([1, 2]),
       seed=st.integers(0, 2 ** 16))
@example(n_q=256, n_k=256, causal=True, train=2, seed=0)
@example(n_q=333, n_k=200, causal=True, train=1, seed=1)  # N_Q > N_K: empty rows
@example(n_q=70, n_k=257, causal=True, train=2, seed=2)  # a ragged key block with one key
@example(n_q=200, n_k=130, causal=False, train=1, seed=3)
def test_replayed_schedule_matches_float64_autograd(n_q, n_k, causal, train, seed):
    torch.manual_seed(seed)
    D = 16
    xs = [torch.randn(n, D, dtype=torch.float64) for n in (n_q, n_k, n_q, n_k)]
    g = torch.rand(n_q, dtype=torch.float64) + 0.5
    scale1, scale2 = 0.3, 0.2
    kl, lse1, lse2 = _forward64(*xs, causal, scale1, scale2)
    dq, dk = _replay(g, *xs, lse1, lse2, kl, causal, train, scale1, scale2)
    rq, rk = _reference(g, xs, causal, train, scale1, scale2)
    torch.testing.assert_close(dq, rq, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(dk, rk, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("train", [1, 2])
@pytest.mark.parametrize("what", ["key", "query"])
def test_replayed_nan_isolation(train, what):
    """A NaN key stays out of the dQ of rows that cannot see it, a NaN query row out of the dK of
    keys it cannot see (the finite copies); the trained side, causal, 200 x 260."""
    torch.manual_seed(5)
    n_q, n_k, D = 200, 260, 16
    diag = n_k - n_q
    sc = 0.3
    xs = [torch.randn(n, D, dtype=torch.float64) for n in (n_q, n_k, n_q, n_k)]
    g = torch.rand(n_q, dtype=torch.float64) + 0.5

    def run(inputs):
        kl, l1, l2 = _forward64(*inputs, True, sc, sc)
        return _replay(g, *inputs, l1, l2, kl, True, train, sc, sc)

    clean = run(xs)
    t = 2 * (train - 1)
    bad = [x.clone() for x in xs]
    if what == "key":
        j = 150  # rows < j - diag cannot see key j
        bad[t + 1][j, 2] = float("nan")
        dq, _ = run(bad)
        rows = slice(0, j - diag)
        assert torch.isfinite(dq[rows]).all()
        torch.testing.assert_close(dq[rows], clean[0][rows], rtol=1e-9, atol=1e-10)
        assert torch.isnan(dq[j - diag:]).all()  # rows that see it: NaN, not silently finite
    else:
        i = 100  # sees keys <= i + diag only
        bad[t][i, 3] = float("nan")
        dq, dk = run(bad)
        keys = slice(i + diag + 1, n_k)
        assert torch.isfinite(dk[keys]).all()
        torch.testing.assert_close(dk[keys], clean[1][keys], rtol=1e-9, atol=1e-10)
        assert torch.isnan(dk[:i + diag + 1]).all() and torch.isnan(dq[i]).all()


# ----------------------------------------------------------------------------------------------
# The mbarrier protocol of one CTA (producer, two consumer warpgroups), replayed under random
# interleavings: it mirrors the waits and arrives of _gluon_bwd._load_partition, _bwd_tile and
# _dq_tile (keep them in step), with and without DQ_LAG.
# ----------------------------------------------------------------------------------------------

class _Barrier:
    """An mbarrier: ``count`` arrivals complete a phase; ``wait(parity)`` passes once the phase of
    that parity has completed (a fresh barrier passes the parity-1 wait)."""

    def __init__(self, count):
        self.count, self.arrived, self.completed = count, 0, 0

    def ready(self, parity):
        return self.completed % 2 != parity

    def arrive(self):
        self.arrived += 1
        assert self.arrived <= self.count
        if self.arrived == self.count:
            self.arrived, self.completed = 0, self.completed + 1


def _producer(n_tiles, stages, q_ready, q_empty, q_slot):
    for i in range(n_tiles):
        s, ph = i % stages, (i // stages) & 1
        yield ("wait", q_empty[s], ph ^ 1)
        q_slot[s] = i  # the TMA load of query tile i (its bytes complete q_ready)
        yield ("arrive", q_ready[s])


def _consumer(wg, n_tiles, stages, bufs, lag, q_ready, q_empty, ds_ready, ds_free, q_slot, ds, log):
    def dq_of(j, q_slot_free=None):  # the dQ half of tile j: both halves of its dS, then the buffer released
        buf = j % bufs
        yield ("wait", ds_ready[buf], (j // bufs) & 1)
        assert ds[buf] == [j, j], f"wg{wg} dQ of tile {j} reads dS of tiles {ds[buf]}"
        log.append((wg, "dq", j))
        if q_slot_free is not None:  # without the lag: the Q slot released after the dK + dQ wait
            yield ("arrive", q_slot_free)
        yield ("arrive", ds_free[buf])

    for i in range(n_tiles):
        s, ph = i % stages, (i // stages) & 1
        buf, ds_ph = i % bufs, (i // bufs) & 1
        yield ("wait", q_ready[s], ph)
        assert q_slot[s] == i, f"wg{wg} tile {i} reads the Q of tile {q_slot[s]}"
        yield ("wait", ds_free[buf], ds_ph ^ 1)
        ds[buf][wg] = i  # this warpgroup's dS half of tile i
        yield ("arrive", ds_ready[buf])
        assert q_slot[s] == i, f"wg{wg} dK of tile {i}: its Q slot was refilled"  # dK += dS^T Q
        if lag:
            yield ("arrive", q_empty[s])
            if i > 0:
                yield from dq_of(i - 1)
        else:
            yield from dq_of(i, q_empty[s])
    if lag and n_tiles > 0:
        yield from dq_of(n_tiles - 1)


def _run_protocol(n_tiles, stages, bufs, lag, seed):
    """Runs the three partitions under a random interleaving; returns the dQ log, or None on deadlock."""
    import random

    rng = random.Random(seed)
    q_ready = [_Barrier(1) for _ in range(stages)]
    q_empty = [_Barrier(2) for _ in range(stages)]
    ds_ready = [_Barrier(2) for _ in range(bufs)]
    ds_free = [_Barrier(2) for _ in range(bufs)]
    q_slot, ds, log = [None] * stages, [[None, None] for _ in range(bufs)], []
    procs = [_producer(n_tiles, stages, q_ready, q_empty, q_slot)] + [
        _consumer(wg, n_tiles, stages, bufs, lag, q_ready, q_empty, ds_ready, ds_free, q_slot, ds, log)
        for wg in (0, 1)]
    pending = {i: next(p, None) for i, p in enumerate(procs)}
    while any(op is not None for op in pending.values()):
        runnable = [i for i, op in pending.items() if op is not None and (op[0] == "arrive" or op[1].ready(op[2]))]
        if not runnable:
            return None
        i = rng.choice(runnable)
        if pending[i][0] == "arrive":
            pending[i][1].arrive()
        pending[i] = next(procs[i], None)
    return log


@pytest.mark.parametrize("lag,bufs", [(False, 1), (False, 2), (True, 2), (True, 3)])
@pytest.mark.parametrize("stages", [2, 3])
def test_barrier_protocol_completes_and_reads_the_right_tiles(lag, bufs, stages):
    """Every interleaving tried finishes (no deadlock), every dQ reads both dS halves of its own
    tile, every dK its own Q tile, and each warpgroup adds the dQ of every tile exactly once."""
    for n_tiles in (0, 1, 2, 3, 7):
        for seed in range(40):
            log = _run_protocol(n_tiles, stages, bufs, lag, seed)
            assert log is not None, f"deadlock: n_tiles={n_tiles} seed={seed}"
            for wg in (0, 1):
                assert [j for w, _, j in log if w == wg] == list(range(n_tiles))


def test_barrier_protocol_lag_needs_two_ds_buffers():
    """The model can fail: the lagged dQ with one dS buffer deadlocks (tile i's dS waits for tile
    i - 1's dQ, which comes after it), which is why launch_args refuses DQ_LAG with DS_BUFS=1."""
    assert _run_protocol(3, 2, 1, True, 0) is None
