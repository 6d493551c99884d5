"""Test-wide settings: one torch thread (tiny ops; CI shares 2 cores with Ray workers)."""

import torch

torch.set_num_threads(1)
