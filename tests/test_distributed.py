"""Two processes, one mesh (`--coordinator`, jax.distributed): two local `xlr serve`
processes with 2 virtual CPU devices each (CPU collectives by gloo) split the tiny Llama
over 4 devices. Process 0 answers with one process's greedy tokens; a follower's death
fails the leader's requests with an error (never tokens) and ends it within the
heartbeat timeout; the leader's death ends the follower at once; speculative decoding
is refused across processes."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

try:
    import httpx
except ImportError:  # the openai client's own HTTP library, where it is httpx2
    import httpx2 as httpx

import xlr_jax
from xlr_jax.server.replicas import free_port

PROMPTS = ["t1 t2 t3", "t6 t1"]  # (those of distributed_driver.py)
HEARTBEAT_S = 5


class Pair:
    """`xlr serve` as process 0 (the leader, on an HTTP port, joined by flags) and process
    1 (a follower, joined by XLR_COORDINATOR, XLR_NUM_PROCESSES and XLR_PROCESS_ID)."""

    def __init__(self, model, cache_dir, tmp):
        self.port = free_port()
        serve = [sys.executable, "-m", "xlr_jax.cli", "serve", "--model", str(model),
                 "--port", str(self.port), "--cache-dir", str(cache_dir),
                 "--heartbeat-timeout", str(HEARTBEAT_S)]
        coordinator = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        joined = {"XLR_COORDINATOR": coordinator, "XLR_NUM_PROCESSES": "2",
                  "XLR_PROCESS_ID": "1"}
        self.logs = [tmp / f"process-{i}.log" for i in (0, 1)]
        self.procs = [subprocess.Popen(argv, env=e, stdout=subprocess.DEVNULL,
                                       stderr=log.open("w"))
                      for argv, e, log in zip(
                          [[*serve, "--coordinator", coordinator, "--num-processes", "2",
                            "--process-id", "0"], serve],
                          [env, {**env, **joined}], self.logs)]
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process exited:\n{self.output()[-3000:]}")
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.5)
        raise RuntimeError("the leader did not answer /health within 300 s")

    def complete(self, prompt: str) -> httpx.Response:
        return self.http.post("/v1/completions", json={
            "model": "target", "prompt": prompt, "max_tokens": 12, "temperature": 0})

    def output(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


@pytest.fixture
def pair(tiny_models, tmp_path):
    live = Pair(tiny_models.target, tmp_path / "cache", tmp_path)
    yield live
    live.close()


def test_two_processes_give_one_process_tokens_and_logits(tiny_models, tmp_path):
    """Greedy tokens, tokens drawn again under a logits processor's late bias, and a
    prompt's logits (f32; the split sums in another order), through the Python API."""
    driver = [sys.executable, str(Path(__file__).with_name("distributed_driver.py")),
              str(tiny_models.target), str(tmp_path / "cache")]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    one = subprocess.run(driver, capture_output=True, text=True, timeout=300, env=env)
    joined = [*driver, f"127.0.0.1:{free_port()}", "2"]
    follower = subprocess.Popen([*joined, "1"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    leader = subprocess.run([*joined, "0"], capture_output=True, text=True, timeout=300,
                            env=env)
    assert follower.wait(60) == 0 and leader.returncode == 0, leader.stderr[-2000:]
    want, got = (json.loads(r.stdout.splitlines()[-1]) for r in (one, leader))
    assert want["mesh"] == {"data": 1, "model": 1} and got["mesh"] == {"data": 1, "model": 4}
    assert all(len(tokens) >= 8 for tokens in want["greedy"])  # past a few tokens
    assert got["greedy"] == want["greedy"] and got["processed"] == want["processed"]
    assert len(got["processed"]) == 12 and not {0, 4} & set(got["processed"])
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=0, atol=1e-5)


def test_a_followers_death_fails_the_leaders_requests_and_ends_it(pair, tiny_models,
                                                                  tmp_path):
    log = pair.output()
    assert "each layer split over 4 devices" in log and "following process 0" in log
    one = xlr_jax.load_model(tiny_models.target, cache_dir=tmp_path / "one")
    want = one.generate(PROMPTS[0], max_tokens=12)
    one.shutdown()
    got = pair.complete(PROMPTS[0])
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want.text
    spec = pair.http.post("/v1/completions", json={
        "model": "target", "prompt": PROMPTS[0], "max_tokens": 4,
        "speculative": {"method": "exact", "draft": "ngram"}})
    assert spec.status_code == 400 and "one process only" in spec.text

    pair.procs[1].send_signal(signal.SIGKILL)
    pair.procs[1].wait(30)
    failed = pair.complete(PROMPTS[0])
    assert failed.status_code == 500 and "Gloo" in failed.json()["error"]["message"]
    # JAX's coordination service ends the leader once the heartbeats stop
    assert pair.procs[0].wait(HEARTBEAT_S + 60) != 0
    assert "another task died" in pair.output()


def test_the_leaders_death_ends_the_follower(pair):
    assert pair.complete(PROMPTS[1]).status_code == 200
    pair.procs[0].send_signal(signal.SIGKILL)
    started = time.monotonic()
    assert pair.procs[1].wait(HEARTBEAT_S + 60) != 0
    assert time.monotonic() - started < HEARTBEAT_S + 60
    assert "JAX distributed service detected fatal errors" in pair.logs[1].read_text()


def test_coordinator_without_its_count_and_index_is_refused():
    run = subprocess.run([sys.executable, "-m", "xlr_jax.cli", "generate", "hi",
                          "--coordinator", "127.0.0.1:1"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert "--coordinator 127.0.0.1:1 needs --num-processes N and --process-id I" in run.stderr


def test_the_several_processes_experiment_quick(tmp_path):
    """experiments/several_processes.py --quick: the same split in one process and in two,
    side by side: both decode, the same tokens, the ratios written."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] /
                                              "experiments" / "several_processes.py"),
                          "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("several_processes-quick-*.json")
    r = json.loads(path.read_text())
    assert r["same_tokens"] and r["decode_two_over_one"] > 0 and r["ttft_two_over_one"] > 0
    assert all(len(f["token_ids"]) == 8 and f["decode_tokens_per_s"] > 0
               for f in r["figures"].values())
