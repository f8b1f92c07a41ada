"""A model runner without a model: for testing and teaching the scheduler at thousands of steps a second.

`FakeRunner` has `ModelRunner`'s interface (`execute`, `copy_blocks`, `swap_out`, `swap_in`).
Its "KV cache" is one token id per slot: `execute` writes each scheduled token's id at its slot,
then, for every sequence that samples, reads the whole sequence back *through its block table*
and picks the next token as a hash of what it read. So the next token depends on every token
of the sequence, exactly as a real model's does, and any bookkeeping mistake (a wrong slot, a
block freed while still in use, a missing copy-on-write, a swap that lost a block) changes the
tokens. `reference_tokens` computes the same tokens with no cache at all: the gold answer.
"""

from __future__ import annotations

import hashlib
from array import array

import torch


def next_token(tokens, vocab_size: int) -> int:
    """The fake model: a stable hash of the whole sequence so far."""
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


def reference_tokens(prompt: list[int], max_tokens: int, vocab_size: int, eos: int | None = None) -> list[int]:
    """What the engine must produce greedily for `prompt` with the fake runner (stops at eos if given)."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(seq, vocab_size)
        seq.append(t)
        out.append(t)
        if t == eos:
            break
    return out


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int):
        self.block_size, self.vocab_size = block_size, vocab_size
        self.pool = [-1] * (num_blocks * block_size)   # one "K/V" per slot: the token id written there
        self.steps = 0

    def execute(self, steps) -> torch.Tensor:
        bs, rows = self.block_size, []
        for st in steps:   # write first (as the real runner does, layer by layer), then read
            for pos, (tok, slot) in enumerate(zip(st.token_ids, st.slots), st.start_pos):
                assert slot == st.block_table[pos // bs] * bs + pos % bs, "slot does not match the block table"
                self.pool[slot] = tok
        for st in steps:
            if st.wants_logits:
                end = st.start_pos + len(st.token_ids)
                seen = [self.pool[st.block_table[p // bs] * bs + p % bs] for p in range(end)]
                rows.append(next_token(seen, self.vocab_size))
        self.steps += 1
        logits = torch.full((len(rows), self.vocab_size), -10.0)
        logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 10.0
        return logits

    def copy_blocks(self, pairs) -> None:
        bs = self.block_size
        for src, dst in pairs:
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]

    def swap_out(self, blocks) -> list[list[int]]:
        bs = self.block_size
        return [self.pool[b * bs:(b + 1) * bs] for b in blocks]

    def swap_in(self, data, blocks) -> None:
        bs = self.block_size
        for b, content in zip(blocks, data):
            self.pool[b * bs:(b + 1) * bs] = content
