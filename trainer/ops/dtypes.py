"""``train.precision`` → the torch dtype the kernels compute in (the optimizer's precision rules in
trainer/optim/precision.py and the kernel self-check both read it)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
