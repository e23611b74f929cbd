from __future__ import annotations

import copy

import pytest
import torch
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
