"""The course's pictures, one module per stage; every picture is importable from ``minikv.viz``.

* ``style``: colours and helpers every figure shares.
* ``memory`` (stages 2-3): memory maps, occupancy, waste by policy and block size, block tables.
* ``kernel`` (stage 4): roofline, the kernel's grid, split-KV, errors against the reference.
* ``sharing`` (stage 5): shared blocks, copy-on-write, the hash chain, eviction, savings.
* ``engine`` (stage 6): static vs continuous batching, the pool over engine steps, token timelines.

Each function draws on ``ax`` when one is given (else on a new figure) and returns the Figure: a plain
``matplotlib.figure.Figure``, not registered with pyplot, so a notebook shows it once.
"""

from minikv.viz.engine import (
                               batch_slots,
                               batching_figure,
                               engine_occupancy_figure,
                               scheduler_states_figure,
                               step_throughput_figure,
                               throughput_bars,
                               token_timeline_figure,
)
from minikv.viz.kernel import kernel_errors_figure, kernel_grid_figure, roofline_figure, split_kv_figure
from minikv.viz.memory import (
                               MemoryMapWidget,
                               block_size_plot,
                               block_tables_figure,
                               default_step,
                               memory_map,
                               memory_map_widget,
                               occupancy_plot,
                               waste_breakdown,
)
from minikv.viz.sharing import (
                               beam_sharing_plot,
                               cow_figure,
                               eviction_curve_figure,
                               hash_chain_figure,
                               paper_comparison_figure,
                               shared_memory_map,
                               sharing_savings_figure,
)
from minikv.viz.style import COLORS, LABELS, PAPER_PRIOR, seq_color

__all__ = ["COLORS", "LABELS", "PAPER_PRIOR", "MemoryMapWidget", "batch_slots", "batching_figure", "beam_sharing_plot",
           "block_size_plot", "block_tables_figure", "cow_figure", "default_step", "engine_occupancy_figure",
           "eviction_curve_figure", "hash_chain_figure", "kernel_errors_figure", "kernel_grid_figure", "memory_map",
           "memory_map_widget", "occupancy_plot", "paper_comparison_figure",
           "scheduler_states_figure", "step_throughput_figure", "roofline_figure", "seq_color", "shared_memory_map",
           "sharing_savings_figure", "split_kv_figure", "throughput_bars", "token_timeline_figure", "waste_breakdown"]
