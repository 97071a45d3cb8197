"""Every config option is documented once, where it is declared, and the reference pages are generated from that.

tools/config_reference.py reads the comment above / beside each dataclass field (xc/config.py, and xc/ann/base.py for
`miner.ann`) and writes docs/config.md and docs/config_eval.md. These tests fail on a field without its comment, on a
page that was not regenerated, on a conf/ YAML key the reference does not list, and on a reference that walked other
fields or defaults than the dataclasses themselves hold.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from xc.config import XCConfig

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"

@pytest.fixture(scope="module")
def ref():
    """tools/config_reference.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_every_config_field_has_a_comment_where_it_is_declared(ref):
    missing = list(ref.undocumented())
    assert not missing, "fields without a comment above or beside them: " + ", ".join(missing)


def test_a_field_whose_comment_is_removed_is_reported(ref, tmp_path, monkeypatch):
    for name in ("xc/config.py", "xc/ann/base.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    source = (tmp_path / "xc/config.py").read_text()
    line = next(line for line in source.splitlines() if line.strip().startswith("log_every: int = 50"))
    (tmp_path / "xc/config.py").write_text(source.replace(line, line.split("#")[0].rstrip()))
    monkeypatch.setattr(ref, "ROOT", tmp_path)
    for cached in (ref._module, ref._class):
        cached.cache_clear()
    try:
        assert "train.log_every" in ref.undocumented()
    finally:
        for cached in (ref._module, ref._class):
            cached.cache_clear()


def test_the_reference_pages_are_what_the_tool_writes(ref):
    stale = ref.stale()
    assert not stale, f"{', '.join(stale)} out of date: run `{ref.COMMAND}`"


def test_each_reference_page_stays_under_400_lines(ref):
    long = {page: text.count("\n") for page, text in ref.pages().items() if text.count("\n") > 400}
    assert not long, f"split these pages further (tools/config_reference.py PAGES): {long}"


def _dataclass_options(instance, prefix: str = "") -> dict[str, object]:
    """Dotted path -> default of every field of the dataclass instance, nested sections as themselves."""
    out = {}
    for f in dataclasses.fields(instance):
        value, path = getattr(instance, f.name), prefix + f.name
        out[path] = value
        if dataclasses.is_dataclass(value):
            out.update(_dataclass_options(value, path + "."))
    return out


def test_the_reference_lists_the_dataclasses_fields_and_defaults(ref):
    listed, actual = ref.options(), _dataclass_options(XCConfig())
    assert sorted(listed) == sorted(actual)
    wrong = [f"{path}: reference {listed[path].default!r}, dataclass {ref._render(value)!r}"
             for path, value in actual.items() if not dataclasses.is_dataclass(value)
             and listed[path].default != ref._render(value)]
    assert not wrong, "\n".join(wrong)
    assert all(bool(listed[path].section) == dataclasses.is_dataclass(value) for path, value in actual.items())


def _yaml_options(node: dict, prefix: str) -> list[str]:
    """Dotted paths of every key `node` sets (nested mappings followed)."""
    out = []
    for key, value in node.items():
        path = prefix + str(key)
        out.append(path)
        if isinstance(value, dict):
            out += _yaml_options(value, path + ".")
    return out


def _conf_files() -> list[Path]:
    return sorted(CONF.rglob("*.yaml"))


@pytest.mark.parametrize("path", _conf_files(), ids=lambda p: str(p.relative_to(CONF)))
def test_every_option_a_conf_file_sets_is_in_the_reference(ref, path):
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    for key in ("defaults", "hydra"):  # hydra's own keys, which build_config ignores
        node.pop(key, None)
    group = path.parent.relative_to(CONF).as_posix()
    is_global = group == "." or "# @package _global_" in path.read_text().splitlines()[0]
    documented = set()
    for page in ref.PAGES:
        documented |= set(re.findall(r"^\| `([^`]+)` \|", (ROOT / page).read_text(), re.M))
    missing = [p for p in _yaml_options(node, "" if is_global else group + ".") if p not in documented]
    assert not missing, f"{path.relative_to(ROOT)} sets options the reference does not list: {missing}"
