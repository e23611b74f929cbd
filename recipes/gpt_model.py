"""A mini GPT: decoder-only transformer over bytes, with weight tying.

Causal attention goes through `scaled_dot_product_attention(is_causal=True)`,
so a token's logits depend only on itself and earlier tokens. The token
embedding and the output head share one weight matrix.

Tokens are the bytes of UTF-8 text (`encode_text`, `decode_tokens`), so any
text is valid input and any token sequence decodes to some text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BYTE_VOCAB = 256


def encode_text(text: str) -> torch.Tensor:
    """The UTF-8 bytes of `text` as a 1-D int64 tensor of tokens in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode_tokens(tokens: torch.Tensor) -> str:
    """Text from a 1-D tensor of byte tokens; broken UTF-8 becomes U+FFFD, never an error.

    A sampled sequence can end (or wander) mid-character, so decoding must not fail.
    """
    if tokens.dim() != 1:
        raise ValueError(f"decode_tokens takes one sequence (1-D), got shape {list(tokens.shape)}")
    values = tokens.tolist()
    if any(not 0 <= v < BYTE_VOCAB for v in values):
        raise ValueError(f"tokens must be bytes in [0, {BYTE_VOCAB})")
    return bytes(values).decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = BYTE_VOCAB
    """Byte-level tokens: any text is valid input."""
    block_size: int = 128
    """Longest context, in tokens."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    """Width; must be divisible by n_head."""
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (b, t, vocab) and, given targets, the mean cross-entropy."""
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.8,
        top_k: int | None = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """The prompt followed by `max_new_tokens` sampled tokens, as int64 on the model's device.

        `prompt` is one sequence (t,) or a batch (b, t) with t >= 1; the result has the
        same number of dimensions. Each step sees at most the last `block_size` tokens.
        `temperature <= 0` picks the most likely token (greedy, deterministic); otherwise
        logits are divided by `temperature` and, with `top_k`, all but the k likeliest
        tokens are dropped before sampling.

        Invariants: torch's global random streams are never drawn from (sampling uses
        `generator`, or a fresh nondeterministically seeded one), so a training run that
        samples continues with exactly the random numbers it would have had; dropout is
        off while sampling, and every submodule's training flag is restored afterwards.
        Call it on the model itself, not on a DDP wrapper.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 0")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be at least 1 (or None for no limit)")
        if prompt.dim() not in (1, 2) or prompt.shape[-1] == 0:
            raise ValueError(f"prompt must be (t,) or (b, t) tokens with t >= 1, got shape {list(prompt.shape)}")
        device = self.tok_emb.weight.device
        idx = prompt.to(device=device, dtype=torch.long)
        idx = idx.unsqueeze(0) if prompt.dim() == 1 else idx
        if generator is None:
            # Not torch.default_generator: drawing from it would shift the training run's stream.
            generator = torch.Generator()
            generator.seed()
        modes = {module: module.training for module in self.modules()}
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.cfg.block_size :])
                next_token = _pick(logits[:, -1, :].float(), temperature, top_k, generator)
                idx = torch.cat([idx, next_token.to(device)], dim=1)
        finally:
            for module, training in modes.items():
                module.training = training
        return idx[0] if prompt.dim() == 1 else idx

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B estimate."""
        cfg = self.cfg
        non_embedding = self.num_parameters() - self.pos_emb.weight.numel()
        return 6 * non_embedding + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator
) -> torch.Tensor:
    """One next token per row of (b, vocab) float logits, as (b, 1) int64."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    # Sample where the generator lives: a CPU generator then works for a CUDA model too.
    return torch.multinomial(probs.to(generator.device), 1, generator=generator)


def configure_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, norms or position tables)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # yields a tied weight once
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "pos_emb" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
