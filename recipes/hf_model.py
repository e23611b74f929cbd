"""The Hugging Face recipes' model and data: a byte-level causal LM built from a `transformers`
config (nothing downloaded), and the GPT recipe's text as a map-style data set of windows.

    model = byte_lm(n_layer=2, n_head=2, n_embd=64, block_size=32, dropout=0.1)
    train = ByteWindows(windows)          # windows: text_data.TokenWindows

Sample i is the window `block_size + 1` bytes long that the GPT recipe's sample i
is made of: `input_ids` and `labels` are both the whole window (the model shifts
labels by one inside), so both recipes predict the same next bytes.
"""

from __future__ import annotations

import argparse

import torch
from text_data import TokenWindows
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from elastic import (
    non_negative_int,
    positive_float,
    positive_int,
    unit_interval,
)

VOCAB = 256
"""Tokens are bytes."""


def byte_lm(*, n_layer: int, n_head: int, n_embd: int, block_size: int, dropout: float) -> GPT2LMHeadModel:
    """A GPT-2 of bytes, freshly initialised from torch's global generator (seed it first)."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=block_size + 1, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None, eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags both Hugging Face recipes take for the model, its optimisation and its evaluation."""
    p.add_argument("--block-size", type=positive_int, default=128, help="context length in bytes")
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    p.add_argument("--dropout", type=unit_interval, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=non_negative_int, default=None, help="default: 5%% of --max-steps")
    p.add_argument("--grad-clip", type=positive_float, default=1.0, help="max global gradient norm")
    p.add_argument("--eval-every", type=non_negative_int, default=100, help="steps between validations (0: off)")
    p.add_argument("--eval-samples", type=positive_int, default=256, help="held-out windows per validation")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")


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
