# Issue 3's whole device job in one process: trains the `demo` and `topo` Qwen3-MoE models on the carried corpus,
# exports demo (HF safetensors -> GGUF Q8_0/BF16 via tools/py/convert_hf_to_gguf.py), writes routing traces, the topo
# hidden-state sidecar and router weights, and packs everything into at most 8 returnable files under --out.
"""Train the demo and topo models and record their routing.

Usage (device):  python3 tools/train/train_models.py --out $OUT --budget-s 520
Usage (CPU dry run): python3 tools/train/train_models.py --smoke --out /tmp/smoke-out

Every phase is timed; training loops have a fixed step count that is lowered once, after a short calibration, so the
schedule fits the wall-clock budget, and a hard guard that stops early (recorded as stopped_early) if it still does
not. A failing phase is recorded in summary.json and later phases still run; the exit status is 1 if any failed.
"""
import argparse
import hashlib
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "train"))
sys.path.insert(0, str(REPO / "tools" / "data"))
import moe_model  # noqa: E402
import pstrace  # noqa: E402
import routing_capture as rc  # noqa: E402

T0 = time.time()
MiB = 1 << 20
PART_BYTES = 15 * MiB
RETURN_LIMIT_BYTES = 62 * MiB        # device returns at most 64 MiB; keep a margin for the log
HIDDEN_MAX_BYTES = 15_000_000
PROMPT_SOURCES = ("sharegpt", "mt-bench", "vicuna-bench", "gsm8k", "humaneval")

RUNS = {
    # steps: planned optimiser steps (lowered after calibration if the budget is short); batch x seq tokens per step.
    "full": {
        "demo": dict(spec="demo", steps=3000, batch=64, seq=512, lr=3e-3, warmup=100, aux=0.01, seed=1234,
                     eval_windows=2048),
        "topo": dict(spec="topo", steps=2000, batch=32, seq=512, lr=2e-3, warmup=100, aux=0.01, seed=4321,
                     eval_windows=512),
        "trace_budget": {
            "demo": {"test-split": 14336, "sharegpt": 3072, "mt-bench": 1024, "vicuna-bench": 1024,
                     "gsm8k": 2048, "humaneval": 2048},
            "topo": {"test-split": 32768, "sharegpt": 8192, "mt-bench": 2048, "vicuna-bench": 2048,
                     "gsm8k": 6144, "humaneval": 4096},
        },
        "trace_max_len": 512, "eval_windows": 2048, "zstd_level": 19,
        "demo_share": 0.45,          # demo training ends by this share of the budget
        "topo_reserve_s": 80,        # kept after topo training for its traces and the packing
    },
    "smoke": {
        "demo": dict(spec="demo-smoke", steps=30, batch=4, seq=64, lr=3e-3, warmup=5, aux=0.01, seed=1234,
                     eval_windows=16),
        "topo": dict(spec="topo-smoke", steps=30, batch=4, seq=64, lr=3e-3, warmup=5, aux=0.01, seed=4321,
                     eval_windows=16),
        "trace_budget": {
            "demo": {"test-split": 1024, "sharegpt": 128, "mt-bench": 64, "vicuna-bench": 64, "gsm8k": 128,
                     "humaneval": 128},
            "topo": {"test-split": 2048, "sharegpt": 256, "mt-bench": 64, "vicuna-bench": 64, "gsm8k": 256,
                     "humaneval": 256},
        },
        "trace_max_len": 128, "eval_windows": 16, "zstd_level": 19, "max_docs": 300,
        "demo_share": 0.40, "topo_reserve_s": 40,
    },
}


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Phases:
    """Runs named phases, recording duration and failure without stopping the job."""

    def __init__(self, summary):
        self.summary = summary
        summary.setdefault("phases", {})
        summary.setdefault("errors", {})

    def run(self, name, fn, *a, **kw):
        t = time.time()
        log(f"phase {name} ...")
        try:
            out = fn(*a, **kw)
            ok = True
        except Exception as e:  # a failed phase must not lose the other phases' outputs
            out = None
            ok = False
            self.summary["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"phase {name} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
        self.summary["phases"][name] = {"seconds": round(time.time() - t, 2), "ok": ok}
        log(f"phase {name} done in {time.time() - t:.1f}s ({'ok' if ok else 'failed'})")
        return out


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- data


def load_carry(carry):
    """Reads .carry/manifest.json, checks every file's sha256, and returns (splits {name: [doc]}, prompts [dict])."""
    carry = Path(carry)
    mpath = carry / "manifest.json"
    if not mpath.exists():
        raise SystemExit(f"{mpath} not found: run python3 tools/data/prepare_carry.py here and carry .carry")
    manifest = json.loads(mpath.read_text())
    for name, meta in manifest["files"].items():
        p = carry / name
        if not p.exists() or sha256_file(p) != meta["sha256"]:
            raise SystemExit(f"{p}: missing or sha256 differs from {mpath}")

    def read_jsonl_xz(name):
        with lzma.open(carry / name, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    splits = {s: read_jsonl_xz(f"corpus/{s}.jsonl.xz") for s in ("train", "validation", "test")}
    prompts = read_jsonl_xz("trace_prompts.jsonl.xz")
    return splits, prompts, manifest


def tokenize_stream(tok, docs, eos_id):
    """Token ids of the documents, each followed by <|endoftext|>, as one uint16 array."""
    encs = tok.encode_batch([d["text"] for d in docs])
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, dtype=np.uint16))
        parts.append(np.asarray([eos_id], dtype=np.uint16))
    return np.concatenate(parts)


def unigram_log_probs(train_tokens, vocab):
    """Add-one smoothed unigram log-probabilities from the train stream (float64 [vocab])."""
    counts = np.bincount(train_tokens, minlength=vocab).astype(np.float64) + 1.0
    return np.log(counts / counts.sum())


def eval_windows(tokens, seq, n_windows):
    """Up to n_windows non-overlapping windows of seq+1 tokens from the start of a stream, as int64 [n, seq+1]."""
    n = min(n_windows, (len(tokens) - 1) // seq)
    return np.stack([tokens[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int64)


# ---------------------------------------------------------------- training


def lr_at(step, total, peak, warmup):
    """Linear warm-up then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def autocast_for(device, enabled=True):
    """bf16 autocast on CUDA (training, quick probes); a disabled context elsewhere or when not enabled."""
    if device.type == "cuda" and enabled:
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return torch.autocast(device_type=device.type, enabled=False)


@torch.no_grad()
def evaluate(model, windows, device, batch, unigram_lp=None, fp32=True):
    """Mean next-token cross-entropy (nats) of the model over all predicted positions of `windows` (fp32 unless
    fp32=False); with unigram_lp also the unigram baseline's on the same positions. Returns a dict."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = torch.from_numpy(windows[i:i + batch]).to(device)
        with autocast_for(device, enabled=not fp32):
            logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        n += w[:, 1:].numel()
    out = {"tokens": n, "ce_nats": total / n, "ppl": math.exp(total / n)}
    if unigram_lp is not None:
        uni = -unigram_lp[windows[:, 1:]].mean()
        out.update({"unigram_ce_nats": float(uni), "unigram_ppl": float(math.exp(uni))})
    model.train()
    return out


def train_step(model, opt, x, vocab, aux_coef, device, balance="hf", seq_aux_coef=0.0):
    """One optimiser step on token windows x [B, T+1]; returns (loss, ce, aux, grad_norm) as device tensors.
    balance: "hf" (transformers' load-balancing loss, layers pooled) or "per-layer" (moe_model.per_layer_balance_loss
    over the batch); seq_aux_coef > 0 adds the same loss taken per window (sequence-wise balance)."""
    with autocast_for(device):
        out = model(input_ids=x[:, :-1], use_cache=False, output_router_logits=True)
    ce = F.cross_entropy(out.logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
    k = model.config.num_experts_per_tok
    if balance == "per-layer":
        aux = moe_model.per_layer_balance_loss(out.router_logits, k)
    else:
        aux = out.aux_loss.float() if out.aux_loss is not None else torch.zeros((), device=device)
    loss = ce + aux_coef * aux
    if seq_aux_coef > 0:
        loss = loss + seq_aux_coef * moe_model.per_layer_balance_loss(out.router_logits, k, x.shape[1] - 1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, ce, aux, gnorm


def train_model(run, train_tokens, val_windows, vocab, eos_id, device, deadline, experts_impl, unigram_lp):
    """Trains one model; returns (model, record) with the loss curve, step counts and timing."""
    model = moe_model.build_model(run["spec"], vocab, eos_id, run["aux"], device, run["seed"], experts_impl,
                                  run.get("overrides"))
    balance, seq_aux = run.get("balance", "hf"), run.get("seq_aux", 0.0)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=run["lr"], betas=(0.9, 0.95), eps=1e-8, **fused)
    rng = np.random.default_rng(run["seed"])
    batch, seq = run["batch"], run["seq"]
    planned = total_steps = run["steps"]
    curve, val_curve = [], []
    rec = {"spec": run["spec"], "config": json.loads(model.config.to_json_string()), "params": n_params,
           "planned_steps": planned, "batch": batch, "seq": seq, "lr": run["lr"], "warmup": run["warmup"],
           "router_aux_loss_coef": run["aux"], "balance": balance, "seq_aux_coef": seq_aux, "seed": run["seed"],
           "experts_implementation": experts_impl,
           "optimizer": "AdamW(0.9, 0.95), wd 0.1 on matrices, clip 1.0, warm-up then cosine to 10%"}
    calib = (10, 30) if planned >= 200 else (2, 4)
    t_start = time.time()
    t_calib = None
    stopped_early = False
    log_every = max(1, min(25, planned // 20))
    val_every = max(1, total_steps // 5)
    val_probe = val_windows[:min(len(val_windows), 4 * batch)]
    step = 0
    while step < total_steps:
        if time.time() > deadline:
            stopped_early = True
            break
        lr = lr_at(step, total_steps, run["lr"], run["warmup"])
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train_tokens) - seq - 1, size=batch)
        x = torch.from_numpy(np.stack([train_tokens[s:s + seq + 1] for s in starts]).astype(np.int64))
        x = x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x
        try:
            loss, ce, aux, gnorm = train_step(model, opt, x, vocab, run["aux"], device, balance, seq_aux)
        except RuntimeError as e:
            # The grouped kernel passed its self-test; should the full model still trip it, the looped path
            # (same arithmetic) takes over rather than losing the run. Only the first step may do this.
            if step > 0 or not moe_model.grouped_enabled():
                raise
            log(f"{run['spec']}: first step failed on the grouped expert path ({e}); retrying with the looped path")
            rec["grouped_path_failed"] = f"{type(e).__name__}: {e}"
            moe_model.set_grouped_enabled(False)
            opt.zero_grad(set_to_none=True)
            loss, ce, aux, gnorm = train_step(model, opt, x, vocab, run["aux"], device, balance, seq_aux)
        step += 1
        if step == calib[0]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if step == calib[1] and t_calib is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = (time.time() - t_calib) / (calib[1] - calib[0])
            fit = int((deadline - time.time() - 10.0) / step_s) + step
            rec["calibrated_step_s"] = step_s
            if fit < total_steps:
                total_steps = max(step + 1, fit)
                val_every = max(1, total_steps // 5)
                log(f"{run['spec']}: {step_s * 1e3:.1f} ms/step; steps lowered {planned} -> {total_steps}")
            else:
                log(f"{run['spec']}: {step_s * 1e3:.1f} ms/step; {planned} steps fit the budget")
        if step % log_every == 0 or step == total_steps:
            row = {"step": step, "loss": loss.item(), "ce": ce.item(), "aux": aux.item(), "grad_norm": gnorm.item(),
                   "lr": lr, "elapsed_s": round(time.time() - t_start, 2), "tokens": step * batch * seq}
            curve.append(row)
            if step % (log_every * 8) == 0 or step == total_steps:
                log(f"{run['spec']} step {step}/{total_steps} ce {row['ce']:.3f} aux {row['aux']:.3f} "
                    f"lr {lr:.2e} {row['tokens'] / max(row['elapsed_s'], 1e-9) / 1e3:.0f} ktok/s")
        if step % val_every == 0 and step < total_steps:
            v = evaluate(model, val_probe, device, batch, fp32=False)
            val_curve.append({"step": step, "ce_nats": v["ce_nats"]})
    train_s = time.time() - t_start
    rec.update({"steps_done": step, "steps_scheduled": total_steps, "stopped_early": stopped_early,
                "train_seconds": round(train_s, 1), "tokens_seen": step * batch * seq,
                "tokens_per_s": step * batch * seq / max(train_s, 1e-9), "loss_curve": curve,
                "val_probe_curve": val_curve})
    rec["validation"] = evaluate(model, val_windows[:run["eval_windows"]], device, batch, unigram_lp)
    log(f"{run['spec']}: {step} steps in {train_s:.0f}s, validation ppl {rec['validation']['ppl']:.2f} "
        f"(unigram {rec['validation']['unigram_ppl']:.1f})")
    return model, rec


# ---------------------------------------------------------------- export and conversion


def export_hf(model, tokenizer_dir, out_dir):
    """save_pretrained (fp32 safetensors, per-expert tensor names as in Qwen3-30B-A3B checkpoints) plus tokenizer
    files; config.json also gets num_experts and rope_theta, the keys llama.cpp-style converters read."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("num_experts", model.config.num_experts)
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", moe_model.ROPE_THETA))
    cfg.setdefault("torch_dtype", "float32")
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    return out_dir


@torch.no_grad()
def check_reload(model, hf_dir, device, tokens):
    """Reloads the exported directory with Qwen3MoeForCausalLM.from_pretrained and compares logits (fp32)."""
    from transformers import Qwen3MoeForCausalLM
    m2 = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    model.eval()
    x = torch.as_tensor(np.asarray(tokens[:256], dtype=np.int64)).unsqueeze(0).to(device)
    a = model(input_ids=x, use_cache=False).logits.float()
    b = m2(input_ids=x, use_cache=False).logits.float()
    diff = float((a - b).abs().max())
    del m2
    if diff > 1e-3:
        raise RuntimeError(f"reloaded {hf_dir} gives logits {diff:.3g} away from the trained model")
    return {"max_abs_logit_diff": diff}


def convert_gguf_both(hf_dir, q8_file, bf16_file):
    """Runs tools/py/convert_hf_to_gguf.py (the project's converter) for Q8_0 and BF16 at the same time; returns
    {outtype: {file, bytes, seconds, sha256} or {"error": ...}}."""
    conv = REPO / "tools" / "py" / "convert_hf_to_gguf.py"
    if not conv.exists():
        raise RuntimeError(f"{conv} not found")
    t = time.time()
    procs = {o: (f, subprocess.Popen([sys.executable, str(conv), str(hf_dir), "--outtype", o, "--outfile", str(f)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for o, f in (("q8_0", q8_file), ("bf16", bf16_file))}
    out = {}
    for o, (f, p) in procs.items():
        try:
            text, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            text = "timed out after 240 s"
        if p.returncode != 0 or not Path(f).exists():
            out[o] = {"error": f"convert_hf_to_gguf.py --outtype {o} exited {p.returncode}: {text.strip()[-600:]}"}
            log(out[o]["error"])
            continue
        out[o] = {"file": Path(f).name, "bytes": Path(f).stat().st_size, "seconds": round(time.time() - t, 1),
                  "sha256": sha256_file(f)}
    if all("error" in v for v in out.values()):
        raise RuntimeError("; ".join(v["error"] for v in out.values()))
    return {o: (v if "error" not in v else None) for o, v in out.items()} | {
        f"{o}_error": v["error"] for o, v in out.items() if "error" in v}


def inspect_gguf(path, cfg):
    """Reads a GGUF back with the gguf package and checks the MoE metadata against the training config."""
    import gguf
    r = gguf.GGUFReader(str(path))

    def field(key):
        f = r.fields.get(key)
        if f is None:
            return None
        v = f.parts[f.data[0]]
        return bytes(v).decode("utf-8") if f.types and f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]

    arch = field("general.architecture")
    got = {"architecture": arch, "block_count": field(f"{arch}.block_count"),
           "expert_count": field(f"{arch}.expert_count"), "expert_used_count": field(f"{arch}.expert_used_count"),
           "tokenizer_pre": field("tokenizer.ggml.pre"), "tokenizer_model": field("tokenizer.ggml.model"),
           "n_tensors": len(r.tensors), "tensor_types": sorted({t.tensor_type.name for t in r.tensors})}
    want = {"architecture": "qwen3moe", "block_count": cfg.num_hidden_layers, "expert_count": cfg.num_experts,
            "expert_used_count": cfg.num_experts_per_tok, "tokenizer_pre": "qwen2", "tokenizer_model": "gpt2"}
    bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    if bad:
        raise RuntimeError(f"{path}: metadata (got, expected): {bad}")
    return got


@torch.no_grad()
def check_gguf_with_hf(model, gguf_path, device, tokens, n_greedy):
    """Loads the GGUF with transformers' own GGUF reader (an implementation independent of our converter; the
    config is passed because transformers does not map expert_feed_forward_length) and compares fp32 logits on
    256 test tokens and n_greedy greedy tokens with the trained model."""
    from transformers import Qwen3MoeForCausalLM
    g = Qwen3MoeForCausalLM.from_pretrained(str(Path(gguf_path).parent), gguf_file=str(gguf_path),
                                            config=model.config, dtype=torch.float32).to(device).eval()
    g.set_experts_implementation(moe_model.EXPERTS_IMPL)
    model.eval()
    x = torch.as_tensor(np.asarray(tokens[:256], dtype=np.int64)).unsqueeze(0).to(device)
    a = model(input_ids=x, use_cache=False).logits.float()
    b = g(input_ids=x, use_cache=False).logits.float()
    prompt = x[:, :32]
    ya = model.generate(input_ids=prompt, max_new_tokens=n_greedy, do_sample=False, pad_token_id=0)
    yb = g.generate(input_ids=prompt, max_new_tokens=n_greedy, do_sample=False, pad_token_id=0)
    same = int((ya[0, 32:] == yb[0, 32:]).cumprod(0).sum())
    del g
    return {"max_abs_logit_diff": float((a - b).abs().max()), "logit_scale": float(a.abs().max()),
            "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "greedy_prefix_agreement": f"{same}/{n_greedy}"}


@torch.no_grad()
def greedy_samples(model, tok, docs, device, n_new):
    """Greedy continuations (fp32, no sampling) of the first 32 tokens of held-out test documents."""
    model.eval()
    out = []
    for d in docs:
        prompt = tok.encode(d["text"]).ids[:32]
        x = torch.tensor([prompt], device=device)
        y = model.generate(input_ids=x, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        out.append({"doc": d["id"], "prompt": tok.decode(prompt), "continuation": tok.decode(y[0, len(prompt):].tolist())})
    return out


# ---------------------------------------------------------------- traces


def trace_candidates(test_docs, prompts):
    """Candidate sequences: test-split documents round-robin across their corpus sources, then the real prompts."""
    test = rc.round_robin_by_source(test_docs, lambda d: d["source"])
    cands = [{"name": d["id"], "source": "test-split", "text": d["text"]} for d in test]
    return cands + prompts


def make_traces(model, model_name, tok, candidates, budget, max_len, device, outdir, level, pad_id, created_by):
    """Writes MODEL-test.pstrace (test-split sequences) and MODEL-prompts.pstrace (real prompts); returns sizes."""
    info = {}
    seqs = rc.select_sequences(tok, candidates, budget, max_len)
    groups = {"test": [s for s in seqs if s["source"] == "test-split"],
              "prompts": [s for s in seqs if s["source"] != "test-split"]}
    threads = min(16, os.cpu_count() or 1)
    for group, gseqs in groups.items():
        if not gseqs:
            continue
        ids, w, _ = rc.route_sequences(model, [s["tokens"] for s in gseqs], pad_id, device)
        path = Path(outdir) / f"{model_name}-{group}.pstrace"
        nbytes = rc.write_trace_file(path, model, model_name, gseqs, ids, w, created_by, level, threads)
        t = pstrace.read_trace(path)
        srcs = {}
        for s in gseqs:
            srcs[s["source"]] = srcs.get(s["source"], 0) + len(s["tokens"])
        raw = int(len(t.token_ids)) * (4 + 2 * t.n_layer * t.top_k)
        info[path.name] = {"bytes": nbytes, "tokens": int(len(t.token_ids)), "sequences": len(gseqs),
                           "tokens_by_source": srcs, "raw_bytes": raw, "compression_ratio": round(nbytes / raw, 4)}
        log(f"{path.name}: {len(t.token_ids)} tokens, {nbytes / MiB:.2f} MiB (ratio {nbytes / raw:.3f})")
    return info


def write_hidden_within(trace_path, seqs, inputs, budget_bytes, level, threads):
    """Writes NAME.hidden.zst for as many whole leading sequences as fit budget_bytes compressed (ratio measured on
    the first sequence, then shrunk until it fits)."""
    hpath = trace_path.with_name(trace_path.name.replace(".pstrace", ".hidden.zst"))
    per_tok = [inputs[i].shape[0] for i in range(len(seqs))]
    n_seq = len(seqs)
    probe = pstrace.write_hidden(hpath, trace_name=trace_path.name, token_ranges=[[0, 0, per_tok[0]]],
                                 hidden=inputs[0], level=level, threads=threads)
    bytes_per_tok = probe / per_tok[0]
    cum = np.cumsum(per_tok)
    n_seq = max(1, int(np.searchsorted(cum, budget_bytes / bytes_per_tok * 0.97, side="right")))
    while True:
        ranges = [[i, 0, per_tok[i]] for i in range(n_seq)]
        nbytes = pstrace.write_hidden(hpath, trace_name=trace_path.name, token_ranges=ranges,
                                      hidden=np.concatenate([inputs[i] for i in range(n_seq)]), level=level,
                                      threads=threads)
        if nbytes <= budget_bytes or n_seq == 1:
            break
        n_seq = max(1, int(n_seq * 0.9))
    h = pstrace.read_hidden(hpath, trace=pstrace.read_trace(trace_path))
    log(f"{hpath.name}: {h.header['n_tokens']} tokens in {n_seq} sequences, {nbytes / MiB:.2f} MiB")
    return {hpath.name: {"bytes": nbytes, "tokens": int(h.header["n_tokens"]), "sequences": n_seq,
                         "dim": int(h.header["dim"])}}


def save_routers(model, path):
    """Router (mlp.gate) and post-attention RMSNorm weights of every layer, fp32 safetensors: what a Fate-style
    predictor needs to apply layer l+1's router to layer l's hidden state."""
    from safetensors.torch import save_file
    tensors = {}
    for i, layer in enumerate(model.model.layers):
        tensors[f"layers.{i}.mlp.gate.weight"] = layer.mlp.gate.weight.detach().float().cpu().contiguous()
        tensors[f"layers.{i}.post_attention_layernorm.weight"] = \
            layer.post_attention_layernorm.weight.detach().float().cpu().contiguous()
    save_file(tensors, str(path), metadata={"config": model.config.to_json_string()})
    return {"bytes": Path(path).stat().st_size}


# ---------------------------------------------------------------- packing


def fresh_stage(out, work):
    """Creates the output folder `out`, empties the work folder `work` and returns `work/stage` with an empty
    `traces/` folder in it (Paths): where a device job assembles what pack_outputs sends back."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(work)
    if work.exists():
        shutil.rmtree(work)
    stage = work / "stage"
    (stage / "traces").mkdir(parents=True)
    return out, stage


def pack_outputs(stage, out, items, summary):
    """Tars `items` ([(path_in_tar, file)], in priority order; later ones are left out if the return budget is
    exceeded) into OUT/results.tar.part-NN pieces of at most 15 MiB and records their checksums."""
    tar_path = stage / "results.tar"
    used = 0
    kept, dropped = [], []
    for arc, f in items:
        size = Path(f).stat().st_size
        if used + size + 4096 > RETURN_LIMIT_BYTES:
            dropped.append(arc)
            continue
        used += size + 1024
        kept.append((arc, f))
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tf:
        for arc, f in kept:
            info = tf.gettarinfo(str(f), arcname=arc)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(f, "rb") as fh:
                tf.addfile(info, fh)
    parts = []
    with open(tar_path, "rb") as fh:
        i = 0
        while True:
            block = fh.read(PART_BYTES)
            if not block:
                break
            p = Path(out) / f"results.tar.part-{i:02d}"
            p.write_bytes(block)
            parts.append({"file": p.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            i += 1
    summary["package"] = {"tar_bytes": tar_path.stat().st_size, "tar_sha256": sha256_file(tar_path), "parts": parts,
                          "contents": {arc: {"bytes": Path(f).stat().st_size, "sha256": sha256_file(f)}
                                       for arc, f in kept},
                          "left_out_for_size": dropped}
    if len(parts) > 6:
        raise RuntimeError(f"{len(parts)} parts: more than the 6 the return limit leaves room for")


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder whose files come back (flat; at most 8 files)")
    ap.add_argument("--carry", default=str(REPO / ".carry"))
    ap.add_argument("--work", default="/tmp/prescope-train")
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall-clock budget in seconds, counted from "
                    "--start-time")
    ap.add_argument("--start-time", type=float, default=None, help="epoch seconds the budget counts from "
                    "(default: this process's start); the device script passes the time it started")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and steps, CPU allowed (dry run)")
    ap.add_argument("--skip-topo", action="store_true")
    args = ap.parse_args()

    global T0
    if args.start_time:
        T0 = min(T0, args.start_time)
    cfg = RUNS["smoke" if args.smoke else "full"]
    deadline_all = T0 + args.budget_s
    out, stage = fresh_stage(args.out, args.work)
    work = stage.parent
    summary = {"mode": "smoke" if args.smoke else "full", "budget_s": args.budget_s,
               "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])}
    ph = Phases(summary)

    summary["environment"] = moe_model.check_environment(require_cuda=not args.smoke)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Training runs under bf16 autocast; fp32 work (evaluation, traces, checks) stays true fp32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    log(f"environment: {summary['environment']}")
    moe_model.register_experts_impl()
    st = moe_model.self_test_experts(device)
    summary["experts_self_test"] = st
    experts_impl = moe_model.EXPERTS_IMPL
    moe_model.set_grouped_enabled(st["ok"])
    summary["experts_path_in_training"] = "grouped bf16" if st["ok"] and device.type == "cuda" else "looped"
    log(f"experts self-test {st}; training uses the {summary['experts_path_in_training']} path")

    from tokenizers import Tokenizer
    tok_dir = REPO / "tools" / "data" / "tokenizer"
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|endoftext|>")

    t = time.time()
    splits, prompts, carry_manifest = load_carry(args.carry)
    if "max_docs" in cfg:  # dry run: a slice of each split keeps CPU tokenisation short
        splits = {s: docs[:cfg["max_docs"]] for s, docs in splits.items()}
    data = {s: tokenize_stream(tok, docs, eos_id) for s, docs in splits.items()}
    unigram_lp = unigram_log_probs(data["train"], vocab)
    summary["data"] = {s: {"docs": len(splits[s]), "tokens": int(len(data[s]))} for s in data}
    summary["data"]["tokenize_seconds"] = round(time.time() - t, 1)
    summary["data"]["corpus_sha256"] = {k: v["sha256"] for k, v in carry_manifest["files"].items()}
    log(f"tokens: { {s: len(v) for s, v in data.items()} } in {time.time() - t:.1f}s")
    val_windows = eval_windows(data["validation"], cfg["demo"]["seq"], cfg["eval_windows"])
    candidates = trace_candidates(splits["test"], prompts)
    created = "tools/train/train_models.py" + (" --smoke" if args.smoke else "")
    items = []  # (path in tar, file) in packing priority order

    # ---- demo
    budget_left = deadline_all - time.time()
    demo_deadline = T0 + args.budget_s * cfg["demo_share"]
    log(f"demo training until t={demo_deadline - T0:.0f}s ({budget_left:.0f}s of budget left)")
    res = ph.run("train_demo", train_model, cfg["demo"], data["train"], val_windows, vocab, eos_id, device,
                 demo_deadline, experts_impl, unigram_lp)
    demo, demo_rec = res if res else (None, None)
    if demo is not None:
        rec_path = stage / "train-demo.json"
        rec_path.write_text(json.dumps(demo_rec, indent=1) + "\n")
        items.append(("docs/data/train-demo.json", rec_path))
        summary["demo"] = {k: v for k, v in demo_rec.items() if k not in ("loss_curve", "val_probe_curve", "config")}
        hf_dir = ph.run("export_demo", export_hf, demo, tok_dir, work / "hf-demo")
        if hf_dir:
            summary["demo"]["reload_check"] = ph.run("reload_demo", check_reload, demo, hf_dir, device, data["test"])
            for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                if (hf_dir / name).exists():
                    items.append((f"models/demo/{name}", hf_dir / name))
            conv = ph.run("gguf_convert", convert_gguf_both, hf_dir, stage / "demo-q8_0.gguf",
                          work / "demo-bf16.gguf") or {}
            q8, bf16 = conv.get("q8_0"), conv.get("bf16")
            summary["demo"]["gguf"] = dict(conv)
            n_greedy = 16 if args.smoke else 64
            if bf16:
                summary["demo"]["gguf"]["bf16_hf_check"] = ph.run(
                    "hf_check_bf16", check_gguf_with_hf, demo, work / "demo-bf16.gguf", device, data["test"], n_greedy)
            if q8:
                summary["demo"]["gguf"]["q8_0_metadata"] = ph.run("inspect_q8_0", inspect_gguf,
                                                                   stage / "demo-q8_0.gguf", demo.config)
                summary["demo"]["gguf"]["q8_0_hf_check"] = ph.run(
                    "hf_check_q8_0", check_gguf_with_hf, demo, stage / "demo-q8_0.gguf", device, data["test"],
                    n_greedy)
                items.append(("models/demo/demo-q8_0.gguf", stage / "demo-q8_0.gguf"))
            else:
                # Without a GGUF the weights still come back, as bf16 safetensors, for a conversion here.
                demo.to(torch.bfloat16).save_pretrained(work / "hf-demo-bf16", safe_serialization=True)
                demo.float()
                for f in sorted((work / "hf-demo-bf16").glob("*.safetensors")):
                    items.append((f"models/demo/hf-bf16/{f.name}", f))
        test_docs = [d for d in rc.round_robin_by_source(splits["test"], lambda d: d["source"])
                     if d["source"] in ("debian-handbook", "python3.11-doc", "bible-kjv", "linux-doc")][:4]
        summary["demo"]["greedy_samples"] = ph.run("samples_demo", greedy_samples, demo, tok, test_docs, device,
                                                   16 if args.smoke else 64)
        tr = ph.run("traces_demo", make_traces, demo, "demo", tok, candidates, cfg["trace_budget"]["demo"],
                    cfg["trace_max_len"], device, stage / "traces", cfg["zstd_level"], eos_id, created)
        if tr:
            summary["demo"]["traces"] = tr
        del demo
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- topo
    if not args.skip_topo:
        topo_deadline = deadline_all - cfg["topo_reserve_s"]
        log(f"topo training until t={topo_deadline - T0:.0f}s")
        res = ph.run("train_topo", train_model, cfg["topo"], data["train"], val_windows, vocab, eos_id, device,
                     topo_deadline, experts_impl, unigram_lp)
        topo, topo_rec = res if res else (None, None)
        if topo is not None:
            rec_path = stage / "train-topo.json"
            rec_path.write_text(json.dumps(topo_rec, indent=1) + "\n")
            items.append(("docs/data/train-topo.json", rec_path))
            summary["topo"] = {k: v for k, v in topo_rec.items() if k not in ("loss_curve", "val_probe_curve", "config")}
            (stage / "topo-config.json").write_text(topo.config.to_json_string())
            items.append(("traces/topo-config.json", stage / "topo-config.json"))
            r = ph.run("routers_topo", save_routers, topo, stage / "traces" / "topo-routers.safetensors")
            if r:
                items.append(("traces/topo-routers.safetensors", stage / "traces" / "topo-routers.safetensors"))
            # Everything else that goes back is written by now except the topo traces; the sidecar gets what is left
            # once those are counted at their measured size.
            fixed = sum(Path(f).stat().st_size for _, f in items) + sum(
                (stage / "traces" / n).stat().st_size for n in summary.get("demo", {}).get("traces", {}))
            tr = ph.run("traces_topo", make_traces, topo, "topo", tok, candidates, cfg["trace_budget"]["topo"],
                        cfg["trace_max_len"], device, stage / "traces", cfg["zstd_level"], eos_id, created)
            if tr:
                summary["topo"]["traces"] = tr
                used = fixed + sum(v["bytes"] for v in tr.values())
                hidden_budget = min(HIDDEN_MAX_BYTES, RETURN_LIMIT_BYTES - used - 2 * MiB)
                summary["topo"]["hidden_budget_bytes"] = hidden_budget
                if hidden_budget > 256 * 1024:
                    h = ph.run("hidden_topo", hidden_sidecar, topo, tok, candidates, cfg, device, stage / "traces",
                               eos_id, hidden_budget)
                    if h:
                        summary["topo"]["traces"].update(h)
            del topo

    for name in ("demo-test.pstrace", "demo-prompts.pstrace", "topo-test.pstrace", "topo-prompts.pstrace",
                 "topo-test.hidden.zst"):
        if (stage / "traces" / name).exists():
            items.append((f"traces/{name}", stage / "traces" / name))
    summary["elapsed_s_before_packing"] = round(time.time() - T0, 1)
    ph.run("pack", pack_outputs, stage, out, items, summary)
    summary["elapsed_s"] = round(time.time() - T0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    log(f"done in {time.time() - T0:.0f}s; errors: {summary['errors'] or 'none'}")
    return 1 if summary["errors"] else 0


def hidden_sidecar(model, tok, candidates, cfg, device, outdir, pad_id, budget):
    """Re-routes the leading topo test sequences keeping router inputs and writes topo-test.hidden.zst."""
    seqs = rc.select_sequences(tok, candidates, {"test-split": cfg["trace_budget"]["topo"]["test-split"]},
                               cfg["trace_max_len"])
    # Enough sequences for the budget at the raw size (compression only makes it smaller).
    per_tok = model.config.num_hidden_layers * (4 + model.config.hidden_size)
    need, n = 0, 0
    while n < len(seqs) and need < budget / per_tok * 1.3:
        need += len(seqs[n]["tokens"])
        n += 1
    seqs = seqs[:n]
    _, _, inputs = rc.route_sequences(model, [s["tokens"] for s in seqs], pad_id, device,
                                      keep_inputs_for=range(len(seqs)))
    threads = min(16, os.cpu_count() or 1)
    # int8 router inputs barely compress (ratio ~0.96 at any level): a fast level saves device time.
    return write_hidden_within(Path(outdir) / "topo-test.pstrace", seqs, inputs, budget, 6, threads)


if __name__ == "__main__":
    sys.exit(main())
