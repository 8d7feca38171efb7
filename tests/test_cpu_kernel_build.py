"""Building the CPU kernels: every target's vectors, and every way a build can go wrong
(no compiler, a broken or hung one, a read-only, full or unusable kernels directory, two
processes building at once, a library truncated by a crash). Each ends in XLA's ops and
one clear line, decided in milliseconds by later processes, never a crash, a hang or a
second build.

Each case runs in fresh processes on a kernels directory of its own, with a compiler
that is a real program: the machine's, behind a script that counts its runs, or a
script that fails or never ends.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from xlr_jax.ops import cpu_build, cpu_kernels

FAST_S = 0.5  # "in milliseconds": a decided question, with the interpreter's noise


def child(script: str, env: dict, *, prefix: list[str] | None = None) -> dict:
    """Run `script` (which sets `out`) in a fresh Python; its `out` and stderr."""
    code = "import json, sys, time\n" + textwrap.dedent(script) + \
        "\nprint('RESULT ' + json.dumps(out))\n"
    run = subprocess.run([*(prefix or []), sys.executable, "-c", code], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "stderr": run.stderr}


# what a child reports of one call: its answer, its time, and the status line
ASK = """
from xlr_jax.ops import cpu_kernels
start = time.perf_counter()
why = cpu_kernels.build_error({args})
out = {{"why": why, "s": time.perf_counter() - start, "status": cpu_kernels.status()}}
"""


def ask(env: dict, args: str = "") -> dict:
    return child(ASK.format(args=args), env)


def fake_compiler(path: Path, counter: Path, body: str) -> str:
    """A compiler script that notes each run (its parent's pid) in `counter`, then runs
    `body`."""
    path.write_text(f'#!/bin/sh\necho "$PPID" >> {counter}\n{body}\n')
    path.chmod(0o755)
    return str(path)


def runs(counter: Path) -> int:
    return len(counter.read_text().split()) if counter.exists() else 0


def machine_compiler() -> str:
    found = shutil.which("c++") or shutil.which("g++")
    if found is None:
        pytest.skip("no C++ compiler on this machine")
    return found


def counting(tmp_path: Path) -> tuple[dict, Path]:
    """An environment whose compiler is the machine's behind a counting script, and its
    kernels directory."""
    counter = tmp_path / "runs"
    cxx = fake_compiler(tmp_path / "cxx", counter, f'exec {machine_compiler()} "$@"')
    return {"CXX": cxx, "XLR_KERNEL_DIR": str(tmp_path / "kernels")}, counter


def wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_every_target_builds_with_its_own_vectors(kernel_target):
    """The kernels build for each tested target (a failed build fails this test where a
    compiler is): 4 floats a vector for SSE2, 8 for AVX2, this CPU's own for native."""
    build = cpu_kernels.library_build(kernel_target)
    lanes = ctypes.CDLL(str(build.library)).XlrVectorLanes()
    flags = set(open("/proc/cpuinfo").read().split()) if Path("/proc/cpuinfo").exists() else set()
    native = 16 if "avx512f" in flags else 8 if "avx" in flags else 4
    assert lanes == {"x86-64": 4, "x86-64-v3": 8, "native": native}[kernel_target]
    assert build.library.parent == cpu_kernels.kernel_dir()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("aarch64-linux-gnu-g++")
                    is None, reason="needs x86-64 and the aarch64 cross compiler")
def test_sources_compile_for_aarch64(tmp_path):
    """The kernels' sources compile for aarch64 (NEON, 4 lanes, 32 registers) with the
    build's own flags: no x86 in them."""
    include = __import__("jax").ffi.include_dir()
    for src in cpu_build.SOURCES:
        run = subprocess.run(["aarch64-linux-gnu-g++", *cpu_build.FLAGS, "-march=armv8-a",
                              f"-I{include}", f"-I{src.parent}", "-c", str(src), "-o",
                              str(tmp_path / f"{src.stem}.o")], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]


def test_no_compiler_keeps_xla_and_says_so_at_once(tmp_path):
    """CXX naming no program: build_error says so in milliseconds; the plan keeps the
    XLA walk and XLA's products and says why; impl="cpu" still answers, by the walk."""
    r = child("""
import jax.numpy as jnp
from xlr_jax.model.config import ModelConfig
from xlr_jax.ops import cpu_kernels, paged_attention
from xlr_jax.planning.hardware import HardwareProfile
from xlr_jax.planning.mapper import plan
start = time.perf_counter()
why = cpu_kernels.build_error()
s = time.perf_counter() - start
config = ModelConfig("llama", 512, 128, 2, 4, 2, 64, 256, 1e-5, 1e4, 256, tie_embeddings=True)
hw = HardwareProfile("cpu", "cpu", 1, 8 * 10**9, 8 * 10**9, None, 16, 1000.0, 100.0, "table")
p = plan(hw, config)
q = jnp.ones((1, 1, 4, 64))
pages = jnp.ones((3, 2, 8, 64))
o = paged_attention(q, (pages, pages), jnp.zeros((1, 2), jnp.int32), jnp.array([5]),
                    jnp.array([[4]]), impl="cpu", pages_per_block=1)
out = {"why": why, "s": s, "status": cpu_kernels.status(), "impl": p.attn_impl,
       "attn_why": p.reasons["attn_impl"], "linear": p.linear_impl,
       "linear_why": p.reasons["linear_impl"], "sum": float(o.sum())}
""", {"CXX": str(tmp_path / "no-such-compiler"), "XLR_KERNEL_DIR": str(tmp_path / "k")})
    assert "no-such-compiler is not a program" in r["why"] and r["s"] < FAST_S
    assert r["status"] == f"CPU kernels off: {r['why']}; using XLA's ops"
    assert r["impl"] == "xla" and "attention kernel is off" in r["attn_why"]
    assert r["linear"] == "xla" and "few-row kernel is off" in r["linear_why"]
    assert r["sum"] == pytest.approx(4 * 64)  # ones attending over ones
    assert not (tmp_path / "k").exists()  # nothing was tried


def test_a_failed_build_is_recorded_once(tmp_path):
    """A compiler that fails: the first process answers at once (the build runs in the
    background), the failure is recorded with its log, and later processes say why in
    milliseconds without running the compiler again, waiting or not; retry runs it."""
    counter = tmp_path / "runs"
    env = {"CXX": fake_compiler(tmp_path / "cxx", counter,
                                'echo "kernel.cc:1:1: error: this compiler is broken" >&2\nexit 1'),
           "XLR_KERNEL_DIR": str(tmp_path / "kernels")}
    first = ask(env)
    assert first["why"].startswith("building in the background") and first["s"] < FAST_S
    assert first["status"] == f"CPU kernels off: {first['why']}; using XLA's ops"
    wait_for(lambda: list((tmp_path / "kernels").glob("*.failed")))
    assert runs(counter) == len(cpu_build.SOURCES)  # compiled side by side, never linked
    for args in ("", "wait_s=30"):
        later = ask(env, args)
        assert "this compiler is broken" in later["why"] and later["s"] < FAST_S
        log = Path(later["why"].rsplit("(log: ", 1)[1].rstrip(")"))
        assert "this compiler is broken" in log.read_text()
        assert later["status"] == f"CPU kernels off: {later['why']}; using XLA's ops"
    assert runs(counter) == len(cpu_build.SOURCES)
    again = ask(env, "retry=True")
    assert "this compiler is broken" in again["why"]
    assert runs(counter) == 2 * len(cpu_build.SOURCES)


def test_a_hung_compiler_never_stalls_and_builds_once(tmp_path):
    """A compiler that never ends: a process asks and goes on at once; a load waits its
    bounded while ($XLR_KERNEL_WAIT) and goes on; neither starts a second build."""
    counter = tmp_path / "runs"
    env = {"CXX": fake_compiler(tmp_path / "cxx", counter, "exec sleep 600"),
           "XLR_KERNEL_DIR": str(tmp_path / "kernels"), "XLR_KERNEL_WAIT": "1"}
    try:
        first = ask(env)
        assert first["why"].startswith("building in the background") and first["s"] < FAST_S
        wait_for(lambda: runs(counter) == len(cpu_build.SOURCES))
        load = ask(env, "wait_s=cpu_kernels.wait_s_for_load()")
        assert load["why"].startswith("being built by another process")
        assert 1 <= load["s"] < 3
        assert ask(env)["why"].startswith("being built by another process")
        assert runs(counter) == len(cpu_build.SOURCES)
    finally:
        for pid in set(counter.read_text().split()):  # the builder and its compilers
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_unusable_kernel_directories(tmp_path):
    """A kernels directory that is a file's child, on a read-only file system, or on a
    full one: one clear line in milliseconds, no compiler run; a read-only directory
    that holds the library loads it."""
    env, counter = counting(tmp_path)
    (tmp_path / "file").write_text("")
    r = ask({**env, "XLR_KERNEL_DIR": str(tmp_path / "file" / "kernels")})
    assert r["why"].startswith("cannot write the kernels directory") and r["s"] < FAST_S
    assert "set XLR_KERNEL_DIR" in r["why"]

    built = tmp_path / "built"  # a library built for the mounts below, in a process of its own
    assert ask({**env, "XLR_KERNEL_DIR": str(built)}, "wait_s=300")["why"] is None
    runs_before = runs(counter)
    mount = tmp_path / "mount"
    mount.mkdir()

    def on_mount(setup: str, args: str = "") -> dict:
        """ask() in a mount namespace of its own, the kernels directory on `mount`."""
        if shutil.which("unshare") is None:
            pytest.fail("unshare (util-linux) is needed to mount test file systems")
        script = ASK.format(args=args)
        code = "import json, sys, time\n" + script + "\nprint('RESULT ' + json.dumps(out))\n"
        (tmp_path / "child.py").write_text(code)
        shell = f"{setup} && exec {sys.executable} {tmp_path / 'child.py'}"
        run = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True,
                             text=True, env={**os.environ, **env, "XLR_KERNEL_DIR": str(mount)},
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.split("RESULT ", 1)[1])

    read_only = f"mount -t tmpfs tmpfs {mount} && mount -o remount,ro {mount}"
    r = on_mount(read_only)
    assert r["why"].startswith("cannot write the kernels directory") and r["s"] < FAST_S
    full = f"mount -t tmpfs -o size=1m tmpfs {mount}"
    r = on_mount(full)
    assert "MB free" in r["why"] and r["s"] < FAST_S
    r = on_mount(full, "wait_s=30")  # waiting changes nothing
    assert "MB free" in r["why"]
    assert runs(counter) == runs_before
    holding = (f"mount -t tmpfs tmpfs {mount} && cp {built}/*.so {built}/*.sha256 {mount} "
               f"&& mount -o remount,ro {mount}")
    assert on_mount(holding)["why"] is None


LINEAR = """
import jax.numpy as jnp, numpy as np
from xlr_jax.ops import cpu_kernels, cpu_linear
why = cpu_kernels.build_error(wait_s=300)
x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
w = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
err = float(np.abs(np.asarray(cpu_linear.linear(jnp.asarray(x), jnp.asarray(w))) - x @ w.T).max())
out = {"why": why, "err": err}
"""


def test_two_processes_at_once_build_once(tmp_path):
    """Two processes that find no library and both wait for it: one builds, the other
    waits on its lock; both then run the kernel."""
    env, counter = counting(tmp_path)
    code = "import json, sys, time\n" + LINEAR + "\nprint('RESULT ' + json.dumps(out))\n"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
             for _ in range(2)]
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        r = json.loads(stdout.split("RESULT ", 1)[1])
        assert r["why"] is None and r["err"] < 1e-4
    assert runs(counter) == len(cpu_build.SOURCES) + 1  # one build: its compiles and link


def test_a_truncated_library_is_built_again(tmp_path):
    """A library cut short (a crash while copying it in): the next process says so,
    removes it and builds it again in the background, planning XLA's ops; the one after
    loads the new library."""
    env, counter = counting(tmp_path)
    assert ask(env, "wait_s=300")["why"] is None
    (library,) = (tmp_path / "kernels").glob("*.so")
    whole = library.stat().st_size
    with open(library, "r+b") as f:
        f.truncate(whole // 3)
    r = child("""
from xlr_jax.ops import cpu_kernels
from xlr_jax.model.config import ModelConfig
from xlr_jax.planning.hardware import HardwareProfile
from xlr_jax.planning.mapper import plan
why = cpu_kernels.build_error()
config = ModelConfig("llama", 512, 128, 2, 4, 2, 64, 256, 1e-5, 1e4, 256, tie_embeddings=True)
hw = HardwareProfile("cpu", "cpu", 1, 8 * 10**9, 8 * 10**9, None, 16, 1000.0, 100.0, "table")
p = plan(hw, config)
out = {"why": why, "impl": p.attn_impl, "attn_why": p.reasons["attn_impl"]}
""", env)
    assert "removing it and building it again" in r["stderr"]
    assert r["why"].startswith("building in the background")
    assert r["impl"] == "xla" and "building in the background" in r["attn_why"]
    # the new library is renamed into place whole
    wait_for(lambda: library.exists() and library.stat().st_size == whole)
    assert runs(counter) == 2 * (len(cpu_build.SOURCES) + 1)
    r = child(LINEAR, env)
    assert r["why"] is None and r["err"] < 1e-4


def test_cli_says_when_the_kernels_are_off(tmp_path):
    """`xlr plan` on the CPU without kernels: one line saying so and why."""
    run = subprocess.run([sys.executable, "-m", "xlr_jax.cli", "plan"], capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
                              "XLR_KERNEL_DIR": str(tmp_path / "k")})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [x for x in run.stderr.splitlines() if x.startswith("CPU kernels off:")]
    assert lines == [f"CPU kernels off: CXX={tmp_path / 'no-such-compiler'} is not a program "
                     "(set CXX to a C++ compiler); using XLA's ops"]
    assert "attention kernel is off" in run.stdout
