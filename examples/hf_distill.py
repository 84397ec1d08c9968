#!/usr/bin/env python3
"""Attention distillation between two Hugging Face ``transformers`` Llama models, streamed.

A Llama teacher and a Llama student (``LlamaForCausalLM`` built from ``LlamaConfig``s, random
weights; ``--teacher PATH`` / ``--student PATH`` load local checkpoints instead) read the same
tokens. The student has the teacher's number of query heads, fewer key/value heads (GQA) and a
smaller head dim. The loss is

    student LM loss + kl_weight * mean over paired layers (t, s) of
        mean over rows of attention_kl(q_teacher[t], k_teacher[t], q_student[s], k_student[s], causal=True)

(teacher = side 1, setting 1: gradients reach the student only). The post-RoPE queries and keys
come out through transformers' own extension point: :class:`QKCapture` is registered with
``AttentionInterface`` under the name ``"streamkl_capture"`` and the models are built with
``attn_implementation="streamkl_capture"``; it records ``(query, key)`` of the watched layers and
hands the attention output to transformers' SDPA implementation unchanged. The models' forwards
are transformers' own. No ``N x N`` attention matrix is stored for the loss.

    pip install -e ".[transformers]"
    python examples/hf_distill.py --tiny                      # CPU, Triton interpreter: seconds
    python examples/hf_distill.py --seq 8192 --steps 20 --compare-materialised --out DIR   # GPU

The GPU run writes ``DIR/hf_distill.csv`` (long format: gpu, timestamp, versions, method, step,
metric, value: the loss curve, step time and peak memory, and the same step with the KL computed
by materialising both attentions, ``streamkl_ref.testing.attention_kl_torch``, or its
out-of-memory) and ``DIR/hf_distill.log``. The last line of output is machine-readable:
``initial_loss=... final_loss=... initial_kl=... final_kl=... kl_grad_norm=...``.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTN_NAME = "streamkl_capture"

# Llama configs (random weights). Student: the teacher's query heads, fewer KV heads, half the head dim.
# The random teacher is drawn wider than transformers' default (initializer_range 0.02) so that its
# attention is far from uniform: a pattern worth distilling into the (default-initialised) student.
TINY = dict(
    seq=16, batch=1, steps=8, lr=1e-2,
    teacher=dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=64, num_hidden_layers=2, vocab_size=64, initializer_range=0.3),
    student=dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=1, head_dim=4,
                 intermediate_size=32, num_hidden_layers=2, vocab_size=64))
FULL = dict(
    seq=8192, batch=1, steps=20, lr=3e-4,
    teacher=dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=5632, num_hidden_layers=8, vocab_size=32000, initializer_range=0.05),
    student=dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                 intermediate_size=2816, num_hidden_layers=8, vocab_size=32000))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="transformers Llama attention distillation with streamkl_gpu.attention_kl.")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="cuda (default when a GPU is present) or cpu (Triton interpreter: use --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs, 16 tokens, 8 steps: CPU in seconds")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 8192; --tiny 16)")
    ap.add_argument("--batch", type=int, help="sequences per step (default 1)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default 20; --tiny 8)")
    ap.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-4; --tiny 1e-2)")
    ap.add_argument("--kl-weight", type=float, default=1.0, help="weight of the attention KL term (default 1)")
    ap.add_argument("--layers", default=None,
                    help="teacher:student layer pairs, e.g. '0:0,2:1,4:2' (default: every layer to the same index)")
    ap.add_argument("--teacher", default=None, help="local teacher checkpoint directory (from_pretrained, no download)")
    ap.add_argument("--student", default=None, help="local student checkpoint directory (from_pretrained, no download)")
    ap.add_argument("--compare-materialised", action="store_true",
                    help="after training, time the same step with the KL materialised (or record its out-of-memory)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of the compared step (default 3)")
    ap.add_argument("--out", default=None, help="directory for hf_distill.csv and hf_distill.log")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else FULL
    for name in ("seq", "batch", "steps", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, cfg[name])
    args.teacher_config, args.student_config = cfg["teacher"], cfg["student"]
    return args


def layer_pairs(spec, n_teacher: int, n_student: int) -> list:
    """``[(teacher_layer, student_layer), ...]`` from ``'t:s,t:s'``; default every layer to itself."""
    if spec is None:
        if n_teacher != n_student:
            raise SystemExit(f"the teacher has {n_teacher} layers and the student {n_student}: pass --layers t:s,...")
        return [(i, i) for i in range(n_teacher)]
    pairs = []
    for item in spec.split(","):
        t, _, s = item.partition(":")
        try:
            pair = (int(t), int(s))
        except ValueError:
            raise SystemExit(f"--layers: {item!r} is not teacher:student (two layer indices)") from None
        if not (0 <= pair[0] < n_teacher and 0 <= pair[1] < n_student):
            raise SystemExit(f"--layers: {item!r} is out of range (teacher {n_teacher} layers, student {n_student})")
        pairs.append(pair)
    return pairs


class QKCapture:
    """An attention function for ``transformers.AttentionInterface``: records the post-RoPE
    ``(query [B, H, N, D], key [B, H_K, N, D], scaling)`` of the attention modules it watches,
    then returns what transformers' SDPA implementation returns for the same call."""

    def __init__(self, sdpa):
        self.sdpa = sdpa
        self.watched = {}  # attention module -> (role, layer index)
        self.records = {}  # (role, layer index) -> (query, key, scaling)

    def watch(self, model, role: str, layers) -> None:
        blocks = model.model.layers
        for i in layers:
            self.watched[blocks[i].self_attn] = (role, i)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        tag = self.watched.get(module)
        if tag is not None:
            if attention_mask is not None:
                raise ValueError("a padding or packed-sequence mask reached the capture: this example distils "
                                 "unpadded causal sequences (streamkl_gpu.attention_kl_varlen takes packed ones)")
            self.records[tag] = (query, key, scaling)
        return self.sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    def take(self, tag):
        return self.records.pop(tag)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import shutil
        args.device = "cuda" if shutil.which("nvidia-smi") else "cpu"
    if args.device == "cpu":
        # must be set before anything defines a Triton kernel, i.e. before importing streamkl_gpu
        os.environ["TRITON_INTERPRET"] = "1"

    import torch
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import streamkl_gpu
    from streamkl_gpu import attention_kl
    from streamkl_ref.testing import attention_kl_torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available (use --device cpu --tiny)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    # the interpreter's bf16 dot is wrong: fp32 on CPU; bf16 weights and activations on the GPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)

    log_file = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log_file = open(os.path.join(args.out, "hf_distill.log"), "w")

    def log(line):
        print(line, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    # transformers' extension point: our attention function, and SDPA's mask builder for its name
    capture = QKCapture(AttentionInterface()["sdpa"])
    AttentionInterface.register(ATTN_NAME, capture)
    AttentionMaskInterface.register(ATTN_NAME, AttentionMaskInterface()["sdpa"])

    def build(path, config):
        if path:  # local weights only: no download
            model = LlamaForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation=ATTN_NAME)
        else:
            cfg = LlamaConfig(max_position_embeddings=max(args.seq, 128), attn_implementation=ATTN_NAME, **config)
            model = LlamaForCausalLM(cfg)
        return model.to(dtype)

    teacher = build(args.teacher, args.teacher_config).to(device).eval().requires_grad_(False)
    student = build(args.student, args.student_config).to(device).train()
    tc, sc = teacher.config, student.config
    if tc.num_attention_heads != sc.num_attention_heads:
        raise SystemExit(f"attention_kl pairs query heads: teacher {tc.num_attention_heads}, student {sc.num_attention_heads}")
    if tc.vocab_size != sc.vocab_size:
        raise SystemExit(f"one tokenizer: the vocab sizes differ ({tc.vocab_size}, {sc.vocab_size})")
    pairs = layer_pairs(args.layers, tc.num_hidden_layers, sc.num_hidden_layers)
    capture.watch(teacher, "teacher", sorted({t for t, _ in pairs}))
    capture.watch(student, "student", sorted({s for _, s in pairs}))
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)

    def head_dim(c):
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    log(f"device={device.type} dtype={str(dtype).replace('torch.', '')} seq={args.seq} batch={args.batch} "
        f"pairs={pairs} kl_weight={args.kl_weight} transformers={transformers.__version__} torch={torch.__version__}")
    log(f"teacher: layers={tc.num_hidden_layers} heads={tc.num_attention_heads}/{tc.num_key_value_heads} "
        f"head_dim={head_dim(tc)}  student: layers={sc.num_hidden_layers} "
        f"heads={sc.num_attention_heads}/{sc.num_key_value_heads} head_dim={head_dim(sc)}")

    def streamed_kl(q1, k1, s1, q2, k2, s2):
        return attention_kl(q1, k1, q2, k2, causal=True, scale1=s1, scale2=s2)

    def materialised_kl(q1, k1, s1, q2, k2, s2):
        # both [B, H, N, N] attentions in fp32 (the dense PyTorch formula everyone writes)
        return attention_kl_torch(q1, k1, q2, k2, causal=True, scale1=s1, scale2=s2, compute_dtype=torch.float32)

    def losses(tokens, kl_fn=streamed_kl):
        with torch.no_grad():
            teacher(input_ids=tokens)
        lm = student(input_ids=tokens, labels=tokens).loss.float()
        kls = []
        for t, s in pairs:
            q1, k1, s1 = capture.take(("teacher", t))
            q2, k2, s2 = capture.take(("student", s))
            kls.append(kl_fn(q1, k1, s1, q2, k2, s2).mean())  # setting 1: q1, k1 carry no gradient
        kl = torch.stack(kls).mean()
        return lm, kl, lm + args.kl_weight * kl

    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(tc.vocab_size, (args.batch, args.seq), generator=gen).to(device)

    # the KL term's own gradient reaches the student's query and key projections
    lm, kl, _ = losses(tokens)
    qk_params = [p for _, s in pairs for p in (student.model.layers[s].self_attn.q_proj.weight,
                                                student.model.layers[s].self_attn.k_proj.weight)]
    kl_grad_norm = float(torch.linalg.vector_norm(torch.cat(
        [g.float().flatten() for g in torch.autograd.grad(kl, qk_params)])))
    initial_lm, initial_kl = float(lm.detach()), float(kl.detach())
    initial = initial_lm + args.kl_weight * initial_kl
    del lm, kl
    log(f"initial: lm={initial_lm:.6f} kl={initial_kl:.6f} loss={initial:.6f} kl_grad_norm={kl_grad_norm:.3e}")

    rows = []
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def record(method, step, metric, value):
        rows.append(dict(gpu=gpu, timestamp=stamp, torch=torch.__version__, triton=_triton_version(),
                         transformers=transformers.__version__, streamkl=streamkl_gpu.__version__,
                         seq=args.seq, batch=args.batch, method=method, step=step, metric=metric, value=value))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def peak_gib():
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")

    def train_step(kl_fn, update=True):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        start = time.perf_counter()
        lm, kl, loss = losses(tokens, kl_fn)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if update:
            opt.step()
        sync()
        return (float(lm.detach()), float(kl.detach()), float(loss.detach()), (time.perf_counter() - start) * 1e3,
                peak_gib())

    times = []
    for step in range(args.steps):
        lm, kl, loss, ms, peak = train_step(streamed_kl)
        if not math.isfinite(loss):
            log(f"step {step}: loss is {loss}")
            return 1
        times.append(ms)
        for metric, value in (("loss", loss), ("lm_loss", lm), ("kl", kl), ("step_ms", ms), ("peak_mem_gib", peak)):
            record("streamkl", step, metric, value)
        log(f"step {step:4d}  loss {loss:.6f}  lm {lm:.6f}  kl {kl:.6f}  {ms:9.1f} ms  peak {peak:.2f} GiB"
            if device.type == "cuda" else f"step {step:4d}  loss {loss:.6f}  lm {lm:.6f}  kl {kl:.6f}  {ms:9.1f} ms")

    with torch.no_grad():
        final_lm, final_kl, final = (float(x) for x in losses(tokens))
    log(f"final: lm={final_lm:.6f} kl={final_kl:.6f} loss={final:.6f}")
    if len(times) > 1:
        log(f"median step time after the first: {statistics.median(times[1:]):.1f} ms")

    if args.compare_materialised:  # the same step (no update) by each method, on the trained student
        for method, kl_fn in (("streamkl", streamed_kl), ("materialised", materialised_kl)):
            oom = None
            try:
                runs = [train_step(kl_fn, update=False) for _ in range(max(1, args.repeats))]
            except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:  # cuBLAS may report it as a RuntimeError
                if "out of memory" not in str(exc).lower() and "alloc" not in str(exc).lower():
                    raise
                oom = str(exc).splitlines()[0]
            if oom is not None:  # outside the handler: the failed step's tensors are released
                opt.zero_grad(set_to_none=True)
                capture.records.clear()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                record(method, "compare", "out_of_memory", 1)
                log(f"compare {method}: out of memory ({oom})")
                continue
            ms, peak = statistics.median(r[3] for r in runs), max(r[4] for r in runs)
            for metric, value in (("loss", runs[-1][2]), ("kl", runs[-1][1]), ("step_ms", ms), ("peak_mem_gib", peak)):
                record(method, "compare", metric, value)
            log(f"compare {method}: loss {runs[-1][2]:.6f} kl {runs[-1][1]:.6f} step {ms:.1f} ms (median of "
                f"{len(runs)})" + (f" peak {peak:.2f} GiB" if device.type == "cuda" else ""))

    if args.out:
        path = os.path.join(args.out, "hf_distill.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) + ["run_status"])
            writer.writeheader()
            writer.writerows(dict(row, run_status="ok") for row in rows)  # the run got to its end
        log(f"wrote {path}")
    log(f"initial_loss={initial:.6f} final_loss={final:.6f} initial_kl={initial_kl:.6f} final_kl={final_kl:.6f} "
        f"kl_grad_norm={kl_grad_norm:.6e}")
    return 0


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
