"""`xlr serve --data-parallel N`: N replicas of `xlr serve` behind one cache-aware router.

Each replica is an `xlr serve` process of its own on a loopback port, with the command
line it was given (same model, plan and cache folder), on its slice of the devices: the
i-th group of GPUs (`CUDA_VISIBLE_DEVICES`), or on the CPU a process with
`--tensor-parallel` virtual devices of its own. Processes, not threads in one: each
replica's host loop then has its own interpreter, and a replica that dies takes nothing
else down. They share the cache folder, so a stable tier one replica wrote to disk is
restored by another on its first miss.

In front runs sglang-router (SGLang's model gateway, a Rust process from PyPI:
`pip install "xlr-jax[router]"`), which serves the OpenAI routes and forwards each
request to a replica. Its `cache_aware` policy keeps a radix tree of the request texts
each replica has seen and sends a request to the replica sharing the longest prefix with
it (an agent's next turn goes where its history is cached), unless the replicas' loads
drift apart past its balance thresholds; `round_robin`, `power_of_two` and `random` are
its others. Chosen over Ray Serve's prefix-aware router (it needs a Ray cluster and the
replicas as Ray actors) and a consistent-hash proxy such as nginx (it hashes a header,
not the prompt, so agents would have to send one); measured against round-robin in
experiments/data_parallel_router.py.

The router starts once every replica answers /health; SIGTERM or Ctrl-C stops it, then
drains the replicas (each finishes its requests in flight, up to --drain-timeout). A
replica or the router exiting on its own ends the rest, with a line saying which.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from xlr_jax.errors import XlrError

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
READY_TIMEOUT_S = 1800  # a large model's load and first compile


@dataclass
class Child:
    """A process this supervisor started, its output copied to stderr under `name`."""
    name: str
    proc: subprocess.Popen
    url: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, path: str) -> bool:
        import urllib.request  # here: the CLI imports this module to build its parser

        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def replica_devices(replicas: int, per_replica: int | None, gpus: list[str]) -> list[dict]:
    """Each replica's environment changes: its slice of `gpus` (visible GPU ids), or on a
    machine without one, `per_replica` virtual CPU devices where that is over 1
    (`per_replica`: its --tensor-parallel plus its --prefill-devices; None: an equal
    share of the GPUs, one CPU device)."""
    if not gpus:
        per = per_replica or 1
        flags = os.environ.get("XLA_FLAGS", "")
        return [{"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={per}".strip()}
                if per > 1 else {} for _ in range(replicas)]
    per = per_replica or len(gpus) // replicas
    if per < 1 or per * replicas > len(gpus):
        raise XlrError(f"--data-parallel {replicas} x {per} devices a replica "
                       f"(--tensor-parallel + --prefill-devices) needs {replicas * per} GPUs; "
                       f"{len(gpus)} visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])}
            for i in range(replicas)]


def visible_gpus() -> list[str]:
    """The GPU ids this process may use (CUDA_VISIBLE_DEVICES, else NVML's count), without
    starting JAX (whose GPU backend would take the memory the replicas need)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import pynvml

        pynvml.nvmlInit()
        return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no NVML: no NVIDIA GPU or driver
        return []


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_replicas(argv: list[str], replicas: int, *, per_replica: int | None,
                   host: str, port: int, policy: str, api_key: str | None,
                   request_log: str | None, drain_timeout: float) -> int:
    """Run `replicas` copies of `xlr serve ARGV` and the router on `host:port` until
    SIGTERM/Ctrl-C or one of them exits; the exit code (0 after a signal)."""
    if not router_available():
        raise XlrError('--data-parallel needs sglang-router: pip install "xlr-jax[router]" '
                       "(or pip install sglang-router)")
    if policy not in POLICIES:
        raise XlrError(f"--router must be one of {', '.join(POLICIES)} (got {policy!r})")
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set())
                for s in (signal.SIGTERM, signal.SIGINT)}
    children: list[Child] = []
    try:
        for i, env in enumerate(replica_devices(replicas, per_replica, visible_gpus())):
            worker_port = free_port()
            # later flags win in argparse: these override the user's for the replica
            flags = ["--data-parallel", "1", "--host", "127.0.0.1", "--port", str(worker_port)]
            if request_log:
                flags += ["--request-log", str(Path(request_log) / f"replica-{i}")]
            children.append(_start(f"replica {i}", [sys.executable, "-m", "xlr_jax.cli", *argv,
                                                    *flags],
                                   {**os.environ, **env}, f"http://127.0.0.1:{worker_port}"))
        _wait_ready(children, "/health", stop)
        if stop.is_set():
            return 0
        router = [sys.executable, "-m", "sglang_router.launch_router", "--host", host,
                  "--port", str(port), "--policy", policy, "--log-level", "error",
                  "--worker-startup-check-interval", "1",
                  "--worker-urls", *(c.url for c in children)]
        if api_key:  # checked by the router; the replicas check the header it forwards
            router += ["--api-key", api_key]
        children.append(_start("router", router, dict(os.environ),
                               f"http://{_loopback(host)}:{port}"))
        _wait_ready(children[-1:], "/health", stop)
        print(f"serving {replicas} replicas on http://{host}:{port}/v1 (router: {policy})",
              file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            if dead := [c for c in children if not c.alive()]:
                print(f"error: {dead[0].name} exited with code {dead[0].proc.returncode}; "
                      "stopping the others", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        for c in children[replicas:]:  # the router first: no new requests reach a replica
            c.stop(10)
        for c in children[:replicas]:
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        for c in children[:replicas]:
            c.stop(drain_timeout + 30)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _loopback(host: str) -> str:
    """Where this process reaches a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _start(name: str, argv: list[str], env: dict, url: str) -> Child:
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            preexec_fn=_die_with_parent)
    threading.Thread(target=_copy_lines, args=(proc.stdout, f"[{name}] "), daemon=True).start()
    return Child(name, proc, url)


def _copy_lines(stream, prefix: str) -> None:
    for line in stream:
        sys.stderr.write(prefix + line)
    stream.close()


def _die_with_parent() -> None:
    """In the child: SIGTERM when this supervisor dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: children outlive a killed supervisor
        pass


def _wait_ready(children: list[Child], path: str, stop: threading.Event) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = list(children)
    while waiting and not stop.is_set():
        for c in list(waiting):
            if not c.alive():
                raise XlrError(f"{c.name} exited with code {c.proc.returncode} while starting "
                               "(its output is above)")
            if c.ready(path):
                waiting.remove(c)
        if time.monotonic() > deadline:
            raise XlrError(f"{waiting[0].name} did not answer {path} within "
                           f"{READY_TIMEOUT_S} s")
        stop.wait(0.5)
