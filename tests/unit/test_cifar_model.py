from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from cifar_model import (
    CPUSyncBatchNorm,
    SmallCNN,
    build_model,
    parameter_groups,
    resnet18_cifar,
    sync_batchnorm,
)


def test_resnet18_keeps_32x32_images_at_full_size_in_its_first_block() -> None:
    model = resnet18_cifar().eval()
    assert model.conv1.stride == (1, 1) and model.conv1.kernel_size == (3, 3)
    assert isinstance(model.maxpool, nn.Identity)
    seen = {}
    model.layer1.register_forward_hook(lambda m, i, out: seen.update(shape=out.shape))
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert seen["shape"] == (2, 64, 32, 32)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962


def test_small_cnn_has_three_batch_norms_and_ten_logits() -> None:
    model = build_model("cnn", cnn_width=4)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 3
    assert model(torch.randn(5, 3, 32, 32)).shape == (5, 10)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg")


def test_weight_decay_skips_batch_norm_and_biases() -> None:
    decay, no_decay = parameter_groups(SmallCNN(4), weight_decay=5e-4)
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])


def test_synced_and_plain_batch_norm_share_state_dict_keys_and_load_each_other() -> None:
    torch.manual_seed(0)
    plain = SmallCNN(4)
    plain(torch.randn(4, 3, 32, 32))  # move the running statistics off their initial values
    synced = sync_batchnorm(copy.deepcopy(plain), torch.device("cpu"))
    assert sum(type(m) is CPUSyncBatchNorm for m in synced.modules()) == 3
    assert not any(type(m) is nn.BatchNorm2d for m in synced.modules())
    assert list(plain.state_dict()) == list(synced.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(value, synced.state_dict()[key]), key
    fresh = SmallCNN(4)
    fresh.load_state_dict(synced.state_dict())  # strict: a checkpoint of W>1 loads at W=1


def test_without_a_process_group_sync_batch_norm_is_batch_norm() -> None:
    torch.manual_seed(0)
    plain, synced = nn.BatchNorm2d(3), CPUSyncBatchNorm(3)
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(synced(x), plain(x), rtol=0, atol=0)
    torch.testing.assert_close(synced.running_var, plain.running_var, rtol=0, atol=0)


def _sync_batch_norm_rank(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it can hang)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        x, grad_y, state = torch.load(os.path.join(out_dir, "inputs.pt"))
        layer = CPUSyncBatchNorm(3)
        layer.load_state_dict(state)
        half = x[rank * 4 : rank * 4 + 4].clone().requires_grad_()
        (layer(half) * grad_y[rank * 4 : rank * 4 + 4]).sum().backward()
        layer(half)  # a second batch: the running statistics compound
        torch.save(
            {"grad_x": half.grad, "weight": layer.weight.grad, "bias": layer.bias.grad,
             "buffers": {k: v for k, v in layer.state_dict().items() if k.startswith(("running", "num"))},
             "y": layer.eval()(half).detach()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_normalise_with_the_statistics_of_their_joint_batch(tmp_path: Path) -> None:
    """Each rank holds half a batch; the result must be batch norm over the whole of it."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 6) * 3 + torch.tensor([1.0, -2.0, 5.0]).view(1, 3, 1, 1)
    x[4:] += 2.0  # the halves differ: local statistics would give other numbers
    grad_y = torch.randn(8, 3, 6, 6)
    whole = nn.BatchNorm2d(3)
    with torch.no_grad():
        whole.weight.uniform_(0.5, 1.5)
        whole.bias.uniform_(-0.5, 0.5)
    torch.save((x, grad_y, whole.state_dict()), tmp_path / "inputs.pt")
    ranks = mp.start_processes(
        _sync_batch_norm_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False, start_method="fork"
    )
    deadline = time.monotonic() + 60
    while not ranks.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two ranks did not finish within 60 s")

    xs = x.clone().requires_grad_()
    (whole(xs) * grad_y).sum().backward()  # the loss is the sum of both ranks' losses
    whole(xs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(torch.cat([r["grad_x"] for r in results]), xs.grad)
    # Weight and bias gradients stay per rank (DDP averages them); their sum is the whole batch's.
    torch.testing.assert_close(results[0]["weight"] + results[1]["weight"], whole.weight.grad)
    torch.testing.assert_close(results[0]["bias"] + results[1]["bias"], whole.bias.grad)
    for key, value in results[0]["buffers"].items():
        assert torch.equal(value, results[1]["buffers"][key]), f"{key} differs between the ranks"
        torch.testing.assert_close(value, whole.state_dict()[key])
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), whole.eval()(x))
