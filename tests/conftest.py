"""Shared fixtures: the embedded model (ours and the transformers reference), loaded once,
and the CPU kernels built for every target the tests check."""
import math
import os
import platform

import pytest

# the targets the CPU kernels are tested on, whatever machine runs the tests: this CPU's
# own, and on x86-64 AVX2 (every x86-64 CI machine runs it) and SSE2 (4 lanes: the
# portable vectors, as on NEON)
KERNEL_TARGETS = ("native", "x86-64-v3", "x86-64") if platform.machine() in ("x86_64", "AMD64") \
    else ("native",)


def pytest_configure(config):
    """One kernels directory for this process and every process the tests start (a test
    moving XLR_CACHE_DIR does not build them again)."""
    from xlr_jax.ops import cpu_kernels

    os.environ.setdefault("XLR_KERNEL_DIR", str(cpu_kernels.kernel_dir()))


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """The runtime's kernels built before the first test (waiting for the compiler, once
    per key; a later run finds them), so the tests' "cpu" paths run them, and processes
    the tests start load them rather than building them in the background."""
    from xlr_jax.ops import cpu_kernels

    cpu_kernels.build_error(wait_s=math.inf)


def built_kernels(target: str | None = None) -> str:
    """`target`'s kernels registered (default: the runtime's), waiting for their build: a
    failed build fails the test; only a machine without a C++ compiler skips it."""
    from xlr_jax.ops import cpu_kernels

    target = target or cpu_kernels.default_target()
    why = cpu_kernels.build_error(target, wait_s=math.inf)
    if why is None:
        return target
    if isinstance(cpu_kernels.library_build(target), str):
        pytest.skip(f"no C++ compiler: {why}")
    pytest.fail(f"the CPU kernels for {target} did not build: {why}")


@pytest.fixture(params=KERNEL_TARGETS)
def kernel_target(request) -> str:
    """Each of KERNEL_TARGETS, its kernels built and registered."""
    return built_kernels(request.param)


@pytest.fixture
def cpu_kernels_on() -> None:
    """The runtime's kernels registered (see built_kernels)."""
    built_kernels()


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# a test leaving more memory maps than this frees the compiled programs at once: the most
# a whole run reached with module-end freeing alone was 51,291 (test_speculative_engine)
MAPS_TO_FREE_AT = 40_000


def _free_compiled_programs():
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Free a module's compiled programs as it ends: XLA:CPU holds ~2.5 memory maps per
    kernel of every live executable, and a whole run keeping them all passed the
    kernel's limit (vm.max_map_count) and segfaulted (README: Memory maps)."""
    yield
    _free_compiled_programs()


@pytest.fixture(autouse=True)
def release_compiled_programs_when_many():
    """Within a module too, once the process holds MAPS_TO_FREE_AT memory maps."""
    yield
    from xlr_jax.model.executables import memory_maps

    if (maps := memory_maps()) is not None and maps[0] > MAPS_TO_FREE_AT:
        _free_compiled_programs()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xlr-cache")


@pytest.fixture(scope="session")
def model(cache_dir):
    import xlr_jax

    return xlr_jax.load_model("smollm2", dtype="float32", cache_dir=cache_dir)


@pytest.fixture(scope="session")
def gguf_path():
    from xlr_jax.loading.registry import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              dtype=torch.float32)
    return hf.eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A 2-layer random Llama over 8 tokens whose token 0 is EOS (a word-level tokenizer
    "t0".."t7" says so), and two drafts saved apart as separate models: its first layer
    alone with the same final norm and head (exactly the "self:1" draft), and the target
    with its LM head scaled by 0.3 (q = softmax(0.3 * logits): flatter than p, so it
    proposes every token p can emit and p / q stays bounded)."""
    import json
    from types import SimpleNamespace

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny_models")
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         vocab_size=8, max_position_embeddings=1024, initializer_range=0.3,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=0)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(root / "target", safe_serialization=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "target" / "tokenizer.json"))
    (root / "target" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}))
    with torch.no_grad():
        head = model.lm_head.weight.clone()
        model.lm_head.weight.mul_(0.3)
        model.save_pretrained(root / "flat_head", safe_serialization=True)
        model.lm_head.weight.copy_(head)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(root / "first_layer", safe_serialization=True)
    return SimpleNamespace(target=root / "target", first_layer=root / "first_layer",
                           flat_head=root / "flat_head")
