"""Every notebook in notebooks/ runs top to bottom without an error (on the CPU here).

The notebooks run in a fresh `python3` kernel of this interpreter (ipykernel from the test
extra; nothing is registered globally), with the working directory set to notebooks/ and this
process's environment (so JAX_PLATFORMS=cpu, as scripts/test.sh sets it, holds there too).
Committed notebooks carry no outputs: the second test keeps it that way.
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
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: clear the outputs of cells {dirty} before committing"


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
