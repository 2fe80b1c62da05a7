"""The dependency floors CI tests are the ones pyproject.toml declares: constraints-floor.txt pins each `>=`
floor, .ci/run installs the project with it, and this test keeps the two files from drifting apart."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
from packaging.requirements import Requirement  # noqa: E402  (transformers and pytest depend on packaging)
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# declared but not pinned in constraints-floor.txt, and why
NOT_PINNED = {
    "torch": ("installed on its own first (a looser requirement pulls a CUDA build); CI runs 2.13.0, 2.14.1 and "
              "the floor 2.11.0"),
    "optimum-quanto": "the quant extra: CI does not install it, and its test skips without it",
}


def _declared_floors() -> dict[str, Version]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for group in project["optional-dependencies"].values():
        requirements += group
    floors: dict[str, Version] = {}
    for text in requirements:
        req = Requirement(text)
        lower = [s for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{text!r}: every dependency declares one `>=` floor"
        name, floor = canonicalize_name(req.name), Version(lower[0].version)
        assert floors.setdefault(name, floor) == floor, \
            f"{req.name} has two floors in pyproject.toml: {floors[name]} and {floor}"
    return floors


def _pinned() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints-floor.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([0-9][0-9A-Za-z.]*)", line)
        assert match, f"constraints-floor.txt: {line!r} is not `name==version`"
        name = canonicalize_name(match[1])
        assert name not in pins, f"constraints-floor.txt pins {match[1]} twice"
        pins[name] = Version(match[2])
    return pins


def test_each_floor_ci_pins_is_the_floor_pyproject_declares():
    declared, pinned = _declared_floors(), _pinned()
    assert set(NOT_PINNED) <= set(declared), "NOT_PINNED names a package pyproject.toml no longer declares"
    missing = set(declared) - set(pinned) - set(NOT_PINNED)
    assert not missing, f"declared in pyproject.toml but not pinned in constraints-floor.txt: {sorted(missing)}"
    extra = set(pinned) - set(declared)
    assert not extra, f"pinned in constraints-floor.txt but not declared in pyproject.toml: {sorted(extra)}"
    assert not set(pinned) & set(NOT_PINNED), "a package both pinned and listed as not pinned"
    differ = {name: (str(declared[name]), str(pinned[name])) for name in pinned if declared[name] != pinned[name]}
    assert not differ, f"pyproject.toml floor != constraints-floor.txt pin (declared, pinned): {differ}"
