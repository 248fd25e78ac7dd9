#!/usr/bin/env bash
# System packages Flare's backends, models and tests use (Debian/Ubuntu, run as root):
#   libvulkan1 + mesa-vulkan-drivers  the Vulkan loader and Mesa's CPU driver (lavapipe)
#   glslc                             compiles the GLSL compute shaders to SPIR-V (stale-.spv check)
#   openmpi-bin + libopenmpi-dev      MPI ranks (mpirun) for multi-rank runs
#   espeak-ng                         phonemes for `flare run piper`; regenerates the shipped speech sample
#   gcc + libc6-dev + python3-dev     build the CPU backend's C kernels (cffi API mode; without
#                                     them the CPU backend runs its NumPy kernels instead)
#   chromium + chromium-driver        headless browser test of flare serve's chat page (Selenium)
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
    libvulkan1 mesa-vulkan-drivers glslc vulkan-tools \
    openmpi-bin libopenmpi-dev espeak-ng gcc libc6-dev python3-dev chromium chromium-driver >/dev/null
echo "system packages installed"
