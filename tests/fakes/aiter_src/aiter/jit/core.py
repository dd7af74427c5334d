"""`aiter/jit/core.py::compile_ops`, minus the JIT build.

The real decorator JIT-builds (or loads) a C++ module at the first call and wraps the
call in `torch_compile_guard`, which registers the torch op when the decorator runs,
i.e. at `import aiter` (ROCm/aiter v0.1.16 core.py:1421-1720, v0.1.20.post1:1658-1968).
Here the "C++ module" is `aiter._kernels`, the fake's Python stand-in for the HIP/asm code.
"""

import functools

from .utils.torch_guard import torch_compile_guard


def compile_ops(_md_name, fc_name=None, gen_func=None, gen_fake=None, ffi_type="pybind",
                develop=False):
    def decorator(func):
        from .. import _kernels

        load_name = fc_name if fc_name is not None else func.__name__
        body = getattr(_kernels, load_name)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return body(*args, **kwargs)

        @torch_compile_guard(device="cuda", gen_fake=gen_fake, calling_func_=func)
        def custom_wrapper(*args, **kwargs):
            return wrapper(*args, **kwargs)

        return custom_wrapper

    return decorator
