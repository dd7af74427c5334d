"""Stand-in for `vllm.platforms`: `current_platform` answers the two capability questions
vllm_flash_attn/flash_attn_interface.py asks (`has_device_capability(80)` for FA2,
`is_device_capability_family(90)` for FA3) the way vLLM's `Platform` answers them
(vllm 0.32 vllm/platforms/interface.py 517-588: from `get_device_capability()`, None on the CPU platform;
family = capability.to_int() // 10). `CAPABILITY` is what the device reports: None (vLLM's CPU
platform, the default), or e.g. (9, 0) for a Hopper host.
"""

CAPABILITY: tuple[int, int] | None = None


class _Platform:
    def get_device_capability(self, device_id: int = 0):
        return CAPABILITY

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        value = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return cap[0] * 10 + cap[1] >= value

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        return (cap[0] * 10 + cap[1]) // 10 == capability // 10


current_platform = _Platform()
