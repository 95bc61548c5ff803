import pytest
import torch

pytest.importorskip("transformers")

# Tiny models: one intra-op thread avoids hand-off overhead and contention on small CI machines.
torch.set_num_threads(1)
