"""The notebooks' simulators: request traces, and replays of them against KV memory policies.

* ``traces``: request traces shaped like the PagedAttention paper's datasets (Alpaca, ShareGPT).
* ``memory``: stage 2/3's memory simulator: slabs vs blocks, where every token of the budget went.
* ``policies``: the allocation policies it replays (contiguous slabs of three kinds, paged blocks).
* ``sharing``: stage 5's replays of shared prefixes, parallel sampling and beams through the real block manager.
* ``fake_runner``: a model runner with no model, whose tokens depend on everything the engine hands it.
"""
