# Issue 9's training job: MoE models whose routing looks like that of real trained MoE models (per-layer load
# balancing), measured against the realism targets, and their routing traces, router-input sidecars and routers.
"""Balanced routing models.

  probe   trains one (usually reduced-depth) model on the CPU or GPU and appends its realism statistics on held-out
          test-split routing, its validation perplexity and its recipe to a JSON list: how recipes are compared.
  full    the device job: trains topo-b (Qwen3-30B-A3B's 48 x 128 top-8 topology) and topo-mixtral (Mixtral-8x7B's
          32 x 8 top-2) with the recipe of docs/decisions/0090-balanced-routing.md, writes traces (test split, real
          prompts, and real prompts continued by the model itself) and router weights, packs them for the return
          (at most 8 files under --out), and keeps each model and its test-split sequences in --keep. --models
          picks which: topo-v2lite (DeepSeek-V2-Lite's 26 MoE layers x 64, top-6; decision 0135) is trained alone,
          by scripts/device/train_v2lite.sh.
  sidecar the router-input sidecar of a kept model's test-split trace, from sequence --first-seq on, as much as one
          return holds (a 20k-token sidecar of topo-b is about 100 MB: several calls on the warm machine).
  merge-sidecars  here, afterwards: joins the returned parts into NAME-test.hidden.zst.

Usage:
  python3 tools/train/train_balanced.py probe --spec topo-b --layers 8 --hidden 64 --balance per-layer --aux 0.01 \\
      --steps 300 --json docs/data/balance-probe.json
  python3 tools/train/train_balanced.py full --out $OUT --budget-s 540          (device; --smoke: tiny CPU dry run)
  python3 tools/train/train_balanced.py full --models topo-v2lite --out $OUT --budget-s 400           (device)
  python3 tools/train/train_balanced.py sidecar --model topo-b --first-seq 0 --out $OUT          (device, warm)
  python3 tools/train/train_balanced.py merge-sidecars traces/topo-b-test.pstrace PART... --out traces/topo-b-test.hidden.zst

Both read the corpus and prompts from .carry/ (python3 tools/data/prepare_carry.py) and the 8192-token tokenizer in
tools/data/tokenizer/. Every number written says which command produced it.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "train"))
sys.path.insert(0, str(REPO / "tools" / "data"))
import moe_model  # noqa: E402
import pstrace  # noqa: E402
import routing_capture as rc  # noqa: E402
import routing_stats as rs  # noqa: E402
import train_models as tm  # noqa: E402

MiB = 1 << 20
# The device job's plan per model: training run, trace token budgets by source, and decoded continuations of real
# prompts (count x new tokens). The budget split gives each model its share of the
# wall clock after the shared set-up.
FULL = {
    "topo-b": dict(run=dict(spec="topo-b", steps=3000, batch=64, seq=512, lr=2e-3, warmup=100, aux=0.01,
                            balance="per-layer", seed=4321, eval_windows=512),
                   share=0.55, traces={"test-split": 32768, "sharegpt": 6144, "mt-bench": 2048, "vicuna-bench": 2048,
                                       "gsm8k": 4096, "humaneval": 4096},
                   decode=(64, 64)),
    "topo-mixtral": dict(run=dict(spec="topo-mixtral", steps=3000, batch=64, seq=512, lr=2e-3, warmup=100,
                                  aux=0.01, balance="per-layer", seed=8765, eval_windows=512),
                         share=0.45, traces={"test-split": 32768, "sharegpt": 6144, "mt-bench": 2048,
                                             "vicuna-bench": 2048, "gsm8k": 4096, "humaneval": 4096},
                         decode=(64, 64)),
    # Issue 12 (decision 0135): the recipe of topo-b on DeepSeek-V2-Lite's routing topology; alone in its call.
    "topo-v2lite": dict(run=dict(spec="topo-v2lite", steps=3000, batch=64, seq=512, lr=2e-3, warmup=100, aux=0.01,
                                 balance="per-layer", seed=2612, eval_windows=512),
                        share=1.0, traces={"test-split": 32768, "sharegpt": 6144, "mt-bench": 2048,
                                           "vicuna-bench": 2048, "gsm8k": 4096, "humaneval": 4096},
                        decode=(64, 64)),
}
# What `full` trains without --models (issue 9's pair).
DEFAULT_MODELS = ["topo-b", "topo-mixtral"]
SMOKE = {"topo-b": dict(spec="topo-smoke", steps=30, batch=4, seq=64, traces=512, decode=(4, 16)),
         "topo-mixtral": dict(spec="mixtral-smoke", steps=30, batch=4, seq=64, traces=512, decode=(4, 16)),
         "topo-v2lite": dict(spec="v2lite-smoke", steps=30, batch=4, seq=64, traces=512, decode=(4, 16))}
TRACE_MAX_LEN = 512
ZSTD_LEVEL = 19


def log(msg):
    tm.log(msg)


def load_data(carry, max_docs=None, cache_dir=None):
    """(tokenizer, {split: uint16 tokens}, splits, prompts, unigram log-probs, eos id); token streams are cached as
    .npy files in cache_dir (keyed by the carry manifest) so that repeated probes skip tokenisation."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(REPO / "tools" / "data" / "tokenizer" / "tokenizer.json"))
    eos_id = tok.token_to_id("<|endoftext|>")
    splits, prompts, manifest = tm.load_carry(carry)
    if max_docs:
        splits = {s: d[:max_docs] for s, d in splits.items()}
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode() + str(max_docs).encode()).hexdigest()[:16]
    data = {}
    for s, docs in splits.items():
        path = Path(cache_dir) / f"tokens-{s}-{key}.npy" if cache_dir else None
        if path and path.exists():
            data[s] = np.load(path)
            continue
        data[s] = tm.tokenize_stream(tok, docs, eos_id)
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, data[s])
    return tok, data, splits, prompts, tm.unigram_log_probs(data["train"], tok.get_vocab_size()), eos_id


def held_out_routing(model, tok, candidates, budget, device, pad_id, keep_inputs=False):
    """Routes the test-split candidates (up to `budget` tokens, sequences of at most TRACE_MAX_LEN): (seqs, ids, w,
    inputs) as routing_capture.route_sequences returns them."""
    seqs = rc.select_sequences(tok, candidates, budget, TRACE_MAX_LEN)
    ids, w, inputs = rc.route_sequences(model, [s["tokens"] for s in seqs], pad_id, device,
                                        keep_inputs_for=range(len(seqs)) if keep_inputs else ())
    return seqs, ids, w, inputs


def bounds_of(seqs):
    """[(first, end)] token ranges of consecutive sequences."""
    ends = np.cumsum([len(s["tokens"]) for s in seqs])
    return list(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist()))


# ---------------------------------------------------------------- probe


def probe(args):
    """Trains one model and appends {recipe, validation, realism} to args.json."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    moe_model.register_experts_impl()
    tok, data, splits, prompts, unigram_lp, eos_id = load_data(args.carry, cache_dir=args.work)
    overrides = {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.hidden:
        overrides["hidden_size"] = args.hidden
        overrides["head_dim"] = max(16, args.hidden // moe_model.MODEL_SPECS[args.spec]["num_attention_heads"])
    if args.expert_ffn:
        overrides["moe_intermediate_size"] = args.expert_ffn
    run = dict(spec=args.spec, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, warmup=args.warmup,
               aux=args.aux, balance=args.balance, seq_aux=args.seq_aux, seed=args.seed,
               eval_windows=args.eval_windows, overrides=overrides)
    val_windows = tm.eval_windows(data["validation"], args.seq, args.eval_windows)
    deadline = time.time() + args.max_train_s
    model, rec = tm.train_model(run, data["train"], val_windows, tok.get_vocab_size(), eos_id, device, deadline,
                                moe_model.EXPERTS_IMPL, unigram_lp)
    cands = tm.trace_candidates(splits["test"], prompts)
    seqs, ids, _, _ = held_out_routing(model, tok, cands, {"test-split": args.route_tokens}, device, eos_id)
    realism = rs.realism_stats(ids, bounds_of(seqs), moe_model.n_experts_of(model.config))
    row = {"command": "python3 tools/train/train_balanced.py " + " ".join(sys.argv[2:]),
           "spec": args.spec, "overrides": overrides, "balance": args.balance, "aux": args.aux,
           "seq_aux": args.seq_aux,
           "steps_done": rec["steps_done"], "tokens_seen": rec["tokens_seen"], "train_seconds": rec["train_seconds"],
           "params": rec["params"], "device": device.type, "validation": rec["validation"],
           "final_train_ce": rec["loss_curve"][-1]["ce"] if rec["loss_curve"] else None,
           "final_aux": rec["loss_curve"][-1]["aux"] if rec["loss_curve"] else None,
           "routed_tokens": int(len(ids)), "realism": realism}
    log(f"probe {args.spec} {overrides} {args.balance} aux {args.aux} seq-aux {args.seq_aux}: ppl {rec['validation']['ppl']:.1f} "
        f"(unigram {rec['validation']['unigram_ppl']:.0f}); medians "
        + ", ".join(f"{k} {v:.3f}" for k, v in realism["median"].items()))
    if args.json:
        path = Path(args.json)
        rows = json.loads(path.read_text()) if path.exists() else []
        rows.append(row)
        path.write_text(json.dumps(rows, indent=1) + "\n")
    return row


# ---------------------------------------------------------------- full (device) job


@torch.no_grad()
def decode_continuations(model, tok, prompts, n_prompts, n_new, device, pad_id, seed):
    """The first n_prompts real prompts (at most 256 tokens each), each continued by n_new tokens that the model
    samples itself (temperature 0.8, top-p 0.95, seeded; batched with left padding; bf16 on CUDA, where the grouped
    expert products need it: the trace re-routes the whole sequence in fp32 afterwards). Returns
    select_sequences-style dicts with "n_prompt" set."""
    model.eval()
    chosen = []
    for p in prompts:
        toks = tok.encode(p["text"]).ids[:256]
        if len(toks) >= 8:
            chosen.append({"name": p["name"] + "+decode", "source": p["source"] + "-decode", "tokens": toks})
        if len(chosen) == n_prompts:
            break
    torch.manual_seed(seed)
    out = []
    for i in range(0, len(chosen), 64):
        batch = chosen[i:i + 64]
        width = max(len(c["tokens"]) for c in batch)
        x = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, c in enumerate(batch):
            x[r, width - len(c["tokens"]):] = torch.tensor(c["tokens"])
            mask[r, width - len(c["tokens"]):] = 1
        with tm.autocast_for(device):
            y = model.generate(input_ids=x.to(device), attention_mask=mask.to(device), max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=True, temperature=0.8, top_p=0.95,
                               pad_token_id=pad_id, output_router_logits=False)
        for r, c in enumerate(batch):
            gen = y[r, width:].tolist()
            out.append({**c, "tokens": c["tokens"] + gen, "n_prompt": len(c["tokens"])})
    return out


def write_traces(model, name, tok, cands, prompts, plan, device, outdir, pad_id, created_by):
    """NAME-test.pstrace (test split), NAME-prompts.pstrace (real prompts, and the same prompts continued by the model
    itself); returns (info per file, test-split seqs) (the realism statistics are computed from the files
    afterwards, off the device: python3 tools/data/routing_stats.py)."""
    budget = plan["traces"]
    seqs = rc.select_sequences(tok, cands, budget, TRACE_MAX_LEN)
    groups = {"test": [s for s in seqs if s["source"] == "test-split"],
              "prompts": [s for s in seqs if s["source"] != "test-split"]}
    n_prompts, n_new = plan["decode"]
    groups["prompts"] += decode_continuations(model, tok, prompts, n_prompts, n_new, device, pad_id, 99)
    info = {}
    threads = min(16, os.cpu_count() or 1)
    for group, gseqs in groups.items():
        ids, w, _ = rc.route_sequences(model, [s["tokens"] for s in gseqs], pad_id, device)
        path = Path(outdir) / f"{name}-{group}.pstrace"
        nbytes = rc.write_trace_file(path, model, name, gseqs, ids, w, created_by, ZSTD_LEVEL, threads)
        t = pstrace.read_trace(path)
        info[path.name] = {"bytes": nbytes, "tokens": int(len(t.token_ids)), "sequences": len(gseqs),
                           "decoded_tokens": int(sum(len(s["tokens"]) - s.get("n_prompt", len(s["tokens"]))
                                                     for s in gseqs))}
        log(f"{path.name}: {len(t.token_ids)} tokens, {nbytes / MiB:.2f} MiB")
    return info, groups["test"]


def keep_model(model, keep, test_seqs):
    """Saves the trained model (HF safetensors, fp32) and the token ids of its test-split trace sequences in `keep`,
    for the sidecar calls that follow on the same machine."""
    if keep.exists():
        shutil.rmtree(keep)
    model.save_pretrained(keep, safe_serialization=True)
    (keep / "test-seqs.json").write_text(json.dumps([{"name": s["name"], "tokens": s["tokens"]} for s in test_seqs]))
    return {"dir": str(keep), "sequences": len(test_seqs)}


def sidecar(args):
    """Writes NAME-test.hidden.part-S.zst (S = --first-seq): router inputs of test-split sequences S, S+1, ... of the
    kept model's trace, as many whole sequences as fit --budget-bytes compressed (at most --max-tokens tokens),
    packed for the return; prints the next sequence to start from."""
    from transformers import AutoModelForCausalLM
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    moe_model.register_experts_impl()
    keep = Path(args.keep) / args.model
    model = AutoModelForCausalLM.from_pretrained(keep, dtype=torch.float32).to(device).eval()
    model.set_experts_implementation(moe_model.EXPERTS_IMPL)
    seqs = json.loads((keep / "test-seqs.json").read_text())
    per_tok = model.config.num_hidden_layers * (4 + model.config.hidden_size)
    # int8 router inputs compress to about 0.85-0.9 of their size: route a little more than the budget can hold
    n_want = min(args.max_tokens, int(args.budget_bytes / per_tok / 0.8))
    chosen, n = [], 0
    for i in range(args.first_seq, len(seqs)):
        if n >= n_want:
            break
        chosen.append(i)
        n += len(seqs[i]["tokens"])
    if not chosen:
        raise SystemExit(f"sidecar: no test-split sequences from {args.first_seq} on ({len(seqs)} in all)")
    _, _, inputs = rc.route_sequences(model, [seqs[i]["tokens"] for i in chosen], model.config.eos_token_id, device,
                                      keep_inputs_for=range(len(chosen)))
    stage = Path(args.work) / "sidecar"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    path = stage / f"{args.model}-test.hidden.part-{args.first_seq:04d}.zst"
    threads = min(16, os.cpu_count() or 1)
    while True:
        ranges = [[s, 0, len(seqs[s]["tokens"])] for s in chosen]
        nbytes = pstrace.write_hidden(path, trace_name=f"{args.model}-test.pstrace", token_ranges=ranges,
                                      hidden=np.concatenate([inputs[j] for j in range(len(chosen))]), level=6,
                                      threads=threads)
        if nbytes <= args.budget_bytes or len(chosen) == 1:
            break
        chosen = chosen[:max(1, int(len(chosen) * 0.9))]
    summary = {"command": "python3 tools/train/train_balanced.py " + " ".join(sys.argv[1:]), "model": args.model,
               "first_seq": args.first_seq, "next_seq": chosen[-1] + 1, "sequences": len(seqs),
               "tokens": int(sum(len(seqs[s]["tokens"]) for s in chosen)), "bytes": nbytes}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tm.pack_outputs(stage, Path(args.out), [(f"traces/{path.name}", path)], summary)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"{path.name}: sequences {args.first_seq}..{chosen[-1]} of {len(seqs)}, {summary['tokens']} tokens, "
        f"{nbytes / MiB:.1f} MiB; next --first-seq {chosen[-1] + 1}")
    return 0


def merge_sidecars(args):
    """Joins sidecar parts of one trace (each a valid sidecar of some of its sequences) into one file, in sequence
    order, checking each part against the trace."""
    trace = pstrace.read_trace(args.trace)
    parts = [pstrace.read_hidden(p, trace=trace) for p in args.parts]
    parts.sort(key=lambda h: h.header["token_ranges"][0][0])
    seen = set()
    for h in parts:
        for r in h.header["token_ranges"]:
            if r[0] in seen:
                raise SystemExit(f"merge-sidecars: sequence {r[0]} is in more than one part")
            seen.add(r[0])
    ranges = [r for h in parts for r in h.header["token_ranges"]]
    nbytes = pstrace.write_hidden(args.out, trace_name=Path(args.trace).name, token_ranges=ranges,
                                  scale=np.concatenate([h.scale for h in parts]),
                                  q=np.concatenate([h.q for h in parts]), level=19, threads=os.cpu_count() or 1)
    h = pstrace.read_hidden(args.out, trace=trace)
    print(f"{args.out}: {h.header['n_tokens']} tokens of {len(ranges)} sequences from {len(parts)} parts, "
          f"{nbytes / MiB:.1f} MiB")
    return 0


def full(args):
    """The device job (module docstring); a failed phase is recorded and the others still run."""
    t0 = time.time()
    out, stage = tm.fresh_stage(args.out, args.work)
    summary = {"mode": "smoke" if args.smoke else "full", "budget_s": args.budget_s, "models": args.models,
               "command": "python3 tools/train/train_balanced.py " + " ".join(sys.argv[1:])}
    ph = tm.Phases(summary)
    summary["environment"] = moe_model.check_environment(require_cuda=not args.smoke)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    moe_model.register_experts_impl()
    st = moe_model.self_test_experts(device)
    moe_model.set_grouped_enabled(st["ok"])
    summary["experts_self_test"] = st
    tok, data, splits, prompts, unigram_lp, eos_id = load_data(args.carry, 300 if args.smoke else None)
    cands = tm.trace_candidates(splits["test"], prompts)
    created = "tools/train/train_balanced.py full" + (" --smoke" if args.smoke else "")
    items = []
    selected = {name: FULL[name] for name in args.models}
    for name, plan in selected.items():
        if args.smoke:
            sm = SMOKE[name]
            plan = dict(plan, run=dict(plan["run"], spec=sm["spec"], steps=sm["steps"], batch=sm["batch"],
                                       seq=sm["seq"], eval_windows=8),
                        traces={"test-split": sm["traces"], "sharegpt": sm["traces"] // 4},
                        decode=sm["decode"])
        left = t0 + args.budget_s - time.time()
        deadline = time.time() + left * plan["share"] / sum(p["share"] for n, p in selected.items()
                                                             if n not in summary.get("done", []))
        deadline -= 0 if args.smoke else 75  # routers, traces, decoding and keeping the model after training
        val_windows = tm.eval_windows(data["validation"], plan["run"]["seq"], plan["run"]["eval_windows"])
        res = ph.run(f"train_{name}", tm.train_model, plan["run"], data["train"], val_windows, tok.get_vocab_size(),
                     eos_id, device, deadline, moe_model.EXPERTS_IMPL, unigram_lp)
        summary.setdefault("done", []).append(name)
        if not res:
            continue
        model, rec = res
        rec_path = stage / f"train-{name}.json"
        rec_path.write_text(json.dumps(rec, indent=1) + "\n")
        items.append((f"docs/data/train-{name}.json", rec_path))
        cfg_path = stage / "traces" / f"{name}-config.json"
        cfg_path.write_text(model.config.to_json_string())
        items.append((f"traces/{name}-config.json", cfg_path))
        r = ph.run(f"routers_{name}", tm.save_routers, model, stage / "traces" / f"{name}-routers.safetensors")
        if r:
            items.append((f"traces/{name}-routers.safetensors", stage / "traces" / f"{name}-routers.safetensors"))
        tr = ph.run(f"traces_{name}", write_traces, model, name, tok, cands, prompts, plan, device, stage / "traces",
                    eos_id, created)
        test_seqs = []
        if tr:
            info, test_seqs = tr
            summary[name] = {"traces": info, "validation": rec["validation"]}
            items += [(f"traces/{n}", stage / "traces" / n) for n in info]
        keep = Path(args.keep) / name
        ph.run(f"keep_{name}", keep_model, model, keep, test_seqs if tr else [])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary["elapsed_s"] = round(time.time() - t0, 1)
    ph.run("pack", tm.pack_outputs, stage, out, items, summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return 1 if summary["errors"] else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe", help="train one model and append its realism statistics to --json")
    p.add_argument("--spec", default="topo-b", choices=sorted(moe_model.MODEL_SPECS))
    p.add_argument("--layers", type=int, help="override the spec's layer count (reduced-depth probes)")
    p.add_argument("--hidden", type=int, help="override the hidden size (head_dim follows)")
    p.add_argument("--expert-ffn", type=int, help="override the expert FFN width")
    p.add_argument("--balance", default="per-layer", choices=["per-layer", "hf"])
    p.add_argument("--aux", type=float, default=0.01, help="load-balancing loss coefficient")
    p.add_argument("--seq-aux", type=float, default=0.0, help="sequence-wise balance loss coefficient (per window)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--route-tokens", type=int, default=8192, help="held-out test-split tokens routed for the stats")
    p.add_argument("--max-train-s", type=float, default=4 * 3600)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    p.add_argument("--json", help="JSON list to append the result row to")
    p.add_argument("--carry", default=str(REPO / ".carry"))
    p.add_argument("--work", default="/tmp/prescope-balance", help="token cache")
    f = sub.add_parser("full", help="the device job (module docstring)")
    f.add_argument("--out", required=True)
    f.add_argument("--budget-s", type=float, default=540.0)
    f.add_argument("--smoke", action="store_true", help="tiny shapes and steps on the CPU (dry run)")
    f.add_argument("--models", nargs="+", choices=list(FULL), default=DEFAULT_MODELS,
                   help=f"models to train, in this order (default: {' '.join(DEFAULT_MODELS)})")
    f.add_argument("--carry", default=str(REPO / ".carry"))
    f.add_argument("--work", default="/tmp/prescope-balanced")
    f.add_argument("--keep", default=str(REPO / "build-train"), help="where the trained models stay for sidecar")
    c = sub.add_parser("sidecar", help="a router-input sidecar part of a kept model (module docstring)")
    c.add_argument("--model", required=True, choices=sorted(FULL))
    c.add_argument("--first-seq", type=int, default=0)
    c.add_argument("--budget-bytes", type=int, default=58 * MiB)
    c.add_argument("--max-tokens", type=int, default=20480)
    c.add_argument("--out", required=True)
    c.add_argument("--keep", default=str(REPO / "build-train"))
    c.add_argument("--work", default="/tmp/prescope-balanced")
    m = sub.add_parser("merge-sidecars", help="join sidecar parts (module docstring)")
    m.add_argument("trace")
    m.add_argument("parts", nargs="+")
    m.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "probe":
        probe(args)
        return 0
    return {"full": full, "sidecar": sidecar, "merge-sidecars": merge_sidecars}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
