"""examples/hf_distill.py: transformers Llama distillation through AttentionInterface.

The --tiny run as a user runs it (a subprocess, TRITON_INTERPRET set by the script itself): the
loss and the attention KL fall, every logged value is finite, the KL term's gradient reaches the
student's projections, the CSV is written, and the same step with the KL materialised gives the
same loss. In process: the capture function leaves the model's
output as transformers' SDPA gives it and records the post-RoPE queries and keys.
"""
import csv
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "hf_distill.py")
LAST = re.compile(r"^initial_loss=(\S+) final_loss=(\S+) initial_kl=(\S+) final_kl=(\S+) kl_grad_norm=(\S+)$", re.M)


def test_tiny_run_distils(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the script must set it itself for the CPU
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--steps", "6", "--out", str(tmp_path),
                           "--compare-materialised", "--repeats", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = LAST.findall(proc.stdout)
    assert len(found) == 1, proc.stdout
    initial, final, initial_kl, final_kl, grad_norm = (float(x) for x in found[0])
    assert all(math.isfinite(v) for v in (initial, final, initial_kl, final_kl, grad_norm)), found
    assert final < 0.9 * initial, (initial, final)  # LM + KL on the trained batch
    assert 0.0 < final_kl < initial_kl, (initial_kl, final_kl)  # the student's attention moved towards the teacher's
    assert grad_norm > 1e-6, grad_norm  # d KL / d (student q_proj, k_proj) is not zero
    with open(tmp_path / "hf_distill.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["value"]) for r in rows if r["metric"] == "loss" and r["step"] != "compare"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert {r["gpu"] for r in rows} == {"cpu"} and all(r["transformers"] and r["torch"] for r in rows)
    # the same step with the KL materialised: the same loss (fp32 on CPU), a time for each method
    compared = {(r["method"], r["metric"]): float(r["value"]) for r in rows if r["step"] == "compare"}
    streamed, materialised = compared[("streamkl", "loss")], compared[("materialised", "loss")]
    assert abs(streamed - materialised) <= 1e-5 * abs(materialised), (streamed, materialised)
    assert abs(compared[("streamkl", "kl")] - compared[("materialised", "kl")]) <= 1e-5 * compared[("materialised", "kl")]
    assert compared[("streamkl", "step_ms")] > 0 and compared[("materialised", "step_ms")] > 0
    assert (tmp_path / "hf_distill.log").read_text().strip().splitlines()[-1] == proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("hf_distill_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_capture_delegates_to_sdpa_and_records_post_rope(example):
    from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    capture = example.QKCapture(AttentionInterface()["sdpa"])
    AttentionInterface.register(example.ATTN_NAME, capture)
    AttentionMaskInterface.register(example.ATTN_NAME, AttentionMaskInterface()["sdpa"])
    config = dict(example.TINY["student"], max_position_embeddings=64)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **config)).eval()
    captured = LlamaForCausalLM(LlamaConfig(attn_implementation=example.ATTN_NAME, **config)).eval()
    captured.load_state_dict(plain.state_dict())
    capture.watch(captured, "student", [1])
    seen = {}
    attn = captured.model.layers[1].self_attn
    attn.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs, x=args[0] if args else None),
                                   with_kwargs=True)
    tokens = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = plain(input_ids=tokens).logits
        got = captured(input_ids=tokens).logits
        query, key, scaling = capture.take(("student", 1))
        x = seen["x"] if seen["x"] is not None else seen["hidden_states"]
        cos, sin = seen["position_embeddings"]
        b, n = tokens.shape
        q = attn.q_proj(x).view(b, n, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, -1, attn.head_dim).transpose(1, 2)
        q_rope, k_rope = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(got, want)  # the attention output is SDPA's
    assert query.shape == (2, 4, 12, 4) and key.shape == (2, 1, 12, 4)  # [B, H, N, D], GQA keys
    assert torch.equal(query, q_rope) and torch.equal(key, k_rope) and not torch.equal(query, q)
    assert scaling == attn.scaling
    assert capture.records == {}  # only the watched layer was recorded (and taken)


def test_layer_pairs(example):
    assert example.layer_pairs(None, 3, 3) == [(0, 0), (1, 1), (2, 2)]
    assert example.layer_pairs("0:0,3:1", 4, 2) == [(0, 0), (3, 1)]
    for spec, n_t, n_s in ((None, 4, 2), ("4:0", 4, 2), ("a:b", 4, 2)):
        with pytest.raises(SystemExit):
            example.layer_pairs(spec, n_t, n_s)


def test_local_weights_flag(example, tmp_path, capsys):
    """--teacher / --student load local checkpoints (no download): the student's first LM loss
    is the saved model's own on the script's tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    paths = {}
    for role in ("teacher", "student"):
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=128, **example.TINY[role]))
        paths[role] = str(tmp_path / role)
        model.save_pretrained(paths[role])
    tokens = torch.randint(64, (1, 16), generator=torch.Generator().manual_seed(1))  # the script's --seed 0 batch
    with torch.no_grad():
        want = float(model(input_ids=tokens, labels=tokens).loss)
    code = example.main(["--device", "cpu", "--tiny", "--steps", "1", "--layers", "1:0",
                         "--teacher", paths["teacher"], "--student", paths["student"]])
    out = capsys.readouterr().out
    assert code == 0, out
    lm = float(re.search(r"^initial: lm=(\S+) ", out, re.M).group(1))
    assert abs(lm - want) < 1e-5, (lm, want)
    assert "pairs=[(1, 0)]" in out
