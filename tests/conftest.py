import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)

FAMILIES = ["sdar", "llada", "dream"]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
