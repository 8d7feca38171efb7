"""A load parses its model file once, caches what it derives, and never holds the weights twice.

These use a tiny GGUF written here (tests/tiny_gguf.py), so each cold load takes a second.
"""
import contextlib
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

import xlr_jax
from xlr_jax.loading.disk_cache import atomic_entry, file_digest
from xlr_jax.loading.weights import load_weights, open_source

TEXTS = ["Hello there, the theory is on.", "<|im_start|>user\nhi<|im_end|>\n", "tabs\tand 123 é 😀"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _same_tokenizer(a, b):
    assert (a.bos_token_id, a.bos_token, a.eos_token, a.eos_token_ids, a.add_bos_token,
            a.chat_template, a.vocab_size) == (b.bos_token_id, b.bos_token, b.eos_token,
                                               b.eos_token_ids, b.add_bos_token,
                                               b.chat_template, b.vocab_size)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))


def test_second_open_reads_the_cache_not_the_gguf(tiny, tmp_path):
    cold = open_source(tiny, tmp_path)
    assert not cold.from_cache and cold.reader is not None  # parsed, kept for the weights
    warm = open_source(tiny, tmp_path)
    assert warm.from_cache and warm.reader is None
    assert warm.digest == cold.digest and warm.config == cold.config
    _same_tokenizer(warm.tokenizer, cold.tokenizer)
    # the cold source's reader serves the conversion: the GGUF is parsed once per load
    loaded = load_weights(cold, cache_dir=tmp_path)
    assert cold.reader is None and not loaded.from_cache


def _garble(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _foreign(entry: Path):
    manifest = json.loads((entry / "source.json").read_text())
    (entry / "source.json").write_text(json.dumps({**manifest, "digest": "0" * 32}))


@pytest.mark.parametrize("damage", [
    lambda e: _garble(e / "tokenizer.json"),
    lambda e: (e / "config.json").write_text("{}"),
    lambda e: (e / "tokenizer_facts.json").unlink(),
    _foreign,
], ids=["garbled-tokenizer", "emptied-config", "missing-file", "foreign"])
def test_damaged_or_foreign_source_entry_is_rebuilt(tiny, tmp_path, caplog, damage):
    fresh = open_source(tiny, tmp_path)
    (entry,) = (tmp_path / "source").iterdir()
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="xlr_jax.loading.weights"):
        rebuilt = open_source(tiny, tmp_path)
    assert not rebuilt.from_cache, "a damaged entry was trusted"
    assert any("parsing tiny.gguf again" in r.getMessage() for r in caplog.records)
    assert rebuilt.config == fresh.config
    _same_tokenizer(rebuilt.tokenizer, fresh.tokenizer)
    again = open_source(tiny, tmp_path)  # the rebuilt entry serves the next load
    assert again.from_cache
    _same_tokenizer(again.tokenizer, fresh.tokenizer)


def test_file_digest_is_remembered_until_the_file_changes(tmp_path):
    data = tmp_path / "model.bin"
    data.write_bytes(b"weights" * 1000)
    real = file_digest([data], tmp_path / "cache")
    (memo,) = (tmp_path / "cache" / "digests").iterdir()
    memo.write_text("f" * 32)  # a stand-in: returned only if the file is not hashed again
    assert file_digest([data], tmp_path / "cache") == "f" * 32
    data.write_bytes(b"weights" * 1000)  # same bytes, but rewritten: a new stamp
    assert file_digest([data], tmp_path / "cache") == real
    data.write_bytes(b"other" * 1000)
    assert file_digest([data], tmp_path / "cache") not in (real, "f" * 32)
    assert file_digest([data]) == file_digest([data], tmp_path / "cache")


def test_a_cache_entry_published_by_another_process_meanwhile_is_kept(tmp_path):
    """Two processes loading one model convert it at once; the second to finish finds the
    first's entry in place (a rename onto it fails: ENOTEMPTY) and keeps it."""
    entry = tmp_path / "params" / "key"
    with atomic_entry(entry) as tmp:
        (tmp / "a.npy").write_bytes(b"mine")
        entry.mkdir()  # the other process's rename lands while this one still writes
        (entry / "a.npy").write_bytes(b"theirs")
    assert (entry / "a.npy").read_bytes() == b"theirs"
    assert sorted(p.name for p in entry.parent.iterdir()) == ["key"]  # no temporary left
    with atomic_entry(tmp_path / "params" / "fresh") as tmp:
        (tmp / "a.npy").write_bytes(b"mine")
    assert (tmp_path / "params" / "fresh" / "a.npy").read_bytes() == b"mine"


def test_cached_params_are_memory_mapped_and_checked_once(tiny, tmp_path):
    cold = load_weights(tiny, cache_dir=tmp_path)
    warm = load_weights(tiny, cache_dir=tmp_path)
    assert warm.from_cache
    leaves = jax.tree.leaves(warm.params)
    assert all(isinstance(a, np.memmap) or isinstance(a.base, np.memmap) for a in leaves)
    for a, b in zip(jax.tree.leaves(cold.params), leaves):
        np.testing.assert_array_equal(a, b)


class LiveBytes:
    """Peak bytes of live jax arrays, sampled whenever an xlr_jax function returns."""

    def __init__(self):
        self.root = os.path.dirname(xlr_jax.__file__)
        self.peak = 0

    def __call__(self, frame, event, arg):
        if event == "return" and frame.f_code.co_filename.startswith(self.root):
            self.peak = max(self.peak, sum(a.nbytes for a in jax.live_arrays()))

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def test_a_load_never_holds_the_weights_twice(tmp_path):
    path = write_tiny_gguf(tmp_path / "wide.gguf", layers=4, hidden=256, heads=4, kv_heads=2,
                           ffn=1024, context=256)
    kwargs = dict(cache_dir=tmp_path, num_pages=4, max_batch=1, compile_cache=False,
                  prefix_cache=False)
    xlr_jax.load_model(path, **kwargs)  # converts; the load measured below maps the cache
    for params_cache in (True, False):  # memory-mapped, and freshly converted
        jax.block_until_ready(jax.live_arrays())
        baseline = sum(a.nbytes for a in jax.live_arrays())
        with LiveBytes() as live:
            model = xlr_jax.load_model(path, params_cache=params_cache, **kwargs)
        params, kv = model.engine.runner.params.nbytes(), model.engine.runner.kv.nbytes()
        assert params > 8 * kv  # the weights dominate: holding them twice would show
        assert live.peak - baseline <= params + kv + params // 20, (
            f"peak {live.peak - baseline} bytes for {params} of params and {kv} of KV")
        del model


# counts XLA compiles that JAX's persistent cache did not answer: len(compiles) - len(hits)
COUNT_COMPILES = textwrap.dedent("""
    import json, sys
    import jax.monitoring
    compiles, hits = [], []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, s, **kw: compiles.append(name) if name.endswith("backend_compile_duration")
        else hits.append(name) if name.endswith("cache_retrieval_time_sec") else None)
""")
WARM_RUN = COUNT_COMPILES + textwrap.dedent("""
    import xlr_jax
    model = xlr_jax.load_model(sys.argv[1], cache_dir=sys.argv[2], max_context=512)
    parsed = "gguf" in sys.modules
    prompt = model.chat_prompt([{"role": "user", "content": "Hello there"}])
    r = model.generate(prompt, max_tokens=6, ignore_eos=True)
    print(json.dumps({"ids": r.token_ids, "load": model.load_info, "gguf_imported": parsed,
                      "compiles": len(compiles) - len(hits)}))
""")


def _run_script(script: str, *args) -> dict:
    """Run `script` in a fresh process; its last line of output, as JSON."""
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_warm_process_parses_nothing_and_compiles_nothing(tiny, tmp_path):
    cold, warm = _run_script(WARM_RUN, tiny, tmp_path), _run_script(WARM_RUN, tiny, tmp_path)
    assert cold["gguf_imported"] and cold["compiles"] > 0
    assert not warm["gguf_imported"], "a warm load parsed the GGUF"
    assert warm["load"]["metadata_from_cache"] and warm["load"]["params_from_cache"]
    assert warm["load"]["steps_preloaded"] == 2  # this request's prefill and decode
    assert warm["compiles"] == 0, "a warm process compiled"
    assert warm["ids"] == cold["ids"]  # the stored executables compute the same tokens


def _steps_dirs(cache: Path) -> set[Path]:
    return set((cache / "executables").iterdir())


def test_damaged_compiled_step_is_compiled_again(tiny, tmp_path, caplog):
    kwargs = dict(cache_dir=tmp_path, max_context=512)
    model = xlr_jax.load_model(tiny, **kwargs)
    prompt = model.chat_prompt([{"role": "user", "content": "Hello there"}])
    ref = model.generate(prompt, max_tokens=5, ignore_eos=True).token_ids
    (steps,) = _steps_dirs(tmp_path)
    files = sorted(steps.glob("*.bin"))
    # the prompt's chunk alone, then one decode row: (decode rows, chunk)
    assert [f.name for f in files] == ["step-0-32.bin", "step-1-0.bin"]
    _garble(files[0])
    with caplog.at_level(logging.WARNING, logger="xlr_jax.model.executables"):
        again = xlr_jax.load_model(tiny, **kwargs)
    assert again.load_info["steps_preloaded"] == 1  # the intact decode step
    assert any("compiling it again" in r.getMessage() for r in caplog.records)
    assert again.generate(prompt, max_tokens=5, ignore_eos=True).token_ids == ref
    assert files[0].exists()  # compiled and stored again
    assert xlr_jax.load_model(tiny, **kwargs).load_info["steps_preloaded"] == 2


@contextlib.contextmanager
def _memory_maps_left(left: int):
    """Map anonymous pages (alternately read-only and writable, so the kernel cannot
    merge neighbours) until `left` maps remain under vm.max_map_count; unmap on exit."""
    from xlr_jax.model.executables import memory_maps

    if memory_maps() is None:
        pytest.skip("no vm.max_map_count on this system")
    regions = []
    try:
        used, limit = memory_maps()
        while (missing := limit - left - used) > 0:
            for i in range(missing):
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0)
                regions.append(mmap.mmap(-1, mmap.PAGESIZE, prot=prot))
            used, _ = memory_maps()
        yield
    finally:
        for region in regions:
            region.close()


def test_past_the_memory_map_limit_a_step_is_an_error_not_a_crash(tiny, tmp_path):
    """XLA:CPU segfaults when its loader runs out of memory maps (vm.max_map_count): with
    too few left, reading a stored step or compiling one raises MemoryMapLimitError,
    naming the fix, and both work again once maps are freed."""
    from xlr_jax.errors import MemoryMapLimitError
    from xlr_jax.model.executables import MAP_HEADROOM

    kwargs = dict(cache_dir=tmp_path, max_context=512)
    prompt = "<|im_start|>user\nHello<|im_end|>\n"
    ref = xlr_jax.load_model(tiny, **kwargs).generate(prompt, max_tokens=3).token_ids
    fresh = xlr_jax.load_model(tiny, max_context=512, compile_cache=False)
    with _memory_maps_left(MAP_HEADROOM - 64):
        with pytest.raises(MemoryMapLimitError, match="vm.max_map_count"):
            xlr_jax.load_model(tiny, **kwargs)  # reads the steps stored above
        with pytest.raises(MemoryMapLimitError, match="free models you no longer use"):
            fresh.generate(prompt, max_tokens=3)  # compiles its first step
    assert fresh.generate(prompt, max_tokens=3).token_ids == ref
    assert xlr_jax.load_model(tiny, **kwargs).load_info["steps_preloaded"] == 2


def test_compiled_steps_are_kept_apart_by_what_shapes_them(tiny, tmp_path):
    prompt = "<|im_start|>user\nHello<|im_end|>\n"
    for options in ({}, {"xla_cpu_prefer_vector_width": 256}):
        model = xlr_jax.load_model(tiny, cache_dir=tmp_path, max_context=512,
                                   compiler_options=options)
        model.generate(prompt, max_tokens=2)
    model = xlr_jax.load_model(tiny, cache_dir=tmp_path, max_context=512, num_pages=9)
    model.generate(prompt, max_tokens=2)
    assert len(_steps_dirs(tmp_path)) == 3  # compile options and the KV pool each count


def test_compiled_steps_are_keyed_by_the_whole_packages_source(tmp_path):
    """An edit in any module a step's code comes from (attention in ops/, the batch in
    runtime/, pages in kv/) keys new executables: a stale one never runs."""
    from xlr_jax.model.executables import PACKAGE_ROOT, code_digest

    assert PACKAGE_ROOT == Path(xlr_jax.__file__).parent
    copy = tmp_path / "xlr_jax"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = code_digest.__wrapped__  # uncached: the copy changes
    assert digest(copy) == code_digest()
    for module in ("ops/paged_attention.py", "runtime/step_batch.py", "kv/paged_kv.py"):
        before = digest(copy)
        with open(copy / module, "a") as f:
            f.write("# edited\n")
        assert digest(copy) != before, module


AGENT_RUN = COUNT_COMPILES + textwrap.dedent("""
    import xlr_jax
    model = xlr_jax.load_model(sys.argv[1], cache_dir=sys.argv[2], max_context=1024)
    system = "You are a careful agent. " * 12 + "Use the tools."
    r = model.chat([{"role": "system", "content": system},
                    {"role": "user", "content": "Find the papers."}], max_tokens=4)
    model.engine.kv.tier_store.flush()
    print(json.dumps({"ids": r.token_ids, "cached": r.metrics["cached_tokens"],
                      "stable": r.metrics["stable_tokens"], "compiles": len(compiles) - len(hits)}))
""")


def test_a_restarted_agent_runs_the_steps_the_first_process_compiled(tiny, tmp_path):
    first = _run_script(AGENT_RUN, tiny, tmp_path)
    assert first["stable"] > 256 and first["stable"] % 256 and not first["cached"]
    steps = {p.name for p in (tmp_path / "executables").rglob("*.bin")}
    again = _run_script(AGENT_RUN, tiny, tmp_path)
    assert again["cached"] == again["stable"]  # the stable tier came from disk
    # prefill chunks stop at the tier's end, so what follows it is a chunk compiled before
    assert {p.name for p in (tmp_path / "executables").rglob("*.bin")} == steps
    # restoring the tier (its pages written, its partial last page copied on write) ran
    # programs the first process compiled into JAX's cache when it saved the tier
    assert again["compiles"] == 0, "the restarted agent compiled"
    assert again["ids"] == first["ids"]
