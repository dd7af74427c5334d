"""Import-only stand-in for `sgl_kernel`, for SGLang's CPU engine in the test environment.

SGLang 0.5.23's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports names from `sgl_kernel` at
module level (`copy_all_layer_kv_cache_cpu` in kernels/ops/kvcache/cache_move.py and the
speculative `*_cpu` helpers); PyPI's sgl-kernel wheels are CUDA builds. With
`--prefill-attention-backend mla_plugins --decode-attention-backend torch_native` on a CPU
where SGLang's intel_amx path is off, none of them is called: every attribute here is a
function that records the call and raises, so a call would fail the run loudly and the
tests can check that none happened.

It registers no `torch.ops.sgl_kernel` ops, so SGLang's `cpu_has_amx_support()` (which
looks for `torch.ops.sgl_kernel.convert_weight_packed`) stays False even on an AMX CPU.

`MLA_PLUGINS_TEST_SGL_KERNEL_LOG=<file>`: one JSON line per import and per call (with the
pid), appended by whichever process does it (SGLang's spawned scheduler included).
Lives under tests/ only; never part of the mla_plugins package.
"""

import json
import os

STANDIN = True


def _log(event: str, name: str) -> None:
    path = os.environ.get("MLA_PLUGINS_TEST_SGL_KERNEL_LOG")
    if not path:
        return
    line = json.dumps({"event": event, "name": name, "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class StandInCalled(RuntimeError):
    pass


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def standin(*args, **kwargs):
        _log("call", name)
        raise StandInCalled(
            f"sgl_kernel.{name} was called, but this sgl_kernel is the test environment's "
            "import-only stand-in (tests/sglang/env/sgl_kernel_standin): SGLang took a path that "
            "needs a real sgl-kernel CPU build"
        )

    standin.__name__ = standin.__qualname__ = name
    globals()[name] = standin
    return standin


_log("import", "sgl_kernel")
