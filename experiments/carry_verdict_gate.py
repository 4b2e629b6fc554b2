"""The gate of the carry-verdict family: can PRISM's weights ``pi`` differ on its targets?

Forward passes only (and one warm-up SFT): the inter-quartile range of ``pi`` over the
family's candidate target pairs (every behaviour probe of a seed as ``(probe, chosen =
the dropped-carry rule's verdict, rejected = the right one)``, :func:`.verdict.candidate_pairs`)
at the embedded model as it is and at the start model a clean warm-up SFT makes (the
warm-up of experiments/carry_verdict.yaml: its records, its fine-tuning settings). A
testbed on which PRISM can differ from equal aggregation needs a spread: IQR above
about 0.2.

Variants (``--variants``) change the verdicts' written form, so a design change is
measured on the same probes and the same warm-up records (each variant warms up on its
own form):

    plain     "Yes." / "No."
    bare      "Yes" / "No" (one word and the end-of-turn tokens)

    PYTHONPATH=. python experiments/carry_verdict_gate.py --out docs/results/carry-verdict/gate.json
    (add --no-warmup for the embedded model alone; --device cuda on a GPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.evaluation import verdict  # noqa: E402
from prism_select.evaluation.config import load_config  # noqa: E402
from prism_select.preference import pair_margins  # noqa: E402

#: the written verdicts per variant: (yes, no)
VARIANTS = {"plain": ("Yes.", "No."), "bare": ("Yes", "No")}
GATE_IQR = 0.2  # the spread of pi a testbed needs (about)


def _rewrite(rows: list, form: tuple, keys: tuple) -> list:
    """``rows`` with the verdicts in ``keys`` written in ``form``."""
    to = {verdict.YES: form[0], verdict.NO: form[1]}
    return [{**r, **{k: to[r[k]] for k in keys if k in r}} for r in rows]


def spread(pi: torch.Tensor) -> dict:
    q = torch.quantile(pi, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=pi.dtype)).tolist()
    w = pi / pi.mean()
    return {"n": len(pi), "iqr": q[3] - q[1], "p10": q[0], "q1": q[1], "median": q[2], "q3": q[3], "p90": q[4],
            "min": float(pi.min()), "max": float(pi.max()), "weight_ratio_max_min": float(w.max() / w.min()),
            "share_prefers_right": float((pi < 0.5).double().mean())}


def gate_pi(lm, pairs: list, max_length: int) -> dict:
    tok = lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ch = [encode(tok, p["prompt"], p["chosen"], max_length) for p in pairs]
    rj = [encode(tok, p["prompt"], p["rejected"], max_length) for p in pairs]
    lm.model.eval()
    _, pi = pair_margins(lm.model, ch, rj, pad_id=pad, batch_size=64)
    wrong = torch.tensor([bool(p.get("stated_wrong")) for p in pairs])
    out = spread(pi)
    for name, sel in (("wrong_statements", wrong), ("true_statements", ~wrong)):
        if sel.any():
            out[name] = spread(pi[sel])
    out["pi"] = [round(float(x), 6) for x in pi]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "experiments" / "carry_verdict.yaml"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-pairs", type=int, default=None,
                    help="the first N candidate pairs only (half of them wrong statements; default: all)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--warmup-records", type=int, default=None,
                    help="a smaller warm-up than the config's (its first records; a CPU's budget)")
    ap.add_argument("--warmup-epochs", type=int, default=None, help="the warm-up's epochs (default: the config's)")
    args = ap.parse_args(argv)
    import dataclasses

    from peft import PeftModel

    from prism_select.finetune import finetune
    from prism_select.evaluation.sections import finetune_settings
    from prism_select.model import load_model

    cfg = load_config(args.config, "repair")
    model_settings = dataclasses.replace(cfg.model, device=args.device)
    built = verdict.build(args.seed, pool_size=cfg.data.pool_size, harmful_ratio=cfg.harmful_ratios[0],
                          carry_share=cfg.data.carry_share, n_probes=cfg.probes.n,
                          n_capability=cfg.probes.capability_per_task, n_warmup=cfg.warmup.n_records)
    pairs = verdict.candidate_pairs(built["probes"])
    for p, probe in zip(pairs, [q for q in built["probes"] if q["task"] == verdict.BEHAVIOUR_TASK]):
        p["stated_wrong"] = probe["reference"] == "no"
    if args.n_pairs:  # the probes come wrong statements first, then true ones: take half of each
        wrong = [p for p in pairs if p["stated_wrong"]]
        right = [p for p in pairs if not p["stated_wrong"]]
        pairs = wrong[:args.n_pairs // 2] + right[:args.n_pairs - args.n_pairs // 2]
    max_length = cfg.score.max_length
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(),
              "device": f"{args.device} ({platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} threads)",
              "torch": torch.__version__, "config": str(Path(args.config).resolve().relative_to(ROOT)),
              "seed": args.seed, "n_pairs": len(pairs), "gate_iqr": GATE_IQR, "variants": {}}
    lm = load_model(model_settings)
    for name in args.variants:
        form = VARIANTS[name]
        vpairs = _rewrite(pairs, form, ("chosen", "rejected"))
        row = {"verdicts": list(form)}
        t = time.perf_counter()
        row["start"] = gate_pi(lm, vpairs, max_length)
        if not args.no_warmup:
            with tempfile.TemporaryDirectory() as tmp:
                n_warm = args.warmup_records or cfg.warmup.n_records
                warm = _rewrite(verdict.warmup_records(n_warm), form, ("response",))
                path = Path(tmp) / "warmup.jsonl"
                path.write_text("".join(json.dumps(r) + "\n" for r in warm))
                settings = finetune_settings(cfg.warmup.finetune, 0)
                if args.warmup_epochs:
                    settings = dataclasses.replace(settings, epochs=args.warmup_epochs)
                res = finetune(lm, path, Path(tmp) / "sft", settings, overwrite=True)
                warmed = PeftModel.from_pretrained(lm.model, str(res.adapter_dir))
                row["warmup"] = {"n_records": len(warm), "finetune": dataclasses.asdict(settings)}
                row["warmed"] = gate_pi(_With(lm, warmed), vpairs, max_length)
                lm.model = warmed.unload()  # the base weights back, the LoRA dropped
        row["seconds"] = round(time.perf_counter() - t, 1)
        result["variants"][name] = row
        print(name, {k: round(v["iqr"], 4) for k, v in row.items() if isinstance(v, dict) and "iqr" in v}, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(result))


class _With:
    """``lm`` with another model module (its tokenizer kept)."""

    def __init__(self, lm, model):
        self.model, self.tokenizer = model, lm.tokenizer


def _markdown(r: dict) -> str:
    lines = [f"# Carry verdict: the spread of pi over the candidate target pairs", "",
             f"{r['date']}, {r['device']}, torch {r['torch']}, commit {r['commit'][:10]}, seed {r['seed']}, "
             f"{r['n_pairs']} candidate pairs (probe, the dropped-carry rule's verdict, the right verdict); "
             f"config {r['config']}. Gate: IQR of pi above about {r['gate_iqr']}.", "",
             "| variant | verdicts | model | IQR | q1 | median | q3 | p10 | p90 | max/min weight | prefers right "
             "| IQR, wrong statements (chosen yes) | IQR, true statements (chosen no) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in r["variants"].items():
        for model in ("start", "warmed"):
            if model not in row:
                continue
            s = row[model]
            lines.append(f"| {name} | {' / '.join(row['verdicts'])} | {model} | {s['iqr']:.3f} | {s['q1']:.3f} | "
                         f"{s['median']:.3f} | {s['q3']:.3f} | {s['p10']:.3f} | {s['p90']:.3f} | "
                         f"{s['weight_ratio_max_min']:.1f} | {s['share_prefers_right']:.2f} | "
                         + " | ".join(f"{s[k]['iqr']:.3f} (median {s[k]['median']:.3f})" if k in s else "-"
                                      for k in ("wrong_statements", "true_statements")) + " |")
    lines += ["", "start: the embedded model as it is; warmed: after the clean warm-up SFT. prefers right: the "
              "share of pairs with pi < 0.5. The last two columns: the spread within the pairs of one chosen verdict "
              "(what is left once the model's bias between the two words is taken out)."]
    return "\n".join(lines) + "\n"


def render(path) -> None:
    """Write the .md of a finished gate JSON again (``--render FILE.json``)."""
    path = Path(path)
    path.with_suffix(".md").write_text(_markdown(json.loads(path.read_text())))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:
        for f in sys.argv[2:]:
            render(f)
    else:
        main()
