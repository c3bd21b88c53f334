#!/usr/bin/python3
"""bench/gpt.c's PyTorch peer: nanoGPT's GPT (the model tests/fixtures/models/make_gpt_ref.py
writes, F.scaled_dot_product_attention's math done as nanoGPT's slow path does on torch 1.13)
trained with AdamW on random tokens, in f32 or under torch.autocast(bfloat16), on --world ranks
with DistributedDataParallel over gloo. With --pin each rank runs on its own core, as
bench/gpt.c's ranks do. Prints tokens_per_s, the median window's, and cpu_s, the CPU time of every
rank's threads over the windows together."""
import argparse
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_peer import run_ranks, time_windows


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.H)
        mask = torch.ones(T, T, device=x.device).tril() == 0
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, a.width), nn.Embedding(a.context, a.width)
        self.h = nn.ModuleList([Block(a.width, a.heads) for _ in range(a.layers)])
        self.ln_f = nn.LayerNorm(a.width)

    def forward(self, idx, y):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, 256), y.view(-1))


def rank(r, a, result):
    if a.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[r % len(cores)]})
    torch.set_num_threads(1)
    if a.world > 1:
        dist.init_process_group("gloo", rank=r, world_size=a.world)
    torch.manual_seed(1)
    model = GPT(a)
    net = nn.parallel.DistributedDataParallel(model) if a.world > 1 else model
    opt = torch.optim.AdamW(model.parameters())
    b = a.batch // a.world
    idx = torch.randint(0, 256, (b, a.context))
    y = torch.randint(0, 256, (b, a.context))

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss = net(idx, y)
        loss.backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    cpu0 = time.process_time()
    rates = time_windows(step, argparse.Namespace(**{**vars(a), "warmup": 0}))
    # Each rank's CPU time goes through a file: a collective of our own here left a gloo callback
    # waiting for the interpreter lock while destroy_process_group joined it (torch 1.13).
    with open(os.path.join(a.cpu_dir, "rank%d" % r), "w") as f:
        f.write("%.6f" % (time.process_time() - cpu0))
    if a.world > 1:
        dist.barrier()
    if r == 0:
        result["rate"] = statistics.median(rates) * a.context
        result["cpu"] = sum(float(open(os.path.join(a.cpu_dir, "rank%d" % k)).read())
                            for k in range(a.world))
    if a.world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    for k, v in [("layers", 4), ("heads", 4), ("width", 128), ("context", 128), ("batch", 16),
                 ("iters", 5), ("warmup", 2), ("world", 1), ("windows", 3)]:
        p.add_argument("--" + k, type=int, default=v)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--pin", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as a.cpu_dir:
        result = run_ranks(rank, a)
    print("tokens_per_s %.1f" % result["rate"])
    print("cpu_s %.4f" % result["cpu"])


if __name__ == "__main__":
    main()
