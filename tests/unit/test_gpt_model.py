from __future__ import annotations

import pytest
import torch
from gpt_model import GPT, GPTConfig, configure_optimizer

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def test_logits_have_one_row_per_token_over_the_byte_vocabulary() -> None:
    model = GPT(CFG)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256)
    assert loss is not None and loss.shape == ()
    assert model(idx)[1] is None


def test_head_and_token_embedding_share_one_weight() -> None:
    model = GPT(CFG)
    assert model.head.weight is model.tok_emb.weight
    assert sum(1 for _ in model.parameters()) == len({id(p) for p in model.parameters()})


def test_future_tokens_do_not_change_past_logits() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        before, after = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_a_sequence_longer_than_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than block_size=16"):
        GPT(CFG)(torch.zeros(1, 17, dtype=torch.long))


def test_config_rejects_a_width_not_divisible_by_heads() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(n_embd=30, n_head=4)


def test_optimizer_holds_every_parameter_once_and_decays_only_matrices() -> None:
    model = GPT(CFG)
    decay, no_decay = configure_optimizer(model, lr=1e-3).param_groups
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] > 0
    assert no_decay["weight_decay"] == 0.0
    assert model.pos_emb.weight in no_decay["params"]
