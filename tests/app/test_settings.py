"""Where the workbench keeps its data, and when it may listen beyond this machine."""
from __future__ import annotations

import pytest

from app import settings


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True), ("127.0.0.2", True),
    ("0.0.0.0", False), ("", False), (None, False), ("192.168.1.5", False), ("example.org", False),
])
def test_only_loopback_addresses_count_as_local(address, loopback):
    assert settings.is_loopback(address) is loopback


def test_another_address_needs_the_explicit_flag(monkeypatch):
    monkeypatch.delenv(settings.ALLOW_REMOTE_ENV, raising=False)
    assert settings.binding("127.0.0.1", []) == "loopback"
    assert settings.binding("0.0.0.0", []) == "remote-refused"
    assert settings.binding("0.0.0.0", ["--allow-remote"]) == "remote-allowed"
    monkeypatch.setenv(settings.ALLOW_REMOTE_ENV, "1")
    assert settings.binding("0.0.0.0", []) == "remote-allowed"


def test_the_data_folder_comes_from_the_environment_the_flag_or_home(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.DATA_DIR_ENV, str(tmp_path / "env"))
    assert settings.data_dir(["--data-dir", str(tmp_path / "flag")]) == tmp_path / "env"
    monkeypatch.delenv(settings.DATA_DIR_ENV)
    assert settings.data_dir(["--data-dir", str(tmp_path / "flag")]) == tmp_path / "flag"
    assert settings.data_dir([f"--data-dir={tmp_path / 'eq'}"]) == tmp_path / "eq"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    folder = settings.data_dir([])
    assert folder == tmp_path / "home" / ".flexlab" and folder.is_dir()
    assert (folder.stat().st_mode & 0o777) == 0o700  # experiments hold the user's code
