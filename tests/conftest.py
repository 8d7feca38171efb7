"""Shared fixtures: the embedded model (ours and the transformers reference), loaded once."""
import os

import pytest


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xlr-cache")


@pytest.fixture(scope="session")
def model(cache_dir):
    import xlr_jax

    return xlr_jax.load_model("smollm2", dtype="float32", cache_dir=cache_dir)


@pytest.fixture(scope="session")
def gguf_path():
    from xlr_jax.registry import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              dtype=torch.float32)
    return hf.eval()
