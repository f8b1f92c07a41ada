"""What every picture of the course shares: colours, the figure and axes helpers, PNG bytes.

Figures are plain ``matplotlib.figure.Figure`` objects, not registered with pyplot: in a notebook
one shows once when it is the cell's last expression (or with ``display(fig)``), never twice, and
redrawing in a loop or a widget does not pile up open figures.
"""

from __future__ import annotations

import io
import math
import sys

import matplotlib
from matplotlib.backends.backend_agg import RendererAgg
from matplotlib.colors import rgb_to_hsv
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

# Jupyter shows a plain Figure through an image formatter that the inline backend installs
# lazily, when the first pyplot figure is made; until then a returned Figure prints as text.
# Loading the backend now (it makes no figure) installs it, so these figures always show.
if "ipykernel" in sys.modules:
    import matplotlib.pyplot as plt

    plt.switch_backend(matplotlib.get_backend())

COLORS = {"live": "#2166ac", "reserved": "#92c5de", "internal": "#f4a582",
          "external": "#b2182b", "free": "#f0f0f0"}
LABELS = {"live": "live tokens", "reserved": "reserved, not yet used",
          "internal": "internal fragmentation", "external": "external fragmentation",
          "free": "free"}
PAPER_PRIOR = (0.204, 0.382)  # share of KV memory holding tokens in prior systems (Kwon et al. 2023)
# Sequence colours: the 60 of tab20, tab20b and tab20c minus the greys, which would read as
# "free"; neighbours in id order are far apart in the palette so adjacent slabs differ.
_PALETTE = [c for name in ("tab20", "tab20b", "tab20c") for c in matplotlib.colormaps[name].colors
            if rgb_to_hsv(c)[1] > 0.2]


_STRIDE = next(k for k in (11, 13, 17, 19, 23) if math.gcd(k, len(_PALETTE)) == 1)  # visits every colour


def seq_color(seq_id: int):
    return _PALETTE[(seq_id * _STRIDE) % len(_PALETTE)]


def percent_axis() -> FuncFormatter:  # one per axis: a formatter belongs to the axis it is set on
    return FuncFormatter(lambda v, _: f"{v:.0%}")


def axes(ax, size=(9, 4)):
    if ax is None:
        ax = Figure(figsize=size, layout="constrained").add_subplot()
    return ax.figure, ax




# How wide a notebook shows a figure: JupyterLab 4.6's output area at a 1,400 px window with the file
# browser open (measured in Chromium). A wider PNG is scaled down to this, and its text with it.
DISPLAY_WIDTH_PX = 968
MIN_TEXT_PX = 9  # the smallest text a figure may show, on screen, in CSS pixels (em size)
# A figure no wider than this (inches at matplotlib's 100 dpi) shows unscaled, and 7-point text
# shows at 9.7 px; a wider one shrinks, and its text with it.
MAX_WIDTH_IN = 9.5


def text_sizes_px(fig: Figure, display_width: int = DISPLAY_WIDTH_PX) -> dict:
    """How big ``fig``'s smallest text is on screen: it is rendered as Jupyter's inline backend shows
    it (PNG at the figure's dpi, cropped tight), every string actually drawn is recorded, and a PNG
    wider than ``display_width`` is scaled down to it. ``smallest_px`` = points x dpi / 72 x scale."""
    drawn: list[tuple[float, str]] = []
    draw_text = RendererAgg.draw_text

    def record(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if s.strip():
            drawn.append((prop.get_size_in_points(), s))
        return draw_text(self, gc, x, y, s, prop, angle, ismath=ismath, mtext=mtext)

    buf = io.BytesIO()
    RendererAgg.draw_text = record
    try:
        fig.savefig(buf, format="png", dpi=fig.dpi, bbox_inches="tight")
    finally:
        RendererAgg.draw_text = draw_text
    width = int.from_bytes(buf.getvalue()[16:20], "big")  # the PNG header's IHDR width
    scale = min(1.0, display_width / width)
    points, text = min(drawn, default=(math.inf, ""))
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    return {"title": (titles or [""])[0], "width_px": width, "scale": round(scale, 3), "smallest_pt": points,
            "smallest_px": round(points * fig.dpi / 72 * scale, 2), "text": text}


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()
