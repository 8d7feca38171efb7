"""Several processes, one model: the leader's device work mirrored on its followers.

Under `jax.distributed` every process owns some of the mesh's devices, and a program
over the mesh runs only when every process calls it, in the same order, with the same
host inputs. The leader (process 0) takes the requests and decides each step; it sends
what its model runner is about to run (a step's host inputs, page copies, a redraw's
bias) to the followers before running it, and each follower's runner runs the same
(`ModelRunner.follow`). The message travels by `multihost_utils.broadcast_one_to_all`,
JAX's own collective over the same devices, pickled and padded to a power of two of
bytes (a few shapes, each compiled once): no socket or protocol of ours.

When a process dies, JAX's coordination service notices (a missed heartbeat, or the
coordinator gone with the leader) and ends every other process with a line naming the
task that failed, within `heartbeat_s`: no process waits for ever, and no step runs on
a part of the mesh.
"""
from __future__ import annotations

import pickle

import jax
import numpy as np


def initialize(coordinator: str | None, num_processes: int | None,
               process_id: int | None, heartbeat_s: int = 30) -> None:
    """Join this process to the others before JAX starts a backend: `coordinator`
    HOST:PORT (process 0 serves it), or "auto" for JAX's own cluster detection (Slurm,
    Open MPI, Kubernetes); None: one process, nothing to join."""
    if coordinator is None:
        return
    from xlr_jax.errors import InvalidRequestError

    if coordinator == "auto":
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_s)
        return
    if num_processes is None or process_id is None or not 0 <= process_id < num_processes:
        raise InvalidRequestError(
            f"--coordinator {coordinator} needs --num-processes N and --process-id I with "
            f"0 <= I < N (got {num_processes} and {process_id})")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_s)


class Mirror:
    """The leader's side sends, a follower's receives (see the module docstring)."""

    def __init__(self):
        self.leads = jax.process_index() == 0

    @staticmethod
    def needed() -> bool:
        return jax.process_count() > 1

    def send(self, *message) -> None:
        assert self.leads, "only the leader sends"
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._exchange(len(payload), payload)

    def receive(self) -> tuple:
        assert not self.leads, "the leader decides; followers receive"
        return pickle.loads(self._exchange(0, b""))

    @staticmethod
    def _exchange(size: int, payload: bytes) -> bytes:
        from jax.experimental.multihost_utils import broadcast_one_to_all

        size = int(broadcast_one_to_all(np.int64(size)))
        padded = 1 << max(10, (size - 1).bit_length())  # a shape per power of two
        buffer = np.zeros(padded, np.uint8)
        buffer[:len(payload)] = np.frombuffer(payload, np.uint8)
        return np.asarray(broadcast_one_to_all(buffer))[:size].tobytes()
