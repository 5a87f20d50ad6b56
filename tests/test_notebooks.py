"""Every notebook in notebooks/ runs top to bottom without an error (on the CPU here).

The notebooks run in a fresh `python3` kernel of this interpreter (ipykernel from the test
extra; nothing is registered globally), with the working directory set to notebooks/ and this
process's environment (so JAX_PLATFORMS=cpu, as scripts/test.sh sets it, holds there too).
Committed notebooks carry the outputs of one top-to-bottom run, so their plots show where the
repository is browsed: the second test checks that they are whole, in order and error-free.
To refresh them: `.venv/bin/jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb`.
"""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Seconds one cell may take; each notebook aims at well under a minute and a half on a CPU.
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_inside_the_engine.ipynb", "03_kernels.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_the_outputs_of_one_clean_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        f"{path.name}: run it top to bottom once before committing (README, Notebooks)"
    outputs = [o for c in code for o in c.outputs]
    errors = [o.get("ename") for o in outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: committed with errors {errors}"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "IProgress" not in text, f"{path.name}: tqdm's IProgress warning (install the notebooks extra)"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no plot in its outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    # NOTE: jupyter_client launches a kernel spec whose command is "python" with
    # sys.executable, so the kernel is this venv's interpreter.
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{path.name} failed:\n{err}", pytrace=False)
