# Sourced by scripts/serve.sh and scripts/test.sh: make sure .venv exists (Python 3.12) and
# holds jaxserve with its test extras; re-install only when pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

find_python312() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo python3.12; return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    local v; v="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V | tail -1 || true)"
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python3.12"; return; fi
  fi
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  echo "error: Python 3.12 not found (install it, e.g. 'pyenv install 3.12'); jaxserve needs jax 0.11.2, which needs Python >= 3.12" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python312)"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.jaxserve-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing jaxserve and its dependencies into $VENV (the first time: a minute or two)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
