"""Compile for sm_90, without a GPU, every Triton kernel that one indexer or attention call
launches, and read what ptxas made of each: registers, stack (spills), the MMA instructions
(HGMMA is Hopper's warpgroup MMA; HMMA the older per-warp one, what a tile too short for a
warpgroup gets), MUFU exponentials, local-memory loads and stores, instructions.

It is the facts half of a profile, for a machine with no GPU: the kernels are the ones the call
picks on an H200 (132 SMs, compute capability 9, TMA descriptors, the shape rules' configs),
found by the compile-ahead walk (``_core/launcher.compile_ahead``: the whole call, forward and
backward, with every launch only recorded). Times are not known here; a kernel that spills or
runs HMMA where the tile could take HGMMA is where a GPU profile should look first.

Run it in a process of its own: it installs a stand-in Triton driver and H200 device facts for
the rest of the process (CPU tensors stand for the GPU's; nothing runs on them).

    python -m streamkl_gpu.devtools.offline_call dsa:8192:lse gqa:8192:nolse mqa64:8192:nolse
    python -m streamkl_gpu.devtools.offline_call --csv OUT.csv gqa:8192:lse
    python -m streamkl_gpu.devtools.offline_call --force indexer_storing_forward_order=forward_rule mqa64:8192:nolse

A spec is ``teacher:N:lse|nolse[:reduction]`` (reduction ``mean`` by default, as a training step);
the teachers are the benchmark's: ``dsa`` (H = 128, D = 576, MQA; indexer 64 x 128), ``mqa64``
(the first-call section's: 64 heads, otherwise DSA-like), ``gqa`` (H = 32 over 8 key heads,
D = 128; indexer 16 x 64). ``attn:N:s1|s2|both[:full]``: an ``attention_kl`` training step
(``.sum().backward()``; B = 1, H = 2, D = 128, bf16, causal unless ``full``) with side 2, side 1 or
both trained; its Triton kernels (the Gluon forward and backward are compiled by
``devtools.sass``). ``varlen:N:s1|s2|both[:full][:fused|separate]``: the same step through
``attention_kl_varlen`` on two packed sequences of N and N/2 tokens (what a first call compiles:
each pick's first candidate, the shape rule's; every candidate under ``STREAMKL_AUTOTUNE=1``).
One CSV row (or printed line) per distinct kernel launch.
``--force NAME=VALUE``: the call inside ``_core.forcing.forcing(NAME=VALUE)`` (the documented hook).
"""
import csv
import os
import re
import subprocess
import sys
import tempfile
import time

TEACHERS = {  # (H, H_K, D, H_I, D_I)
    "dsa": (128, 1, 576, 64, 128),
    "mqa64": (64, 1, 576, 64, 128),
    "gqa": (32, 8, 128, 16, 64),
}
COUNTS = {  # SASS mnemonics counted per kernel (whole kernel, every loop and stage)
    "hgmma": r"\bHGMMA\b", "hmma": r"\bHMMA\b", "mufu_ex2": r"MUFU\.EX2", "ldl": r"\bLDL\b", "stl": r"\bSTL\b",
    "bar_sync": r"\bBAR\.SYNC\b", "red_atom": r"\b(RED|ATOM)\b",
}
FIELDS = ["spec", "kernel", "grid", "compile_s", "registers", "stack_bytes", "shared_bytes", "instructions",
          *COUNTS, "config"]


def _stand_in_gpu():
    """A Triton driver for device 0 of an sm_90 target (compiles, never launches) and H200 facts."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StandIn:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(StandIn())
    from streamkl_gpu._core import runtime
    from streamkl_gpu.indexer import plan

    runtime._device_facts = lambda device_type, index: (132, 9)  # an H200: SMs, compute capability

    def tma_ok(t):  # runtime.tma_ok without its device test (CPU tensors stand for the GPU's)
        size = t.element_size()
        return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
            st > 0 and (st * size) % 16 == 0 for st in t.stride()[:-1])
    runtime.tma_ok = tma_ok

    class PlanRuntime:  # the input check's "CPU tensors need the interpreter" passes
        def __getattr__(self, name):
            return getattr(runtime, name)

        def interpreting(self):
            return True
    plan._runtime = PlanRuntime()

    from streamkl_gpu._core import checks
    attention_check = checks._check_tensors_uncached

    def check_tensors(*args):  # attention's "CPU tensors need the interpreter" passes too
        checks.interpreting = lambda: True
        try:
            return attention_check(*args)
        finally:
            checks.interpreting = runtime.interpreting
    checks._check_tensors_uncached = check_tensors


ATTENTION_SETTINGS = {"s1": (False, True), "s2": (True, False), "both": (True, True)}  # (side 1, side 2) trained


def _attention_launches(spec):
    """The distinct launches of the ``attn:N:s1|s2|both[:full]`` training step, or of
    ``varlen:N:s1|s2|both[:full][:fused|separate]``'s: two packed sequences of N and N/2 tokens."""
    import torch
    import streamkl_gpu

    parts = spec.split(":")
    options = {"full", "fused", "separate"} if parts[0] == "varlen" else {"full"}
    if len(parts) < 3 or parts[2] not in ATTENTION_SETTINGS or not set(parts[3:]) <= options:
        raise ValueError(f"an attention spec is attn:N:s1|s2|both[:full] or "
                         f"varlen:N:s1|s2|both[:full][:fused|separate], got {spec!r}")
    n, (side1, side2) = int(parts[1]), ATTENTION_SETTINGS[parts[2]]
    train, causal = (side1, side1, side2, side2), "full" not in parts
    if parts[0] == "varlen":  # (the walk reaches the custom op's backward from its forward)
        cu = torch.tensor([0, n, n + n // 2], dtype=torch.int32)
        mode = "fused" if "fused" in parts else "separate" if "separate" in parts else "auto"
        xs = [torch.zeros(n + n // 2, 2, 128, dtype=torch.bfloat16, requires_grad=t) for t in train]
        return recorded_launches(lambda: streamkl_gpu.attention_kl_varlen(*xs, cu, cu, n, n, causal=causal,
                                                                          bwd_mode=mode), spec)
    xs = [torch.zeros(1, 2, n, 128, dtype=torch.bfloat16, requires_grad=t) for t in train]
    return recorded_launches(lambda: streamkl_gpu.attention_kl(*xs, causal=causal).sum().backward(), spec)


def _launches(spec):
    """The distinct launches (kernel, grid, args, kwargs) of the call ``spec`` names."""
    import torch
    import streamkl_gpu

    if spec.startswith(("attn:", "varlen:")):
        return _attention_launches(spec)
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[0] not in TEACHERS or parts[2] not in ("lse", "nolse"):
        raise ValueError(f"a spec is teacher:N:lse|nolse[:reduction] with teacher in {sorted(TEACHERS)}, got {spec!r}")
    H, HK, D, HI, DI = TEACHERS[parts[0]]
    n, reduction = int(parts[1]), parts[3] if len(parts) == 4 else "mean"
    bf = torch.bfloat16
    q, k = torch.zeros(1, H, n, D, dtype=bf), torch.zeros(1, HK, n, D, dtype=bf)
    student = [torch.zeros(1, HI, n, DI, dtype=bf, requires_grad=True),
               torch.zeros(1, 1, n, DI, dtype=bf, requires_grad=True),
               torch.zeros(1, HI, n, dtype=bf, requires_grad=True)]
    lse = torch.zeros(1, H, n) if parts[2] == "lse" else None
    # (the backward's kernels too: in the walk, custom_ops.call runs each op's backward)
    return recorded_launches(
        lambda: streamkl_gpu.indexer_kl(q, k, *student, causal=True, scale=D ** -0.5, lse=lse, reduction=reduction),
        spec)


def recorded_launches(call, what):
    """The distinct launches (kernel, grid, args, kwargs) ``call()`` makes in a compile-ahead walk
    (``launcher.compile_ahead``), recorded instead of compiled; ``what`` names the call in the
    errors (it raised, or it reached no launch)."""
    from streamkl_gpu._core import launcher

    seen, found = set(), []

    def record(fn, grid, args, kwargs):
        key = (id(fn), tuple(launcher._spec(a) for a in args),
               tuple((name, launcher._value_key(v)) for name, v in kwargs.items()))
        if key not in seen:
            seen.add(key)
            found.append((fn, grid, args, kwargs))

    raised = []

    def walk():
        try:
            call()
        except Exception as exc:  # the walk ends quietly; say why here
            raised.append(exc)
            raise

    launcher._compile_only, kept = record, launcher._compile_only
    try:
        launcher.compile_ahead(walk, None).join()
    finally:
        launcher._compile_only = kept
    if raised:
        raise RuntimeError(f"the call of {what!r} raised in the compile-ahead walk") from raised[0]
    if not found:
        raise RuntimeError(f"the call of {what!r} reached no kernel launch")
    return found


def _facts(kernel):
    from streamkl_gpu.devtools.sass import cuobjdump
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump(), "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    res = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    out = dict(registers=int(res.group(1)), stack_bytes=int(res.group(2)),
               shared_bytes=getattr(kernel.metadata, "shared", None),  # dynamic shared memory per program
               instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass)))
    out.update({name: len(re.findall(pattern, sass)) for name, pattern in COUNTS.items()})
    return out


def census(spec):
    """One dict per distinct kernel launch of ``spec``'s call (FIELDS), compiled one after another."""
    rows = []
    for fn, grid, args, kwargs in _launches(spec):
        t0 = time.perf_counter()
        kernel = fn.warmup(*args, grid=grid, **kwargs)
        seconds = time.perf_counter() - t0
        config = " ".join(f"{name}={v}" for name, v in kwargs.items() if isinstance(v, (bool, int, str)))
        rows.append(dict(spec=spec, kernel=fn.fn.__name__, grid="x".join(str(g) for g in grid),
                         compile_s=round(seconds, 2), **_facts(kernel), config=config))
    return rows


def main(argv):
    out, forced = None, {}
    while argv[:1] in (["--csv"], ["--force"]) and len(argv) > 1:
        if argv[0] == "--csv":
            out = argv[1]
        else:
            name, _, value = argv[1].partition("=")
            forced[name] = value
        argv = argv[2:]
    if not argv:
        print(__doc__)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    _stand_in_gpu()
    from streamkl_gpu._core.forcing import forcing
    with forcing(**forced):
        rows = [row for spec in argv for row in census(spec)]
    for row in rows:
        print(" ".join(f"{name}={row[name]}" for name in FIELDS))
    if out:
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
