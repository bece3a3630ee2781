"""The router kernels' by-value parameter: ``amdqb::RouterParams`` (hip_src/include/
amdqb_router_params.h) and its ctypes mirror ``amdqb.backends.hip._spec.RouterParams`` agree field
for field -- names, order, offsets, size and alignment -- as the host compiler lays the header out
(the GPU ABIs lay out a structure of pointers, ints and floats the same way; test_hip_compile.py
checks the parameter's size in the PTX NVRTC emits)."""

import ctypes
import re
import shutil
import subprocess

import pytest

from amdqb.backends.hip import _spec

HEADER = _spec.source_root() / "include" / "amdqb_router_params.h"


def _header_fields() -> list[str]:
    body = re.search(r"struct RouterParams \{(.*?)\};", HEADER.read_text(), re.S).group(1)
    names = []
    for line in body.splitlines():
        code = line.split("//")[0].strip()
        if code:
            names.append(re.search(r"(\w+);$", code).group(1))
    return names


def test_field_names_and_order_match_the_header():
    assert [name for name, _ in _spec.RouterParams._fields_] == _header_fields()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to lay the header out")
def test_offsets_size_and_alignment_match_the_header(tmp_path):
    names = [name for name, _ in _spec.RouterParams._fields_]
    prints = "\n".join(f'  std::printf("%zu ", offsetof(amdqb::RouterParams, {n}));' for n in names)
    src = tmp_path / "layout.cpp"
    src.write_text(
        f'#include <cstddef>\n#include <cstdio>\n#include "{HEADER}"\nint main() {{\n{prints}\n'
        '  std::printf("%zu %zu\\n", sizeof(amdqb::RouterParams), '
        "alignof(amdqb::RouterParams));\n}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(["g++", "-std=c++17", str(src), "-o", str(exe)], check=True)
    got = [
        int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True).stdout.split()
    ]
    want = [getattr(_spec.RouterParams, n).offset for n in names]
    want += [ctypes.sizeof(_spec.RouterParams), ctypes.alignment(_spec.RouterParams)]
    assert got == want


def test_params_are_range_checked_and_complete():
    fields = {name: 0 for name, _ in _spec.RouterParams._fields_}
    params = _spec.RouterParams.of(**{**fields, "logits": 0x1000, "topk": 5, "scale": 1.5})
    assert params.logits == 0x1000 and params.bias is None and params.topk == 5
    assert params.scale == 1.5
    with pytest.raises(ValueError, match="int32"):
        _spec.RouterParams.of(**{**fields, "num_tokens": 2**31})
    with pytest.raises(TypeError, match="missing"):
        _spec.RouterParams.of(**{k: v for k, v in fields.items() if k != "scale"})
    assert len(_spec.KernelParams([params])) == 1  # one by-value kernel parameter
