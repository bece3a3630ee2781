"""The ``hip`` backend (kernels land in later issues)."""

OPS: dict = {}


def availability(info) -> tuple[bool, str]:
    return False, "no HIP kernels yet"
