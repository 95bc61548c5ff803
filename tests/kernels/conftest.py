import torch

# The tests use tiny tensors: one intra-op thread avoids thread hand-off overhead
# (and contention with other work on small CI machines) dominating the runtime.
torch.set_num_threads(1)
