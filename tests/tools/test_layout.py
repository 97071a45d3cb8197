"""tools/ by purpose: every script is listed in tools/README.md under the folder it lies in, every tool path the
docs, tests and code cite exists, every `tools.*` import resolves, and a script run from another directory finds
a sibling group's module (tools/bench/bench_host_share.py imports tools/experiments/scale_quality.py)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

TOOLS = REPO / "tools"
CITED = re.compile(r"(?<![\w/.-])tools/[\w/.-]*?\.(?:py|sh)\b")


def scripts() -> set[str]:
    """Every script under tools/, relative to tools/: results/ holds figures, and a package's modules (a folder with
    an __init__.py, such as probes/reliability/) are imported by the script that runs them, not run themselves."""
    return {path.relative_to(TOOLS).as_posix() for pattern in ("*.py", "*.sh") for path in TOOLS.rglob(pattern)
            if "results" not in path.parts and "__pycache__" not in path.parts
            and not (path.parent / "__init__.py").exists()}


def listed() -> dict[str, str]:
    """tools/README.md's bullets ("- `name`: ...") as {path relative to tools/: section heading}; a bullet names
    the file from its section's folder (`## bench/: ...`) or, where it has a slash, from tools/."""
    found, folder, heading = {}, "", ""
    for line in (TOOLS / "README.md").read_text().splitlines():
        if line.startswith("## "):
            heading = line
            match = re.match(r"## (\w+)/", line)
            folder = match.group(1) + "/" if match else ""
        match = re.match(r"- `([\w/.]+\.(?:py|sh))`", line)
        if match:
            name = match.group(1)
            path = name if "/" in name or not (TOOLS / folder / name).exists() else folder + name
            found[path] = heading
    return found


def test_every_script_is_listed_in_the_readme_and_every_listed_one_exists():
    entries = listed()
    assert set(entries) == scripts(), "tools/README.md and tools/ disagree"
    for path, heading in entries.items():
        folder = path.split("/")[0] if "/" in path else None
        assert folder is None or heading.startswith(f"## {folder}/"), f"{path} listed under {heading!r}"


def test_every_cited_tool_path_exists():
    texts = [REPO / "README.md", REPO / "pyproject.toml", REPO / ".ci" / "run", TOOLS / "README.md",
             *REPO.glob("docs/*.md"), *TOOLS.rglob("*.py"), *TOOLS.glob("*.sh"), *REPO.glob("tests/**/*.py"),
             *REPO.glob("xc/**/*.py"), *REPO.glob("launch/*"), *REPO.glob("conf/**/*.yaml")]
    missing = []
    for path in texts:
        if "results" in path.parts or not path.is_file():
            continue
        text = path.read_text()
        for match in CITED.finditer(text):
            near = text[max(0, match.start() - 100):match.end() + 100]
            if not (REPO / match.group()).exists() and "git history" not in near:  # a removed one-off script
                missing.append(f"{path.relative_to(REPO)}: {match.group()}")
    assert missing == []


def test_every_tools_import_resolves():
    sys.path.insert(0, str(REPO))
    try:
        unresolved = []
        for path in [*TOOLS.rglob("*.py"), *REPO.glob("tests/**/*.py")]:
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                    [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    if name.startswith("tools.") and importlib.util.find_spec(name) is None:
                        unresolved.append(f"{path.relative_to(REPO)}: {name}")
    finally:
        sys.path.remove(str(REPO))
    assert unresolved == []


def test_a_script_finds_another_groups_module_from_any_directory(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOLS / "bench" / "bench_host_share.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: bench_host_share.py" in proc.stdout


@pytest.mark.slow  # a Python process per script, about 30 s in all
@pytest.mark.parametrize("script", sorted(path for path in scripts() if "/" in path and path.endswith(".py")))
def test_every_grouped_script_starts_from_any_directory(script, tmp_path):
    """Its module-level imports (xc, tools.*, a sibling) resolve when run by path from elsewhere: `--help` exits 0."""
    proc = subprocess.run([sys.executable, str(TOOLS / script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:")
