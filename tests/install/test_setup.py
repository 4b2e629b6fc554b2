"""The set-up a new user runs: scripts/venv.sh's choice of torch build, the package
metadata's license (no setuptools deprecation warning) and what git ignores."""

import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

# Stands in for python3: `python3 -m venv .venv` makes a .venv whose pip and python only
# record their arguments; the python's exit status is whether PyTorch's CPU index answers.
FAKE_PYTHON3 = """#!/bin/sh
mkdir -p .venv/bin
printf '#!/bin/sh\\necho "pip $*" >> "$LOG"\\n' > .venv/bin/pip
printf '#!/bin/sh\\necho "python $*" >> "$LOG"\\nexit "$INDEX_RC"\\n' > .venv/bin/python
chmod +x .venv/bin/pip .venv/bin/python
"""


def _venv_sh(tmp_path, gpu: bool, index_answers: bool) -> list:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "log"
    # PATH: the stand-ins, then the system's tools (uname, mkdir, ...) but no real nvidia-smi
    path = [str(bin_dir)] + [d for d in os.environ.get("PATH", "").split(os.pathsep)
                             if d and not (Path(d) / "nvidia-smi").exists()]
    env = {"PATH": os.pathsep.join(path), "LOG": str(log), "INDEX_RC": "0" if index_answers else "1",
           "HOME": str(tmp_path)}
    subprocess.run(["bash", str(ROOT / "scripts" / "venv.sh"), "eval"], cwd=work, env=env, check=True,
                   timeout=60)
    return log.read_text().splitlines()


@pytest.mark.skipif(platform.system() != "Linux" or shutil.which("bash") is None, reason="venv.sh's Linux branch")
def test_venv_sh_installs_the_cpu_torch_without_a_gpu_and_the_default_build_with_one(tmp_path):
    cpu = _venv_sh(tmp_path / "cpu", gpu=False, index_answers=True)
    torch_line = next(x for x in cpu if x.startswith("pip install") and "torch==" in x)
    assert CPU_INDEX in torch_line  # not PyPI's CUDA build and its nvidia-* packages
    assert cpu[-1] == "pip install -q -e .[eval]"
    gpu = _venv_sh(tmp_path / "gpu", gpu=True, index_answers=True)
    assert [x for x in gpu if "torch==" in x] == ["pip install -q torch==2.13.0"]
    offline = _venv_sh(tmp_path / "offline", gpu=False, index_answers=False)  # the index does not answer
    assert [x for x in offline if "torch==" in x] == ["pip install -q torch==2.13.0"]


def test_package_metadata_gives_no_setuptools_warning(monkeypatch):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("SPDX license strings need setuptools >= 77 (pyproject's build requirement)")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message)[:200] for w in caught] == []
    assert dist.metadata.license_expression == "MIT"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_demo_output_is_ignored_by_git():
    for path in ("prism-demo/run/scores.jsonl", "prism-demo/data/pool.jsonl"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
