"""Tools that build and read the AMD code objects of the ``hip_src`` kernels without an AMD GPU.

Not part of the amdqb package (``import amdqb`` never imports them; the wheel does not ship them):
the test suite, ``setup.py`` and ``scripts/`` use them from a checkout.

* :mod:`.toolchain`: the clang / lld / LLVM tools installed here and the device-library
  directories (Debian's ROCm 5.2 set, Triton's ROCm 7 set) each links against;
* :mod:`.build`: offline builds of every kernel module the runtime can request at the seed shapes,
  with the runtime's flags, cached;
* :mod:`.code_objects`: metadata, symbols, disassembly and listing comments of a code object;
* :mod:`.occupancy`: waves per SIMD from register and LDS counts (LLVM's per-target rules);
* :mod:`.hiprtc`: the kernels built the way hiprtc builds them on a device (``__HIPCC_RTC__``);
* :mod:`.isa`: counts of the cross-lane and atomic instructions in a kernel's disassembly;
* :mod:`.mca`: a static model of the hot kernels' main loops (llvm-mca, occupancy, bytes);
* :mod:`.table`: the generated tables of docs/amd_occupancy.md;
* :mod:`.triton_codegen`: the Triton kernels compiled for the AMD targets in their launchers'
  own specialisations (recorded from public op calls);
* :mod:`.derive`: the AMD config entries that follow from the code objects' occupancy;
* ``python -m amdqb_tools``: the command line (build, inspect, table, configs).
"""
