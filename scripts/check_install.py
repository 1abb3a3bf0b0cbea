"""Check that this Python environment holds exactly what `make` installs (the last step of its bootstrap).

Run with the venv's interpreter: `.venv/bin/python scripts/check_install.py`. It fails (exit 1) unless
  - every package in requirements.lock is installed at its locked version;
  - torch is installed at the version pinned in constraints.txt (any local label: 2.13.0+cpu is 2.13.0);
  - gradleak itself is installed;
  - nothing else is installed, except pip and whatever torch's own requirements pulled in that the lock lacks
    (the CUDA runtime packages of a CUDA torch elsewhere; with the CPU torch there are none);
  - `pip check` reports nothing but the declared dependencies of the lock's no-deps section, which are
    left out on purpose (see scripts/lock.sh).
"""

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
CONSTRAINTS = ROOT / "constraints.txt"
NO_DEPS_MARKER = "# ---- no-deps:"  # the section header scripts/lock.sh writes
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def read_pins(path: Path) -> tuple[dict[str, str], set[str]]:
    """Return {name: version} of every `name==version` line, and the names in the no-deps section."""
    pins: dict[str, str] = {}
    no_deps: set[str] = set()
    in_no_deps = False
    for line in path.read_text().splitlines():
        in_no_deps = in_no_deps or line.startswith(NO_DEPS_MARKER)
        match = PIN.match(line)
        if match:
            name = canonicalize_name(match[1])
            pins[name] = match[2]
            if in_no_deps:
                no_deps.add(name)
    return pins, no_deps


def torch_closure(installed: dict[str, metadata.Distribution]) -> set[str]:
    """Names of the installed packages that torch requires, directly or through each other."""
    seen: set[str] = set()
    todo = ["torch"]
    while todo:
        dist = installed.get(todo.pop())
        for spec in (dist.requires or []) if dist else []:
            req = Requirement(spec)
            name = canonicalize_name(req.name)
            if name not in seen and (req.marker is None or req.marker.evaluate({"extra": ""})):
                seen.add(name)
                todo.append(name)
    return seen


def main() -> int:
    pins, no_deps = read_pins(LOCK)
    torch_pin = read_pins(CONSTRAINTS)[0]["torch"]
    installed = {str(canonicalize_name(d.metadata["Name"])): d for d in metadata.distributions()}
    problems = []

    for name, version in sorted(pins.items()):
        dist = installed.get(name)
        if dist is None:
            problems.append(f"{name}=={version} is locked but not installed")
        elif Version(dist.version) != Version(version):
            problems.append(f"{name} is {dist.version}, the lock says {version}")
    torch = installed.get("torch")
    if torch is None or Version(torch.version).public != Version(torch_pin).public:
        problems.append(
            f"torch is {torch.version if torch else 'not installed'}, constraints.txt says {torch_pin}"
        )
    if "gradleak" not in installed:
        problems.append("gradleak itself is not installed")

    allowed = set(pins) | {"torch", "gradleak", "pip"} | torch_closure(installed)
    for name in sorted(set(installed) - allowed):
        problems.append(
            f"{name} {installed[name].version} is installed but not in requirements.lock "
            "(left from an older lock? `make clean` then retry)"
        )

    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    exempt = re.compile(r"^(\S+) \S+ requires \S+, which is not installed\.$")
    for line in (check.stdout + check.stderr).splitlines():
        match = exempt.match(line)
        if (
            line.strip()
            and line != "No broken requirements found."
            and not (match and canonicalize_name(match[1]) in no_deps)
        ):
            problems.append(f"pip check: {line}")

    if problems:
        sys.stderr.write("check_install: the environment does not match requirements.lock:\n")
        sys.stderr.writelines(f"  - {problem}\n" for problem in problems)
        return 1
    sys.stdout.write(
        f"check_install: {len(pins)} locked packages, torch {installed['torch'].version}, gradleak: "
        f"as locked; pip check clean (no-deps on purpose: {', '.join(sorted(no_deps)) or 'none'})\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
