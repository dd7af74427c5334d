"""Fresh processes for the release-matrix cells, forked from one that has imported torch.

A matrix cell (tests/vllm/test_aiter_matrix.py, tests/sglang/test_aiter_matrix.py) must be a
fresh process: the fake AITER registers its torch ops once per process and must be
importable before the framework is imported, the plugins load once per process, and the
shims bind when the framework's module is first imported. Each cell used to be a new
interpreter (`python -c CELL`), which first imports torch (2-4 s here) before anything of
the cell happens. Here one server process per test session imports torch and the heavy
libraries beneath every framework (`PRELOAD`: torch's compiler stack, sympy, transformers;
in a framework's environment only), and nothing of the cell's own: no framework, no fake, no
mla_plugins, no aiter; each cell is a child forked from it
(`os.fork`), with the cell's environment, argv, working directory and leading sys.path
entries (the cell's PYTHONPATH, as at an interpreter's start), stdout and stderr to files, and its code run
as `__main__`. So every cell still imports its framework, its fake AITER, its plugins in a
process of its own, in the order the cell's code says, exactly as before.

`run(code, argv=..., env=..., cwd=..., path=..., timeout=...)` returns a
`subprocess.CompletedProcess` like `subprocess.run(..., capture_output=True, text=True)`.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading

#: modules the server imports after torch, where installed: what vLLM (`vllm.env_override`
#: imports torch._inductor) and SGLang (transformers' integrations, torch.distributed.tensor)
#: import before anything of theirs runs: 9-15 s of each cell's ~15-25 s on a 2-core machine
#: (`python -X importtime`). None of them is a framework, a plugin, an entry point or AITER,
#: which the cells test; the cells' asserts on sys.modules concern only those.
PRELOAD = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "sympy", "transformers",
           "transformers.activations")

SERVER = r"""
import importlib, importlib.util, json, os, signal, sys, traceback
import torch  # noqa: F401  the one import every cell begins with
# only in a framework's environment (transformers beside it): the core's cells import no
# compiler stack, and would only wait for it
for name in sys.argv[1:] if importlib.util.find_spec("transformers") else ():
    try:
        importlib.import_module(name)
    except Exception:  # not installed here
        pass

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the cell
        rc = 1
        try:
            os.setpgid(0, 0)
            signal.alarm(req["timeout"])
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            # sys.path as an interpreter started with this PYTHONPATH has it: '' (the working
            # directory), then PYTHONPATH's entries in order, then the standard library and site
            lead = []
            for p in req["path"] + req["env"].get("PYTHONPATH", "").split(os.pathsep):
                if p and os.path.abspath(p) not in lead:
                    lead.append(os.path.abspath(p))
            sys.path[1:] = lead + [p for p in sys.path[1:] if os.path.abspath(p) not in lead]
            sys.argv = ["-c", *req["argv"]]
            try:
                exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
                rc = 0
            except SystemExit as exc:
                code = exc.code
                rc = code if isinstance(code, int) else (0 if code is None else 1)
                if not isinstance(code, (int, type(None))):
                    print(code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                rc = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(rc)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    try:
        os.killpg(pid, signal.SIGKILL)  # what the cell left running (it runs in its own group)
    except OSError:
        pass
    sys.stdout.write(json.dumps({"rc": rc}) + "\n")
    sys.stdout.flush()
"""

_lock = threading.Lock()
_server: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER, *PRELOAD], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, bufsize=1)
        atexit.register(_server.kill)
    return _server


def run(code: str, *, argv=(), env: dict, cwd, path=(), timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `code` as `python -c code *argv` would, in a child forked from the server."""
    with _lock, tempfile.TemporaryDirectory(prefix="cell-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        server = _start()
        server.stdin.write(json.dumps({
            "code": code, "argv": [str(a) for a in argv], "env": {k: str(v) for k, v in env.items()},
            "cwd": str(cwd), "path": [str(p) for p in path], "timeout": int(timeout),
            "stdout": out, "stderr": err}) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server exited (rc {server.wait()})")
        rc = json.loads(reply)["rc"]

        def read(p):
            try:
                with open(p, errors="replace") as f:
                    return f.read()
            except FileNotFoundError:
                return ""

        stdout, stderr = read(out), read(err)
        if rc < 0:
            stderr += f"\n[forkserver: the cell was killed by signal {-rc}" + (
                f" (SIGALRM: past its {timeout} s)]" if -rc == 14 else "]")
        return subprocess.CompletedProcess(["python", "-c", "<cell>", *map(str, argv)], rc, stdout, stderr)
