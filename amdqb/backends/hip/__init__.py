"""The ``hip`` backend: ``hip_src`` kernels compiled at run time (placeholder until it lands)."""

OPS: dict = {}


def availability(info) -> tuple[bool, str]:
    return False, "HIP backend not built yet"
