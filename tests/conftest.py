import os
import random

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two threads unless OMP_NUM_THREADS says otherwise (the suite must pass with one thread too). Under pytest-xdist
# (the README's `-n 2`) each worker takes one thread, and so do the processes its tests start: two workers share
# two cores instead of four threads contending for them.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))

FAMILIES = ["sdar", "llada", "dream"]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def in_tmp_path(tmp_path, monkeypatch):
    """Run the test in its own temporary folder: for tests whose trainers write into a relative ``output_dir``
    ("unused"), which would otherwise land in the folder pytest was started from."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same global random state (torch, random, numpy), whatever ran before it, so a
    failure reproduces when the test runs alone or in another order."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    yield
