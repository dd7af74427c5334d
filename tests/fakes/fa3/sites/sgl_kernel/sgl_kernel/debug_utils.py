"""Stand-in for `sgl_kernel.debug_utils`: `maybe_wrap_debug_kernel(fn, name=None)` returns `fn`
(the real one wraps kernels for SGLang's kernel-debug logging when that is switched on; off by
default). Used by the real flash_attn.py as a decorator and by the real __init__ with a name."""


def maybe_wrap_debug_kernel(fn, name=None):
    return fn
