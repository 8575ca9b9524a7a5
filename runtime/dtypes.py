"""The torch dtype of each 16-bit type name (the names are optimizer_server.protocol.DTYPES)."""
import torch

from zero_offload.server.protocol import DTYPES

TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
assert tuple(TORCH_DTYPES) == DTYPES
