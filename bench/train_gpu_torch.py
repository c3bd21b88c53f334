"""PyTorch peer for bench/train_gpu: the same models, batch and optimizer on cuda:0, timed the
same way (forward + backward + SGD step with momentum per iteration, the batch resident on the
GPU, median of timed windows after warm-up, each window ended by torch.cuda.synchronize()).

Precisions: f32 (TF32 off for matmuls and convolutions), tf32 (both on), bf16
(torch.autocast("cuda", dtype=torch.bfloat16)). Modes: eager, and with --compile also
torch.compile for the small models. Then the matmul ceiling: forward, data-gradient and
weight-gradient products of each shape through torch.mm (cuBLAS/cuBLASLt), in TFLOP/s.

Prints one JSON line per row: {"model", "precision", "mode", "samples_per_s"} and
{"matmul": "MxKxN", "precision", "mode": "matmul", "tflops"}.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_torch import GPT
from torch_peer import load_images
from train_torch import Net, cnn, mlp


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, as tandem's small ResNet builds it."""

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.downsample(x) if self.downsample is not None else x))


class SmallResNet(nn.Module):
    """td_resnet_default_params(): a 3x3 stride-1 stem to 16 channels, BasicBlocks [1, 1, 1, 1]
    of 16, 32, 64, 128 planes, average pooling, 10 classes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for i, planes in enumerate([16, 32, 64, 128]):
            layers.append(BasicBlock(cin, planes, 1 if i == 0 else 2))
            cin = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return F.log_softmax(self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)), dim=1)


def torchvision_resnet(depth):
    import torchvision
    return getattr(torchvision.models, f"resnet{depth}")()


def gpt():
    """td_gpt_default_params(): 4 blocks of 4 heads, width 128, context 128, byte tokens."""
    return GPT(argparse.Namespace(layers=4, heads=4, width=128, context=128))


MODELS = {"net": Net, "mlp": mlp, "cnn": cnn, "resnet": SmallResNet,
          "resnet50": lambda: torchvision_resnet(50), "resnet101": lambda: torchvision_resnet(101),
          "gpt": gpt}
COMPILED = {"net", "mlp", "cnn", "resnet"}  # quick enough to compile in the benchmark's budget


def set_precision(precision):
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    # as a PyTorch user training fixed shapes sets it: cuDNN times its algorithms once a shape
    torch.backends.cudnn.benchmark = True


def time_windows(step, args):
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    rates = []
    for _ in range(args.windows):
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
        rates.append(args.batch * args.iters / (time.perf_counter() - t0))
    return statistics.median(rates)


def train_rate(name, precision, mode, args):
    torch.manual_seed(0)
    set_precision(precision)
    model = MODELS[name]().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run = torch.compile(model) if mode == "compile" else model
    if name == "gpt":  # samples are sequences of 128 tokens; the model returns its loss
        x = torch.randint(0, 256, (args.batch, 128), device="cuda")
        y = torch.randint(0, 256, (args.batch, 128), device="cuda")
        loss_of = lambda: run(x, y)
    elif name.startswith("resnet") and name != "resnet":
        x = torch.randn(args.batch, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (args.batch,), device="cuda")
        loss_of = lambda: F.cross_entropy(run(x), y)
    else:
        x = load_images(args.batch).cuda()
        y = torch.randint(0, 10, (args.batch,), device="cuda")
        loss_of = lambda: F.nll_loss(run(x), y)

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of()
        loss.backward()
        opt.step()

    return time_windows(step, args)


def matmul_tflops(m, k, n, precision, args):
    """Forward, data gradient and weight gradient of y = x W^T, x (m, k), W (n, k)."""
    set_precision(precision)
    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt)
    dy = torch.randn(m, n, device="cuda", dtype=dt)

    def step():
        torch.mm(x, w.t())
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    rate = time_windows(step, argparse.Namespace(**{**vars(args), "batch": 1}))
    return rate * 3 * 2 * m * k * n / 1e12


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="net,mlp,cnn,resnet,resnet50,resnet101,gpt")
    p.add_argument("--precisions", default="f32,tf32,bf16")
    p.add_argument("--matmuls", default="128x1024x1024,8192x8192x8192")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    for name in args.models.split(","):
        for precision in args.precisions.split(","):
            modes = ["eager"] + (["compile"] if args.compile and name in COMPILED else [])
            for mode in modes:
                try:
                    rate = train_rate(name, precision, mode, args)
                except Exception as e:  # a failed row is reported and the others still run
                    print(f"train_gpu_torch: {name} {precision} {mode}: {e}", file=sys.stderr)
                    continue
                print(json.dumps({"model": name, "precision": precision, "mode": mode,
                                  "samples_per_s": rate}), flush=True)
    for shape in args.matmuls.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        for precision in args.precisions.split(","):
            print(json.dumps({"matmul": shape, "precision": precision, "mode": "matmul",
                              "tflops": matmul_tflops(m, k, n, precision, args)}), flush=True)


if __name__ == "__main__":
    main()
