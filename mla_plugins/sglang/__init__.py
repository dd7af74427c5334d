"""SGLang adapter: the `mla_plugins` attention backend, selected by name, and the AITER shim.

Loaded by SGLang's plugin loader through the entry point
`[project.entry-points."sglang.srt.plugins"] mla_plugins = "mla_plugins.sglang:register"`
(SGLang >= 0.5.11), before argument parsing and again in every scheduler process.

Use it for MLA prefill and keep a decode backend of the platform:

    python -m sglang.launch_server --model-path ... \\
        --prefill-attention-backend mla_plugins --decode-attention-backend triton

(`aiter` on ROCm, `fa3`/`flashinfer`/`triton` on CUDA). Decode is not ours: used as the
only backend (`--attention-backend mla_plugins`) the backend factory refuses with an error
that names the flag to add.

Importing this package imports no SGLang; `register()` imports it lazily.
"""

from __future__ import annotations

from .plugin import BACKEND_NAME, SUPPORTED_RANGE, register

__all__ = ["BACKEND_NAME", "SUPPORTED_RANGE", "register"]
