"""Two CPU ranks under torchrun for test_distributed.py and test_sharding.py: a free port,
the ranks' environment, a launch retried when its port was taken, and the one launch of
two ranks that the fixture ``two_ranks`` (conftest.py, scope="session") makes for both files: the
CLI's run, the sharded runs and a worker of the library's own calls."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORKER = r"""
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
from prism_select.runtime import distributed
from prism_select.curvature import CurvatureSettings, fit_curvature
from prism_select.data.tokenize import encode
from prism_select.scoring import Chunking, score_encoded
from conftest import POOL
from tiny import tiny_llama, tiny_tokenizer

distributed.init_from_env("cpu")
torch.set_num_threads(1)
tok = tiny_tokenizer()
model = tiny_llama(len(tok))
modules = {{n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}}
pool = [encode(tok, p, r) for p, r in POOL + [(p + "?", r + "!") for p, r in POOL]]
g = torch.Generator().manual_seed(0)
d = {{n: torch.randn(m.out_features, m.in_features, generator=g, dtype=torch.float64) for n, m in modules.items()}}
cur = fit_curvature(model, modules, pool, CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3),
                    pad_id=tok.pad_token_id)
v = cur.precondition(d)
s = score_encoded(model, modules, pool, v, pad_id=tok.pad_token_id, batch_size=2, chunking=Chunking(3))
if distributed.rank() == 0:
    name = "model.layers.1.mlp.down_proj"
    with open(sys.argv[1], "w") as f:
        json.dump({{"scores": s.tolist(), "lam": cur.tensors[name + "::Lambda"].flatten().tolist(),
                   "world": distributed.world()}}, f)
ranks = distributed.world()
distributed.barrier()  # no rank tears the group down while another is still in a collective
distributed.destroy()
if ranks > 1:
    # what still holds the gloo group (the sharded runs' device meshes) is freed in the
    # interpreter's teardown, where its threads can abort a finished rank: leave before it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    env.pop("WORLD_SIZE", None)
    return env


PORT_TAKEN = ("Address already in use", "EADDRINUSE", "errno: 98")


def run_torchrun(n, args, cwd, timeout=240):
    for attempt in range(3):  # the free port can be taken between probing and binding: retry
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--nnodes=1",
               f"--master-port={free_port()}", "--master-addr=127.0.0.1"] + args
        r = subprocess.run(cmd, cwd=cwd, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
        if r.returncode == 0 or not any(m in r.stderr for m in PORT_TAKEN):
            break
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


#: one torchrun launch for the tests of two ranks here and in test_sharding.py (a launch
#: more would only add a launcher's and two ranks' imports): the first command as
#: ``python -m prism_select.cli`` runs it (its module as ``__main__``, in fresh processes:
#: it joins the process group itself), the other commands through ``cli.main``, then WORKER
#: (whose ``init_from_env`` finds the group joined). Nothing leaves and joins again: a gloo
#: group made again on the same store can read the old group's addresses.
CHAIN = r"""
import json, runpy, sys
worker, out, commands = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.argv = [sys.argv[0], *commands[0]]
try:
    runpy.run_module("prism_select.cli", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert not e.code, e.code
from prism_select import cli
for args in commands[1:]:
    assert cli.main(args) == 0, args
sys.argv = [worker, out]
runpy.run_path(worker, run_name="__main__")
"""


def cli_args(d, out, cache):
    return ["score", "--model", str(d / "model"), "--pool", str(d / "pool.jsonl"), "--targets",
            str(d / "targets.jsonl"), "--out", str(out), "--cache-dir", str(cache), "--batch-size", "2",
            "--chunk-size", "4", "--no-progress", "--device", "cpu", "--dtype", "float64",
            "--damping-rule", "heuristic"]  # a fitted curvature (auto ranks a pool this small with identity)


def task_args(d, out, cache):
    """:func:`cli_args` with two target sets (``tasks-a.jsonl``, ``tasks-b.jsonl``, the
    pairs of ``targets.jsonl`` split in two) scored in one pass."""
    args = cli_args(d, out, cache)
    i = args.index("--targets")
    return args[:i + 1] + [str(d / "tasks-a.jsonl"), str(d / "tasks-b.jsonl")] + args[i + 2:]


def launch_two_ranks(d):
    """Write the CLI's inputs in ``d`` and run CHAIN on two ranks: WORKER's results in
    ``d / "two.json"``; the CLI's run in ``d / "multi"`` (curvature cache ``d / "c2"``),
    with two target sets in ``d / "multi-tasks"`` (:func:`task_args`);
    the sharded runs of test_sharding.py (:func:`sharded_commands`). The
    fixture ``two_ranks`` (scope="session", conftest.py) calls it once."""
    sys.path.insert(0, str(HERE))
    from conftest import PAIRS, POOL
    from tiny import tiny_llama, tiny_tokenizer
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), dtype=torch.float32)
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    from test_architectures import build  # a mixture-of-experts model for test_sharding.py
    moe = build("qwen3_moe", len(tok)).float()
    moe.save_pretrained(d / "moe-model")
    tok.save_pretrained(d / "moe-model")
    with open(d / "pool.jsonl", "w") as f:
        for i, (p, r) in enumerate(POOL * 3):
            f.write(json.dumps({"id": f"x{i}", "prompt": p, "response": r + " " * (i % 4)}) + "\n")
    with open(d / "targets.jsonl", "w") as f:
        for q, c, r in PAIRS:
            f.write(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n")
    half = (len(PAIRS) + 1) // 2
    for name, part in (("tasks-a", PAIRS[:half]), ("tasks-b", PAIRS[half:])):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n"
                                                 for q, c, r in part))
    (d / "worker.py").write_text(WORKER.format(tests=str(HERE)))
    (d / "chain.py").write_text(CHAIN)
    commands = [cli_args(d, d / "multi", d / "c2"), task_args(d, d / "multi-tasks", d / "c2"), *sharded_commands(d)]
    r = run_torchrun(2, [str(d / "chain.py"), str(d / "worker.py"), str(d / "two.json"), json.dumps(commands)], d)
    (d / "console.txt").write_text(r.stdout)
    (d / "commands.json").write_text(json.dumps(commands))
    return d




def score_args(d, out, *extra):
    return ["-m", "prism_select.cli", "score", "--model", str(d / "model"), "--pool",
            str(d / "pool.jsonl"), "--targets", str(d / "targets.jsonl"), "--out", str(out),
            "--cache-dir", str(d / "cache"), "--batch-size", "2", "--chunk-size", "5", "--no-progress",
            "--device", "cpu", "--dtype", "float64",
            "--damping-rule", "heuristic", *extra]  # a fitted curvature (auto ranks a pool this small with identity)


#: the sharded runs: (curvature, transfers). "auto": the memory plan's choices, which on
#: the (unbounded) CPU are the statistics sent once per pass and the blocks' weights kept
#: gathered from forward to backward; "lean": every step, and gathered twice per step
SHARDED_RUNS = (("ekfac", "auto"), ("ekfac", "lean"), ("identity", "auto"))
LEAN = ("--fsdp-sums", "step", "--fsdp-keep-gathered", "off")


def sharded_dir(d, kind, transfers):
    return d / (f"fsdp-{kind}" if transfers == "auto" else f"fsdp-{kind}-{transfers}")


def sharded_commands(d):
    """The sharded runs (SHARDED_RUNS) into ``d / "fsdp-<kind>[-lean]"`` (each its own
    cache: it fits, not reuses, the curvature): run on two ranks in the launch of the
    fixture ``two_ranks`` (scope="session"; :func:`launch_two_ranks`), on its inputs."""
    out = []
    for kind, transfers in SHARDED_RUNS:
        run = sharded_dir(d, kind, transfers)
        out.append(score_args(d, run, "--curvature", kind, "--shard", "fsdp", *(LEAN if transfers == "lean" else ()),
                         "--cache-dir", str(run.with_name(f"cache-{run.name}")))[2:])
    out.append(moe_args(d, d / "fsdp-moe", "--shard", "fsdp", "--cache-dir", str(d / "cache-fsdp-moe")))
    return out


def moe_args(d, out, *extra):
    """A mixture-of-experts model (tests/test_architectures.py's Qwen3-MoE, saved by
    :func:`launch_two_ranks`), EK-FAC with the heuristic damping (a fitted
    curvature: the default ranks a pool this small with identity), every expert tracked."""
    args = score_args(d, out, "--curvature", "ekfac", *extra)[2:]
    args[args.index("--model") + 1] = str(d / "moe-model")
    return args
