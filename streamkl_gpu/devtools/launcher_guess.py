"""Check, without a GPU, that the early launcher build (``_core/triton_launchers``) builds the launcher
Triton will load: for every distinct kernel launch of the calls named (``devtools.offline_call``'s
specs, compiled for sm_90 with its stand-in driver), the C source built before the compile against
the one Triton's ``CudaLauncher`` asks to build for the compiled kernel (its tensor-descriptor
metadata included).
Meaningful with a Triton that builds a launcher per kernel (3.6, the GPU image's); with 3.8 or 3.9
it says there is nothing to check. The host compiler is not run: the sources are compared.

    python -m streamkl_gpu.devtools.launcher_guess [--csv OUT.csv] attn:4096:s1 gqa:8192:lse gluon:fwd ...

``gluon:fwd`` and ``gluon:bwd``: the Gluon forward and backward (D = 128, bf16, causal, setting 1).

A launch whose kernel was already compiled in this process (an earlier spec's) compiles nothing and
builds nothing: its row says so, and it is not counted.
"""
import csv
import os
import sys
import threading

FIELDS = ["spec", "kernel", "descriptors", "early_builds", "same_source", "triton"]


def check(specs):
    """One dict per distinct kernel launch of ``specs`` (FIELDS)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.nvidia import driver as nvidia

    from streamkl_gpu._core import triton_launchers
    from streamkl_gpu.devtools import offline_call

    if triton_launchers._builder() is None:
        raise SystemExit(f"triton {triton.__version__} builds no launcher per kernel: nothing to check")
    built = []
    lock = threading.Lock()

    def record(src, **_):  # in place of the host-compiler build: the source it would build
        with lock:
            built.append(src)

    nvidia.compile_module_from_src, nvidia.library_dirs = record, lambda: []  # (no libcuda without a GPU)
    offline_call._stand_in_gpu()
    rows = []
    for spec in specs:
        for name, kernel in _compiled(spec, built, offline_call, triton_launchers):
            early = list(built)
            built.clear()
            try:  # Triton's own launcher for the compiled kernel: its source is recorded, then it fails to load
                nvidia.CudaLauncher(kernel.src, kernel.metadata)
            except Exception:  # noqa: BLE001 - nothing was built to load
                pass
            rows.append(dict(spec=spec, kernel=name, early_builds=len(early), triton=triton.__version__,
                             descriptors=sum(isinstance(t, str) and t.startswith("tensordesc")
                                             for t in kernel.src.signature.values()),
                             same_source=(early == built) if early else "compiled before in this process"))
    return rows


GLUON = {  # the Gluon forward and backward at D = 128, bf16, causal (setting 1), as devtools.sass compiles them
    "gluon:fwd": lambda sass, torch: sass.compile_sm90(128, 128, torch.bfloat16, True),
    "gluon:bwd": lambda sass, torch: sass.compile_attention_bwd_sm90(128, torch.bfloat16, True, 2),
}


def _compiled(spec, built, offline_call, triton_launchers):
    """(kernel name, compiled kernel) per distinct launch of ``spec``, ``built`` holding what the early
    build made for it. The Gluon kernels are compiled by ``triton.compile`` directly (no JIT function
    runs), so their early build is called here on the same source object."""
    if spec in GLUON:
        import torch
        from streamkl_gpu.devtools import sass
        kernel = GLUON[spec](sass, torch)
        built.clear()
        triton_launchers._builder()(kernel.src)
        yield kernel.src.fn.__name__, kernel
        return
    for fn, grid, args, kwargs in offline_call._launches(spec):
        built.clear()
        yield fn.fn.__name__, fn.warmup(*args, grid=grid, **kwargs)


def main(argv):
    out = None
    if argv[:1] == ["--csv"] and len(argv) > 1:
        out, argv = argv[1], argv[2:]
    if not argv:
        print(__doc__)
        return 2
    rows = check(argv)
    for row in rows:
        print(" ".join(f"{name}={row[name]}" for name in FIELDS))
    counted = [r for r in rows if r["early_builds"]]
    same = sum(r["same_source"] is True for r in counted)
    print(f"{same} of {len(counted)} compiled launches: the early launcher source is Triton's")
    if out:
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    return 0 if same == len(counted) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
