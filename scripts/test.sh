#!/usr/bin/env bash
# Run the test suite on the CPU (extra arguments go to pytest).
source "$(dirname "$0")/env.sh"
cd "$ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
jaxserve download >/dev/null          # the default model, once, before the workers start
exec python -m pytest -n 2 --dist loadfile -q "$@"
