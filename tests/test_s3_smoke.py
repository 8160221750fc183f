"""Round trip through a real S3-compatible store (SeaweedFS, tests/s3store.py)."""

import os

from helpers import run_leanimg


def test_convert_to_the_store_and_restore_from_it_byte_identical(s3store, tmp_path):
    import zstandard
    from leanimg.sample import __file__ as sample_init

    save = tmp_path / "vm.save"
    with open(os.path.join(os.path.dirname(sample_init), "vm.save.zst"), "rb") as f:
        save.write_bytes(zstandard.ZstdDecompressor().decompressobj().decompress(f.read()))
    env = dict(os.environ, **s3store.env)
    url = s3store.url("smoke/vm.lean")
    run_leanimg("convert", str(save), "-o", url, timeout=120, env=env, check=True)
    assert "smoke/vm.lean" in s3store.keys("smoke/")
    back = tmp_path / "back.save"
    run_leanimg("restore", url, "--to", "qemu", "-o", str(back), timeout=120, env=env, check=True)
    assert back.read_bytes() == save.read_bytes()
