"""Per-iteration SASS instruction classes of the Hopper Gluon forward's key-tile loops, offline.

For each spec (``sass.py``'s ``attention_fwd`` specs: ``bf16:causal:128:128[:name=value...]``)
and optionally a forced variant, compiles the kernel for sm_90 with whatever triton is imported
(``sass.compile_sm90``), finds the key-tile loops (``sass.main_loops``: the innermost loops with
HGMMA) and counts, per loop iteration (one key tile of one consumer warpgroup, per thread): HGMMA,
the warpgroup arrive / depbar, MUFU.EX2, the FP32 classes, conversions, shuffles, the rest, and
whether ptxas serialised the products (every HGMMA followed by a DEPBAR before the next HGMMA:
the back-edge trap). The loops come in code order, two per consumer warpgroup: the whole-tile
stage, then the masked stage. A loop with a data-dependent branch (the ``lazy_max`` variant)
gets three rows: ``static`` (every instruction of the body), ``fast`` and ``slow`` (its cheapest
and dearest path through one iteration, ``loop_paths``); a loop of one path gets ``static`` alone.

    python -m streamkl_gpu.devtools.sass_table [--csv OUT] [--variant NAME]... SPEC...

Run it in its own process (no ``TRITON_INTERPRET``); with another triton first on ``PYTHONPATH``
(the GPU image's 3.6) it counts that triton's build. ``--variant kernel`` is the default kernel.
"""
import csv
import re
import sys

# instruction classes: (column, regular expression on the opcode), first match wins
CLASSES = (
    ("hgmma", r"^HGMMA\b"), ("wg_arrive", r"^WARPGROUP\.ARRIVE"), ("wg_depbar", r"^WARPGROUP\.DEPBAR"),
    ("mufu_ex2", r"^MUFU\.EX2"), ("mufu_other", r"^MUFU\."), ("ffma", r"^FFMA\b"), ("fmul", r"^FMUL\b"),
    ("fadd", r"^FADD\b"), ("fmnmx", r"^FMNMX\b"), ("fsetp", r"^FSETP\b"), ("fsel", r"^FSEL\b"),
    ("conv", r"^(F2F|F2FP|F2I|I2F|I2FP|F2IP)\b"), ("shfl", r"^SHFL\b"), ("bar_sync", r"^BAR\b"),
    ("mbarrier", r"^SYNCS\b"), ("spill", r"^(STL|LDL)\b"), ("int", r"^(IADD3|IMAD|LOP3|ISETP|SHF|LEA|SGXT|IMNMX|"
                                                                     r"VIMNMX|SEL|PRMT|IABS|S2R|S2UR|R2UR|UIADD3|ULOP3)\b"),
    ("mov", r"^(MOV|UMOV|IMAD\.MOV)\b"), ("branch", r"^(BRA|BSSY|BSYNC|WARPSYNC|EXIT)\b"),
)
FIELDS = ["triton", "spec", "variant", "loop", "stage", "path", "instructions"] + [c for c, _ in CLASSES] + [
    "other", "fp32", "serialised", "ex2_between_waits", "registers", "stack", "local", "run_status"]


def opcode(text: str) -> str:
    """The opcode of one SASS instruction text (its predicate guard dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text.strip()).split()[0]


def classify(body) -> dict:
    """Counts of ``CLASSES`` (and ``other``) over one loop body (instruction texts)."""
    out = {c: 0 for c, _ in CLASSES}
    out["other"] = 0
    for text in body:
        op = opcode(text)
        for name, pattern in CLASSES:
            if re.match(pattern, op):
                out[name] += 1
                break
        else:
            out["other"] += 1
    out["fp32"] = sum(out[c] for c in ("ffma", "fmul", "fadd", "fmnmx", "fsetp", "fsel"))
    return out


def serialised(body) -> bool:
    """ptxas' serialised-wgmma trap: every HGMMA followed by a WARPGROUP.DEPBAR before the next HGMMA
    (the source waits twice per key tile; a loop of 16 HGMMA with 16 DEPBAR is the trap)."""
    ops = [opcode(t) for t in body if re.match(r"^(HGMMA|WARPGROUP\.DEPBAR)", opcode(t))]
    hg = [k for k, o in enumerate(ops) if o.startswith("HGMMA")]
    if len(hg) < 2:
        return False
    return all(k + 1 < len(ops) and ops[k + 1].startswith("WARPGROUP.DEPBAR") for k in hg)


def loop_paths(sass_text: str) -> list:
    """Per main loop (``sass.main_loops``' order): the instruction texts of its cheapest and of its
    dearest path through one iteration (fewest / most HGMMA, then instructions), following the
    conditional forward branches inside the loop both ways; branches that leave the loop (the
    mbarrier waits' retry paths) are taken as not taken. A loop without such a branch has one path."""
    from streamkl_gpu.devtools import sass

    ins = sass._instructions(sass_text)
    at = {a: k for k, (a, _) in enumerate(ins)}
    out = []
    for lo, hi in sass.mma_loop_spans(ins):
        first = at[lo]
        paths = []

        def walk(k, taken, depth=0):
            while ins[k][0] <= hi:
                taken = taken + [ins[k][1]]
                text = ins[k][1]
                m = sass._BRA.search(text)
                if ins[k][0] == hi or depth > 16:
                    break
                if m and lo < int(m.group(1), 16) <= hi and int(m.group(1), 16) > ins[k][0]:
                    target = at[int(m.group(1), 16)]
                    if text.startswith("@"):
                        walk(target, taken, depth + 1)
                    else:
                        k = target
                        continue
                k += 1
            paths.append(taken)

        walk(first, [])
        key = lambda p: (sum("HGMMA" in t for t in p), len(p))
        out.append((min(paths, key=key), max(paths, key=key)))
    return out


def loop_rows(spec: str, variant: str = "kernel") -> list:
    """One dict (``FIELDS``) per key-tile loop of the compiled ``spec`` (forced ``variant``)."""
    import triton

    from streamkl_gpu.attention.gluon import fwd_sm90_launch as launch
    from streamkl_gpu.devtools import sass

    dtype, mode, d1, d2, *items = spec.split(":")
    config = sass.config_from_spec(launch.GluonFwdConfig, items) if items else None
    kernel = sass.compile_sm90(int(d1), int(d2), sass.DTYPES[dtype], mode == "causal", config=config,
                               variant=None if variant == "kernel" else variant)
    text = sass.sass_of(kernel)
    res = sass.resource_usage(kernel)
    counts = sass.sass_counts(text)
    rows = []
    for k, (body, summary, (fast, slow)) in enumerate(zip(sass.main_loops(text), counts["loops"], loop_paths(text))):
        stage = "whole" if k % 2 == 0 else "masked"
        for path, name in ((body, "static"), (fast, "fast"), (slow, "slow")):
            if name != "static" and len(fast) == len(slow):
                continue  # one path: the static count is the iteration's
            row = dict(triton=triton.__version__, spec=spec, variant=variant, loop=k, stage=stage, path=name,
                       instructions=len(path), **classify(path), serialised=int(serialised(path)),
                       ex2_between_waits=summary["ex2_between_waits"], registers=res.get("reg"),
                       stack=res.get("stack"), local=res.get("local"), run_status="ok")
            rows.append(row)
    return rows


def main(argv) -> int:
    out, variants = None, []
    while argv[:1] in (["--csv"], ["--variant"]) and len(argv) > 1:
        if argv[0] == "--csv":
            out = argv[1]
        else:
            variants.append(argv[1])
        argv = argv[2:]
    if not argv:
        print(__doc__)
        return 2
    rows = [r for spec in argv for v in (variants or ["kernel"]) for r in loop_rows(spec, v)]
    show = ["triton", "spec", "variant", "loop", "stage", "path", "instructions", "hgmma", "wg_arrive", "wg_depbar",
            "mufu_ex2", "ffma", "fmul", "fadd", "fmnmx", "fsetp", "fsel", "conv", "shfl", "bar_sync", "spill", "int", "mov",
            "fp32", "serialised",
            "registers", "stack"]
    print(" ".join(show))
    for r in rows:
        print(" ".join(str(r[c]) for c in show), flush=True)
    if out:
        with open(out, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
