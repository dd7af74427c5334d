"""Stand-in for sglang-kernel 0.4.10's `sgl_kernel` package, FA3 only.

The real `sgl_kernel/__init__.py` loads the architecture-specific `common_ops` library and
re-exports ~50 kernels (it needs CUDA); of it only the first line is kept
(`from sgl_kernel.version import __version__`). What the provider imports is the real
`sgl_kernel/flash_attn.py` (here verbatim, with one `# ruff: noqa` line on top), which imports
`sgl_kernel.debug_utils.maybe_wrap_debug_kernel` and `sgl_kernel.flash_ops`; `flash_ops` (a
compiled library in the wheel) is faked in flash_ops.py, `debug_utils` stood in by a pass-through.
`version.py` is verbatim.
"""

from sgl_kernel.version import __version__  # noqa: F401
