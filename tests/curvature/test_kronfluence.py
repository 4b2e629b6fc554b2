"""Agreement with kronfluence's EK-FAC at matched settings (optional dependency).

PRISM in kronfluence: the query measurement is ``-(1/|Q|) sum_q softplus(m_q)``
(its gradient is g_KL) with ``aggregate_query_gradients=True``; empirical Fisher,
heuristic damping (0.1 x mean eigenvalue, both libraries), the same tracked
modules, every non-padding token in the activation covariance. Compared: the score
values (relative to the largest) and their ranks.
"""

import pytest
import torch

kronfluence = pytest.importorskip("kronfluence")

from kronfluence.analyzer import Analyzer, prepare_model  # noqa: E402
from kronfluence.arguments import FactorArguments, ScoreArguments  # noqa: E402
from kronfluence.task import Task  # noqa: E402
from kronfluence.utils.dataset import DataLoaderKwargs  # noqa: E402

from prism_select.curvature import CurvatureSettings, fit_curvature  # noqa: E402
from prism_select.data.tokenize import collate, encode, token_losses  # noqa: E402
from prism_select.preference import compute_preference  # noqa: E402
from prism_select.scoring import score_encoded  # noqa: E402

from tiny import ARITHMETIC_POOL as POOL  # noqa: E402

MIN_SPEARMAN = 0.99
# Every score within this fraction of the largest |score| of kronfluence's: both run in
# float64, so only summation order and the eigensolver differ. Measured 6.9e-15 on this
# test's 24 candidates (x86 CPU, torch's float64 eigh); about 7x that.
KRONFLUENCE_SCORE_REL_TOL = 5e-14

# More candidates than the theorem test's 12: arithmetic with right and wrong answers.
EXTRA_POOL = [(f"What is {a}+{b}?", f"{a}+{b}={a + b + (k % 3 == 0)}. The answer is {a + b + (k % 3 == 0)}.")
              for k, (a, b) in enumerate((a, b) for a in range(2, 6) for b in range(1, 4))]


def spearman(a, b):
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).correlation)


class PrismTask(Task):
    def __init__(self, names):
        self.names = names

    def compute_train_loss(self, batch, model, sample=False):
        assert not sample  # empirical Fisher only in this test
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total, _ = token_losses(logits, batch["labels"])
        return total.sum()

    def compute_measurement(self, batch, model):
        # One forward over chosen + rejected: kronfluence's hooks expect each tracked
        # module to run once per measurement (else has_shared_parameters=True).
        b = batch["both"]
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        total, count = token_losses(logits, b["labels"])
        mean = total / count
        q = mean.shape[0] // 2
        margin = -mean[:q] + mean[q:]
        return -torch.nn.functional.softplus(margin).sum() / batch["n_pairs"]

    def get_influence_tracked_modules(self):
        return self.names

    def get_attention_mask(self, batch):
        return batch["attention_mask"]


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_ekfac_scores_agree_with_kronfluence(model, modules, tok, pair_examples, tmp_path):
    pool = [encode(tok, p, r) for p, r in POOL + EXTRA_POOL]
    chosen = [encode(tok, q, c) for q, c, _ in pair_examples]
    rejected = [encode(tok, q, r) for q, _, r in pair_examples]
    pad = tok.pad_token_id

    pref = compute_preference(model, modules, chosen, rejected, pad_id=pad)
    cur = fit_curvature(model, modules, pool, CurvatureSettings(kind="ekfac", batch_size=4), pad_id=pad)
    ours = score_encoded(model, modules, pool, cur.precondition(pref.direction), pad_id=pad)

    task = PrismTask(list(modules))
    kf_model = prepare_model(model, task)
    analyzer = Analyzer("prism", model=kf_model, task=task, output_dir=str(tmp_path), disable_tqdm=True,
                        disable_model_save=True, cpu=True)
    f64 = torch.float64
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True,
                                  activation_covariance_dtype=f64, gradient_covariance_dtype=f64,
                                  eigendecomposition_dtype=f64, per_sample_gradient_dtype=f64, lambda_dtype=f64)
    train = ListDataset(pool)
    n_pairs = len(chosen)
    query = ListDataset([(c, r) for c, r in zip(chosen, rejected)])
    analyzer.fit_all_factors("f", dataset=train, factor_args=factor_args, per_device_batch_size=4,
                             dataloader_kwargs=DataLoaderKwargs(collate_fn=lambda b: collate(b, pad)),
                             overwrite_output_dir=True)

    def query_collate(items):
        return {"both": collate([c for c, _ in items] + [r for _, r in items], pad), "n_pairs": n_pairs}

    score_args = ScoreArguments(damping_factor=None, aggregate_query_gradients=True,
                                per_sample_gradient_dtype=f64, precondition_dtype=f64, score_dtype=f64)
    # Query and train batches go through one collate_fn in kronfluence; dispatch on the item type.
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(
        collate_fn=lambda b: query_collate(b) if isinstance(b[0], tuple) else collate(b, pad)))
    analyzer.compute_pairwise_scores("s", factors_name="f", query_dataset=query, train_dataset=train,
                                     per_device_query_batch_size=n_pairs, per_device_train_batch_size=4,
                                     score_args=score_args, overwrite_output_dir=True)
    theirs = analyzer.load_pairwise_scores("s")["all_modules"].reshape(-1)
    assert ours.shape == theirs.shape == (len(pool),)
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    rho = spearman(ours.numpy(), theirs.numpy())
    print(f"vs kronfluence EK-FAC, {len(pool)} candidates: max |ours - theirs| / max |theirs| = {rel:.2e}, "
          f"Spearman {rho:.6f}")
    assert rel <= KRONFLUENCE_SCORE_REL_TOL, (rel, ours, theirs)
    assert rho >= MIN_SPEARMAN, (rho, ours, theirs)
