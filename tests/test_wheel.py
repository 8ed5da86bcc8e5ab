"""The package carries what it reads at run time: a wheel built from this checkout, installed
into a fresh virtualenv, generates with the compiled kernel and runs `specdec bench` on its own
questions from a folder with no repository (and no shared/ data) beside it."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from specdec import generate
from specdec.kernels import CppSkinnyLinear, KernelUnavailable
from specdec.paths import cache_root

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
PROMPT = "The capital of France is"

GENERATE = f"""
import json, specdec
from specdec import generate, load_target
target = load_target({MODEL!r}, progress=False)
out = generate(target, {PROMPT!r}, max_new_tokens=8)
print(json.dumps({{"package": specdec.__file__, "linear_backend": target.linear_backend, "tokens": out.tokens}}))
"""


def _run(command: list, cwd: Path, env: dict) -> str:
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory, smollm2):
    """(venv python, env, work dir): the wheel installed into a new venv that sees this
    interpreter's dependencies (a .pth file) but not this checkout; the model cache is shared,
    the kernel cache is new, so the kernel is compiled from the wheel's own source."""
    try:
        CppSkinnyLinear()
    except KernelUnavailable as exc:
        pytest.skip(f"compiled kernel unavailable on this machine: {exc}")
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECDEC_LINEAR")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # build from a copy of the sources: an in-tree build/ folder may hold stale modules
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "specdec", source / "specdec", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", root / "dist", source], root, env)
    (wheel,) = (root / "dist").glob("specdec-*.whl")

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], root, env)
    python = venv / "bin" / "python"
    venv_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env).strip())
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (venv_site / "dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(dependencies)))
    # --force-reinstall: this interpreter's own (editable) specdec is visible through the .pth
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", wheel], root, env)

    cache = root / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / MODEL).symlink_to(cache_root() / "models" / MODEL)
    env["SPECDEC_CACHE"] = str(cache)
    work = root / "work"  # no repository, no shared/ beside it
    work.mkdir()
    return python, env, work, venv_site


def test_wheel_generates_with_the_compiled_kernel(installed, smollm2):
    python, env, work, venv_site = installed
    result = json.loads(_run([python, "-c", GENERATE], work, env).strip().splitlines()[-1])
    assert Path(result["package"]).is_relative_to(venv_site)  # the wheel's copy, not this checkout
    assert result["linear_backend"] == "cpp"
    assert list((Path(env["SPECDEC_CACHE"]) / "kernels").glob("skinny_gemm-*.so"))  # built from the wheel's source
    assert result["tokens"] == generate(smollm2, PROMPT, max_new_tokens=8).tokens


def test_wheel_bench_reads_its_own_questions(installed):
    python, env, work, venv_site = installed
    specdec_script = python.parent / "specdec"
    _run([specdec_script, "bench", "--target", MODEL, "--methods", "plain", "--limit-per-category", "1",
          "--max-new-tokens", "8", "--no-progress", "--out", work / "bench"], work, env)
    config = json.loads((work / "bench" / "results.json").read_text())["config"]
    assert Path(config["questions_path"]).is_relative_to(venv_site) and config["questions"] == 6  # one per task kind
