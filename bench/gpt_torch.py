#!/usr/bin/python3
"""bench/gpt.c's PyTorch peer: nanoGPT's GPT (the model tests/fixtures/models/make_gpt_ref.py
writes, F.scaled_dot_product_attention's math done as nanoGPT's slow path does on torch 1.13)
trained with AdamW on random tokens, in f32 or under torch.autocast(bfloat16), on --world ranks
with DistributedDataParallel over gloo. Prints tokens_per_s, the median window's."""
import argparse
import math
import statistics

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
        att = att.masked_fill(torch.ones(T, T).tril() == 0, float("-inf")).softmax(-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, a.width), nn.Embedding(a.context, a.width)
        self.h = nn.ModuleList([Block(a.width, a.heads) for _ in range(a.layers)])
        self.ln_f = nn.LayerNorm(a.width)

    def forward(self, idx, y):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, 256), y.view(-1))


def rank(r, a, result):
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

    rates = time_windows(step, a)
    if r == 0:
        result["rate"] = statistics.median(rates) * a.context
    if a.world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    for k, v in [("layers", 4), ("heads", 4), ("width", 128), ("context", 128), ("batch", 16),
                 ("iters", 5), ("warmup", 2), ("world", 1), ("windows", 3)]:
        p.add_argument("--" + k, type=int, default=v)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    print("tokens_per_s %.1f" % run_ranks(rank, a)["rate"])


if __name__ == "__main__":
    main()
