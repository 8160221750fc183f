"""The documentation site: the tutorial's commands run and print what the page shows, the site
builds offline (no CDN), the generated CLI reference lists every command and option, the JSON
page documents every field of every schema, and the .ksy diagram is up to date."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from leanimg.cli import main
from leanimg.output import schema, schema_names

REPO_DIR = Path(__file__).resolve().parent.parent
TUTORIAL = REPO_DIR / "spec" / "tutorial.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
BLOCK_MARK = "@@tutorial-block"
QEMU = "qemu-system-x86_64"


def tutorial_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of the tutorial in order: (language, text)."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(TUTORIAL.read_text())]


def shell_blocks() -> list[tuple[str, list[str]]]:
    """Each bash block but QEMU's, with the lines of the text block that shows its output."""
    blocks, pending = [], None
    for language, text in tutorial_blocks():
        if language == "bash" and not text.startswith(QEMU):
            pending = (text, [])
            blocks.append(pending)
        elif language == "text" and pending is not None:
            pending[1].extend(text.splitlines())
            pending = None
        else:
            pending = None
    return blocks


def shell_environment() -> dict:
    """PATH starting with this interpreter's bin (leanimg and python3 of the test's environment)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def expected_pattern(line: str) -> re.Pattern:
    """A shown output line as a pattern: timings vary, paths of the parent are absolute."""
    pattern = re.escape(line.strip())
    pattern = re.sub(r"\d+\\\.\d+\\ s\b", r"[0-9.]+\\ s", pattern)
    pattern = pattern.replace(re.escape("/tmp/tutorial/"), r".*/")
    return re.compile(pattern)


@pytest.fixture(scope="module")
def tutorial_run(module_dirs):
    """All of the tutorial's shell blocks run in one bash, in a fresh folder; output by block."""
    folder = module_dirs("tutorial")
    blocks = shell_blocks()
    script = ["set -euo pipefail", "exec 2>&1"]
    for k, (text, _) in enumerate(blocks):
        script += [f"echo {BLOCK_MARK} {k}", text]
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=folder,
        env=shell_environment(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    outputs = re.split(rf"^{BLOCK_MARK} \d+\n", proc.stdout, flags=re.M)[1:]
    assert len(outputs) == len(blocks)
    return folder, blocks, outputs


def test_the_tutorial_has_the_steps_it_promises():
    commands = "\n".join(text for text, _ in shell_blocks())
    for step in (
        "leanimg convert vm.save -o vm.lean --disk vda=disk.img",
        "leanimg inspect",
        "leanimg validate",
        "--parent vm.lean",
        "leanimg restore vm-2.lean --to qemu",
    ):
        assert step in commands, step
    qemu = [text for language, text in tutorial_blocks() if language == "bash" and text.startswith(QEMU)]
    assert len(qemu) == 1 and '-incoming "exec:leanimg restore vm-2.lean --to qemu -o -' in qemu[0]


def test_every_tutorial_command_runs_and_prints_what_the_page_shows(tutorial_run):
    folder, blocks, outputs = tutorial_run
    for (text, shown), output in zip(blocks, outputs):
        lines = [line.strip() for line in output.splitlines()]
        for line in shown:
            if not line.strip() or "..." in line or "…" in line:
                continue
            pattern = expected_pattern(line)
            assert any(pattern.fullmatch(actual) for actual in lines), (
                f"the tutorial shows {line!r} after\n{text}\nbut the command printed:\n{output}"
            )
    assert (folder / "restored.save").read_bytes() == (folder / "vm.save").read_bytes()


@pytest.mark.qemu
def test_the_tutorial_s_qemu_line_restores_the_guest(tutorial_run):
    if shutil.which(QEMU) is None:
        pytest.skip(f"{QEMU} is not installed")
    from guest.vm import QMP

    folder = tutorial_run[0]
    line = next(text for language, text in tutorial_blocks() if language == "bash" and text.startswith(QEMU))
    qemu = subprocess.Popen(
        ["bash", "-c", "exec " + line],
        cwd=folder,
        env=shell_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    monitor = None
    try:
        _wait_for_socket(folder / "qmp.sock", qemu)
        monitor = QMP(folder / "qmp.sock")
        status, deadline = None, time.monotonic() + 300
        while time.monotonic() < deadline and status not in ("completed", "failed"):
            status = (monitor.execute("query-migrate") or {}).get("status")
            time.sleep(0.5)
        assert status == "completed", status
        assert monitor.execute("query-status")["status"] == "paused"  # as it was saved: stopped
        monitor.execute("cont")
        assert monitor.execute("query-status")["status"] == "running"
        monitor.execute("quit")
        assert qemu.wait(timeout=60) == 0
    finally:
        if monitor is not None:
            monitor.close()  # QEMU has closed its end after quit: the helper expects that
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
        qemu.stdout.close()


def _wait_for_socket(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert process.poll() is None, process.stdout.read().decode(errors="replace")
        assert time.monotonic() < deadline, "QEMU did not create its QMP socket"
        time.sleep(0.2)


# --- the site ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(module_dirs):
    out = module_dirs("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def test_the_site_loads_nothing_from_other_hosts(site):
    pages = list(site.rglob("*.html"))
    assert len(pages) >= 12
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.I)
    for page in pages:
        html = page.read_text()
        assert not remote.search(html), f"{page.relative_to(site)} loads {remote.search(html).group(0)}"
        assert "fonts.googleapis" not in html and "fonts.gstatic" not in html
    # material's offline plugin: the search index as a script, readable from file://
    assert (site / "search" / "search_index.js").is_file()


def test_the_site_publishes_the_ksy_its_diagram_and_the_schemas(site):
    assert (site / "ksy" / "leanimg.ksy").read_bytes() == (REPO_DIR / "ksy" / "leanimg.ksy").read_bytes()
    assert (site / "images" / "leanimg-ksy.svg").is_file()
    for name in schema_names():
        assert json.loads((site / "schemas" / f"{name}.schema.json").read_text()) == schema(name)
    ksy_page = (site / "ksy.html").read_text()
    assert "images/leanimg-ksy.svg" in ksy_page and "doc-ref" in ksy_page


def _commands():
    ctx = click.Context(main)
    return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}


def test_the_cli_reference_lists_every_command_and_option(site):
    reference = (site / "reference" / "cli.html").read_text()
    commands = _commands()
    assert {"convert", "inspect", "validate", "restore", "demo", "serve", "checkpoint"} <= set(commands)
    for name, command in {"": main, **commands}.items():
        if name:
            assert f"leanimg {name}" in reference, name
        for param in command.params:
            for option in getattr(param, "opts", []) + getattr(param, "secondary_opts", []):
                if option.startswith("-"):
                    assert option in reference, f"{name} {option}"


def test_help_texts_state_defaults_and_ranges():
    no_default = (None, getattr(click.core, "UNSET", None))  # click >= 8.3 marks "no default" so
    for name, command in {"": main, **_commands()}.items():
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden or param.count or param.multiple:
                continue
            ctx = click.Context(command)
            help_text = param.get_help_record(ctx)[1]
            on_off = param.is_flag and param.secondary_opts  # --x/--no-x
            if on_off or (not param.is_flag and param.get_default(ctx, call=False) not in no_default):
                assert "default" in help_text.lower(), f"{name} {param.opts}: {help_text}"
            if isinstance(param.type, click.IntRange):
                assert re.search(r"\d", help_text), f"{name} {param.opts} states no range: {help_text}"


def _properties(node, found: set) -> set:
    if isinstance(node, dict):
        for key, value in node.get("properties", {}).items():
            found.add(key)
        for value in node.values():
            _properties(value, found)
    elif isinstance(node, list):
        for value in node:
            _properties(value, found)
    return found


def test_the_json_page_documents_every_field_of_every_schema():
    """Each schema's fields in its own section of spec/guides/json.md (or in the shared shapes)."""
    sections = (REPO_DIR / "spec" / "guides" / "json.md").read_text().split("\n## ")
    shared = next(section for section in sections if section.startswith("Shared shapes"))
    for name in schema_names():
        section = next(s for s in sections if f"`schemas/{name}.schema.json`" in s)
        for field in _properties(schema(name), set()):
            assert f"`{field}`" in section + shared, f"{name}: field {field} is not documented in its section"


@pytest.mark.kaitai
def test_the_ksy_diagram_is_up_to_date():
    sys.path.insert(0, str(REPO_DIR / "spec" / "tools"))
    import ksy_diagram
    from kaitai_support import KaitaiUnavailable

    if shutil.which("dot") is None or shutil.which("node") is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("CI=true but node or graphviz's dot is missing (.ci/install installs them)")
        pytest.skip("node or graphviz's dot is not installed")
    try:
        svg = ksy_diagram.diagram()
    except KaitaiUnavailable as exc:
        pytest.skip(str(exc))
    assert svg == ksy_diagram.SVG.read_bytes(), "run python spec/tools/ksy_diagram.py and commit the SVG"
