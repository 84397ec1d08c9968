"""The chunk design's backward: its three fp32 gradient buffers times the upstream gradient, each
written in its input's dtype, in one launch.

The forward already formed the gradient of the summed loss (``training/chunk.py``); the backward
only scales it by ``g`` (a 0-dim device tensor: never read on the host) and casts. In PyTorch that
is ``(g * t).to(dtype)`` per buffer: two passes each, the first one not vectorised (a 0-dim
operand is broadcast), six launches; at the DSA-like 8K step (a [1, 64, 8192, 128] fp32 dq) about
0.9 GB of traffic against the 0.4 GB of one pass. Rounding as PyTorch's: the fp32 product, then
round to nearest even into the output dtype, so the result is bitwise ``(g * t).to(dtype)``
(a NaN stays a NaN; its bits are PyTorch's CPU cast's, 0x7FC0 in bf16).
Offsets are int64 (a 128K-token dq passes 2^31 elements).
"""
import triton
import triton.language as tl


@triton.jit
def _scale_cast_block(src, dst, n, block, g, BLOCK: tl.constexpr):
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(src + offs, mask=mask, other=0.0) * g
    if dst.dtype.element_ty == tl.bfloat16:
        # round to nearest even on the bits, as PyTorch's c10::BFloat16 does (NaN -> 0x7FC0): the
        # interpreter's own fp32 -> bf16 cast rounds ties away and truncates by default
        bits = y.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        rounded = tl.where(y != y, 0x7FC0, rounded).to(tl.uint16)
        tl.store(dst + offs, rounded.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(dst + offs, y.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _scale_cast_kernel(g_ptr, src0, dst0, n0, src1, dst1, n1, src2, dst2, n2, BLOCK: tl.constexpr):
    """Programs ``[0, b0)`` take buffer 0, the next ``b1`` buffer 1, the rest buffer 2 (``b_i``:
    its blocks of BLOCK elements; a buffer of 0 elements has none)."""
    block = tl.program_id(0)
    b0 = tl.cdiv(n0, BLOCK)
    b1 = tl.cdiv(n1, BLOCK)
    g = tl.load(g_ptr).to(tl.float32)
    if block < b0:
        _scale_cast_block(src0, dst0, n0, block, g, BLOCK)
    elif block < b0 + b1:
        _scale_cast_block(src1, dst1, n1, block - b0, g, BLOCK)
    else:
        _scale_cast_block(src2, dst2, n2, block - b0 - b1, g, BLOCK)
