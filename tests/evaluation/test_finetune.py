"""LoRA SFT (prism_select.finetune) and subset export, on a tiny in-process Llama."""

import json

import pytest
import torch
from safetensors import safe_open

from prism_select.data.records import PoolExample
from prism_select.data.tokenize import collate, encode, token_losses
from prism_select.errors import ConfigError, InputError, OutputError
from prism_select.evaluation import FinetuneSettings, export_subset, finetune, load_optimizer_state
from prism_select.model import LoadedModel, ModelSettings, load_model, model_fingerprint

from conftest import POOL
from evaluation_data import offline_with_own_cache  # noqa: F401 (fixture)
from tiny import save_tiny, tiny_llama, tiny_tokenizer


@pytest.fixture
def tiny_dir(tmp_path):
    return save_tiny(tmp_path / "tiny")


def _pool():
    return [PoolExample(i, p, r, i) for i, (p, r) in enumerate(POOL)]


def _mean_loss(model, tok):
    enc = [encode(tok, p, r) for p, r in POOL]
    b = collate(enc, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    total, count = token_losses(logits, b["labels"])
    return float(total.sum() / count.sum())


FAST = dict(learning_rate=3e-2, epochs=3, batch_size=4, grad_accum=1, lora_r=4, lora_alpha=8,
            lora_dropout=0.0, warmup_ratio=0.0, progress=False)


def test_presets_have_the_paper_values():
    g = FinetuneSettings.preset("general")
    assert (g.learning_rate, g.epochs, g.batch_size, g.grad_accum) == (2e-5, 4, 1, 128)
    assert (g.lora_r, g.lora_alpha, g.lora_dropout) == (128, 512, 0.1)
    assert g.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (g.lr_scheduler, g.warmup_ratio, g.weight_decay, g.max_length) == ("linear", 0.03, 0.0, 2048)
    r = FinetuneSettings.preset("repair")
    assert (r.learning_rate, r.epochs, r.batch_size, r.grad_accum) == (1e-4, 1, 4, 1)
    assert (r.lora_r, r.lora_alpha, r.target_modules, r.weight_decay, r.max_length) == (32, 64, "all-linear", 0.0, 2048)
    assert FinetuneSettings() == g
    assert FinetuneSettings.preset("repair", epochs=2).epochs == 2
    with pytest.raises(ConfigError):
        FinetuneSettings.preset("nope")
    with pytest.raises(ConfigError):
        FinetuneSettings.preset("general", nope=1)
    with pytest.raises(ConfigError):
        FinetuneSettings(lora_r=0)
    with pytest.raises(ConfigError):
        FinetuneSettings(warmup_ratio=1.0)


def test_finetune_lowers_the_loss_and_the_adapter_loads_back(tmp_path, tiny_dir):
    lm = load_model(ModelSettings(str(tiny_dir), dtype="float32", device="cpu"))
    fp = lm.fingerprint
    before = _mean_loss(lm.model, lm.tokenizer)
    res = finetune(lm, _pool(), tmp_path / "ft", FinetuneSettings(**FAST), save_every_epoch=True)
    # the caller's model is restored: same weights, eval mode, no adapter
    assert model_fingerprint(lm.model) == fp and not lm.model.training
    assert not hasattr(lm.model, "peft_config")
    assert (res.adapter_dir / "adapter_config.json").is_file()
    assert (res.adapter_dir / "adapter_model.safetensors").is_file()
    losses = [h["loss"] for h in res.log_history if "loss" in h]
    assert len(losses) == 6  # 8 examples / batch 4 = 2 steps per epoch, 3 epochs
    tuned = load_model(ModelSettings(str(tiny_dir), adapter=str(res.adapter_dir), dtype="float32", device="cpu"))
    after = _mean_loss(tuned.model, tuned.tokenizer)
    assert after < before - 0.1
    # per-epoch checkpoints with Adam state keyed like the adapter's tensors
    assert [c.name for c in res.checkpoints] == ["epoch-1", "epoch-2", "epoch-3"]
    with safe_open(str(res.checkpoints[-1] / "adapter_model.safetensors"), "pt") as f:
        adapter_keys = set(f.keys())
    m, v, meta = load_optimizer_state(res.checkpoints[-1])
    assert set(m) == set(v) == adapter_keys
    assert int(meta["step"]) == 6
    assert all(float(t.min()) >= 0 for t in v.values()) and any(float(t.abs().sum()) > 0 for t in m.values())
    info = json.loads((res.checkpoints[0] / "checkpoint.json").read_text())
    assert info["epoch"] == 1 and len(info["lrs"]) == 2
    assert info["mean_lr"] == pytest.approx(sum(info["lrs"]) / 2)
    assert res.epoch_lrs[0][0] == pytest.approx(3e-2)  # linear decay from the peak, no warm-up
    assert json.loads((tmp_path / "ft" / "finetune.json").read_text())["n_examples"] == 8
    # the last checkpoint's adapter equals the final adapter
    with safe_open(str(res.adapter_dir / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(res.checkpoints[-1] / "adapter_model.safetensors"), "pt") as b:
        for k in a.keys():
            torch.testing.assert_close(a.get_tensor(k), b.get_tensor(k))
    with pytest.raises(OutputError):
        finetune(lm, _pool(), tmp_path / "ft", FinetuneSettings(**FAST))


def test_finetune_is_seeded_and_takes_a_pool_file(tmp_path):
    tok = tiny_tokenizer()
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in POOL))
    outs = []
    for k in range(2):
        model = tiny_llama(len(tok), dtype=torch.float32)
        lm = LoadedModel(model, tok, ModelSettings("tiny", device="cpu"), model_fingerprint(model), {})
        s = FinetuneSettings(**{**FAST, "epochs": 1, "lora_dropout": 0.1, "target_modules": "all-linear"})
        res = finetune(lm, pool, tmp_path / f"ft{k}", s)
        with safe_open(str(res.adapter_dir / "adapter_model.safetensors"), "pt") as f:
            outs.append({key: f.get_tensor(key) for key in f.keys()})
    assert any("mlp.down_proj" in key for key in outs[0])
    for key in outs[0]:
        torch.testing.assert_close(outs[0][key], outs[1][key])


def test_finetune_refuses_a_model_with_an_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    pm = get_peft_model(tiny_llama(len(tok), dtype=torch.float32), LoraConfig(r=2, target_modules=["q_proj"]))
    lm = LoadedModel(pm, tok, ModelSettings("tiny", device="cpu"), "x", {})
    with pytest.raises(ConfigError):
        finetune(lm, _pool(), tmp_path / "ft", FinetuneSettings(**FAST))


# ---------------------------------------------------------------- export

def _write_pool(tmp_path):
    rows = [
        {"id": "a", "prompt": "What is 2+3?", "response": "5"},
        {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye?"},
                                 {"role": "assistant", "content": "Bye."}]},
        {"id": "c", "instruction": "Add", "input": "1 and 1", "output": "2"},
    ]
    p = tmp_path / "pool.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_export_llamafactory_alpaca_and_sharegpt(tmp_path):
    pool = _write_pool(tmp_path)
    out = tmp_path / "lf"
    r = export_subset(pool, ["a", "c"], out, "plain")
    assert r["style"] == "alpaca" and r["count"] == 2
    data = json.loads((out / "plain.json").read_text())
    assert data[0] == {"instruction": "What is 2+3?", "input": "", "output": "5", "system": "", "history": []}
    assert data[1]["instruction"] == "Add\n\n1 and 1" and data[1]["output"] == "2"
    info = json.loads((out / "dataset_info.json").read_text())
    assert info["plain"]["file_name"] == "plain.json"
    assert info["plain"]["columns"] == {"prompt": "instruction", "query": "input", "response": "output",
                                        "system": "system", "history": "history"}
    # a chat prompt: sharegpt by default, alpaca on request; entries accumulate
    export_subset(pool, ["b", "a"], out, "chat")
    chat = json.loads((out / "chat.json").read_text())
    assert [m["role"] for m in chat[0]["messages"]] == ["user", "assistant"]  # pool order: a first
    assert chat[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat[1]["messages"][-1] == {"role": "assistant", "content": "Bye."}
    info = json.loads((out / "dataset_info.json").read_text())
    assert set(info) == {"plain", "chat"}
    assert info["chat"]["formatting"] == "sharegpt" and info["chat"]["columns"] == {"messages": "messages"}
    assert info["chat"]["tags"]["role_tag"] == "role" and info["chat"]["tags"]["assistant_tag"] == "assistant"
    export_subset(pool, ["b"], out, "chat_alpaca", style="alpaca")
    row = json.loads((out / "chat_alpaca.json").read_text())[0]
    assert row == {"instruction": "Bye?", "input": "", "output": "Bye.", "system": "Be brief.",
                   "history": [["Hi", "Hello"]]}


def test_export_trl(tmp_path):
    pool = _write_pool(tmp_path)
    r = export_subset(pool, ["a", "b"], tmp_path / "trl", "sel", fmt="trl")
    lines = [json.loads(x) for x in (tmp_path / "trl" / "sel.jsonl").read_text().splitlines()]
    assert r["count"] == 2 and len(lines) == 2
    assert lines[0] == {"messages": [{"role": "user", "content": "What is 2+3?"},
                                     {"role": "assistant", "content": "5"}]}
    export_subset(pool, ["b"], tmp_path / "trl", "pc", fmt="trl", style="prompt_completion")
    pc = json.loads((tmp_path / "trl" / "pc.jsonl").read_text())
    assert pc["completion"] == [{"role": "assistant", "content": "Bye."}]
    assert pc["prompt"][-1] == {"role": "user", "content": "Bye?"}


def test_export_errors(tmp_path):
    pool = _write_pool(tmp_path)
    with pytest.raises(InputError, match="not in this pool"):
        export_subset(pool, ["a", "zzz"], tmp_path / "x", "s")
    assert not (tmp_path / "x" / "s.json").exists()
    with pytest.raises(ConfigError):
        export_subset(pool, ["a"], tmp_path / "x", "s", fmt="csv")
    with pytest.raises(ConfigError):
        export_subset(pool, ["a"], tmp_path / "x", "s", fmt="trl", style="alpaca")
    with pytest.raises(ConfigError):
        export_subset(pool, ["a"], tmp_path / "x", "../s")
    p = tmp_path / "odd.jsonl"
    p.write_text(json.dumps({"id": 1, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                                   {"role": "assistant", "content": "c"}]}) + "\n")
    with pytest.raises(InputError, match="alternating"):
        export_subset(p, [1], tmp_path / "x", "odd")
    export_subset(p, ["1"], tmp_path / "x", "odd", fmt="trl")  # text id matches an integer id


def test_gradient_checkpointing_is_undone_afterwards(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), dtype=torch.float32)
    lm = LoadedModel(model, tok, ModelSettings("tiny", device="cpu"), model_fingerprint(model), {})
    s = FinetuneSettings(**{**FAST, "epochs": 1, "gradient_checkpointing": True})
    res = finetune(lm, _pool(), tmp_path / "ft", s)
    assert any("loss" in h for h in res.log_history)
    assert model_fingerprint(model) == lm.fingerprint
    assert not model.get_input_embeddings()._forward_hooks
    assert not getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False))


def test_sft_trains_on_one_gpu_when_several_are_visible(monkeypatch, tmp_path):
    """Outside a distributed launch Trainer would spread the batch over every visible GPU
    (nn.DataParallel), changing the effective batch and the step count with the machine."""
    from prism_select.finetune import FinetuneSettings, _training_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    args = _training_args(FinetuneSettings(), tmp_path, torch.device("cuda"), torch.float32)
    assert args.device.type == "cuda"
    assert args.n_gpu == 1
    assert args.train_batch_size == FinetuneSettings().batch_size
