"""Model tests share the machine with benchmarks: one torch thread, tiny shapes."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
