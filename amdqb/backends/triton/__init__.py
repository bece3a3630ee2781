"""The ``triton`` backend (kernels land in later issues)."""

OPS: dict = {}


def availability(info) -> tuple[bool, str]:
    return False, "no Triton kernels yet"
