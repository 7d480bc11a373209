"""``experiments/device_wheels.py``: the wheels a GPU call carries are the pinned versions, for
the device's Python, without dependencies (no download here: the tests run offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import device_wheels


def test_the_wheels_are_the_pinned_versions_for_the_devices_python(tmp_path: Path) -> None:
    command = device_wheels.download_command(tmp_path)
    pinned = device_wheels.pins()
    names = [*device_wheels.MISSING_ON_DEVICE, *device_wheels.DEVICE_VERSIONS]
    assert [p.split("==")[0].lower() for p in pinned] == [n.lower() for n in names]
    assert "flax==0.12.10" in pinned  # the device's jax 0.11.2 needs it (not our pinned 0.12.8)
    assert all("==" in p for p in pinned) and command[-len(pinned) :] == pinned
    assert {"--no-deps", "--only-binary=:all:"} <= set(command)
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("-d") + 1] == str(tmp_path)
    assert "--target /tmp/site .whl/*.whl" in device_wheels.INSTALL


def test_a_package_constraints_does_not_pin_is_named(tmp_path: Path) -> None:
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("grain==0.2.18\nml-collections==1.1.0\n")
    with pytest.raises(ValueError, match=r"pins no version of .*'array_record'"):
        device_wheels.pins(constraints)


def test_the_wheel_folder_is_ignored_by_git() -> None:
    ignored = (Path(device_wheels.ROOT) / ".gitignore").read_text().split()
    assert "/.whl/" in ignored
