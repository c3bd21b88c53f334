"""Prints the largest absolute difference between two state_dicts saved with torch.save (the
same names and shapes), as "max difference X", or says where they disagree and exits 1."""
import sys

import torch

a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
    print("the state_dicts hold different tensors")
    sys.exit(1)
worst = max(a, key=lambda k: (a[k].double() - b[k].double()).abs().max().item())
print("max difference %.3g (%s)" % ((a[worst].double() - b[worst].double()).abs().max().item(),
                                    worst))
