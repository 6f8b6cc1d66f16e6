"""Block files whose tensor bytes changed on disk (same size, header intact) are never served.

Each block's metadata carries a checksum of its tensor data; every read verifies it on the SSD
writer's thread. A block that fails is deleted, forgotten by the index, counted and logged once,
and the chain read stops before it (the scheduler prefills its tokens again). The serving-level
test, across a restart on the tiny model, is in ``test_prefix_serving.py``.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
import safetensors.numpy
from test_ssd_writer import FP, eventually, make_block, make_chain, running_cache

from troupe.actors import block_store
from troupe.actors.cache_messages import FORMAT_VERSION, ReadBlocks


def data_region(data: bytes) -> tuple[int, int]:
    """(start, end) of the tensor bytes of a safetensors file: after the 8-byte length and
    the JSON header."""
    return 8 + int.from_bytes(data[:8], "little"), len(data)


def overwrite_data(path: Path, *, fill: int = 0xFF, length: int = 4096) -> None:
    """Overwrite up to ``length`` bytes in the middle of the file's tensor data with ``fill``
    (0xFF is NaN in every float dtype); the size and header stay as they were."""
    data = bytearray(path.read_bytes())
    start, end = data_region(bytes(data))
    n = min(length, end - start)
    at = start + (end - start - n) // 2
    data[at : at + n] = bytes([fill]) * n
    path.write_bytes(bytes(data))


def test_every_changed_byte_of_the_tensor_data_fails_the_checksum_and_the_header_still_reads(
    tmp_path: Path,
) -> None:
    block = make_block(n_tokens=8)
    data = block_store.encode_block(block, FP)
    assert block_store.decode_block(data, FP, block.block_hash).tensors.keys() == \
        block.tensors.keys()
    start, end = data_region(data)
    # A spread of positions, first and last byte included, one flipped bit each.
    for at in sorted({start, end - 1, *range(start, end, 97)}):
        bad = bytearray(data)
        bad[at] ^= 0x01
        with pytest.raises(block_store.BlockFileError) as caught:
            block_store.decode_block(bytes(bad), FP, block.block_hash)
        assert caught.value.reason == "corrupt" and caught.value.checksum, at
    # The start-up scan reads headers only: such a file is indexed, so reads must verify.
    path = block_store.block_path(tmp_path, block.block_hash)
    block_store.write_atomic(path, data, "t")
    overwrite_data(path)
    assert block_store.read_block_info(path, FP).block_hash == block.block_hash


def test_the_checksum_covers_names_dtypes_and_shapes_in_a_fixed_order() -> None:
    a = np.arange(8, dtype=np.float16)
    base = block_store.data_checksum({"0.keys": a, "0.values": a + 1})
    assert base.startswith(f"{block_store.CHECKSUM_ALGORITHM}:")
    assert block_store.data_checksum({"0.values": a + 1, "0.keys": a}) == base  # by name
    assert block_store.data_checksum({"0.keys": a + 1, "0.values": a}) != base
    assert block_store.data_checksum({"0.keys": a.view(np.uint16), "0.values": a + 1}) != base
    assert block_store.data_checksum({"0.keys": a.reshape(2, 4), "0.values": a + 1}) != base
    # A strided view hashes as its contiguous copy (what the file holds).
    wide = np.arange(16, dtype=np.float16)
    assert block_store.data_checksum({"x": wide[::2]}) == \
        block_store.data_checksum({"x": np.ascontiguousarray(wide[::2])})


def test_the_checksum_is_zlibs_crc32_so_files_written_before_zlib_ng_still_read(
    tmp_path: Path,
) -> None:
    tensors = {"0.keys": np.arange(64, dtype=np.float32).reshape(1, 2, 2, 16),
               "0.values": np.ones((1, 2, 2, 16), np.float32)}
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(f"{name}\0float32\0{tensors[name].shape}\0".encode(), crc)
        crc = zlib.crc32(tensors[name].tobytes(), crc)
    assert block_store.data_checksum(tensors) == f"crc32:{crc:08x}"
    # A file written with the standard library's CRC, then read through prefetch.
    block = make_block(n_tokens=8)
    data = block_store.encode_block(block, FP)
    path = block_store.block_path(tmp_path, block.block_hash)
    block_store.write_atomic(path, data, "t")
    block_store.prefetch([tmp_path / "missing.safetensors", path])  # a missing file: no error
    got = block_store.decode_block(path.read_bytes(), FP, block.block_hash)
    for name, array in block.tensors.items():
        np.testing.assert_array_equal(got.tensors[name], array)


def test_a_file_of_format_version_1_is_left_alone_and_a_file_without_a_checksum_is_corrupt(
    tmp_path: Path,
) -> None:
    assert FORMAT_VERSION == 2

    def put(version: int, block_hash: str) -> Path:
        # What a server of that version wrote: the same metadata without a checksum.
        tensors = {"0.keys": np.zeros((1, 2, 4, 16), np.float16)}
        meta = {"format_version": str(version), "fingerprint": FP, "block_hash": block_hash,
                "parent_hash": "", "n_tokens": "4",
                "dtypes": msgspec.json.encode({"0.keys": "float16"}).decode()}
        path = block_store.block_path(tmp_path, block_hash)
        block_store.write_atomic(path, safetensors.numpy.save(tensors, metadata=meta), "t")
        return path

    old = put(1, "a1" * 16)
    unverifiable = put(FORMAT_VERSION, "b2" * 16)
    scan = block_store.scan_cache_dir(tmp_path, FP)
    assert scan.blocks == []
    assert scan.skipped["version"] == 1 and scan.skipped["corrupt"] == 1
    assert old.exists() and not unverifiable.exists()


async def test_a_block_whose_data_changed_on_disk_is_dropped_counted_logged_once_and_forgotten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    async with running_cache(tmp_path) as cache:
        blocks = make_chain(3, n_tokens=16, head_dim=32)
        await cache.write(blocks)
        assert await cache.flush() == 3
        bad = cache.path(blocks[1])
        size = bad.stat().st_size
        overwrite_data(bad)
        assert bad.stat().st_size == size  # not truncated: only the checksum can tell
        hashes = [b.block_hash for b in blocks]
        with caplog.at_level(logging.WARNING, logger="actors.ssd_writer"):
            await cache.writer.tell(ReadBlocks(request_id="q", hashes=hashes,
                                               reply_to=cache.scheduler))
            await eventually(lambda: len(cache.inbox) == 1)
        # Only the chain before it is served; the file is gone and the index forgets it.
        assert [b.block_hash for b in cache.inbox[0].blocks] == hashes[:1]
        assert not bad.exists()
        await eventually(lambda: cache.report("cache_index")["forgotten"] == 1)
        assert await cache.lookup(blocks) == ["disk"]
        report = cache.report("ssd_writer")
        assert (report["blocks_corrupt"], report["checksum_failures"]) == (1, 1)
        assert (report["read_blocks"], report["read_corrupt"]) == (1, 1)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                    and blocks[1].block_hash in r.getMessage()]
        assert len(warnings) == 1 and "checksum" in warnings[0].getMessage()
        assert warnings[0].exc_info is None  # one line, no traceback

        # Asked again (a request that raced the forget): missing now, not corrupt again.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="actors.ssd_writer"):
            await cache.writer.tell(ReadBlocks(request_id="q2", hashes=hashes,
                                               reply_to=cache.scheduler))
            await eventually(lambda: len(cache.inbox) == 2)
        assert [b.block_hash for b in cache.inbox[1].blocks] == hashes[:1]
        assert cache.report("ssd_writer")["blocks_corrupt"] == 1
        assert not any(r.levelno >= logging.WARNING for r in caplog.records)

        # The recomputed block is written again, and verifies.
        await cache.write([blocks[1]], request_id="r2")
        assert await cache.flush() == 1
        assert await cache.lookup(blocks) == ["disk"] * 3
        await cache.writer.tell(ReadBlocks(request_id="q3", hashes=hashes,
                                           reply_to=cache.scheduler))
        await eventually(lambda: len(cache.inbox) == 3)
        assert len(cache.inbox[2].blocks) == 3
