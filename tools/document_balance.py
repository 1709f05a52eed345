"""How evenly zig-zag ring attention spreads its work over cp ranks when attention stays inside packed documents.

    python -m tools.document_balance [--seq-lens 16384 32768 65536 131072] [--cp 2 4 8 16 32]
                                     [--samples 256] [--source stdlib | --tokens PREFIX] [--out DIR]

Zig-zag (rank r holds chunks r and 2cp-1-r) balances the causal mask of one long document exactly.
With packed documents a rank computes, for each of its query rows, the keys of that row's own
document up to it (`moe_lc.ops.documents`), so its work is the sum over its rows of (position in the
document + 1), and how long documents are decides the balance. This tool packs a real corpus the way
training reads it (`TokenWindows`: consecutive windows of the token stream, documents cut where the
window cuts them), and reports per (sequence length, cp):

  work fraction   the score elements computed over the causal mask's (what the mask saves)
  imbalance       busiest rank / mean rank per sequence: mean, p90, max over the sampled windows
  balanced        the same under `parallel.cp_layout = "balanced"`: each sequence's 2cp chunks paired
                  heaviest-with-lightest (`Documents.balanced_chunks`: the best pairing of chunks into
                  ranks; zig-zag is that pairing for a single document)

It writes balance.json and balance.png under --out (default runs/document_balance) and prints a table.
Host arithmetic only (no model, no processes): the 128K rows take seconds.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/document_balance.py` from a checkout
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.document_balance", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from moe_lc.data.corpus import stdlib_token_stream
from moe_lc.data.loader import TokenWindows
from moe_lc.data.token_file import open_token_file
from moe_lc.data.tokenizer import load_tokenizer
from moe_lc.ops.documents import Documents


def row_work(lengths: np.ndarray) -> np.ndarray:
    """(S,) work of each query row: its position inside its document + 1."""
    starts = np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(int(lengths.sum())) - starts + 1


def rank_work(lengths: np.ndarray, cp: int, layout: str = "zigzag") -> np.ndarray:
    """(cp,) work of each rank for one sequence with these document lengths."""
    chunks = row_work(lengths).reshape(2 * cp, -1).sum(1)
    if layout == "zigzag":
        return chunks[:cp] + chunks[::-1][:cp]
    pairs = Documents([lengths.tolist()], int(lengths.sum())).balanced_chunks(cp)
    return np.array([chunks[list(p)].sum() for p in pairs])


def check_against_plan(lengths: np.ndarray, cp: int) -> None:
    """The closed form above is what the ring's own plan computes (Documents.plan_call)."""
    S, chunk = int(lengths.sum()), int(lengths.sum()) // (2 * cp)
    docs = Documents([lengths.tolist()], S)
    ranges = [tuple((c * chunk, (c + 1) * chunk) for c in (r, 2 * cp - 1 - r)) for r in range(cp)]
    for r in range(cp):
        docs.plan_call(ranges[r], [ranges[(r - s) % cp] for s in range(cp)])
        assert docs.call_work == rank_work(lengths, cp)[r], (r, docs.call_work)


def measure(windows: TokenWindows, cp_list: list[int], samples: int) -> dict:
    S = windows.seq_len
    rows = {cp: {"zigzag": [], "balanced": []} for cp in cp_list if S % (2 * cp) == 0}
    fractions, n_docs = [], []
    for i in range(samples):
        lengths = windows[i]["documents"].numpy()
        n_docs.append(len(lengths))
        fractions.append(float((lengths * (lengths + 1) // 2).sum()) / (S * (S + 1) / 2))
        if i == 0:
            check_against_plan(lengths, min(rows))
        for cp, out in rows.items():
            for layout in out:
                work = rank_work(lengths, cp, layout)
                out[layout].append(float(work.max() / work.mean()))
    summary = {"seq_len": S, "samples": samples, "documents_per_sequence": float(np.mean(n_docs)),
               "work_fraction": float(np.mean(fractions)), "cp": {}}
    for cp, out in rows.items():
        summary["cp"][cp] = {p: {"mean": float(np.mean(v)), "p90": float(np.percentile(v, 90)), "max": float(np.max(v))}
                             for p, v in out.items()}
    return summary


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        cps = sorted(r["cp"], key=int)
        ax.plot(cps, [r["cp"][c]["zigzag"]["mean"] for c in cps], marker="o", label=f"zig-zag, S={r['seq_len'] // 1024}K")
        ax.plot(cps, [r["cp"][c]["balanced"]["mean"] for c in cps], marker="x", ls=":", color=ax.lines[-1].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cp degree")
    ax.set_ylabel("busiest rank / mean (mean over sequences)")
    ax.set_title("Ring attention work per rank, packed stdlib documents\n(solid: zig-zag; dotted: cp_layout = balanced)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--samples", type=int, default=256, help="windows per sequence length")
    ap.add_argument("--tokens", default="", help="a token-file prefix (tools/prepare_data.py --out); default: the stdlib corpus")
    ap.add_argument("--tokenizer", default="byte")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/document_balance")
    args = ap.parse_args(argv)
    if args.tokens:
        tokens, _, starts = open_token_file(f"{args.tokens}.train", documents=True, eos_id=load_tokenizer(args.tokenizer).eos_id)
        corpus = args.tokens
    else:
        tokens, starts = stdlib_token_stream("train", load_tokenizer(args.tokenizer), documents=True)
        corpus = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library ({args.tokenizer} tokens)"
    lengths = np.diff(np.append(starts, len(tokens)))
    print(f"{corpus}: {len(tokens):,} tokens in {len(starts):,} documents (median {int(np.median(lengths)):,}, "
          f"mean {int(lengths.mean()):,}, max {int(lengths.max()):,})", flush=True)
    results = []
    print(f"{'S':>6} {'docs/seq':>8} {'work':>6} {'cp':>3} {'zig-zag mean/p90/max':>24} {'balanced mean/p90/max':>24}")
    for S in args.seq_lens:
        r = measure(TokenWindows(tokens, S, args.seed, doc_starts=starts), args.cp, args.samples)
        results.append(r)
        for cp, v in r["cp"].items():
            z, s = v["zigzag"], v["balanced"]
            print(f"{S // 1024:>5}K {r['documents_per_sequence']:>8.1f} {r['work_fraction']:>6.2f} {cp:>3} "
                  f"{z['mean']:>8.3f}{z['p90']:>8.3f}{z['max']:>8.3f} {s['mean']:>8.3f}{s['p90']:>8.3f}{s['max']:>8.3f}",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "balance.json").write_text(json.dumps({"corpus": corpus, "results": results}, indent=1))
    plot(results, out / "balance.png")
    print(f"wrote {out / 'balance.json'} and {out / 'balance.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
