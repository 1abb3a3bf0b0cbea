"""No code path in ``src/`` can unpickle: an AST scan that fails on ``torch.load`` without
``weights_only=True``, any import of a pickle-family module, ``allow_pickle=True`` and ``yaml.load``.

Unpickling runs whatever its sender wrote (``__reduce__``): a malicious server that reached one such call
ran code on every client (``integrations/flower/apps.py`` had ``torch.load(..., weights_only=False)`` on a
train message's record). The scan is checked on snippets that hold each forbidden pattern, so that a
scanner that finds nothing cannot pass silently."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PICKLE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "joblib",
    "shelve",
    "marshal",
    "jsonpickle",
}
UNSAFE_CALLS = {"read_pickle", "unsafe_load", "full_load"}  # pandas, PyYAML


def _true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(source: str, filename: str = "<snippet>") -> list[str]:
    """Every forbidden pattern in ``source``, as ``file:line: what``."""
    out = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            root = (node.module or "").split(".")[0]
            if root in PICKLE_MODULES:
                out.append(f"{where}: from {node.module} import ...")
            if root == "torch" and any(a.name == "load" for a in node.names):
                out.append(f"{where}: from torch import load (call it as torch.load(..., weights_only=True))")
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            owner = (
                func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            )
            keywords = {k.arg: k.value for k in node.keywords}
            if _true(keywords.get("allow_pickle")):
                out.append(f"{where}: allow_pickle=True")
            if name == "load" and owner == "torch" and not _true(keywords.get("weights_only")):
                out.append(f"{where}: torch.load without weights_only=True")
            if name == "load" and owner == "yaml":
                out.append(f"{where}: yaml.load (use yaml.safe_load)")
            if name in UNSAFE_CALLS:
                out.append(f"{where}: {name}")
    return out


def test_src_never_unpickles():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        found += findings(path.read_text(encoding="utf-8"), str(path.relative_to(SRC.parent)))
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\nm = torch.load(f, weights_only=False)",
        "import torch\nm = torch.load(f)",
        "from torch import load",
        "import pickle",
        "import pickle as p",
        "from pickle import loads",
        "import cloudpickle",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import yaml\nyaml.load(f)",
        "import pandas as pd\npd.read_pickle(f)",
    ],
)
def test_the_scan_finds_each_forbidden_pattern(snippet):
    assert findings(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    ["import torch\ntorch.load(f, weights_only=True)", "import numpy as np\nnp.load(f, allow_pickle=False)",
     "import yaml\nyaml.safe_load(f)", "import safetensors.torch\nsafetensors.torch.load_file(f)"],
)  # fmt: skip
def test_the_scan_lets_safe_loading_pass(snippet):
    assert findings(snippet) == []
