"""The launcher reads `kaitian init`'s config on every supported Python (3.10 has no tomllib).

CI runs tests/unit under Python 3.10 as well: there the config is parsed by
tomli, and a failing import must surface instead of silently dropping the
measured capabilities.
"""

import sys

import pytest

from kaitian.launcher import cli


def test_measured_capabilities_reach_the_launch(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text('[devices."cpu:0"]\ncapability = 812.5\n\n[devices."cuda:1"]\ncapability = 270\n')
    monkeypatch.setenv("KAITIAN_CONFIG", str(config))
    assert cli._capabilities() == {"cpu:0": 812.5, "cuda:1": 270.0}


@pytest.mark.parametrize("text", ["devices = [not toml\n", "devices = 3\n"])
def test_a_broken_config_warns_and_launches_without(tmp_path, monkeypatch, caplog, text):
    config = tmp_path / "config.toml"
    config.write_text(text)
    monkeypatch.setenv("KAITIAN_CONFIG", str(config))
    assert cli._capabilities() == {}
    assert "kaitian init -r" in caplog.text


def test_a_broken_import_is_not_swallowed(monkeypatch):
    # None in sys.modules makes `import` raise ImportError, as a missing tomli would.
    monkeypatch.setitem(sys.modules, "kaitian.training.capability", None)
    with pytest.raises(ImportError):
        cli._capabilities()
