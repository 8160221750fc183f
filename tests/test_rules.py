"""Every rule id has exactly one implementation, and the reader and the validator agree.

- leanimg.rules.IMPLEMENTATIONS maps each rule of spec/format.md to the one function
  (registered with ``@implements``) that checks it;
- no other code names a rule id where it builds a finding: a rule id in the source is either
  in that function or in a private helper of its module that the function calls;
- the reader refuses each invalid vector with the vector's rule (or a follow-on rule the
  vector lists), as ``leanimg validate`` reports it; the few rules the reader does not check
  on open or use are listed below, with why.
"""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest

from helpers import VECTORS_DIR, restore_bytes
from leanimg.errors import ChainError, LeanImageError
from leanimg.rules import (
    HINT_IMPLEMENTATIONS,
    HINT_RULES,
    IMPLEMENTATIONS,
    RULES,
    WORKING_SET_IMPLEMENTATIONS,
    WORKING_SET_RULES,
)

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = [REPO / "lean-image", REPO / "converters", REPO / "restore"]
RULE_ID = re.compile(r"^LI-[A-Z]{3}-\d{3}$")

# Rules the reader does not check, and why; validate checks each of them.
NOT_CHECKED_BY_THE_READER = {
    "LI-FTR-004": "the image digest covers the whole file: the reader would have to read it all to open it",
}


def _import_everything() -> None:
    for package in ("leanimg", "leanimg.converters", "leanimg.restore"):
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, package + "."):
            importlib.import_module(module.name)


def test_every_rule_has_exactly_one_implementation():
    _import_everything()
    assert sorted(IMPLEMENTATIONS) == sorted(RULES)


def test_every_hint_rule_has_exactly_one_implementation():
    _import_everything()
    assert sorted(HINT_IMPLEMENTATIONS) == sorted(HINT_RULES)
    assert not set(HINT_RULES) & set(RULES)


def test_every_working_set_rule_has_exactly_one_implementation_and_is_in_the_guide():
    _import_everything()
    assert sorted(WORKING_SET_IMPLEMENTATIONS) == sorted(WORKING_SET_RULES)
    assert not set(WORKING_SET_RULES) & (set(RULES) | set(HINT_RULES))
    guide = (REPO / "spec" / "guides" / "lazy-restore.md").read_text()
    assert sorted(re.findall(r"^\| (LI-WKS-\d{3}) \|", guide, re.M)) == sorted(WORKING_SET_RULES)


def _units(path: Path):
    """(top-level unit name, node) of a module: its functions and classes."""
    tree = ast.parse(path.read_text())
    return [(node.name, node) for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]


def _rule_literals(node) -> set[str]:
    """Rule ids a unit names as values (comparisons such as ``exc.rule == ...`` excluded, and
    a fast path's declaration of the rules it accepts, ``@fast_path(...)``: it raises none)."""
    compared = {
        id(c) for n in ast.walk(node) if isinstance(n, ast.Compare) for c in ast.walk(n) if isinstance(c, ast.Constant)
    }
    compared |= {
        id(c)
        for decorator in getattr(node, "decorator_list", [])
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "fast_path"
        for c in ast.walk(decorator)
    }
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and RULE_ID.match(n.value) and id(n) not in compared
    }


def _names_used(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _reachable(start: str, units: dict) -> set[str]:
    """The module's units ``start`` uses, directly or through the units it uses."""
    seen, todo = {start}, [start]
    while todo:
        for name in _names_used(units[todo.pop()]) & set(units):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _sources():
    for directory in SOURCE_DIRS:
        for path in sorted(directory.rglob("*.py")):
            if path.name != "rules.py":
                yield path


def test_rule_ids_appear_only_in_their_implementation():
    _import_everything()
    owners = {
        rule: (fn.__module__, fn.__qualname__.split(".")[0])
        for rule, fn in {**IMPLEMENTATIONS, **HINT_IMPLEMENTATIONS, **WORKING_SET_IMPLEMENTATIONS}.items()
    }
    stray = []
    for path in _sources():
        units = dict(_units(path))
        module = _module_name(path)
        for name, node in units.items():
            for rule in _rule_literals(node):
                owner_module, owner = owners[rule]
                if (
                    owner_module != module
                    or name not in _reachable(owner, units)
                    or (name != owner and not name.startswith("_"))
                ):
                    stray.append(f"{path.relative_to(REPO)}:{name} names {rule}, implemented by {owner_module}.{owner}")
    assert not stray, "\n".join(stray)


def _module_name(path: Path) -> str:
    package = {"lean-image": "leanimg", "converters": "leanimg.converters", "restore": "leanimg.restore"}
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join([package[parts[0]], *parts[1:]]).removesuffix(".__init__")


META = json.loads((VECTORS_DIR / "vectors.json").read_text())["vectors"]
INVALID = sorted(k for k, m in META.items() if m["kind"] == "invalid")


@pytest.mark.parametrize("rel", INVALID)
def test_the_reader_refuses_each_invalid_vector_with_its_rule(rel):
    meta = META[rel]
    if meta["rule"] in NOT_CHECKED_BY_THE_READER:
        pytest.skip(NOT_CHECKED_BY_THE_READER[meta["rule"]])
    disks = {name: str(VECTORS_DIR / p) for name, p in meta["disks"].items()}
    parents = [str(VECTORS_DIR / p) for p in meta["parents"]]
    with pytest.raises(LeanImageError) as info:
        restore_bytes(VECTORS_DIR / rel, disks=disks, parents=parents)
    error = info.value
    if error.rule == "LI-CHN-001" and meta["rule"] != "LI-CHN-001" and not parents:
        # the vector needs a parent it does not ship (its rule is in a delta entry): the
        # reader cannot restore it, and says which parent is missing
        assert isinstance(error, ChainError)
        return
    assert error.rule in {meta["rule"], *meta["also_reported"]}, f"{rel}: {meta['description']}: {error}"
