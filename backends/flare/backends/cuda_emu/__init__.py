"""The CUDA kernels run on the host, for checking them where there is no GPU.

A testing plugin, not part of the runtime: `flare.backends.cuda` never imports
it. It registers the `cuda-emu` backend (entry point `cuda-emu` in group
`flare.backends`, active only with FLARE_CUDA_EMULATE=1) and gives the tests
their CUDA devices:

- `emulator`: the kernel sources built as a host shared library (each block's
  threads run as cooperative fibers, so __shared__ memory, __syncthreads and
  warp shuffles behave as on a GPU), and `open_emulated_device()`;
- `host_driver`: a host stand-in for the cuda.bindings.driver calls that
  CudaDevice makes (memory, copies, modules, stream capture, graphs);
- `devices`: `open_device(kind)` / `device_for_test` for kinds `emulated`
  and `gpu`, so one test runs on both.
"""
