"""One benchmark variant in a process of its own (Dynamo's cache is per code
object, so variants sharing a process share it), answering the
coordinator's requests one JSON line at a time, so a coordinator can
interleave the variants round by round."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List


class Worker:
    """``python <script> <args>`` with ``threads`` OpenMP threads; ``ask``
    sends a command line and reads one JSON answer (the first ``ask()``, with
    no command, reads the line the worker prints when it is ready)."""

    def __init__(self, script: str, args: List[str], variant: str, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.p = subprocess.Popen([sys.executable, script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)
        self.variant = variant

    def ask(self, cmd: str = "") -> dict:
        if cmd:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.variant} died")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        self.p.wait(timeout=60)
