"""Per-iteration SASS of the key-tile loops of every Triton kernel one indexer call launches (sm_90, offline).

    python loop_table.py [--csv OUT] [--force NAME=VALUE]... SPEC...   (specs: devtools.offline_call's)

Per distinct launch (``offline_call._launches``), compiled with whatever triton is imported: one row per
innermost loop holding HGMMA (``sass.main_loops``, in code order) with ``sass_table.classify``'s classes
plus memory classes (TMA loads/stores/reductions, global loads/stores, atomics, MEMBAR, shared memory),
whether the HGMMA are serialised, the dots' warp layouts (TTGIR: M x N of each warp_group_dot and its
layout's warpsPerCTA / instrShape), registers, stack and the whole kernel's instructions.
"""
import csv
import re
import sys

MEM = (("tma_load", r"^UTMALDG\b"), ("tma_store", r"^UTMASTG\b"), ("tma_reduce", r"^UTMAREDG\b"),
       ("ldg", r"^LDG\b"), ("stg", r"^STG\b"), ("atomics", r"^(RED|REDG|ATOM|ATOMG|REDAS)\b"),
       ("membar", r"^MEMBAR\b"), ("lds", r"^(LDS|LDSM)\b"), ("sts", r"^STS\b"), ("fence", r"^FENCE\b"),
       ("depbar_all", r"^WARPGROUP\.DEPBAR"), ("syncs", r"^SYNCS\b"))


def dot_layouts(ttgir):
    """'MxNxK@[wm,wn]/instrN' of each warp_group_dot (or tt.dot) in the TTGIR, in order."""
    layouts = {}
    for m in re.finditer(r"^(#\w+) = #ttg\.nvidia_mma<\{([^}]*)\}>", ttgir, re.M):
        w = re.search(r"warpsPerCTA = \[([^\]]*)\]", m.group(2)).group(1).replace(" ", "")
        i = re.search(r"instrShape = \[([^\]]*)\]", m.group(2)).group(1).replace(" ", "")
        layouts[m.group(1)] = f"w[{w}]i[{i}]"
    out = []
    for line in ttgir.splitlines():
        if "warp_group_dot " in line or " tt.dot " in line:
            ts = re.findall(r"tensor<([0-9x]+)x\w+, (#\w+)>", line.split("->")[-1])
            if ts:
                shape, lay = ts[-1]
                out.append(f"{shape}@{layouts.get(lay, lay)}")
    return out


def all_loops(text):
    """Every loop (a conditional backward branch's span) holding HGMMA, outermost first within code order,
    each as its OWN instructions (nested loops' spans left out); names 'L<k>' with '/inner' or '/outer'."""
    from streamkl_gpu.devtools import sass
    ins = sass._instructions(text)
    spans = []
    for addr, t in ins:
        m = sass._BRA.search(t)
        if m and t.startswith("@") and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    spans = sorted(set(sp for sp in spans if any("HGMMA" in t for a, t in ins if sp[0] <= a <= sp[1])))
    out, names = [], []
    for k, sp in enumerate(spans):
        inner = [o for o in spans if o != sp and sp[0] <= o[0] and o[1] <= sp[1]]
        own = [t for a, t in ins if sp[0] <= a <= sp[1] and not any(o[0] <= a <= o[1] for o in inner)]
        out.append(own)
        names.append(f"L{k}/{'outer' if inner else 'inner'}@{sp[0]:x}")
    return out, names


def rows_of(spec, forced):
    import triton
    from streamkl_gpu.devtools import offline_call, sass, sass_table
    rows = []
    for fn, grid, args, kwargs in offline_call._launches(spec):
        kernel = fn.warmup(*args, grid=grid, **kwargs)
        text = sass.sass_of(kernel)
        res = sass.resource_usage(kernel)
        total = len(sass._instructions(text))
        dots = " ".join(dot_layouts(kernel.asm["ttgir"]))
        config = " ".join(f"{k}={v}" for k, v in kwargs.items() if isinstance(v, (bool, int, str)) and k in (
            "BLOCK_T", "BLOCK_N", "GI_PAD", "STAGES", "SPLIT", "P_TMA", "DK_SHARE", "BRANCH_LAYOUT", "num_warps",
            "num_stages", "maxnreg", "HEAD_LOOP", "P_SPLIT", "BAND_IN_MAIN", "DK_TILE", "BLOCK"))
        loops, names = all_loops(text)
        whole = not loops
        if whole:
            loops, names = [[t for _, t in sass._instructions(text)]], ["kernel"]
        for k, body in enumerate(loops):
            c = sass_table.classify(body)
            for name, pat in MEM:
                c[name] = sum(bool(re.match(pat, sass_table.opcode(t))) for t in body)
            rows.append(dict(triton=triton.__version__, spec=spec, forced=" ".join(f"{a}={b}" for a, b in forced.items()),
                             kernel=fn.fn.__name__, grid="x".join(map(str, grid)), config=config,
                             loop=names[k], instructions=len(body), **c,
                             serialised=int(sass_table.serialised(body)), registers=res.get("reg"),
                             stack=res.get("stack"), kernel_instructions=total, dots=dots, run_status="ok"))
    return rows


def main(argv):
    import os
    out, forced = None, {}
    while argv[:1] in (["--csv"], ["--force"]) and len(argv) > 1:
        if argv[0] == "--csv":
            out = argv[1]
        else:
            name, _, value = argv[1].partition("=")
            forced[name] = value
        argv = argv[2:]
    os.environ.pop("TRITON_INTERPRET", None)
    from streamkl_gpu.devtools import offline_call
    offline_call._stand_in_gpu()
    import triton, streamkl_gpu
    print(triton.__version__, streamkl_gpu.__file__, file=sys.stderr)
    from streamkl_gpu._core.forcing import forcing
    with forcing(**forced):
        rows = [r for spec in argv for r in rows_of(spec, forced)]
    show = ["kernel", "grid", "loop", "instructions", "hgmma", "wg_depbar", "serialised", "mufu_ex2", "fp32", "shfl",
            "bar_sync", "tma_load", "tma_store", "tma_reduce", "ldg", "stg", "atomics", "membar", "lds", "sts", "spill",
            "registers", "stack", "kernel_instructions", "config", "dots"]
    print(" | ".join(show))
    for r in rows:
        print(" | ".join(str(r[c]) for c in show))
    if out:
        with open(out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
