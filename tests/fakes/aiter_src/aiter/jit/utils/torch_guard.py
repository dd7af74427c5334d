"""The registration half of `aiter/jit/utils/torch_guard.py::torch_compile_guard`.

As in ROCm/aiter (v0.1.15 and v0.1.20.post1 alike, lines ~200-357): the schema is
`torch.library.infer_schema(func, mutates_args="unknown")`, so every Tensor argument
carries an alias annotation (`Tensor(a0!)`); a function whose first argument is not a
Tensor gets a leading `Tensor dummy`; the op is defined in the "aiter" FRAGMENT library
with CPU and CUDA kernels and a fake (meta) kernel, and the caller gets
`wrapper_custom(*args, **kwargs)`, a forwarder to `torch.ops.aiter.<name>`.
"""

import inspect

import torch
from torch.library import Library

aiter_lib = None


def torch_compile_guard(device="cpu", calling_func_=None, gen_fake=None):
    def decorator(func):
        global aiter_lib
        calling_func = calling_func_ if calling_func_ is not None else func
        name = calling_func.__name__
        schema = torch.library.infer_schema(calling_func, mutates_args="unknown")
        params = list(inspect.signature(calling_func).parameters.values())
        input_is_tensor = bool(params) and params[0].annotation is torch.Tensor
        if not input_is_tensor:
            schema = "(Tensor dummy, " + schema[1:] if params else "(Tensor dummy) " + schema[2:]

        def wrapper_custom(*args, **kwargs):
            op = getattr(torch.ops.aiter, name)
            if input_is_tensor:
                return op(*args, **kwargs)
            return op(torch.empty(1, device=device), *args, **kwargs)

        if hasattr(torch.ops.aiter, name):
            return wrapper_custom

        def custom_func(*args, **kwargs):
            if not input_is_tensor:
                args = args[1:]
            return func(*args, **kwargs)

        def fake_func(*args, **kwargs):
            return None

        aiter_lib = Library("aiter", "FRAGMENT") if aiter_lib is None else aiter_lib
        aiter_lib.define(name + schema, tags=())
        aiter_lib.impl(name, custom_func, dispatch_key="CUDA")
        aiter_lib.impl(name, custom_func, dispatch_key="CPU")
        aiter_lib._register_fake(name, fake_func)
        return wrapper_custom

    return decorator
