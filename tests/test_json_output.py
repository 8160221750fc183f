"""Every command's --json output, run for real on the bundled QEMU save, validated against the
JSON Schema shipped in the package (lean-image/schemas/, spec/guides/json.md); errors as JSON
with the exit codes of the text mode; -q/--quiet and the one-line summaries."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

import jsonschema
import pytest
import zstandard
from click.testing import CliRunner

from leanimg.cli import command_line, main
from leanimg.demo import sample_path
from leanimg.inspect import class_counts
from leanimg.output import schema, schema_names
from leanimg.reader import LeanImage
from leanimg.rules import HINT_RULES, RULES, WORKING_SET_RULES
from helpers import VECTORS_DIR

COMMANDS_WITH_JSON = {
    "inspect",
    "validate",
    "validate-hints",
    "plugins",
    "convert",
    "restore",
    "flatten",
    "merge",
    "serve",
    "checkpoint",
    "uploads",
}
RULE_IDS = set(RULES) | set(HINT_RULES) | set(WORKING_SET_RULES)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The bundled save and disk, converted with --disk, and an incremental image against it."""
    folder = tmp_path_factory.mktemp("json")
    for name in ("vm.save", "disk.img"):
        with open(sample_path(name + ".zst"), "rb") as src, open(folder / name, "wb") as dest:
            zstandard.ZstdDecompressor().copy_stream(src, dest)
    ok(folder, "convert", "vm.save", "-o", "vm.lean", "--disk", "vda=disk.img")
    ok(folder, "convert", "vm.save", "-o", "vm-2.lean", "--parent", "vm.lean", "--disk", "vda=disk.img")
    return folder


def invoke(folder, *args):
    """The command run by click's CliRunner in ``folder``."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    finally:
        os.chdir(before)


def ok(folder, *args, code=0):
    result = invoke(folder, *args)
    assert result.exit_code == code, result.output
    return result


def checked(command: str, text: str):
    """``text`` parsed, and valid against the schema of ``command``."""
    document = json.loads(text)
    jsonschema.validate(document, schema(command), format_checker=jsonschema.FormatChecker())
    return document


# --- the schemas themselves -------------------------------------------------------------------------
def test_every_command_that_reports_has_a_valid_draft_2020_12_schema():
    assert COMMANDS_WITH_JSON | {"error"} <= set(schema_names())
    for name in schema_names():
        document = schema(name)
        assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
        jsonschema.Draft202012Validator.check_schema(document)


def test_classes_have_one_shape_in_every_schema():
    with_classes = {name for name in schema_names() if "classes" in schema(name).get("$defs", {})}
    assert with_classes >= {"inspect", "convert", "restore", "flatten", "merge", "checkpoint"}
    shapes = [schema(name)["$defs"]["classes"] for name in with_classes]
    assert all(shape == shapes[0] for shape in shapes)


def test_every_command_with_json_says_so_in_its_help():
    for command in COMMANDS_WITH_JSON:
        result = CliRunner().invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "--json" in result.output and "--quiet" in result.output, command


# --- each command's output --------------------------------------------------------------------------
def test_inspect(sample):
    out = checked("inspect", ok(sample, "inspect", "vm-2.lean", "--json").stdout)
    with LeanImage.open(sample / "vm-2.lean") as image:
        expected = {cls.name: n for cls, n in class_counts(image).items() if n}
    assert out["classes"] == expected == {"ZERO": 12638, "PARENT": 16180}  # the parent first: no DISK
    assert out["incompatible_features"] == ["PARENT", "DISK", "DELTA", "INHERITED_DIGESTS"]
    assert out["compatible_features"] == ["SOURCE_STATE"]
    assert out["chain"][1]["classes"] == {"STORED": 14634, "ZERO": 12638, "DISK": 1546}
    assert sum(sum(r["classes"].values()) for r in out["regions"]) == sum(expected.values())


def test_validate_lists_the_rules_not_checked_by_id(sample):
    out = checked("validate", ok(sample, "validate", "vm.lean", "--json", code=4).stdout)
    assert out["valid"] is True and out["complete"] is False
    assert out["not_checked"] == ["LI-DIG-002", "LI-DSK-004", "LI-DSK-005"] and set(out["not_checked"]) <= RULE_IDS
    assert len(out["not_checked_reasons"]) == 1 and out["not_checked_reasons"][0].endswith("no --disk for vda")
    whole = checked("validate", ok(sample, "validate", "vm.lean", "--disk", "vda=disk.img", "--json").stdout)
    assert whole["complete"] is True and whole["not_checked"] == [] and whole["checked"]["disk_pages"] == 1546


def test_validate_chain_gives_a_list(sample):
    out = checked("validate", ok(sample, "validate", "--chain", "vm-2.lean", "--json", code=4).stdout)
    assert [r["path"].rsplit("/", 1)[-1] for r in out] == ["vm-2.lean", "vm.lean"]
    # the child has no DISK page of its own (the parent first), its parent's are not read
    assert out[0]["not_checked"] == ["LI-DIG-002"]
    assert out[1]["not_checked"] == ["LI-DIG-002", "LI-DSK-004", "LI-DSK-005"]


def test_validate_of_a_damaged_image(sample, tmp_path):
    data = bytearray((sample / "vm.lean").read_bytes())
    data[200] ^= 1
    (tmp_path / "bad.lean").write_bytes(bytes(data))
    out = checked("validate", ok(sample, "validate", tmp_path / "bad.lean", "--json", code=1).stdout)
    assert out["valid"] is False and out["findings"] and all(f["rule"] in RULE_IDS for f in out["findings"])


def test_validate_hints(sample):
    valid = VECTORS_DIR / "hints" / "valid" / "everything.hnt"
    out = checked("validate-hints", ok(sample, "validate-hints", valid, "--json", code=4).stdout)
    assert out["valid"] is True and out["records"] > 0
    assert out["not_checked"] == ["LI-HNT-017", "LI-HNT-018", "LI-HNT-019", "LI-HNT-020", "LI-HNT-021"]
    invalid = sorted((VECTORS_DIR / "hints" / "invalid").glob("*.hnt"))[0]
    bad = checked("validate-hints", ok(sample, "validate-hints", invalid, "--json", code=1).stdout)
    assert bad["valid"] is False and {f["rule"] for f in bad["findings"]} <= RULE_IDS


def test_plugins():
    out = checked("plugins", CliRunner().invoke(main, ["plugins", "--json"]).stdout)
    assert {(p["kind"], p["name"]) for p in out} >= {
        ("source", "qemu"),
        ("source", "xen"),
        ("target", "raw"),
        ("target", "qemu"),
        ("checkpoint", "qemu"),
    }


def test_convert(sample, tmp_path):
    out = checked(
        "convert",
        ok(
            sample,
            "convert",
            "vm.save",
            "-o",
            tmp_path / "c.lean",
            "--parent",
            "vm.lean",
            "--disk",
            "vda=disk.img",
            "--json",
        ).stdout,
    )
    assert out["classes"] == {"ZERO": 12638, "PARENT": 16180}
    assert out["save"] == "vm.save" and out["source"] == "qemu" and out["save_bytes"] == 66679434
    assert out["file_bytes"] == (tmp_path / "c.lean").stat().st_size and out["parent"].endswith("vm.lean")
    assert out["disk_scan"]["pages"] == {}  # nothing changed since the parent: nothing looked up


def test_restore_to_a_file_and_to_stdout(sample, tmp_path):
    out = checked(
        "restore",
        ok(
            sample, "restore", "vm.lean", "--to", "raw", "-o", tmp_path / "m.raw", "--disk", "vda=disk.img", "--json"
        ).stdout,
    )
    assert out["output_bytes"] == out["logical_bytes"] == (tmp_path / "m.raw").stat().st_size
    assert out["classes"] == {"STORED": 14634, "ZERO": 12638, "DISK": 1546} and out["links"] == 1
    # -o -: standard output is the stream, so the JSON goes to standard error
    proc = subprocess.run(
        [*command_line(), "restore", "vm.lean", "--to", "qemu", "-o", "-", "--disk", "vda=disk.img", "--json"],
        cwd=sample,
        capture_output=True,
        check=True,
    )
    assert proc.stdout == (sample / "vm.save").read_bytes()
    assert checked("restore", proc.stderr)["output"] == "-"


@pytest.mark.parametrize("command", ["flatten", "merge"])
def test_flatten_and_merge(sample, tmp_path, command):
    out = checked(command, ok(sample, command, "vm-2.lean", "-o", tmp_path / "out.lean", "--json").stdout)
    assert out["parent"] is None
    assert out["classes"] == {"STORED": 14634, "ZERO": 12638, "DISK": 1546}
    assert out["file_bytes"] == (tmp_path / "out.lean").stat().st_size


def test_serve_puts_its_counts_on_stderr(sample):
    # the return path closed at once, as by a destination that went away: the stream is not completed
    proc = subprocess.run(
        [*command_line(), "serve", "vm.lean", "--postcopy", "--disk", "vda=disk.img", "--json"],
        cwd=sample,
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )
    if proc.returncode == 1 and b"userfaultfd" in proc.stderr:
        pytest.skip("userfaultfd is not available to this user")
    assert proc.returncode == 0, proc.stderr
    out = checked("serve", proc.stderr)
    assert out["pages_total"] == 28818 and out["pages_to_send"] == 14634 + 1546 and out["completed"] is False
    assert out["bytes_sent"] == len(proc.stdout) > 0


def test_checkpoint_result_shape():
    from leanimg.converters.checkpoint import Balloon, CheckpointResult, FrozenDisk
    from leanimg.format import PageClass

    result = CheckpointResult(
        output="vm.lean",
        mode="live",
        then="continue",
        file_bytes=1 << 20,
        page_size=4096,
        classes=Counter({PageClass.STORED: 10, PageClass.ZERO: 5, PageClass.FREE: 0}),
        downtime_ms=12,
        paused_ms=None,
        seconds=1.5,
        disks=[FrozenDisk("vda", "/vm/disk.img", {"device": "vda"}, True, "/vm/disk.img.after-vm.qcow2", 8192)],
        guest="running",
        balloon=Balloon(1 << 30, 1 << 29, 1 << 29, True),
    )
    out = json.loads(json.dumps(result.to_json()))
    jsonschema.validate(out, schema("checkpoint"))
    assert out["classes"] == {"STORED": 10, "ZERO": 5}
    assert out["disks"] == [
        dict(name="vda", file="/vm/disk.img", frozen=True, overlay="/vm/disk.img.after-vm.qcow2", referenced_bytes=8192)
    ]


# --- errors -----------------------------------------------------------------------------------------
ERRORS = [
    # (arguments, exit code, rule of the error or None)
    (["inspect", "junk.lean"], 1, "LI-HDR-001"),
    (["restore", "junk.lean", "-o", "out.raw"], 1, "LI-HDR-001"),
    (["flatten", "junk.lean", "-o", "out.lean"], 1, "LI-HDR-001"),
    (["merge", "vm.lean", "-o", "out.lean"], 1, None),  # no parent to merge into
    (["convert", "junk.lean", "-o", "out.lean"], 1, None),  # not a save
    (["restore", "vm.lean", "-o", "vm.lean", "-f"], 2, None),  # an input is never an output
    (["validate", "missing.lean"], 2, None),
    (["checkpoint", "--qmp", "missing.sock", "-o", "out.lean"], 1, None),
]


@pytest.mark.parametrize("args,code,rule", ERRORS, ids=[" ".join(a[:2]) for a, _, _ in ERRORS])
def test_errors_are_json_with_the_text_mode_s_exit_code(sample, args, code, rule):
    (sample / "junk.lean").write_bytes(b"not an image at all")
    text = invoke(sample, *args)
    assert text.exit_code == code and not text.stdout.strip(), text.output
    result = invoke(sample, *args, "--json")
    assert result.exit_code == code
    error = checked("error", result.stdout)["error"]
    assert error["exit_code"] == code and error["rule"] == rule and error["message"]
    assert error["kind"] == ("usage" if code == 2 else "invalid")
    if rule:
        assert error["offset"] == 0 and error["structure"] == "header.magic"


# --- quiet, verbose, summaries ----------------------------------------------------------------------
def test_quiet_leaves_nothing_but_errors(sample, tmp_path):
    for where in (["-q", "flatten"], ["flatten", "-q"], ["flatten", "--quiet"]):
        result = invoke(sample, *where, "vm-2.lean", "-o", tmp_path / "q.lean", "-f")
        assert result.exit_code == 0 and result.output == "", (where, result.output)
    loud = invoke(sample, "flatten", "vm-2.lean", "-o", tmp_path / "q.lean", "-f")
    assert loud.stdout.startswith(f"{tmp_path / 'q.lean'}: written, 15.") and loud.stdout.count("\n") == 1


def test_verbose_says_what_it_does_on_stderr(sample, tmp_path):
    result = invoke(sample, "-v", "restore", "vm.lean", "-o", tmp_path / "m.raw", "--disk", "vda=disk.img")
    assert result.exit_code == 0
    assert result.stderr.startswith("leanimg: restoring 112.6 MiB of vm.lean (1 link(s)) as raw")
    assert result.stdout.startswith(f"{tmp_path / 'm.raw'}: restored 112.6 MiB of guest memory as raw")


def test_every_writing_command_ends_with_one_summary_line(sample, tmp_path):
    runs = {
        "convert": ["convert", "vm.save", "-o", tmp_path / "a.lean"],
        "restore": ["restore", "vm.lean", "-o", tmp_path / "a.raw", "--disk", "vda=disk.img"],
        "flatten": ["flatten", "vm-2.lean", "-o", tmp_path / "b.lean"],
        "merge": ["merge", "vm-2.lean", "-o", tmp_path / "c.lean"],
    }
    for command, args in runs.items():
        result = invoke(sample, *args)
        lines = result.stdout.splitlines()
        assert result.exit_code == 0 and len(lines) == 1 and lines[0].startswith(str(args[3]) + ": "), (
            command,
            result.output,
        )


def _on_a_terminal(folder, *args) -> tuple[subprocess.CompletedProcess, str]:
    """The command run with standard error on a pseudo-terminal: the process and what that terminal got."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [*command_line(), *map(str, args)], cwd=folder, stdout=subprocess.PIPE, stderr=slave, timeout=600
        )
    finally:
        os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal has no writer left
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    return proc, seen.decode(errors="replace")


@pytest.mark.parametrize(
    "command,args",
    [
        ("validate", ["vm.lean", "--disk", "vda=disk.img"]),
        ("flatten", ["vm-2.lean", "-o", "{tmp}/f.lean"]),
        ("merge", ["vm-2.lean", "-o", "{tmp}/m.lean"]),
        ("restore", ["vm.lean", "-o", "{tmp}/m.raw", "--disk", "vda=disk.img"]),
    ],
)
def test_progress_is_drawn_on_a_terminal_only(sample, tmp_path, command, args):
    args = [a.format(tmp=tmp_path) for a in args]
    proc, terminal = _on_a_terminal(sample, command, *args, "-f" if command != "validate" else "-v")
    assert proc.returncode == 0 and f"{command}  [" in terminal and "100%" in terminal, terminal[-500:]
    quiet, terminal = _on_a_terminal(sample, command, *args, "-q", *(["-f"] if command != "validate" else []))
    assert quiet.returncode == 0 and "[" not in terminal and quiet.stdout == b"", terminal[-500:]
    piped = subprocess.run(
        [*command_line(), command, *args, *(["-f"] if command != "validate" else [])], cwd=sample, capture_output=True
    )
    assert piped.returncode == 0 and b"[#" not in piped.stderr and b"%" not in piped.stderr


def test_inspect_and_validate_of_an_object_say_what_was_fetched(sample, s3store, monkeypatch):
    """s3:// images: the bytes fetched and the requests, per object, in the schema's shape."""
    from leanimg import s3

    for name, value in s3store.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(s3, "_client", None)
    monkeypatch.setattr(s3, "FETCHED", {})  # what this process read before: not ours
    client = s3store.client()
    for name in ("vm.lean", "vm-2.lean"):
        client.upload_file(str(sample / name), s3store.bucket, f"json/{name}")
    size = (sample / "vm-2.lean").stat().st_size
    out = checked("inspect", ok(sample, "inspect", s3store.url("json/vm-2.lean"), "--json").stdout)
    fetched = {f["location"]: f for f in out["fetched"]}
    assert set(fetched) == {s3store.url("json/vm.lean"), s3store.url("json/vm-2.lean")}
    child = fetched[s3store.url("json/vm-2.lean")]
    assert child["object_bytes"] == size and 0 < child["fetched_bytes"] <= size and child["requests"] >= 1
    monkeypatch.setattr(s3, "_BLOCKS", s3._Blocks())  # cold, as a new process is
    report = checked("validate", ok(sample, "validate", s3store.url("json/vm.lean"), "--json", code=4).stdout)
    (whole,) = report["fetched"]
    assert whole["fetched_bytes"] == whole["object_bytes"] == (sample / "vm.lean").stat().st_size


def test_uploads_lists_and_aborts(s3store, tmp_path, monkeypatch):
    from leanimg import s3

    for name, value in s3store.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(s3, "_client", None)
    client = s3store.client()
    started = client.create_multipart_upload(Bucket=s3store.bucket, Key="uploads-json/left.lean")
    listed = checked("uploads", ok(tmp_path, "uploads", s3store.url("uploads-json/"), "--json").stdout)
    assert [(u["location"], u["upload_id"]) for u in listed["uploads"]] == [
        (s3store.url("uploads-json/left.lean"), started["UploadId"])
    ] and listed["aborted"] is False
    aborted = checked("uploads", ok(tmp_path, "uploads", s3store.url("uploads-json/"), "--abort", "--json").stdout)
    assert aborted["aborted"] is True and len(aborted["uploads"]) == 1
    assert s3store.uploads("uploads-json/") == []
