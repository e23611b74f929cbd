"""Models of the CIFAR-10 recipe, and batch norm synchronised over the job's ranks.

- `resnet18_cifar`: torchvision's ResNet-18 with its stem adapted to 32x32
  inputs (a 3x3 stride-1 first convolution, no max pool), as in the CIFAR
  experiments of the ResNet paper: the ImageNet stem would shrink a 32x32
  image to 8x8 before the first block.
- `SmallCNN`: the classic tutorial network, with batch norm after each
  convolution so that synchronised statistics matter; CPU-cheap.

Batch norm across ranks (`sync_batchnorm`): at world size > 1 every batch norm
layer normalises with the mean and variance of the whole job's batch, so the
replicas' running statistics are the same on every rank without a broadcast.
On CUDA that is `torch.nn.SyncBatchNorm`; torch's version refuses CPU
tensors, so on CPU it is `CPUSyncBatchNorm` here, which works over gloo.

Invariant: `BatchNorm2d`, `torch.nn.SyncBatchNorm` and `CPUSyncBatchNorm` have
the same parameters and buffers under the same `state_dict` keys, so a
checkpoint saved at one world size loads at any other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision

NUM_CLASSES = 10
MODEL_CHOICES = ("resnet18", "cnn")

_CHANNEL_DIMS = [0, 2, 3]  # batch norm statistics are per channel of (N, C, H, W)


def resnet18_cifar(num_classes: int = NUM_CLASSES) -> nn.Module:
    """torchvision's ResNet-18 for 32x32 images (11.2M parameters)."""
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits the rest
    model.maxpool = nn.Identity()
    return model


def _conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU stages (32x32 -> 16x16 -> 8x8), global average pool, linear head.

    `width` is the first stage's channels (doubled at each stage): 32 reaches
    about 80 % on CIFAR-10; 8 is enough for smoke tests on a CPU.
    """

    def __init__(self, width: int = 32, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"width={width} must be at least 1")
        self.features = nn.Sequential(
            _conv_bn_relu(3, width),
            nn.MaxPool2d(2),
            _conv_bn_relu(width, 2 * width),
            nn.MaxPool2d(2),
            _conv_bn_relu(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_model(name: str, *, cnn_width: int = 32) -> nn.Module:
    """A fresh model by name (see MODEL_CHOICES); initial weights follow torch's global seed."""
    if name == "resnet18":
        return resnet18_cifar()
    if name == "cnn":
        return SmallCNN(cnn_width)
    raise ValueError(f"unknown model {name!r}; expected one of {MODEL_CHOICES}")


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on conv and linear weights only: decaying batch norm scales and
    biases only fights the normalisation."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --- batch norm over the whole job ------------------------------------------------


class _SyncBatchNormFn(torch.autograd.Function):
    """Batch norm over the union of every rank's batch; one collective each way.

    Forward: each rank's (count, mean, biased variance) are all-gathered and
    combined in float64 by the parallel variance formula, in rank order, so
    every rank gets the same bits. Backward: the two per-channel sums the input
    gradient needs (of dy and of dy * (x - mean)) are all-reduced; the weight
    and bias gradients stay local (DDP averages them like any other).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        world_size = dist.get_world_size(group)
        var, mean = torch.var_mean(x, dim=_CHANNEL_DIMS, correction=0)
        count = x.numel() // x.size(1)
        local = torch.cat([x.new_tensor([count], dtype=torch.float64), mean.double(), var.double()])
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=group)
        stats = torch.stack(gathered)
        counts, means, variances = stats[:, :1], stats[:, 1 : 1 + x.size(1)], stats[:, 1 + x.size(1) :]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_var = (counts * (variances + (means - global_mean) ** 2)).sum(0) / total

        if running_mean is not None and running_var is not None:
            unbiased = global_var * total / max(total.item() - 1, 1)
            running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        shape = (1, -1, 1, 1)
        mean_c = global_mean.to(x.dtype).view(shape)
        invstd = torch.rsqrt(global_var + eps).to(x.dtype).view(shape)
        x_hat = (x - mean_c) * invstd
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.total = total.item()
        ctx.group = group
        out = x_hat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, weight, invstd = ctx.saved_tensors
        sum_dy = grad_out.sum(_CHANNEL_DIMS)
        sum_dy_xhat = (grad_out * x_hat).sum(_CHANNEL_DIMS)
        both = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(both, group=ctx.group)
        global_dy, global_dy_xhat = both.split(sum_dy.numel())
        shape = (1, -1, 1, 1)
        scale = invstd if weight is None else invstd * weight.view(shape)
        grad_x = scale * (
            grad_out - (global_dy / ctx.total).view(shape) - x_hat * (global_dy_xhat / ctx.total).view(shape)
        )
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """`BatchNorm2d` whose training statistics are those of the whole job's batch.

    For CPU jobs (gloo), where `torch.nn.SyncBatchNorm` refuses to run. Without
    a process group of more than one rank, or in eval mode, it is plain
    `BatchNorm2d`. Same parameters, buffers and state_dict keys.
    """

    def __init__(self, *args: Any, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        synced = self.training and dist.is_available() and dist.is_initialized()
        if not synced or dist.get_world_size(self.process_group) == 1:
            return super().forward(x)
        self._check_input_dim(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm2d does
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFn.apply(
            x, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, momentum, self.process_group,
        )


def _to_cpu_sync(module: nn.Module) -> nn.Module:
    if type(module) is nn.BatchNorm2d:
        synced = CPUSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        synced.load_state_dict(module.state_dict())
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        module.add_module(name, _to_cpu_sync(child))
    return module


def sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """The model with every BatchNorm2d synchronised over the default process group
    (torch's SyncBatchNorm on CUDA, CPUSyncBatchNorm elsewhere); call it before
    building the optimizer, since layers are replaced."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _to_cpu_sync(model)
