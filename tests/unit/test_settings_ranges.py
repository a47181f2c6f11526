"""Every KAITIAN_* number has a documented range and is refused outside it in
one line that names the variable and the range (issue 20)."""

from __future__ import annotations

import pytest

from kaitian.settings import SettingError, Settings


@pytest.mark.parametrize("name,raw", [
    ("KAITIAN_CHUNK_BYTES", "0"),
    ("KAITIAN_CHUNK_BYTES", "-1"),
    ("KAITIAN_CHUNK_BYTES", "1"),
    ("KAITIAN_CHUNK_BYTES", "1000000000000"),
    ("KAITIAN_CHUNK_BYTES", str(2**60)),
    ("KAITIAN_CHUNK_BYTES", "1e12"),
    ("KAITIAN_SPIN_US", "-1"),
    ("KAITIAN_SPIN_US", "100000000000"),
    ("KAITIAN_DEVICE_INDEX", "-1"),
    ("KAITIAN_DEVICE_INDEX", str(2**40)),
    ("KAITIAN_CAPABILITY", "0"),
    ("KAITIAN_CAPABILITY", "-3"),
    ("KAITIAN_CAPABILITY", "inf"),
    ("KAITIAN_CAPABILITY", "nan"),
    ("KAITIAN_FAKE_ACCELERATOR", "mlu"),
    ("KAITIAN_FAKE_ACCELERATOR", "mlu:0"),
    ("KAITIAN_FAKE_ACCELERATOR", "mlu:65"),
    ("KAITIAN_FAKE_ACCELERATOR", "mlu:-1"),
    ("KAITIAN_FAKE_ACCELERATOR", "cuda:2"),
])
def test_out_of_range_numbers_are_refused_in_one_line(name, raw):
    with pytest.raises(SettingError) as err:
        Settings.from_env({name: raw})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{name}={raw!r}"), msg
    assert "expected" in msg, msg


@pytest.mark.parametrize("name,raw,field,value", [
    ("KAITIAN_CHUNK_BYTES", "4096", "chunk_bytes", 4096),
    ("KAITIAN_CHUNK_BYTES", str(256 << 20), "chunk_bytes", 256 << 20),
    ("KAITIAN_SPIN_US", "0", "spin_us", 0),
    ("KAITIAN_SPIN_US", "100000", "spin_us", 100000),
    ("KAITIAN_DEVICE_INDEX", "0", "device_index", 0),
    ("KAITIAN_CAPABILITY", "0.5", "capability", 0.5),
    ("KAITIAN_FAKE_ACCELERATOR", "mlu:1", "fake_accelerator", ("mlu", 1)),
    ("KAITIAN_FAKE_ACCELERATOR", "mlu:64", "fake_accelerator", ("mlu", 64)),
])
def test_range_ends_are_accepted(name, raw, field, value):
    assert getattr(Settings.from_env({name: raw}), field) == value
