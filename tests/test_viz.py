"""minikv.viz's figures show as images in Jupyter, even in a notebook that never touched pyplot."""

import nbformat
import pytest
from nbclient import NotebookClient


@pytest.mark.slow
def test_a_returned_figure_displays_as_an_image():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(
        "from minikv.sim.memory import compare\nfrom minikv.sim.traces import make_trace\n"
        "from minikv.viz import waste_breakdown\n"
        "waste_breakdown(compare(make_trace('sharegpt', 60)))"))
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert any("image/png" in o.get("data", {}) for o in outputs), outputs


def test_paper_comparison_draws_ours_and_the_papers_range_ends_per_width():
    from minikv.viz import paper_comparison_figure

    ours = {"alpaca": {"parallel": {"2": 0.03, "4": 0.05, "6": 0.07}, "beam": {"2": 0.4, "4": 0.6, "6": 0.7}},
            "sharegpt": {"parallel": {"2": 0.1, "4": 0.2, "6": 0.3}, "beam": {"2": 0.5, "4": 0.7, "6": 0.8}}}
    paper = {"alpaca": {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)},
             "sharegpt": {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)}}
    fig = paper_comparison_figure(ours, paper)
    parallel, beam = fig.axes
    for ax, kind in ((parallel, "parallel"), (beam, "beam")):
        heights = sorted(round(p.get_height(), 3) for p in ax.patches)
        want = sorted([v for wl in ours for v in ours[wl][kind].values()]
                      + [x for wl in paper for x in paper[wl][kind]])
        assert heights == sorted(round(v, 3) for v in want), kind
        assert len(ax.lines) == 2  # width 4: one range line per workload


def test_scheduler_states_figure_names_every_state_and_move():
    from minikv.viz import scheduler_states_figure
    from minikv.viz.engine import _MOVES, _STATES

    ax = scheduler_states_figure().axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert all(name.upper() in texts for name in _STATES)
    assert all(label in texts for _, _, label, *_ in _MOVES)
    assert {a for a, *_ in _MOVES} | {b for _, b, *_ in _MOVES} == set(_STATES)


def test_step_throughput_figure_plots_tokens_per_second():
    from minikv.viz import step_throughput_figure

    ax = step_throughput_figure({"short": {1: 0.01, 4: 0.02}, "long": {1: 0.02, 4: 0.08}}).axes[0]
    measured = [line for line in ax.lines if line.get_linestyle() == "-"]
    assert [list(line.get_ydata()) for line in measured] == [[100.0, 200.0], [50.0, 50.0]]
