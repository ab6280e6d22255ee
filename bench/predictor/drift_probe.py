# Offline probe of LLaPor-MLP-prior's linear drift map (decision 0054) on the topo sidecar, in numpy: which
# inputs of the ridge fit move recall@k at distances 1..3. Reproduces the C++ prior-alone numbers for "A".
"""Usage: python3 bench/predictor/drift_probe.py [--fit-val] KIND...

KIND: A (x_l, previous token's x_{l+d} and x_l, 1: the default drift), B (A + x_{l-1}), C (B + previous
token's x_{l+d-1}), P2 (A + the token before the previous one's x_{l+d}), biasB (A's logits plus B times
their per-token std on the experts the previous token used at layer l+d). Fits on topo-test sequences 0, 1,
3, 4, 6 (with --fit-val also 7, the validation sequence), scores sequences 7 (val) and 2, 5, 8 (the held-out
test of run_topo.sh), skipping each sequence's first two tokens. Prints (val, test, Fate on test) recall@k
per distance. About 3 minutes per KIND on 2 cores.
"""
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools/data"))
import pstrace  # noqa: E402


def main():
    args = sys.argv[1:]
    fit_val = "--fit-val" in args
    kinds = [a for a in args if a != "--fit-val"] or ["A"]
    tr = pstrace.read_trace(ROOT / "traces/topo-test.pstrace")
    hs = pstrace.read_hidden(ROOT / "traces/topo-test.hidden.zst", tr)
    x = hs.dequantize()  # [N, L, D] router inputs
    ids = tr.expert_ids[hs.flat_token_indices(tr)]  # [N, L, k]
    n_layer, k = x.shape[1], tr.top_k
    routers = load_file(ROOT / "traces/topo-routers.safetensors")
    r = [routers[f"layers.{l}.mlp.gate.weight"].astype(np.float32) for l in range(n_layer)]
    seq = np.concatenate([[s] * n for s, _, n in hs.header["token_ranges"]])
    pos = np.concatenate([np.arange(n) for _, _, n in hs.header["token_ranges"]])
    ok = pos > 1
    prev, prev2, prev_ids = np.roll(x, 1, axis=0), np.roll(x, 2, axis=0), np.roll(ids, 1, axis=0)
    train = ok & np.isin(seq, [0, 1, 3, 4, 6] + ([7] if fit_val else []))
    val, test = ok & (seq == 7), ok & np.isin(seq, [2, 5, 8])

    def feats(kind, l, d):
        cols = [x[:, l], prev[:, l + d], prev[:, l]]
        if kind in ("B", "C"):
            cols.append(x[:, l - 1] if l > 0 else np.zeros_like(x[:, l]))
        if kind == "C":
            cols.append(prev[:, l + d - 1])
        if kind == "P2":
            cols.append(prev2[:, l + d])
        cols.append(np.ones((x.shape[0], 1), np.float32))
        return np.concatenate(cols, 1)

    def recall(logits, target):
        top = np.argpartition(-logits, k, axis=1)[:, :k]
        return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(top, target)]))

    for kind in kinds:
        res = {}
        for d in (1, 2, 3):
            rv, rt, rf = [], [], []
            for l in range(n_layer - d):
                f = feats(kind, l, d)
                y = x[:, l + d] - x[:, l]
                ft = f[train]
                a = np.linalg.solve(ft.T @ ft + 10.0 * np.eye(f.shape[1]), ft.T @ y[train])  # ridge 10
                lg = (x[:, l] + f @ a) @ r[l + d].T
                if kind.startswith("bias"):
                    onehot = np.zeros_like(lg)
                    np.put_along_axis(onehot, prev_ids[:, l + d].astype(np.int64), 1.0, axis=1)
                    lg = lg + float(kind[4:]) * lg.std(axis=1, keepdims=True) * onehot
                rv.append(recall(lg[val], ids[val, l + d]))
                rt.append(recall(lg[test], ids[test, l + d]))
                rf.append(recall((x[:, l] @ r[l + d].T)[test], ids[test, l + d]))
            res[d] = tuple(round(float(np.mean(v)), 4) for v in (rv, rt, rf))
        print(kind, "fit+val" if fit_val else "fit", res, flush=True)


if __name__ == "__main__":
    main()
