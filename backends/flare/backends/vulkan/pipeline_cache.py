"""A VkPipelineCache kept on disk, so a second process creates its pipelines warm.

Some drivers keep a shader cache of their own (Mesa's in `$XDG_CACHE_HOME`), many do not,
and none is required to; a VkPipelineCache handed back to the driver at device open is the
portable way to skip recompiling. The file lives in Flare's cache folder
(`$FLARE_CACHE_DIR/vulkan`, else `~/.cache/flare/vulkan`) and is named by the device UUID
and driver version, so two GPUs or a driver update never share one:

    pipeline-cache-<device uuid hex>-<driver version hex>.bin

Layout: a Flare header (magic, payload length, SHA-256 of the payload), then the driver's
data as `vkGetPipelineCacheData` returned it, which starts with the
`VkPipelineCacheHeaderVersionOne` (header size 32, version 1, vendor id, device id,
pipelineCacheUUID). At load, a file that is truncated, fails its checksum, or whose Vulkan
header names another vendor, device or cache UUID is ignored (a debug log line says why)
and the cache starts empty: drivers are meant to validate the data themselves, but some
crash on garbage, so nothing unchecked reaches them. At close the data is written to a
temporary file in the same folder and renamed over the old one (atomic on POSIX: a reader
sees the old file or the new one, never half of one); data larger than `max_bytes` is not
written, and an unchanged cache is not rewritten. Any OSError (read-only home, full disk)
only costs a cold start next time.

Threads: the VkPipelineCache handle is shared by every pipeline build of the device, also
from parallel worker threads (pipelines.py). That is allowed because it is created without
VK_PIPELINE_CACHE_CREATE_EXTERNALLY_SYNCHRONIZED_BIT: the implementation synchronises
access to it internally (Vulkan spec, vkCreateComputePipelines, "Host Synchronization").
`save` and `destroy` run only from device close, after every build has returned.
"""
from __future__ import annotations

import hashlib
import logging
import struct
from pathlib import Path
from typing import Any

from flare.core.cache import cache_root, write_atomic

log = logging.getLogger("flare.backends.vulkan")

MAGIC = b"FLAREVKPC1\0\0"  # 12 bytes
FLARE_HEADER = struct.Struct("<12sQ32s")  # magic, payload length, sha256(payload)
VK_HEADER = struct.Struct("<IIII16s")  # headerSize, headerVersion, vendorID, deviceID, pipelineCacheUUID
VK_HEADER_VERSION_ONE = 1
DEFAULT_MAX_BYTES = 64 << 20
ENV_PIPELINE_CACHE = "FLARE_VULKAN_PIPELINE_CACHE"


def cache_folder() -> Path:
    """`$FLARE_CACHE_DIR/vulkan`, else `~/.cache/flare/vulkan` (created only when saving)."""
    return cache_root() / "vulkan"


def cache_path(info: Any, folder: Path | None = None) -> Path:
    """The file for this physical device and driver version."""
    name = f"pipeline-cache-{bytes(info.device_uuid).hex()}-{int(info.driver_version):x}.bin"
    return (folder if folder is not None else cache_folder()) / name


def pack(payload: bytes) -> bytes:
    """Flare header + the driver's data."""
    return FLARE_HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def unpack(blob: bytes, info: Any) -> tuple[bytes | None, str]:
    """The driver data inside `blob` if it is whole and made for `info`'s device, else (None, why)."""
    if len(blob) < FLARE_HEADER.size:
        return None, "shorter than its header"
    magic, length, digest = FLARE_HEADER.unpack_from(blob)
    if magic != MAGIC:
        return None, "not a Flare pipeline cache file"
    payload = blob[FLARE_HEADER.size:]
    if len(payload) != length:
        return None, f"truncated ({len(payload)} of {length} bytes)"
    if hashlib.sha256(payload).digest() != digest:
        return None, "checksum mismatch (corrupt)"
    if len(payload) < VK_HEADER.size:
        return None, "no Vulkan pipeline cache header"
    size, version, vendor, device, uuid = VK_HEADER.unpack_from(payload)
    if size < VK_HEADER.size or version != VK_HEADER_VERSION_ONE:
        return None, f"unknown Vulkan cache header (size {size}, version {version})"
    if (vendor, device, uuid) != (info.vendor_id, info.device_id, bytes(info.pipeline_cache_uuid)):
        return None, (f"made for vendor {vendor:#x} device {device:#x} cache uuid {uuid.hex()}, not this device "
                      f"({info.vendor_id:#x}, {info.device_id:#x}, {bytes(info.pipeline_cache_uuid).hex()})")
    return payload, ""


class DiskPipelineCache:
    """One VkPipelineCache per device, seeded from and saved to its file (see the module docstring)."""

    def __init__(self, vk: Any, device: Any, info: Any, *, path: Path | None = None, enabled: bool = True,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.vk = vk
        self.device = device
        self.info = info
        self.path = path if path is not None else cache_path(info)
        self.enabled = enabled
        self.max_bytes = int(max_bytes)
        self.loaded_bytes = 0
        self.saved_bytes = 0
        self.status = "disabled" if not enabled else "missing"
        self._initial = b""
        initial = self._load() if enabled else b""
        data = vk.ffi.from_buffer(initial) if initial else vk.ffi.NULL
        info_ = vk.VkPipelineCacheCreateInfo(initialDataSize=len(initial), pInitialData=data)
        try:
            self.handle = vk.vkCreatePipelineCache(device, info_, None)
        except vk.VkError as exc:  # a driver refusing our (validated) data: start empty
            if not initial:
                raise
            log.debug("%s: the driver refused the pipeline cache data (%s); starting empty", self.path, exc)
            self.status, self.loaded_bytes, self._initial = f"ignored: driver refused it ({type(exc).__name__})", 0, b""
            self.handle = vk.vkCreatePipelineCache(device, vk.VkPipelineCacheCreateInfo(initialDataSize=0), None)

    def _load(self) -> bytes:
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return b""
        except OSError as exc:
            self.status = f"ignored: {type(exc).__name__}"
            log.debug("%s: cannot read the pipeline cache (%s); starting empty", self.path, exc)
            return b""
        payload, why = unpack(blob, self.info)
        if payload is None:
            self.status = f"ignored: {why}"
            log.debug("%s: pipeline cache ignored: %s", self.path, why)
            return b""
        self.status = "loaded"
        self.loaded_bytes = len(payload)
        self._initial = payload
        return payload

    def data(self) -> bytes:
        """What the driver holds now (`vkGetPipelineCacheData`, size query then copy)."""
        vk = self.vk
        lib, ffi = vk.lib, vk.ffi
        size = ffi.new("size_t*")
        if lib.vkGetPipelineCacheData(self.device, self.handle, size, ffi.NULL) != vk.VK_SUCCESS or not size[0]:
            return b""
        buf = ffi.new("char[]", size[0])
        if lib.vkGetPipelineCacheData(self.device, self.handle, size, buf) != vk.VK_SUCCESS:  # VK_INCOMPLETE: it grew
            return b""
        return bytes(ffi.buffer(buf, size[0]))

    def save(self) -> None:
        """Write the driver's data atomically (temp file + rename); never raises for I/O."""
        if not self.enabled or self.handle is None:
            return
        try:
            payload = self.data()
        except Exception as exc:  # a driver quirk here must not break close()
            log.debug("%s: vkGetPipelineCacheData failed (%s); not saved", self.path, exc)
            return
        if not payload or payload == self._initial:
            return
        if len(payload) > self.max_bytes:
            log.debug("%s: pipeline cache of %d bytes exceeds %d; not saved", self.path, len(payload), self.max_bytes)
            return
        try:
            write_atomic(self.path, pack(payload))
            self.saved_bytes = len(payload)
        except OSError as exc:
            log.debug("%s: cannot write the pipeline cache (%s)", self.path, exc)

    def destroy(self) -> None:
        if self.handle is not None:
            self.vk.vkDestroyPipelineCache(self.device, self.handle, None)
            self.handle = None

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "status": self.status, "loaded_bytes": self.loaded_bytes,
                "saved_bytes": self.saved_bytes}
