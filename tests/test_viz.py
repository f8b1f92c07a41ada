"""minikv.viz's figures show as images in Jupyter, even in a notebook that never touched pyplot."""

import nbformat
import pytest
from nbclient import NotebookClient


@pytest.mark.slow
def test_a_returned_figure_displays_as_an_image():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(
        "from minikv.sim import compare\nfrom minikv.traces import make_trace\nfrom minikv.viz import waste_breakdown\n"
        "waste_breakdown(compare(make_trace('sharegpt', 60)))"))
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert any("image/png" in o.get("data", {}) for o in outputs), outputs
