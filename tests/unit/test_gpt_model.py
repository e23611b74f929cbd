from __future__ import annotations

import pytest
import torch
from gpt_model import GPT, GPTConfig, configure_optimizer, decode_tokens, encode_text

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


# -- text in, text out ---------------------------------------------------------


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_text_round_trips_through_byte_tokens() -> None:
    text = "def f(x):\n    return 'naïve → ok'\n"
    tokens = encode_text(text)
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    assert tokens.tolist() == list(text.encode("utf-8"))
    assert decode_tokens(tokens) == text
    assert encode_text("").shape == (0,) and decode_tokens(encode_text("")) == ""


def test_broken_utf8_decodes_with_replacement_characters() -> None:
    cut = encode_text("é")[:1]  # a sample may stop in the middle of a character
    assert decode_tokens(torch.cat([encode_text("a"), cut])) == "a\ufffd"
    with pytest.raises(ValueError, match="1-D"):
        decode_tokens(torch.zeros(2, 3, dtype=torch.long))


def test_generate_appends_new_tokens_to_the_prompt() -> None:
    model = GPT(CFG)
    prompt = encode_text("def ")
    out = model.generate(prompt, 10, generator=seeded(0))
    assert out.shape == (14,) and out.dtype == torch.int64
    assert torch.equal(out[:4], prompt)
    assert all(0 <= t < 256 for t in out.tolist())
    batch = torch.randint(0, 256, (3, 5))
    out = model.generate(batch, 7, generator=seeded(0))
    assert out.shape == (3, 12) and torch.equal(out[:, :5], batch)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_a_seeded_generator_makes_sampling_repeatable() -> None:
    model = GPT(CFG)
    prompt = encode_text("def ")
    first = model.generate(prompt, 30, temperature=1.0, top_k=None, generator=seeded(1))
    again = model.generate(prompt, 30, temperature=1.0, top_k=None, generator=seeded(1))
    other = model.generate(prompt, 30, temperature=1.0, top_k=None, generator=seeded(2))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_greedy_decoding_is_deterministic_and_follows_the_argmax() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    prompt = encode_text("abc")
    out = model.generate(prompt, 8, temperature=0.0)
    assert torch.equal(out, model.generate(prompt, 8, temperature=0.0))
    assert torch.equal(out, model.generate(prompt, 8, temperature=1.0, top_k=1, generator=seeded(5)))
    with torch.no_grad():
        expected = model(prompt[None])[0][0, -1].argmax()
    assert out[3] == expected


def test_sampling_leaves_the_global_random_stream_where_it_was() -> None:
    """A training run that prints a sample must draw the same random numbers afterwards."""
    model = GPT(CFG).train()  # dropout on: a forward pass in train mode would draw from it
    torch.manual_seed(123)
    expected = torch.rand(4)
    for generator in (None, seeded(0)):
        for temperature in (0.8, 0.0):
            torch.manual_seed(123)
            model.generate(encode_text("def "), 12, temperature=temperature, generator=generator)
            assert torch.equal(torch.rand(4), expected), f"generator={generator}, temperature={temperature}"


def test_generate_restores_each_module_training_flag() -> None:
    model = GPT(CFG).train()
    model.blocks[0].eval()  # a mixed state must come back as it was, not as all-train
    before = {name: m.training for name, m in model.named_modules()}
    model.generate(encode_text("x"), 3, generator=seeded(0))
    assert {name: m.training for name, m in model.named_modules()} == before
    model.eval()
    model.generate(encode_text("x"), 3, generator=seeded(0))
    assert not any(m.training for m in model.modules())
    assert torch.is_grad_enabled(), "no_grad ends with the call"


def test_a_prompt_longer_than_the_block_keeps_only_its_tail_in_context() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    long_prompt = torch.randint(0, 256, (40,))  # block_size is 16
    out = model.generate(long_prompt, 20, temperature=0.0)
    assert out.shape == (60,) and torch.equal(out[:40], long_prompt)
    tail_only = model.generate(long_prompt[-16:], 20, temperature=0.0)
    assert torch.equal(out[40:], tail_only[16:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": torch.zeros(0, dtype=torch.long)}, "t >= 1"),
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"top_k": 0}, "top_k=0"),
    ],
)
def test_generate_rejects_impossible_requests(kwargs: dict, message: str) -> None:
    args = {"prompt": encode_text("a"), "max_new_tokens": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        GPT(CFG).generate(args.pop("prompt"), args.pop("max_new_tokens"), **args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sampling_on_a_gpu_leaves_both_global_streams_alone() -> None:
    model = GPT(CFG).cuda().train()
    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    out = model.generate(encode_text("def ").cuda(), 8, generator=seeded(0))
    cuda_gen = torch.Generator(device="cuda").manual_seed(0)
    out_cuda_gen = model.generate(encode_text("def ").cuda(), 8, generator=cuda_gen)
    assert out.device.type == out_cuda_gen.device.type == "cuda"
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    assert decode_tokens(out).startswith("def ")
