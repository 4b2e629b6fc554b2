"""LLM Judge: local next-token probabilities and an OpenAI-compatible endpoint stub."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from prism_select.curvature import CurvatureSettings
from prism_select.data.records import PoolExample, TargetPair
from prism_select.data.tokenize import encode
from prism_select.errors import ConfigError, PrismError
from prism_select.model import LoadedModel, ModelSettings, load_model, model_fingerprint
from prism_select.run import Inputs, RunContext
from prism_select.settings import ScoreSettings

from conftest import PAIRS, POOL
from tiny import save_tiny, tiny_llama, tiny_tokenizer

from prism_select.methods import get, names
from prism_select.methods import judge as judge_mod

JUDGE = get("judge").fn
SECRET = "sk-test-0123456789abcdef-SECRET"


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PRISM_SELECT_CACHE", str(tmp_path / "cache"))


def make_ctx(tmp_path, options, out="run", pairs=True, max_length=2048):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), dtype=torch.float64)
    lm = LoadedModel(model, tok, ModelSettings("tiny", device="cpu", dtype="float64"), model_fingerprint(model), {})
    pool = [PoolExample(i, p, r, i) for i, (p, r) in enumerate(POOL)]
    tp = [TargetPair(f"t{j}", q, c, r, j) for j, (q, c, r) in enumerate(PAIRS)] if pairs else []
    inputs = Inputs(pool=pool, encoded=[encode(tok, e.prompt, e.response) for e in pool], pairs=tp,
                    chosen=[encode(tok, p.prompt, p.chosen) for p in tp],
                    rejected=[encode(tok, p.prompt, p.rejected) for p in tp], invalid=[],
                    truncated={"pool": 0, "targets": 0})
    settings = ScoreSettings(method="prism", batch_size=3, progress=False, method_options=options,
                             max_length=max_length)
    return RunContext(lm, {}, inputs, settings, CurvatureSettings(), Path(tmp_path / out))


@pytest.fixture
def judge_dir(tmp_path):
    return save_tiny(tmp_path / "judge", dtype=torch.float64, seed=5)


def direct_p_yes(model, tok, text):
    """The judge prompt through the chat template, one forward, softmax over {y, Y} u {n, N}."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    # character-level tokenizer: the first tokens of the variants are y/Y and n/N (" " is on both sides)
    yes = [tok.convert_tokens_to_ids(c) for c in "yY"]
    no = [tok.convert_tokens_to_ids(c) for c in "nN"]
    p = torch.softmax(logits[yes + no], 0)
    return float(p[:2].sum())


def test_local_judge_equals_a_direct_softmax(tmp_path, judge_dir):
    ctx = make_ctx(tmp_path, {"judge": str(judge_dir)})
    scores, rows = JUDGE(ctx)
    assert scores.dtype == torch.float64 and scores.shape == (len(POOL),)
    assert ((scores >= 0) & (scores <= 1)).all()
    jm = load_model(ModelSettings(str(judge_dir), device="cpu", dtype="float64"))
    behaviour = judge_mod.behaviour_from_pairs(ctx.inputs.pairs)
    assert "SHOWS: 1+1=3. The answer is 3." in behaviour and "DOES NOT SHOW: 1+1=2." in behaviour
    for i, (p, r) in enumerate(POOL):
        text = judge_mod.DEFAULT_TEMPLATE.format(prompt=p, response=r, behaviour=behaviour)
        assert scores[i].item() == pytest.approx(direct_p_yes(jm.model, jm.tokenizer, text), rel=1e-9)
    assert len(set(scores.tolist())) > 1
    assert [r["id"] for r in rows] == ["t0", "t1", "t2"] and 0 <= rows[0]["p_chosen"] <= 1
    info = ctx.info["method"]
    assert info["backend"] == "local" and sorted(info["yes_tokens"]) == ["Y", "y"]
    # the run's own model as judge, a custom template and behaviour, no target scoring
    ctx2 = make_ctx(tmp_path, {"template": "Is this {behaviour}? {response}", "behaviour": "rude",
                               "score_targets": False}, out="run2")
    s2, rows2 = JUDGE(ctx2)
    assert rows2 == [] and ctx2.info["method"]["judge_model"] == "the run's model"
    # the record says who judged, and how large it is
    n = sum(p.numel() for p in ctx2.lm.model.parameters())
    assert ctx2.info["method"]["self_judging"] is True and ctx2.info["method"]["judge_parameters"] == n
    assert info["self_judging"] is False and info["judge_parameters"] == sum(p.numel() for p in jm.model.parameters())
    text = "Is this rude? " + POOL[0][1]
    assert s2[0].item() == pytest.approx(direct_p_yes(ctx2.lm.model, ctx2.lm.tokenizer, text), rel=1e-9)


def test_local_judge_shortens_long_prompts(tmp_path):
    ctx = make_ctx(tmp_path, {"behaviour": "x", "score_targets": False}, max_length=120)
    scores, _ = JUDGE(ctx)
    assert ctx.info["method"]["truncated"] == len(POOL)
    assert ((scores >= 0) & (scores <= 1)).all()


def test_template_and_option_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown field"):
        JUDGE(make_ctx(tmp_path, {"template": "{prompt} {response} {nope}"}))
    with pytest.raises(ConfigError, match="response"):
        JUDGE(make_ctx(tmp_path, {"template": "{prompt}"}))
    with pytest.raises(ConfigError, match="behaviour"):
        JUDGE(make_ctx(tmp_path, {}, pairs=False))
    with pytest.raises(ConfigError, match="no option"):
        JUDGE(make_ctx(tmp_path, {"judges": "x"}))
    with pytest.raises(ConfigError, match="model"):
        JUDGE(make_ctx(tmp_path, {"endpoint": "http://127.0.0.1:9/v1"}))


def test_parse_answer():
    p = judge_mod.parse_answer
    assert p("Yes.") == 1.0 and p(" no, it does not") == 0.0 and p("**YES**") == 1.0
    assert p("0.8") == 0.8 and p("probability: .25") == 0.25 and p("Score 1") == 1.0
    assert p("maybe") is None and p("7 out of 10") is None and p("nothing") is None


# ---------------------------------------------------------------- endpoint stub

class _Stub:
    def __init__(self, answers, fail_first=0, status=None):
        self.answers, self.fail_first, self.status = answers, fail_first, status
        self.seen, self.calls = [], 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.calls += 1
                    n = stub.calls
                    stub.seen.append((self.path, self.headers.get("Authorization"), body))
                if stub.status is not None or n <= stub.fail_first:
                    code = stub.status or 503
                    self.send_response(code)
                    self.end_headers()
                    self.wfile.write(b'{"error": "nope"}')
                    return
                if self.headers.get("Authorization") != f"Bearer {SECRET}":
                    self.send_response(401)
                    self.end_headers()
                    return
                text = body["messages"][0]["content"]
                answer = stub.answers(text)
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _answer(text):
    # "yes" when the reviewed response contains a wrong sum from the pool, else a number
    resp = text.split("<response>\n")[1].split("\n</response>")[0]
    return "Yes." if "=9" in resp or "=6" in resp else "0.2"


def test_endpoint_judge_with_key_and_retries(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", SECRET)
    with _Stub(_answer, fail_first=2) as stub:
        ctx = make_ctx(tmp_path, {"endpoint": stub.url + "/", "model": "judge-x", "api_key_env": "MY_JUDGE_KEY",
                                  "retry_backoff": 0.01, "workers": 2, "timeout": 5})
        scores, rows = JUDGE(ctx)
    expect = [1.0 if ("=9" in r or "=6" in r) else 0.2 for _, r in POOL]
    assert scores.tolist() == expect
    assert len(rows) == 3
    assert all(path == "/v1/chat/completions" for path, _, _ in stub.seen)
    assert stub.seen[-1][2]["model"] == "judge-x" and stub.seen[-1][2]["temperature"] == 0
    assert stub.calls == 2 + len(POOL) + 2 * len(PAIRS)
    info = ctx.info["method"]
    assert info["backend"] == "endpoint" and info["api_key_sent"] is True and info["api_key_env"] == "MY_JUDGE_KEY"
    # the key appears nowhere: not in ctx.info, nor in any file the run wrote
    assert SECRET not in json.dumps(ctx.info, default=str)
    from prism_select.io import atomic_write_json
    atomic_write_json(ctx.out_dir / "run.json", ctx.info)
    files = [f for f in ctx.out_dir.rglob("*") if f.is_file()]
    assert any(f.name == "answers.jsonl" for f in files)
    for f in files:
        assert SECRET not in f.read_text(encoding="utf-8", errors="replace")
    # resumed: a second call on the same run dir asks nothing
    with _Stub(_answer) as stub2:
        ctx.settings.method_options = {**ctx.settings.method_options, "endpoint": stub2.url}
        s2, _ = JUDGE(ctx)
    assert stub2.calls == 0 and s2.tolist() == expect


def test_endpoint_errors_are_clear_and_keyless(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    with _Stub(_answer, status=400) as stub:
        with pytest.raises(PrismError, match="HTTP 400") as ei:
            JUDGE(make_ctx(tmp_path, {"endpoint": stub.url, "model": "m", "retries": 1, "retry_backoff": 0.0,
                                      "workers": 1}))
        assert SECRET not in str(ei.value)
        client = judge_mod.EndpointJudge(stub.url, "m", SECRET, timeout=5, retries=3, backoff=0, max_tokens=5)
        before = stub.calls
        with pytest.raises(PrismError, match="HTTP 400"):
            client.ask("hi")
        assert stub.calls == before + 1  # a 400 is not retried
        assert SECRET not in repr(client)
    with _Stub(_answer, status=503) as stub:
        with pytest.raises(PrismError, match="2 attempt") as ei:
            JUDGE(make_ctx(tmp_path, {"endpoint": stub.url, "model": "m", "retries": 1, "retry_backoff": 0.0,
                                      "workers": 1}, out="r2"))
    assert SECRET not in str(ei.value)
    with _Stub(lambda t: "perhaps") as stub:
        with pytest.raises(PrismError, match="cannot read"):
            JUDGE(make_ctx(tmp_path, {"endpoint": stub.url, "model": "m", "workers": 1}, out="r3"))
        s, _ = JUDGE(make_ctx(tmp_path, {"endpoint": stub.url, "model": "m", "unparsed": 0.5,
                                         "score_targets": False}, out="r4"))
    assert s.tolist() == [0.5] * len(POOL)
    monkeypatch.delenv("MISSING_KEY_VAR", raising=False)
    with pytest.raises(ConfigError, match="MISSING_KEY_VAR"):
        JUDGE(make_ctx(tmp_path, {"endpoint": "http://127.0.0.1:9/v1", "model": "m",
                                  "api_key_env": "MISSING_KEY_VAR"}, out="r5"))


@pytest.mark.skipif("judge" not in names(), reason="the registry has no 'judge'")
def test_judge_through_score_pool_never_writes_the_key(tmp_path, monkeypatch, caplog):
    import logging

    from prism_select.run import score_pool

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    tok = tiny_tokenizer()
    d = tmp_path / "tiny"
    tiny_llama(len(tok), dtype=torch.float32).save_pretrained(d)
    tok.save_pretrained(d)
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in POOL))
    targets = tmp_path / "targets.jsonl"
    targets.write_text("".join(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n" for q, c, r in PAIRS))
    with _Stub(_answer) as stub:
        summary = score_pool(ModelSettings(str(d), device="cpu", dtype="float32"), pool, targets, tmp_path / "out",
                             ScoreSettings(method="judge", progress=False,
                                           method_options={"endpoint": stub.url, "model": "m"}))
    assert summary["method_info"]["backend"] == "endpoint"
    scores = [json.loads(x)["score"] for x in (tmp_path / "out" / "scores.jsonl").read_text().splitlines()]
    assert scores == [1.0 if ("=9" in r or "=6" in r) else 0.2 for _, r in POOL]
    for f in (tmp_path / "out").rglob("*"):
        if f.is_file():
            assert SECRET not in f.read_text(encoding="utf-8", errors="replace")
    assert SECRET not in caplog.text
