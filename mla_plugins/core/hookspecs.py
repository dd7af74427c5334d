"""Hook specifications of mla-plugins' kernel providers (specs only, no implementations).

A third-party package contributes kernels by exposing a module or object with a
`mla_plugins_kernels` hook implementation under the entry-point group
`mla_plugins.kernels`:

    [project.entry-points."mla_plugins.kernels"]
    my_kernels = "my_package.mla_kernels"

    # my_package/mla_kernels.py
    from mla_plugins import hookimpl
    @hookimpl
    def mla_plugins_kernels():
        return [MyKernel()]
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "mla_plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def mla_plugins_kernels() -> list:
    """Return the kernels this plugin provides.

    :return: a list of `mla_plugins.Kernel` instances. Each has a unique `name`
        (the value users pass as `kernel=` or `MLA_PLUGINS_KERNEL`), a `priority`
        (lower is tried first under `kernel="auto"`; the built-ins use aiter 0,
        triton 10, torch 100) and answers `not_supported_reasons(inputs)`.

    The registry calls each plugin's implementation on its own: an implementation that
    raises, or returns anything but a list of Kernel instances, loses its own kernels only
    (reported in `mla-plugins doctor`). The built-in names (`aiter`, `triton`, `torch`) and
    `auto` cannot be taken; between third-party plugins the first registered keeps a name.
    A `not_supported_reasons` that raises counts as that kernel's rejection reason.
    """
