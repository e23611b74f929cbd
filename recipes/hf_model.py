"""The Hugging Face recipes' model and data: a byte-level causal LM built from a `transformers`
config (nothing downloaded), and the GPT recipe's text as a map-style data set of windows.

    model = byte_lm(n_layer=2, n_head=2, n_embd=64, block_size=32, dropout=0.1)
    train = ByteWindows(windows)          # windows: text_data.TokenWindows

Sample i is the window `block_size + 1` bytes long that the GPT recipe's sample i
is made of: `input_ids` and `labels` are both the whole window (the model shifts
labels by one inside), so both recipes predict the same next bytes.
"""

from __future__ import annotations

import torch
from text_data import TokenWindows
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256
"""Tokens are bytes."""


def byte_lm(*, n_layer: int, n_head: int, n_embd: int, block_size: int, dropout: float) -> GPT2LMHeadModel:
    """A GPT-2 of bytes, freshly initialised from torch's global generator (seed it first)."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=block_size + 1, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None, eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


class ByteWindows(Dataset):
    """Windows of bytes as the dicts a Hugging Face causal LM takes."""

    def __init__(self, windows: TokenWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.windows.batch(torch.tensor([int(index)]))
        window = torch.cat([x[0], y[0, -1:]])
        return {"input_ids": window, "labels": window}
