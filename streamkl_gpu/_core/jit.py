"""``@triton.jit`` helpers shared by every Triton kernel family (attention and indexer): the dot
with fp32 accumulation, the scale fold into bits, the whole/masked key-tile split, the safe shift
of a running max, and the constants they use. Kernel modules import these; nothing here imports a
kernel module (the runtime's interpreter probe reads one of these functions)."""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from streamkl_gpu._core import triton_keys  # noqa: F401  (kernel keys independent of the process's history)
from streamkl_gpu._core import triton_launchers  # noqa: F401  (launchers built while their kernels compile)

if triton.knobs.runtime.interpret:  # the kernels below are defined for the interpreter
    from streamkl_gpu._core import triton_interpreter

    triton_interpreter.install()  # scalar tensors index under recent NumPy (triton 3.6's interpreter)

# globals read inside @triton.jit code must be constexpr objects
LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE=True (fp32 inputs) keeps full fp32 products, not TF32."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _to_bits(s, qk_scale, NO_CONTRACT: tl.constexpr):
    """Scores times sigma * log2(e), rounded once. NO_CONTRACT (compiled kernels): ``mul.rn``,
    which the compiler may not fuse with the later subtraction of the max into one FFMA (it
    does fuse a plain multiply, measured in the SASS). The interpreter never fuses."""
    if NO_CONTRACT:
        out = libdevice.mul_rn(s, qk_scale)
    else:
        out = s * qk_scale
    return out


@triton.jit
def _key_stages(start_m, key_lo, key_hi, N_Q, N_K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Split the keys [key_lo, key_hi) of the query block starting at ``start_m`` into two stages.

    Returns ``(full_hi, key_hi)``: tiles [key_lo, full_hi) are whole and seen entirely by every row
    of the block (no masking), tiles [full_hi, key_hi) need the bounds / causal mask, and causal
    tiles past the frontier are dropped. ``key_lo`` must be a multiple of BLOCK_N.
    """
    diag_offset = N_K - N_Q
    full_hi = (N_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        # every row of the block sees keys < start_m + diag_offset + 1 (bottom-right causal)
        full_hi = tl.minimum(full_hi, (tl.maximum(start_m + diag_offset + 1, 0) // BLOCK_N) * BLOCK_N)
        # no row of the block sees keys >= start_m + BLOCK_M + diag_offset: those tiles are skipped
        key_hi = tl.minimum(key_hi, tl.maximum(start_m + BLOCK_M + diag_offset, 0))
    full_hi = tl.maximum(tl.minimum(full_hi, key_hi), key_lo)
    return full_hi, key_hi


@triton.jit
def _safe(m):
    # shift to use for a running max: 0 while the row has seen no visible key (m == -inf)
    return tl.where(m == float("-inf"), 0.0, m)
