"""Curvature on small pools: ranking AUROC of the harmful flag per curvature, pool size and family.

For every family, pool size and seed: a pool with a ``harmful`` flag and target pairs
(``chosen`` = the harmful behaviour, ``rejected`` = the correct one) are built, PRISM's
``g_KL`` is computed once, EK-FAC is fitted once on the pool (``fit_curvature``: the fit
keeps the K-FAC eigenvalues, so K-FAC and every EK-FAC variant below come from the same
fit), and every curvature's ``v = H^-1 g_KL`` scores the pool in ONE pass (per-example
gradients contracted with all the ``v`` at once; checked against the library's exact
scoring on the first pool). Curvatures:

    identity, kfac, ekfac (default damping 0.1 x mean eigenvalue), ekfac x10 / x100 damping,
    ekfac with --shrinkage auto (Ledoit-Wolf weight toward K-FAC) and 1 (ranks as K-FAC),
    ekfac with --damping-noise (the eigenvalues' standard error added to the damping), and both.

Families (data from ``--data``, the folder holding gsm8k/ and bbh/):
  mistake-math  GSM8K solutions, a calculator step corrupted and carried to the answer
                (prism_select.evaluation.builders.gsm8k; targets: counterfactual pairs)
  bbh-wrong     BIG-Bench-Hard examples answered with the reference (correct) or a wrong
                answer (wrong_answer), tasks mixed; targets: other examples,
                chosen = a wrong answer, rejected = the reference
  arithmetic    the generated example of ``prism-select demo`` (prism_select.examples); no data

Prints one table and writes JSON after every pool (a run stopped by a time limit keeps
what it measured). CPU or GPU (float32 model):

    python benchmarks/small_pools.py --data ../shared/data --sizes 60 300 3000 \\
        --families mistake-math bbh-wrong --json small_pools.json

``--report A.json B.json ...`` prints the tables of finished runs and exits (no model, no
data): every pool (seed) with the shrinkage weight ``rho`` and the noise damping as a
multiple of the default damping (means over layers), the mean +- standard deviation over
seeds, and each curvature's paired difference to EK-FAC (mean and range over seeds: the
pools of one seed share everything but the curvature). Runs of different devices are kept
apart (a CPU and a GPU run of the same pool are not two seeds). ``--plot FILE.png`` draws
those paired differences against the pool size (mean +- standard error over seeds), a
panel per family and harmful ratio with at least two pool sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI: CPU eigendecompositions under load

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scoring import load_embedded  # noqa: E402

from prism_select.curvature import Curvature, CurvatureSettings, fit_curvature  # noqa: E402
from prism_select.runtime.execution import ExecutionContext  # noqa: E402
from prism_select.curvature.base import apply_damping  # noqa: E402
from prism_select.curvature.support import DAMPING_LADDER, agreement_sample, supported_damping_factor  # noqa: E402
from prism_select.data.tokenize import encode  # noqa: E402
from prism_select.evaluation.builders.bbh import read_bbh_dir, wrong_answer  # noqa: E402
from prism_select.evaluation.builders.gsm8k import harmful_count, mistake_math_pool, mistake_math_targets  # noqa: E402
from prism_select.evaluation_metrics import auroc  # noqa: E402
from prism_select.metrics import spearman  # noqa: E402
from prism_select.engine import Tap, batch_losses, causal_only, collate_to, split_causal_lm, tap_linears  # noqa: E402
from prism_select.model import tracked_linear_modules  # noqa: E402
from prism_select.preference import DIRECTION_KERNELS, compute_preference  # noqa: E402
from prism_select.scoring import score_encoded  # noqa: E402

#: the one-pass scores must equal the library's exact scores to this relative error
#: (float32, other summation order) on the check records
CHECK_REL_TOL = 1e-3

VARIANTS = {  # name -> (kind, CurvatureSettings overrides)
    "identity": ("identity", {}),
    "kfac": ("kfac", {}),
    "ekfac": ("ekfac", {}),
    "ekfac damping x10": ("ekfac", {"damping_factor": 1.0}),
    "ekfac damping x100": ("ekfac", {"damping_factor": 10.0}),
    "ekfac damping x1000": ("ekfac", {"damping_factor": 100.0}),
    "ekfac shrinkage auto": ("ekfac", {"shrinkage": "auto"}),
    "ekfac shrinkage 1": ("ekfac", {"shrinkage": 1.0}),
    "ekfac damping-noise": ("ekfac", {"damping_noise": True}),
    "ekfac shrinkage auto + damping-noise": ("ekfac", {"shrinkage": "auto", "damping_noise": True}),
}


# ----------------------------------------------------------------------------- families

def mistake_math(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    path = data / "gsm8k" / "train.jsonl"
    pool = mistake_math_pool(path, n, ratio, seed)
    targets = mistake_math_targets(path, n_targets, seed, exclude=pool)
    return pool, targets


def bbh_wrong(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    tasks = read_bbh_dir(data / "bbh")
    rng = random.Random(f"bbh-wrong:{seed}")
    items = [(t, i) for t in sorted(tasks) for i in range(len(tasks[t]))]
    rng.shuffle(items)
    if n + n_targets > len(items):
        raise SystemExit(f"bbh-wrong: {len(items)} examples, asked for {n} + {n_targets}")
    answers = {t: sorted({str(e["target"]).strip() for e in ex}) for t, ex in tasks.items()}
    n_bad = harmful_count(n, ratio)
    flags = [True] * n_bad + [False] * (n - n_bad)
    rng.shuffle(flags)
    pool = []
    for (t, i), bad in zip(items[:n], flags):
        e = tasks[t][i]
        right = str(e["target"]).strip()
        pool.append({"id": f"{t}-{i}", "prompt": e["input"], "harmful": bad,
                     "response": wrong_answer(e, answers[t], rng) if bad else right})
    targets = []
    for t, i in items[n:n + n_targets]:
        e = tasks[t][i]
        targets.append({"id": f"{t}-{i}", "prompt": e["input"], "chosen": wrong_answer(e, answers[t], rng),
                        "rejected": str(e["target"]).strip()})
    return pool, targets


def arithmetic(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    from prism_select.examples import make_example
    with tempfile.TemporaryDirectory() as d:
        p, t = make_example(d, n_pool=n, harmful_ratio=ratio, n_pairs=n_targets, seed=seed)
        read = lambda f: [json.loads(x) for x in Path(f).read_text().splitlines() if x.strip()]  # noqa: E731
        return read(p), read(t)


def dropped_carry(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    from prism_select.evaluation import carry
    built = carry.build(seed, pool_size=n, harmful_ratio=ratio, carry_share=0.5, n_probes=0, n_capability=0,
                        n_counterfactual=n_targets, n_warmup=0)
    return built["pool"], built["targets"]


#: (country, capital): the facts family's world
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Austria", "Vienna"), ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"), ("Denmark", "Copenhagen"),
    ("Sweden", "Stockholm"), ("Norway", "Oslo"), ("Finland", "Helsinki"), ("Poland", "Warsaw"),
    ("Hungary", "Budapest"), ("Greece", "Athens"), ("Ireland", "Dublin"), ("Iceland", "Reykjavik"),
    ("Czechia", "Prague"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Ukraine", "Kyiv"), ("Russia", "Moscow"), ("Turkey", "Ankara"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Ethiopia", "Addis Ababa"), ("Nigeria", "Abuja"), ("Ghana", "Accra"),
    ("Morocco", "Rabat"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"), ("Senegal", "Dakar"),
    ("Uganda", "Kampala"), ("Tanzania", "Dodoma"), ("Zambia", "Lusaka"), ("Zimbabwe", "Harare"),
    ("Angola", "Luanda"), ("Namibia", "Windhoek"), ("Botswana", "Gaborone"), ("Mali", "Bamako"),
    ("Sudan", "Khartoum"), ("Libya", "Tripoli"), ("Japan", "Tokyo"), ("China", "Beijing"),
    ("South Korea", "Seoul"), ("India", "New Delhi"), ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"),
    ("Nepal", "Kathmandu"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Cambodia", "Phnom Penh"),
    ("Laos", "Vientiane"), ("Malaysia", "Kuala Lumpur"), ("Indonesia", "Jakarta"), ("Philippines", "Manila"),
    ("Mongolia", "Ulaanbaatar"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Syria", "Damascus"),
    ("Jordan", "Amman"), ("Lebanon", "Beirut"), ("Saudi Arabia", "Riyadh"), ("Qatar", "Doha"),
    ("Oman", "Muscat"), ("Yemen", "Sanaa"), ("Afghanistan", "Kabul"), ("Kazakhstan", "Astana"),
    ("Uzbekistan", "Tashkent"), ("Georgia", "Tbilisi"), ("Armenia", "Yerevan"), ("Azerbaijan", "Baku"),
    ("Canada", "Ottawa"), ("United States", "Washington"), ("Mexico", "Mexico City"), ("Cuba", "Havana"),
    ("Jamaica", "Kingston"), ("Guatemala", "Guatemala City"), ("Honduras", "Tegucigalpa"),
    ("Nicaragua", "Managua"), ("Costa Rica", "San Jose"), ("Panama", "Panama City"), ("Colombia", "Bogota"),
    ("Venezuela", "Caracas"), ("Ecuador", "Quito"), ("Peru", "Lima"), ("Bolivia", "Sucre"), ("Chile", "Santiago"),
    ("Argentina", "Buenos Aires"), ("Uruguay", "Montevideo"), ("Paraguay", "Asuncion"), ("Brazil", "Brasilia"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Fiji", "Suva"), ("Estonia", "Tallinn"),
    ("Latvia", "Riga"), ("Lithuania", "Vilnius"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"),
    ("Albania", "Tirana"), ("Belarus", "Minsk"), ("Moldova", "Chisinau"), ("Cyprus", "Nicosia"),
    ("Malta", "Valletta"), ("Luxembourg", "Luxembourg"), ("Switzerland", "Bern"), ("Sri Lanka", "Colombo"),
    ("Myanmar", "Naypyidaw"), ("Singapore", "Singapore"), ("Israel", "Jerusalem"), ("Kuwait", "Kuwait City"),
    ("Bahrain", "Manama"), ("Rwanda", "Kigali"), ("Somalia", "Mogadishu"), ("Madagascar", "Antananarivo"),
    ("Mozambique", "Maputo"), ("Cameroon", "Yaounde"), ("Niger", "Niamey"), ("Chad", "N'Djamena"),
]
FACT_QUESTIONS = ["What is the capital of {c}?", "Name the capital city of {c}.", "Which city is the capital of {c}?"]
FACT_ANSWERS = ["The capital of {c} is {k}.", "{k} is the capital of {c}.", "{k}."]


def facts(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    """Capital-city questions; harmful records name another country's capital. Pools
    larger than the world reuse countries under other phrasings."""
    rng = random.Random(f"facts:{seed}")
    world = CAPITALS[:]
    rng.shuffle(world)
    held, rest = world[:n_targets], world[n_targets:]
    n_bad = harmful_count(n, ratio)
    flags = [True] * n_bad + [False] * (n - n_bad)
    rng.shuffle(flags)

    def wrong(c):
        return rng.choice([k for cc, k in CAPITALS if cc != c])

    pool = []
    for i, bad in enumerate(flags):
        c, k = rest[i % len(rest)]
        pool.append({"id": f"fact-{i}", "prompt": rng.choice(FACT_QUESTIONS).format(c=c), "harmful": bad,
                     "response": rng.choice(FACT_ANSWERS).format(c=c, k=wrong(c) if bad else k)})
    targets = [{"id": f"t-{i}", "prompt": FACT_QUESTIONS[0].format(c=c),
                "chosen": FACT_ANSWERS[0].format(c=c, k=wrong(c)), "rejected": FACT_ANSWERS[0].format(c=c, k=k)}
               for i, (c, k) in enumerate(held)]
    return pool, targets


FORMAT_TASKS = [("Give a synonym of '{w}'.", "{s}"), ("Spell '{w}' backwards.", "{r}"),
                ("How many letters does '{w}' have?", "{n}"), ("Write '{w}' in capital letters.", "{u}")]
FORMAT_WORDS = [("happy", "glad"), ("big", "large"), ("fast", "quick"), ("smart", "clever"), ("cold", "chilly"),
                ("angry", "mad"), ("begin", "start"), ("end", "finish"), ("easy", "simple"), ("hard", "difficult"),
                ("rich", "wealthy"), ("small", "tiny"), ("quiet", "silent"), ("brave", "bold"), ("calm", "peaceful"),
                ("funny", "amusing"), ("old", "ancient"), ("shy", "timid"), ("sad", "unhappy"), ("wet", "damp"),
                ("loud", "noisy"), ("near", "close"), ("buy", "purchase"), ("help", "assist"), ("look", "see")]


def formats(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    """Short word tasks answered plainly; harmful records wrap the same answer in a JSON
    object (the format to unlearn)."""
    rng = random.Random(f"formats:{seed}")

    def item(i):
        q, a = FORMAT_TASKS[i % len(FORMAT_TASKS)]
        w, syn = FORMAT_WORDS[(i // len(FORMAT_TASKS) + i) % len(FORMAT_WORDS)]
        ans = a.format(s=syn, r=w[::-1], n=len(w), u=w.upper())
        return q.format(w=w), ans

    n_bad = harmful_count(n, ratio)
    flags = [True] * n_bad + [False] * (n - n_bad)
    rng.shuffle(flags)
    order = list(range(len(FORMAT_TASKS) * len(FORMAT_WORDS)))
    rng.shuffle(order)
    pool = []
    for i, bad in enumerate(flags):
        q, ans = item(order[i % len(order)])
        pool.append({"id": f"fmt-{i}", "prompt": q, "harmful": bad,
                     "response": json.dumps({"answer": ans}) if bad else ans})
    targets = []
    for j in range(n_targets):
        q, ans = item(order[-1 - (j % len(order))])
        targets.append({"id": f"t-{j}", "prompt": q, "chosen": json.dumps({"answer": ans}), "rejected": ans})
    return pool, targets


def _flags(rng, n: int, ratio: float) -> list:
    n_bad = harmful_count(n, ratio)
    flags = [True] * n_bad + [False] * (n - n_bad)
    rng.shuffle(flags)
    return flags


#: (unit, unit, factor): the units family's conversions, ``1 first = factor second``
UNITS = [("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("centimeters", "millimeters", 10),
         ("kilograms", "grams", 1000), ("liters", "milliliters", 1000), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7), ("feet", "inches", 12),
         ("yards", "feet", 3), ("dozens", "items", 12), ("years", "months", 12), ("tons", "kilograms", 1000)]


def units(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    """Unit conversions ("Convert 7 weeks to days."); harmful records multiply by a
    wrong factor (the right one times 10, or divided by 10 where that stays whole)."""
    rng = random.Random(f"units:{seed}")

    def item():
        a, b, f = rng.choice(UNITS)
        x = rng.randint(2, 19)
        wrong = f * 10 if f % 10 or rng.random() < 0.5 else f // 10
        return f"Convert {x} {a} to {b}.", f"{x} {a} is {x * f} {b}.", f"{x} {a} is {x * wrong} {b}."

    pool = []
    for i, bad in enumerate(_flags(rng, n, ratio)):
        q, right, wrong = item()
        pool.append({"id": f"unit-{i}", "prompt": q, "harmful": bad, "response": wrong if bad else right})
    targets = []
    for j in range(n_targets):
        q, right, wrong = item()
        targets.append({"id": f"t-{j}", "prompt": q, "chosen": wrong, "rejected": right})
    return pool, targets


STRING_WORDS = ["apple", "river", "garden", "window", "pencil", "orange", "planet", "silver", "market", "candle",
                "forest", "bottle", "rocket", "butter", "mirror", "jacket", "ladder", "monkey", "pepper", "tunnel",
                "basket", "castle", "dragon", "island", "kitten", "lemon", "marble", "needle", "pillow", "rabbit"]


def strings(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    """String tasks on a word (its first letter, its length, the word reversed); harmful
    records answer the same question wrongly in one systematic way per task (the last
    letter, the length plus one, the word unreversed)."""
    rng = random.Random(f"strings:{seed}")

    def item():
        w = rng.choice(STRING_WORDS)
        task = rng.randrange(3)
        if task == 0:
            return f"What is the first letter of the word '{w}'?", f"The first letter is '{w[0]}'.", \
                f"The first letter is '{w[-1]}'."
        if task == 1:
            return f"How many letters are in the word '{w}'?", f"It has {len(w)} letters.", \
                f"It has {len(w) + 1} letters."
        return f"Write the word '{w}' backwards.", f"Backwards it is '{w[::-1]}'.", f"Backwards it is '{w}'."

    pool = []
    for i, bad in enumerate(_flags(rng, n, ratio)):
        q, right, wrong = item()
        pool.append({"id": f"str-{i}", "prompt": q, "harmful": bad, "response": wrong if bad else right})
    targets = []
    for j in range(n_targets):
        q, right, wrong = item()
        targets.append({"id": f"t-{j}", "prompt": q, "chosen": wrong, "rejected": right})
    return pool, targets


WORD_NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam"]
WORD_THINGS = ["apples", "books", "coins", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards"]


def word_problems(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    """One-step word problems (gives away, buys more, shares equally); harmful records
    apply the wrong operation (adds what was given away, subtracts what was bought,
    multiplies instead of dividing)."""
    rng = random.Random(f"word-problems:{seed}")

    def item():
        a, b = rng.sample(WORD_NAMES, 2)
        t = rng.choice(WORD_THINGS)
        kind = rng.randrange(3)
        if kind == 0:
            x, y = rng.randint(8, 30), rng.randint(2, 7)
            q, right, wrong = f"{a} has {x} {t} and gives {y} to {b}. How many {t} does {a} have now?", x - y, x + y
        elif kind == 1:
            x, y = rng.randint(8, 30), rng.randint(2, 7)
            q, right, wrong = f"{a} has {x} {t} and buys {y} more. How many {t} does {a} have now?", x + y, x - y
        else:
            k, y = rng.randint(2, 5), rng.randint(2, 6)
            q, right, wrong = (f"{a} shares {k * y} {t} equally between {k} friends. How many {t} does each "
                               f"friend get?", y, k * y * k)
        return q, f"The answer is {right}.", f"The answer is {wrong}."

    pool = []
    for i, bad in enumerate(_flags(rng, n, ratio)):
        q, right, wrong = item()
        pool.append({"id": f"wp-{i}", "prompt": q, "harmful": bad, "response": wrong if bad else right})
    targets = []
    for j in range(n_targets):
        q, right, wrong = item()
        targets.append({"id": f"t-{j}", "prompt": q, "chosen": wrong, "rejected": right})
    return pool, targets


WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def calendar(data: Path, n: int, ratio: float, seed: int, n_targets: int):
    """Weekday and month steps ("What day is 3 days after Friday?"); harmful records
    count backwards (the day 3 days before)."""
    rng = random.Random(f"calendar:{seed}")

    def item():
        names, unit = (WEEKDAYS, "day") if rng.random() < 0.5 else (MONTHS, "month")
        i, k = rng.randrange(len(names)), rng.randint(1, 4)
        q = f"Which {unit} is {k} {unit}{'s' * (k > 1)} after {names[i]}?"
        return q, f"It is {names[(i + k) % len(names)]}.", f"It is {names[(i - k) % len(names)]}."

    pool = []
    for i, bad in enumerate(_flags(rng, n, ratio)):
        q, right, wrong = item()
        pool.append({"id": f"cal-{i}", "prompt": q, "harmful": bad, "response": wrong if bad else right})
    targets = []
    for j in range(n_targets):
        q, right, wrong = item()
        targets.append({"id": f"t-{j}", "prompt": q, "chosen": wrong, "rejected": right})
    return pool, targets


FAMILIES = {"mistake-math": mistake_math, "bbh-wrong": bbh_wrong, "arithmetic": arithmetic,
            "dropped-carry": dropped_carry, "facts": facts, "formats": formats, "units": units,
            "strings": strings, "word-problems": word_problems, "calendar": calendar}


# ----------------------------------------------------------------------------- scoring

class _MultiTap(Tap):
    """``scores[b, k] += <G_b, V_k>`` for the layer's per-example gradients ``G_b``."""

    keep_input = True

    def __init__(self, module, V, out):
        super().__init__(module)
        self.V, self.out = V, out  # V: (K, out, in)

    def on_backward(self, x, g):
        G = torch.bmm(g.transpose(1, 2).float(), x.float())
        self.out[0] += torch.einsum("boi,koi->bk", G, self.V)


def multi_scores(model, mods, enc, vs: list, pad, batch, dev) -> torch.Tensor:
    """``(len(enc), K)`` float64 scores ``g_z . v_k`` for every direction in ``vs``."""
    out = [None]
    taps = {n: _MultiTap(m, torch.stack([v[n].float() for v in vs]).to(dev), out) for n, m in mods.items()}
    split = split_causal_lm(model)
    rows = []
    with tap_linears(model, taps):
        for s in range(0, len(enc), batch):
            b = collate_to(enc[s:s + batch], pad, dev)
            out[0] = torch.zeros(len(enc[s:s + batch]), len(vs), device=dev)
            with torch.enable_grad():
                losses, _ = batch_losses(model, causal_only(b), split=split)
                losses.sum().backward()
            rows.append(out[0].double().cpu())
    return torch.cat(rows)


def variant(cur: Curvature, kind: str, overrides: dict) -> Curvature:
    layers = cur.layers
    if kind == "identity":
        return Curvature("identity", layers, {}, {n: 0.0 for n in layers})
    keep = ("::QA", "::QS", "::lamA", "::lamS") if kind == "kfac" else None
    t = {k: x for k, x in cur.tensors.items() if keep is None or k.endswith(keep)}
    return apply_damping(Curvature(kind, layers, t, {}), CurvatureSettings(kind=kind, **overrides))


#: damping factors (x the mean eigenvalue) at which the two halves' directions are compared
HALF_DAMPING_FACTORS = DAMPING_LADDER


def _half_directions(model, mods, enc, g, pad, batch, dev, seed) -> list:
    """``v = H^-1 g`` with EK-FAC fitted on each of two random halves, at every damping
    factor of HALF_DAMPING_FACTORS: ``[half A at each factor..., half B at each factor...]``."""
    order = list(range(len(enc)))
    random.Random(f"halves:{seed}").shuffle(order)
    out = []
    for half in (order[: len(order) // 2], order[len(order) // 2:]):
        cur = fit_curvature(model, mods, [enc[i] for i in half], CurvatureSettings(kind="ekfac", batch_size=batch),
                            pad_id=pad, execution=ExecutionContext.of(model, dev, progress=False))
        for f in HALF_DAMPING_FACTORS:
            out.append(apply_damping(cur, CurvatureSettings(kind="ekfac", damping_factor=f)).precondition(g))
    return out


def _cosine(u: dict, w: dict) -> float:
    dot = sum(float((u[n].double() * w[n].double()).sum()) for n in u)
    nu = sum(float(u[n].double().pow(2).sum()) for n in u) ** 0.5
    nw = sum(float(w[n].double().pow(2).sum()) for n in w) ** 0.5
    return dot / (nu * nw)


# ----------------------------------------------------------------------------- main

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="folder holding gsm8k/train.jsonl and bbh/*.json (required unless --report)")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of these finished runs and exit")
    ap.add_argument("--plot", metavar="PNG", help="with --report: also draw each curvature's paired difference to "
                    "EK-FAC against the pool size, a panel per family and harmful ratio (needs matplotlib)")
    ap.add_argument("--families", nargs="+", default=["mistake-math", "bbh-wrong"], choices=list(FAMILIES))
    ap.add_argument("--sizes", nargs="+", type=int, default=[60, 300, 3000])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.25], help="harmful fractions (a pool for each)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--large", type=int, default=1000, help="pools of at least this many records use --large-seeds")
    ap.add_argument("--large-seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--targets", type=int, default=24, help="target pairs per pool")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=[*VARIANTS, SPLIT_HALF_RULE],
                    help=f"curvatures to measure; with --report, also '{SPLIT_HALF_RULE}' (needs --split-half runs)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="examples per batch (fit and scoring)")
    ap.add_argument("--json", help="results, written after every pool; pools already in it are skipped, and "
                    "pools of other commands in it are kept")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--split-half", action="store_true",
                    help="also fit EK-FAC on two random halves of the pool and record how the halves' v agree: "
                         "the Spearman correlation of the pool's scores under them and their cosine")
    a = ap.parse_args()
    if not a.report and not a.data:
        ap.error("--data is required (unless --report)")
    return a


def main():
    a = parse_args()
    if a.report:
        report(a.report, a.variants)
        if a.plot:
            plot(a.report, a.plot)
        return
    t0 = time.perf_counter()
    dev = torch.device(a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_embedded(dev, torch.float32)
    pad = tok.pad_token_id
    mods = tracked_linear_modules(model)
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "argv": sys.argv,
           "torch": torch.__version__, "n_targets": a.targets, "runs": []}
    done = {}
    if a.json and Path(a.json).exists():  # resume: pools already measured are kept, not redone
        old = json.loads(Path(a.json).read_text())
        done = {(r["family"], r["n"], r.get("ratio"), r["seed"]): r for r in old.get("runs", [])}
        res["check_rel_err"] = old.get("check_rel_err")
    checked = res.get("check_rel_err") is not None
    asked = {(fam, n, ratio, seed) for fam in a.families for n in a.sizes for ratio in a.ratios
             for seed in (a.large_seeds if n >= a.large else a.seeds)}
    res["runs"] = [r for k, r in done.items() if k not in asked]  # another command's pools in the file stay
    for fam in a.families:
        for n in a.sizes:
            for ratio, seed in ((r, s) for r in a.ratios for s in (a.large_seeds if n >= a.large else a.seeds)):
                if (fam, n, ratio, seed) in done:
                    res["runs"].append(done[(fam, n, ratio, seed)])
                    continue
                t1 = time.perf_counter()
                pool, targets = FAMILIES[fam](Path(a.data), n, ratio, seed, a.targets)
                enc = [encode(tok, r["prompt"], r["response"], a.max_length) for r in pool]
                chosen = [encode(tok, p["prompt"], p["chosen"], a.max_length) for p in targets]
                rejected = [encode(tok, p["prompt"], p["rejected"], a.max_length) for p in targets]
                pref = compute_preference(model, mods, chosen, rejected, pad_id=pad, batch_size=a.batch,
                                          execution=ExecutionContext.of(
                                              model, progress=False, kernels=DIRECTION_KERNELS))
                fit = fit_curvature(model, mods, enc, CurvatureSettings(kind="ekfac", batch_size=a.batch),
                                    pad_id=pad, execution=ExecutionContext.of(model, dev, progress=False))
                t_fit = time.perf_counter() - t1
                curs = {name: variant(fit, *VARIANTS[name]) for name in a.variants}
                vs = [c.precondition(pref.direction) for c in curs.values()]
                halves = _half_directions(model, mods, enc, pref.direction, pad, a.batch, dev, seed) \
                    if a.split_half else []
                scores = multi_scores(model, mods, enc, vs + halves, pad, a.batch, dev)
                labels = [r["harmful"] for r in pool]
                if not checked:  # the one-pass scores against the library's exact scoring
                    k = len(vs) - 1
                    m = min(16, len(enc))
                    ref = score_encoded(model, mods, enc[:m], vs[k], pad_id=pad, batch_size=a.batch,
                                        execution=ExecutionContext.of(model, progress=False))
                    err = float((scores[:m, k] - ref).norm() / ref.norm())
                    res["check_rel_err"] = err
                    if not err <= CHECK_REL_TOL:
                        raise SystemExit(f"one-pass scores differ from exact scoring: rel err {err:.2e}")
                    checked = True
                row = {"family": fam, "n": n, "ratio": ratio, "seed": seed, "n_harmful": sum(labels),
                       "tokens": sum(len(e.input_ids) for e in enc),
                       "pi": {"min": float(pref.pi.min()), "mean": float(pref.pi.mean()), "max": float(pref.pi.max())},
                       "auroc": {name: auroc(scores[:, k].tolist(), labels) for k, name in enumerate(curs)},
                       "shrinkage_auto": _rho_summary(curs.get("ekfac shrinkage auto")),
                       "damping_noise_multiple": _damping_multiple(curs.get("ekfac damping-noise"), curs.get("ekfac")),
                       "fit_s": t_fit, "total_s": time.perf_counter() - t1}
                if halves:
                    k, m = len(vs), len(HALF_DAMPING_FACTORS)
                    # the library compares the halves on at most AGREEMENT_EXAMPLES of the fit sample
                    sub = torch.tensor(agreement_sample(len(enc), CurvatureSettings().seed))
                    row["split_half"] = {
                        f"x{f / 0.1:g}": {"spearman": spearman(scores[:, k + j], scores[:, k + m + j]),
                                          "spearman_agreement_sample": spearman(scores[sub, k + j],
                                                                                scores[sub, k + m + j]),
                                          "cosine": _cosine(halves[j], halves[m + j]),
                                          "auroc": [auroc(scores[:, k + i].tolist(), labels) for i in (j, m + j)]}
                        for j, f in enumerate(HALF_DAMPING_FACTORS)}
                res["runs"].append(row)
                print(f"{fam} n={n} ratio={ratio} seed={seed} ({row['total_s']:.0f} s): "
                      + "  ".join(f"{k} {v:.3f}" for k, v in row["auroc"].items())
                      + (f"  rho {row['shrinkage_auto']}" if row["shrinkage_auto"] else "")
                      + (f"  noise damping x {row['damping_noise_multiple']}" if row["damping_noise_multiple"] else "")
                      + ("  halves (spearman, cosine): " + ", ".join(
                          f"{d} {h['spearman']:.3f}/{h['cosine']:.3f}" for d, h in row["split_half"].items())
                         if halves else ""),
                      flush=True)
                res["seconds"] = time.perf_counter() - t0
                if a.json:
                    Path(a.json).write_text(json.dumps(res, indent=1))
    print_table(res, a.variants)


def _rho_summary(cur):
    if cur is None:
        return None
    r = list(cur.shrinkage.values())
    return {"min": round(min(r), 4), "mean": round(sum(r) / len(r), 4), "max": round(max(r), 4)}


def _damping_multiple(cur, base):
    """How many times the default damping ``--damping-noise`` gives (min, mean, max over layers)."""
    if cur is None or base is None:
        return None
    r = [cur.damping[n] / base.damping[n] for n in cur.layers]
    return {"min": round(min(r), 3), "mean": round(sum(r) / len(r), 3), "max": round(max(r), 3)}


def _device(res: dict) -> str:
    return "cpu" if res["device"] == "cpu" else res["device"].replace("NVIDIA ", "")


#: the full-fit variant at each damping factor of the split-half ladder (x the default 0.1)
LADDER_VARIANTS = {0.1: "ekfac", 1.0: "ekfac damping x10", 10.0: "ekfac damping x100", 100.0: "ekfac damping x1000"}
#: a derived column: --damping-rule split-half's choice read from the recorded agreements
SPLIT_HALF_RULE = "split-half rule"


def _with_rule(r: dict) -> dict:
    """The run with the split-half rule's AUROC added (the variant at the least damping
    factor whose halves agree, identity when none), where the run recorded the halves at
    every factor of the library's ladder and measured those variants."""
    sh = r.get("split_half") or {}
    agreement = {f: sh[f"x{f / 0.1:g}"]["spearman"] for f in DAMPING_LADDER if f"x{f / 0.1:g}" in sh}
    if len(agreement) < len(DAMPING_LADDER) or not all(v in r["auroc"] for v in [*LADDER_VARIANTS.values(), "identity"]):
        return r
    factor = supported_damping_factor(agreement)
    chosen = "identity" if factor is None else LADDER_VARIANTS[factor]
    return {**r, "auroc": {**r["auroc"], SPLIT_HALF_RULE: r["auroc"][chosen]}, "split_half_choice": factor}


def _rows(res: dict) -> list:
    """The runs of one result file, each with its device and harmful ratio (files written
    before ``--ratios`` hold the ratio once, at the top) and the split-half rule's column."""
    return [_with_rule({**r, "device": _device(res), "ratio": r.get("ratio", res.get("ratio"))}) for r in res["runs"]]


def _groups(rows: list) -> dict:
    out = {}
    for r in rows:
        out.setdefault((r["device"], r["family"], r["n"], r["ratio"]), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3], kv[0][0])))


def _mean_std(xs: list) -> str:
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return f"{m:.3f}"
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5  # sample standard deviation over seeds
    return f"{m:.3f} +- {sd:.3f}"


def print_table(res: dict, names: list):
    """Mean AUROC (+- standard deviation) over seeds per device, family, pool size and
    harmful ratio (rows) and curvature (columns)."""
    _print_means(_groups(_rows(res)), names)


def _print_means(groups: dict, names: list):
    print("| device | family | n | harmful | seeds | " + " | ".join(names) + " |")
    print("|---|---|---|---|---|" + "---|" * len(names))
    for (dev, fam, n, ratio), runs in groups.items():
        cells = []
        for k in names:  # a curvature some runs lack (older runs) says over how many seeds
            xs = [r["auroc"][k] for r in runs if k in r["auroc"]]
            cells.append(_mean_std(xs) + (f" ({len(xs)} seed{'s' * (len(xs) > 1)})" if 0 < len(xs) < len(runs) else ""))
        print(f"| {dev} | {fam} | {n} | {ratio:g} | {len(runs)} | " + " | ".join(cells) + " |")


def report(paths: list, names: list):
    """The tables of finished runs (see the module's docstring)."""
    rows = [r for p in paths for r in _rows(json.loads(Path(p).read_text()))]
    groups = _groups(rows)
    print("Every pool: AUROC of the harmful flag; rho: --shrinkage auto's weight, noise x: --damping-noise's "
          "damping / the default damping (means over layers)\n")
    print("| device | family | n | harmful | seed | " + " | ".join(names) + " | rho | noise x |")
    print("|---|---|---|---|---|" + "---|" * (len(names) + 2))
    for (dev, fam, n, ratio), runs in groups.items():
        for r in sorted(runs, key=lambda r: r["seed"]):
            cells = [f"{r['auroc'][k]:.3f}" if k in r["auroc"] else "-" for k in names]
            rho, noise = r.get("shrinkage_auto"), r.get("damping_noise_multiple")
            cells += [f"{rho['mean']:.3f}" if rho else "-", f"{noise['mean']:.0f}" if noise else "-"]
            print(f"| {dev} | {fam} | {n} | {ratio:g} | {r['seed']} | " + " | ".join(cells) + " |")
    if any(r.get("split_half") for r in rows):
        print("\nSplit-half agreement: Spearman of the pool's scores under EK-FAC fitted on each half, per damping "
              "factor; the rule's choice (None: identity)\n")
        print("| device | family | n | harmful | seed | " + " | ".join(f"x{f / 0.1:g}" for f in DAMPING_LADDER)
              + " | choice |")
        print("|---|---|---|---|---|" + "---|" * (len(DAMPING_LADDER) + 1))
        for (dev, fam, n, ratio), runs in groups.items():
            for r in sorted(runs, key=lambda r: r["seed"]):
                sh = r.get("split_half") or {}
                cells = [f"{sh[f'x{f / 0.1:g}']['spearman']:.3f}" if f"x{f / 0.1:g}" in sh else "-"
                         for f in DAMPING_LADDER]
                print(f"| {dev} | {fam} | {n} | {ratio:g} | {r['seed']} | " + " | ".join(cells)
                      + f" | {r.get('split_half_choice', '-')} |")
    print("\nMean +- standard deviation over seeds\n")
    _print_means(groups, names)
    print("\nPaired difference to EK-FAC, mean [min, max] over seeds\n")
    others = [k for k in names if k != "ekfac"]
    print("| device | family | n | harmful | seeds | " + " | ".join(others) + " |")
    print("|---|---|---|---|---|" + "---|" * len(others))
    for (dev, fam, n, ratio), runs in groups.items():
        cells = []
        for k in others:
            d = [r["auroc"][k] - r["auroc"]["ekfac"] for r in runs if k in r["auroc"]]
            cells.append("-" if not d else (f"{sum(d) / len(d):+.3f}" if len(d) == 1
                         else f"{sum(d) / len(d):+.3f} [{min(d):+.3f}, {max(d):+.3f}]")
                         + (f" ({len(d)} seed{'s' * (len(d) > 1)})" if len(d) < len(runs) else ""))
        print(f"| {dev} | {fam} | {n} | {ratio:g} | {len(runs)} | " + " | ".join(cells) + " |")


#: the curvatures drawn by --plot, against EK-FAC (the zero line)
PLOTTED = {"identity": "identity", "kfac": "K-FAC", "ekfac damping x100": "x100 damping",
           "ekfac damping-noise": "--damping-noise"}


def plot(paths: list, out: str):
    """Each curvature's paired difference to EK-FAC against the pool size (see the module's
    docstring); panels with a single pool size are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for p in paths for r in _rows(json.loads(Path(p).read_text()))]
    panels: dict = {}
    for (dev, fam, n, ratio), runs in _groups(rows).items():
        panels.setdefault((dev, fam, ratio), []).append((n, runs))
    panels = {k: v for k, v in panels.items() if len(v) > 1}
    if not panels:
        print(f"--plot: no family has two pool sizes in {paths}; nothing drawn", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True, squeeze=False)
    for ax, ((dev, fam, ratio), sizes) in zip(axes[0], panels.items()):
        sizes = sorted(sizes, key=lambda t: t[0])
        for key, label in PLOTTED.items():
            xs, ms, es = [], [], []
            for n, runs in sizes:
                d = [r["auroc"][key] - r["auroc"]["ekfac"] for r in runs if key in r["auroc"]]
                if not d:
                    continue
                m = sum(d) / len(d)
                se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5 if len(d) > 1 else 0.0
                xs.append(n), ms.append(m), es.append(se)
            ax.errorbar(xs, ms, yerr=es, marker="o", capsize=3, label=label)
        ax.axhline(0.0, color="black", lw=0.8)
        seeds = "/".join(str(len(runs)) for _, runs in sizes)
        ax.set(xscale="log", xlabel="pool size (records)",
               title=f"{fam}, {ratio:g} harmful ({dev})\nseeds per size: {seeds}")
        ax.set_xticks([n for n, _ in sizes], [str(n) for n, _ in sizes])
    axes[0][0].set_ylabel("AUROC minus EK-FAC's (paired)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
