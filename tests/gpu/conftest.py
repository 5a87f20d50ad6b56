"""GPU tests: `pytest -m gpu tests/gpu` on a machine with an NVIDIA GPU (tests/conftest.py
skips `gpu`-marked tests elsewhere). They reuse the CPU kernel tests' batch builders."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pallas_kernels"))
