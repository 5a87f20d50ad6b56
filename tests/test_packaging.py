"""The distribution: one top-level name in the wheel, the CLI answers, the default model works."""

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_holds_only_jaxserve(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--quiet", "-w", str(tmp_path), ROOT], check=True, capture_output=True, text=True)
    # No warnings of our own making from the build backend (the license's form, package data
    # outside a package, ...).
    assert "BuildBackendWarning" not in res.stdout + res.stderr, res.stdout + res.stderr
    (wheel,) = tmp_path.glob("jaxserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"jaxserve"}
    for sub in ("models", "models/layers", "models/loaders", "pallas_kernels", "sharding", "server",
                "core", "core/kv_cache", "worker", "sample", "engine", "bench", "structured",
                "spec_decode", "train_draft"):
        assert f"jaxserve/{sub}/__init__.py" in names
    assert "jaxserve/models/configs/Llama-3.1-8B.json" in names


def test_cli_help_for_every_command():
    for cmd in ([], ["serve"], ["generate"], ["run-batch"], ["chat"], ["download"], ["bench"],
                ["bench", "serve"], ["bench", "latency"], ["bench", "throughput"], ["train-draft"]):
        res = subprocess.run([sys.executable, "-m", "jaxserve.cli", *cmd, "--help"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "usage: jaxserve" in res.stdout, (cmd, res.stderr[-2000:])


def test_cli_chat_answers_paris():
    res = subprocess.run([sys.executable, "-m", "jaxserve.cli", "chat", "--max-model-len", "256",
                          "--no-warmup", "--max-tokens", "12", "-p", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Paris" in res.stdout


def test_notebooks_extra_and_spdx_license():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "Apache-2.0"                  # an SPDX expression, not a table
    extra = " ".join(project["optional-dependencies"]["notebooks"])
    for name in ("jupyter", "nbconvert", "ipykernel", "ipywidgets", "matplotlib"):
        assert name in extra
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert ".[notebooks]" in readme and ".venv/bin/jaxserve" in readme
