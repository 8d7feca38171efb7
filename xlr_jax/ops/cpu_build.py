"""Building the CPU kernels' library: once per key, by one process at a time, a failure
remembered.

A build is keyed as its library is (the sources, jaxlib, the compiler and its file, the
flags and target, the CPU), and its files lie side by side in the kernels directory:

  xlr_cpu_kernels-<target>-<key>.so       the library (written whole, then renamed)
  xlr_cpu_kernels-<target>-<key>.sha256   its checksum: a library cut short by a crash is
                                          never loaded (dlopen of one dies of SIGBUS)
  xlr_cpu_kernels-<target>-<key>.failed   a failed build: why, and where its log is
  xlr_cpu_kernels-<target>-<key>.log      the compiler's output of the last attempt
  xlr_cpu_kernels-<target>-<key>.lock     held (flock) by the process building it

so a later process knows in milliseconds whether the library is there, failed or is
being built, and never builds a key twice at once. `cpu_kernels` decides when to build
(in the background by default); this module only builds. It imports nothing beyond the
standard library, so the background builder (this file run as a script) starts in
milliseconds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialized across processes
    fcntl = None

HERE = Path(__file__).parent
SOURCES = (HERE / "paged_attention.cc", HERE / "linear.cc", HERE / "quantized_linear.cc",
           HERE / "ffi_bindings.cc")
HEADERS = (HERE / "cpu_kernels.h",)
# -O3: at -O2 GCC keeps the kernels' arrays of accumulators in memory, not registers (it
# unrolls only loops that do not grow the code), and they ran 1.5-3x slower; forcing the
# unrolling at -O2 compiled slower than -O3 (AMD EPYC, AVX2, gcc 12)
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-w")
TIMEOUT_S = 300  # a compiler that hangs: failed after this long (a build takes 5-10 s)
MIN_FREE_BYTES = 64 << 20  # the objects and library take ~2 MB; below this, do not try


@dataclasses.dataclass(frozen=True)
class Build:
    """One library: what builds it and where it lies."""
    compiler: str            # the compiler's path
    target: str              # -march's value ("native": the CPU this runs on)
    include_dirs: tuple[str, ...]
    directory: str           # the kernels directory
    key: str

    def file(self, suffix: str) -> Path:
        return Path(self.directory) / f"xlr_cpu_kernels-{self.target}-{self.key}{suffix}"

    @property
    def library(self) -> Path:
        return self.file(".so")

    @property
    def checksum(self) -> Path:
        return self.file(".sha256")

    @property
    def failure(self) -> Path:
        return self.file(".failed")

    @property
    def log(self) -> Path:
        return self.file(".log")

    @property
    def lock(self) -> Path:
        return self.file(".lock")

    def commands(self, objects: list[Path], out: Path) -> list[list[str]]:
        """The compile command of each source (run side by side), then the link."""
        includes = [f"-I{d}" for d in (*self.include_dirs, str(HERE))]
        flags = [*FLAGS, f"-march={self.target}"]
        compiles = [[self.compiler, *flags, *includes, "-c", str(src), "-o", str(obj)]
                    for src, obj in zip(SOURCES, objects)]
        return [*compiles, [self.compiler, *flags, "-shared", *map(str, objects), "-o", str(out)]]


def key_for(compiler: str, target: str, versions: tuple[str, ...]) -> str:
    """The key of a build: the sources, `versions` (jaxlib's, the CPU's features for a
    native target), the compiler's path, size and time (an upgraded compiler builds
    afresh) and the flags."""
    stat = os.stat(compiler)
    parts = [*(p.read_bytes() for p in SOURCES + HEADERS), *versions, compiler,
             f"{stat.st_size}:{stat.st_mtime_ns}", " ".join(FLAGS), target]
    digest = hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else p.encode()
                                       for p in parts))
    return digest.hexdigest()[:16]


def intact(build: Build) -> bool:
    """Whether the library is there and whole: its checksum is the one its build wrote."""
    try:
        return hashlib.sha256(build.library.read_bytes()).hexdigest() == build.checksum.read_text()
    except OSError:
        return False


def recorded_failure(build: Build) -> str | None:
    """Why the build failed, if a failure is recorded for its key (one line, with the
    log's path), else None."""
    try:
        record = json.loads(build.failure.read_text())
        return f"{record['error']} (log: {record['log']})"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def unwritable(build: Build) -> str | None:
    """Why nothing can be built in the kernels directory (not creatable, not writable,
    nearly full), else None."""
    directory = Path(build.directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        build.lock.touch()
        free = shutil.disk_usage(directory).free
    except OSError as e:
        return f"cannot write the kernels directory {directory} ({e.strerror or e}); set XLR_KERNEL_DIR"
    if free < MIN_FREE_BYTES:
        return (f"the kernels directory {directory} has {free >> 20} MB free (the build "
                f"needs {MIN_FREE_BYTES >> 20} MB); free space or set XLR_KERNEL_DIR")
    return None


@contextlib.contextmanager
def holding_lock(build: Build, wait_s: float):
    """Yields True while this process holds the build's lock, False if another kept it
    for `wait_s` seconds (0: do not wait)."""
    if fcntl is None:
        yield True
        return
    with open(build.lock, "a") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def being_built(build: Build) -> bool:
    """Whether another process holds the build's lock now."""
    with holding_lock(build, 0) as mine:
        return not mine


def build_library(build: Build, *, wait_s: float = 0.0, retry: bool = False) -> str | None:
    """Build the library unless it exists or failed before (`retry`: try a recorded
    failure again); None when the library is there afterwards, else why not. Another
    process building it: wait up to `wait_s` for it, then say so."""
    if (why := unwritable(build)) is not None:
        return why
    with holding_lock(build, wait_s) as mine:
        if not mine:
            return f"being built by another process (lock: {build.lock})"
        if intact(build):
            return None
        if retry:
            build.failure.unlink(missing_ok=True)
        elif (why := recorded_failure(build)) is not None:
            return why
        why = _compile(build)
        if why is not None:
            _record_failure(build, why)
            return f"{why} (log: {build.log})"
        return None


def _compile(build: Build) -> str | None:
    """Compile and link into a temporary file, renamed to the library when whole."""
    try:
        with tempfile.TemporaryDirectory(dir=build.directory, prefix=".build-") as tmp:
            objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
            out = Path(tmp) / build.library.name
            *compiles, link = build.commands(objects, out)
            deadline = time.monotonic() + TIMEOUT_S
            # the sources side by side: on two cores the build takes the longer one's time
            results = _run_all(compiles, deadline)
            if all(code == 0 for _, code, _ in results):
                results += _run_all([link], deadline)
            _write_log(build, [line for cmd, code, output in results
                               for line in (f"$ {' '.join(cmd)}", output, f"(exit {code})")])
            for _, code, output in results:
                if code is None:
                    return f"building with {build.compiler} failed: no result in {TIMEOUT_S} s"
                if code:
                    lines = [x for x in output.splitlines() if "error" in x] or \
                        output.splitlines()[-1:] or [f"exit status {code}"]
                    return f"building with {build.compiler} failed: {lines[0].strip()}"
            # the checksum first: a library is loaded only with its own beside it
            _write_whole(build.checksum, hashlib.sha256(out.read_bytes()).hexdigest())
            os.replace(out, build.library)
    except OSError as e:
        _write_log(build, [str(e)])
        return f"building with {build.compiler} failed: {e.strerror or e}"
    return None


def _run_all(commands: list[list[str]], deadline: float) -> list[tuple[list[str], int | None, str]]:
    """Run `commands` side by side: each with its exit status (None: killed at
    `deadline`) and output. A command that cannot start raises OSError, the others
    killed."""
    running: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            running.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, text=True))
    except OSError:
        for process in running:
            process.kill()
            process.wait()
        raise
    return [(cmd, *_finish(p, deadline)) for cmd, p in zip(commands, running)]


def _finish(process: subprocess.Popen, deadline: float) -> tuple[int | None, str]:
    """A compiler's exit status and output; None as the status if it ran past `deadline`
    (it is killed)."""
    try:
        output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        return None, output


def _write_log(build: Build, lines: list[str]) -> None:
    with contextlib.suppress(OSError):
        build.log.write_text("\n".join(lines) + "\n")


def _record_failure(build: Build, why: str) -> None:
    """Write the failure record; where that fails too (a full disk), this process alone
    knows."""
    with contextlib.suppress(OSError):
        _write_whole(build.failure, json.dumps({"error": why, "log": str(build.log),
                                                "time": time.time()}))


def _write_whole(path: Path, text: str) -> None:
    """Write `text` to a temporary file, then rename it to `path`: readers see all of it
    or nothing."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def start_in_background(build: Build) -> subprocess.Popen:
    """Run `build` in a detached process at the lowest priority: it outlives this one,
    and the next process finds the library (or the failure)."""
    return subprocess.Popen([sys.executable, __file__, json.dumps(dataclasses.asdict(build))],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _main(spec: str) -> int:
    with contextlib.suppress(OSError, AttributeError):
        os.nice(19)  # the foreground answers first
    fields = json.loads(spec)
    return 0 if build_library(Build(**{**fields, "include_dirs": tuple(fields["include_dirs"])})) is None else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
