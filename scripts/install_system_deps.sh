#!/usr/bin/env bash
# Debian packages logitproc's build and tests use (run as root; idempotent):
#   rocm-device-libs + lld-22   link AMDGPU code objects (ROCm target) without a GPU
#   mesa-vulkan-drivers         lavapipe, a Vulkan driver on the CPU, to run the Vulkan (WGSL) kernels without a GPU
#   chromium + chromium-driver  a headless browser for the tests of the chat page (tests/test_web_page.py)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
packages=(rocm-device-libs mesa-vulkan-drivers chromium chromium-driver)
if apt-cache show lld-22 >/dev/null 2>&1 || { apt-get update -qq && apt-cache show lld-22 >/dev/null 2>&1; }; then
  packages+=(lld-22)
else
  packages+=(lld)
fi
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "system packages present: ${packages[*]}"
