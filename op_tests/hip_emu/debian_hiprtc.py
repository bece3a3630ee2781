"""hip-python's ``hiprtc`` module, in its call shapes, over the real hiprtc of Debian's ROCm 5.2
(``libamdhip64.so.5``, with comgr on LLVM 15), through ctypes. It compiles for real on the CPU (no
GPU needed), so the runtime's hiprtc toolchain meets a real compiler's version, logs and
rejections (op_tests/test_hip_runtime_rocm.py). ``runtime_version()`` is the real
hipRuntimeGetVersion of the same library.

Calls return ``(err, value...)`` tuples like hip-python's; errors are enum-like (``int()``,
``str()`` = ``hiprtcResult.NAME``); the log and the code come into caller-sized bytearrays.
ROCm 5.2's comgr aborts the process when asked for a target it does not know (gfx942 and
newer): callers compile for gfx90a, which it knows.
"""

from __future__ import annotations

import ctypes
import glob

_NAMES = (
    "HIPRTC_SUCCESS",
    "HIPRTC_ERROR_OUT_OF_MEMORY",
    "HIPRTC_ERROR_PROGRAM_CREATION_FAILURE",
    "HIPRTC_ERROR_INVALID_INPUT",
    "HIPRTC_ERROR_INVALID_PROGRAM",
    "HIPRTC_ERROR_INVALID_OPTION",
    "HIPRTC_ERROR_COMPILATION",
    "HIPRTC_ERROR_BUILTIN_OPERATION_FAILURE",
    "HIPRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
    "HIPRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
    "HIPRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
    "HIPRTC_ERROR_INTERNAL_ERROR",
)


def library_path() -> str | None:
    """Debian's libamdhip64.so.5 (package libamdhip64-5), or None."""
    found = sorted(glob.glob("/usr/lib/*/libamdhip64.so.5"))
    return found[0] if found else None


class Result:
    """A hiprtcResult as hip-python's enum members behave: int() its value, str() its name."""

    def __init__(self, value: int):
        self.value = int(value)

    def __int__(self):
        return self.value

    def __index__(self):
        return self.value

    def __eq__(self, other):
        return int(self) == int(other)

    def __hash__(self):
        return hash(self.value)

    def __str__(self):
        name = _NAMES[self.value] if 0 <= self.value < len(_NAMES) else str(self.value)
        return f"hiprtcResult.{name}"

    __repr__ = __str__


class Program:
    """A hiprtcProgram handle (``createRef()``: the pointer hiprtcDestroyProgram takes)."""

    def __init__(self):
        self.handle = ctypes.c_void_p()

    def createRef(self):
        return ctypes.byref(self.handle)


class DebianHiprtc:
    """The hiprtc functions the runtime calls, backed by Debian's library."""

    def __init__(self, path: str | None = None):
        path = path or library_path()
        if path is None:
            raise OSError("libamdhip64.so.5 not found (apt-get install libamdhip64-5)")
        lib = self.lib = ctypes.CDLL(path)
        p, size_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
        lib.hiprtcCreateProgram.argtypes = [
            ctypes.POINTER(p),
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.hiprtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.hiprtcGetProgramLogSize.argtypes = [p, size_p]
        lib.hiprtcGetProgramLog.argtypes = [p, ctypes.c_char_p]
        lib.hiprtcGetCodeSize.argtypes = [p, size_p]
        lib.hiprtcGetCode.argtypes = [p, ctypes.c_char_p]
        lib.hiprtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
        self.compiles = []  # the options of every compile

    def runtime_version(self) -> int:
        v = ctypes.c_int()
        err = self.lib.hipRuntimeGetVersion(ctypes.byref(v))
        if err:
            raise OSError(f"hipRuntimeGetVersion failed: {err}")
        return v.value

    def hiprtcVersion(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        err = self.lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return Result(err), major.value, minor.value

    def hiprtcCreateProgram(self, source, name, num_headers, headers, include_names):
        assert num_headers == 0
        prog = Program()
        err = self.lib.hiprtcCreateProgram(ctypes.byref(prog.handle), source, name, 0, None, None)
        return Result(err), prog

    def hiprtcCompileProgram(self, prog, num_options, options):
        self.compiles.append([o.decode() for o in options])
        arr = (ctypes.c_char_p * max(1, num_options))(*options)
        return (Result(self.lib.hiprtcCompileProgram(prog.handle, num_options, arr)),)

    def hiprtcGetProgramLogSize(self, prog):
        n = ctypes.c_size_t()
        err = self.lib.hiprtcGetProgramLogSize(prog.handle, ctypes.byref(n))
        return Result(err), n.value

    def hiprtcGetProgramLog(self, prog, buf):
        raw = ctypes.create_string_buffer(len(buf) + 1)
        err = self.lib.hiprtcGetProgramLog(prog.handle, raw)
        buf[:] = raw.raw[: len(buf)]
        return (Result(err),)

    def hiprtcGetCodeSize(self, prog):
        n = ctypes.c_size_t()
        err = self.lib.hiprtcGetCodeSize(prog.handle, ctypes.byref(n))
        return Result(err), n.value

    def hiprtcGetCode(self, prog, buf):
        raw = ctypes.create_string_buffer(len(buf) + 1)
        err = self.lib.hiprtcGetCode(prog.handle, raw)
        buf[:] = raw.raw[: len(buf)]
        return (Result(err),)

    def hiprtcDestroyProgram(self, ref):
        return (Result(self.lib.hiprtcDestroyProgram(ref)),)
