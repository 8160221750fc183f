"""Incremental chains end to end (issue 6 §5): a real guest, checkpointed while it works.

One 128 MiB guest (tests/guest/chain_scenarios.py) runs ``words 24`` (a few 8-byte words
changed in many pages per round) and then ``pages 24`` (5 % of the pages rewritten whole
per round); three checkpoints are taken in each phase: ``stop``, migrate to a file,
``pmemsave`` ground truth, ``cont``.  Checkpoint 1 is converted plainly, checkpoint k with
``--parent`` checkpoint k-1's image, all images in one directory.  Through the CLI:

* every link: ``validate`` exit 0; ``restore --to raw`` equals that checkpoint's pmemsave
  in pc.ram (but the VGA window, where pmemsave reads the VGA device); ``restore --to
  qemu`` is that checkpoint's save byte for byte; ``validate --chain`` on the last link;
* the last link restored into a fresh QEMU through ``-incoming "exec:leanimg restore IMG
  --to qemu -o -"``: pmemsave equal, ``cont``, the heartbeat goes on;
* ``flatten`` of the last link: valid, no parent, restores byte-identically (alone in its
  directory); ``merge`` of the last link into its parent: valid, parent = grandparent,
  restores byte-identically;
* an image away from its ancestors fails clearly without ``--parent``, works with it;
* sizes per checkpoint — QEMU save, full lean image, PARENT-only incremental
  (``--no-delta``), PARENT+DELTA — printed as a table (``pytest -s``) next to FITDOC's
  52.88 % less than page-level incremental, with PARENT+DELTA <= PARENT-only <= full.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from guest.chain_scenarios import CHAIN_PHASES, VGA_WINDOW, Checkpoint, run_chain_scenario
from guest.scenarios import assert_resumes
from guest.qemus import qemu_params
from guest.vm import copy_disk
from helpers import first_difference
from leanimg.cli import command_line
from leanimg.fileutil import sha256_file

pytestmark = pytest.mark.qemu

CLI_TIMEOUT = 300
NUM_CHECKPOINTS = sum(p.saves for p in CHAIN_PHASES)
LINKS = list(range(1, NUM_CHECKPOINTS + 1))
FITDOC_REDUCTION = 52.88  # % less than page-level incremental, FITDOC (seed 003)


LEANIMG = command_line()


def cli(*args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=CLI_TIMEOUT)
    if check:
        assert proc.returncode == 0, (
            f"leanimg {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')}"
        )
    assert b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
    return proc


def inspect_json(image: Path, *extra) -> dict:
    return json.loads(cli("inspect", "--json", image, *extra).stdout)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", params=qemu_params())
def checkpoints(request, module_dirs) -> list[Checkpoint]:
    request.param.require()
    return run_chain_scenario(
        module_dirs(f"chain-{request.param.id}"),
        qemu=request.param,
        log=lambda msg: print(f"[chain guest] {msg}"),
    )


@pytest.fixture(scope="module")
def chain(checkpoints, module_dirs) -> list[Path]:
    """cp1 plain, cpk against cp(k-1): one directory, parents found beside each image."""
    out = module_dirs("chain")
    images: list[Path] = []
    for cp in checkpoints:
        img = out / f"{cp.name}.lean"
        cli("convert", cp.point.save, "-o", img, *(["--parent", images[-1]] if images else []))
        images.append(img)
    assert sorted(os.listdir(out)) == sorted(p.name for p in images), "no temp files left"
    return images


@pytest.fixture(scope="module")
def sizes(checkpoints, chain, module_dirs) -> list[dict]:
    """Per checkpoint: QEMU save, full lean image, PARENT-only and PARENT+DELTA bytes."""
    full_dir = module_dirs("chain-full")
    page_dir = module_dirs("chain-parent-only")
    rows = []
    for i, cp in enumerate(checkpoints):
        if i == 0:
            full = chain[0]  # checkpoint 1 is converted plainly anyway
        else:
            full = full_dir / f"{cp.name}.lean"
            cli("convert", cp.point.save, "-o", full)
        row = dict(
            checkpoint=cp.index,
            phase=cp.phase,
            save=cp.point.save.stat().st_size,
            full=full.stat().st_size,
            parent_only=None,
            parent_delta=None,
            classes=None,
        )
        if i:
            # same parent as the chain link: the PARENT pages are the same, only DELTA is off
            page_only = page_dir / f"{cp.name}.lean"
            cli("convert", cp.point.save, "-o", page_only, "--parent", chain[i - 1], "--no-delta")
            row["parent_only"] = page_only.stat().st_size
            row["parent_only_classes"] = inspect_json(page_only, "--parent", chain[i - 1])["chain"][0]["classes"]
            row["parent_delta"] = chain[i].stat().st_size
        row["classes"] = inspect_json(chain[i])["chain"][0]["classes"]
        rows.append(row)
    return rows


# ------------------------------------------------------------------ the scenario itself


def test_workloads_changed_memory_as_designed(checkpoints):
    """words checkpoints differ from their predecessor in a few words of many pages; pages
    checkpoints in whole pages (checked on the pmemsave ground truth, not on our images)."""
    prev = None
    for cp in checkpoints:
        mem = np.fromfile(cp.point.mem, np.uint64).reshape(-1, 512)
        if prev is not None and cp.index != CHAIN_PHASES[0].saves + 1:  # not the phase switch
            changed = mem != prev
            pages = changed.any(axis=1)
            words = np.median(changed.sum(axis=1)[pages])
            if cp.phase == "words":
                assert pages.sum() > 500 and words <= 4, (cp.name, pages.sum(), words)
            else:
                assert pages.sum() > 500 and words > 400, (cp.name, pages.sum(), words)
        prev = mem


# ------------------------------------------------------------------ every link


@pytest.mark.parametrize("link", LINKS)
def test_link_validates(link, chain):
    proc = cli("validate", chain[link - 1])
    assert b"valid" in proc.stdout and b"INVALID" not in proc.stdout, proc.stdout


def test_validate_chain_checks_every_link(chain):
    proc = cli("validate", "--chain", chain[-1])
    out = proc.stdout.decode()
    assert "INVALID" not in out, out
    for img in chain:
        assert img.name in out, f"validate --chain does not mention {img.name}:\n{out}"


@pytest.mark.parametrize("link", LINKS)
def test_link_restores_raw_like_pmemsave(link, checkpoints, chain, tmp_path):
    cp, img = checkpoints[link - 1], chain[link - 1]
    raw = tmp_path / "restored.raw"
    cli("restore", img, "--to", "raw", "-o", raw)
    regions = inspect_json(img)["regions"]
    assert regions[0]["name"] == "pc.ram", regions  # raw output: regions in file order
    ram = np.fromfile(raw, np.uint8, count=regions[0]["size_bytes"])
    mem = np.fromfile(cp.point.mem, np.uint8)
    assert len(ram) == len(mem) == cp.point.mem_mib << 20
    lo, hi = VGA_WINDOW
    for part in (slice(0, lo), slice(hi, len(mem))):
        diff = np.flatnonzero(ram[part] != mem[part])
        assert not len(diff), (
            f"{img.name}: {len(diff)} bytes of pc.ram differ from the pmemsave, first at {part.start + diff[0]:#x}"
        )
    assert raw.stat().st_size == sum(r["size_bytes"] for r in regions)


@pytest.mark.parametrize("link", LINKS)
def test_link_restores_qemu_byte_identical(link, checkpoints, chain, tmp_path):
    cp, img = checkpoints[link - 1], chain[link - 1]
    rebuilt = tmp_path / "rebuilt.save"
    cli("restore", img, "--to", "qemu", "-o", rebuilt)
    assert sha256_file(rebuilt) == sha256_file(cp.point.save), first_difference(rebuilt, cp.point.save)


def test_last_link_resumes_from_leanimg_pipe(checkpoints, chain, tmp_path):
    """A fresh QEMU loads the last link (its parents found beside it) via -incoming exec:."""
    cp = checkpoints[-1].point
    assert_resumes(
        cp,
        copy_disk(cp.disk, tmp_path / "disk.img"),
        tmp_path,
        [*LEANIMG, "restore", str(chain[-1]), "--to", "qemu", "-o", "-"],
    )


# ------------------------------------------------------------------ flatten, merge, --parent


def test_flatten_last_link(checkpoints, chain, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    flat = alone / "flat.lean"
    cli("flatten", chain[-1], "-o", flat)
    assert sorted(os.listdir(alone)) == ["flat.lean"]
    cli("validate", flat)
    info = inspect_json(flat)
    assert info["parent_uuid"] is None and len(info["chain"]) == 1
    assert not {"PARENT", "DELTA"} & set(info["chain"][0]["classes"]), info["chain"][0]["classes"]
    rebuilt = tmp_path / "rebuilt.save"
    cli("restore", flat, "--to", "qemu", "-o", rebuilt)
    save = checkpoints[-1].point.save
    assert sha256_file(rebuilt) == sha256_file(save), first_difference(rebuilt, save)


def _check_merged(merged: Path, grandparent: Path, save: Path, tmp_path: Path, *parent_args) -> None:
    cli("validate", merged, *parent_args)
    info = inspect_json(merged, *parent_args)
    assert info["parent_uuid"] == inspect_json(grandparent)["image_uuid"]
    assert len(info["chain"]) == NUM_CHECKPOINTS - 1
    rebuilt = tmp_path / "rebuilt.save"
    cli("restore", merged, "--to", "qemu", "-o", rebuilt, *parent_args)
    assert sha256_file(rebuilt) == sha256_file(save), first_difference(rebuilt, save)
    rebuilt.unlink()


def test_merge_last_link_into_its_parent(checkpoints, chain, tmp_path):
    """Merged beside the chain (a copy of it): the grandparent is found by the directory."""
    here = tmp_path / "chain"
    here.mkdir()
    for img in chain:
        shutil.copyfile(img, here / img.name)
    merged = here / "merged.lean"
    cli("merge", here / chain[-1].name, "-o", merged)
    _check_merged(merged, here / chain[-3].name, checkpoints[-1].point.save, tmp_path)


def test_merge_to_another_directory(checkpoints, chain, tmp_path):
    """OUTPUT away from the chain: merge finds IMAGE's ancestors beside IMAGE; later
    commands are told where the grandparent is."""
    merged = tmp_path / "merged.lean"
    cli("merge", chain[-1], "-o", merged)
    _check_merged(merged, chain[-3], checkpoints[-1].point.save, tmp_path, "--parent", chain[-3])


def test_image_away_from_its_ancestors_needs_parent(checkpoints, chain, tmp_path):
    lonely = tmp_path / chain[2].name
    shutil.copyfile(chain[2], lonely)
    out = tmp_path / "out.raw"
    proc = cli("restore", lonely, "--to", "raw", "-o", out, check=False)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1 and "parent" in err.lower(), (proc.returncode, err)
    assert not out.exists() and sorted(os.listdir(tmp_path)) == [lonely.name]
    # cp2 named explicitly, cp1 found beside it
    cli("restore", lonely, "--to", "qemu", "-o", out, "--parent", chain[1])
    save = checkpoints[2].point.save
    assert sha256_file(out) == sha256_file(save), first_difference(out, save)


# ------------------------------------------------------------------ sizes


def _mib(n):
    return "-" if n is None else f"{n / 2**20:9.2f}"


def render_sizes(rows: list[dict]) -> str:
    lines = [
        "",
        "per checkpoint sizes (MiB); reduction = PARENT+DELTA vs PARENT-only "
        f"(FITDOC: {FITDOC_REDUCTION:.2f}% less than page-level incremental)",
        f"{'cp':>3} {'phase':<6} {'QEMU save':>10} {'full lean':>10} {'PARENT-only':>12} "
        f"{'PARENT+DELTA':>13} {'reduction':>10}  classes of the PARENT+DELTA link",
    ]
    for r in rows:
        red = "-" if r["parent_only"] is None else f"{100 * (1 - r['parent_delta'] / r['parent_only']):9.2f}%"
        classes = " ".join(f"{k}={v}" for k, v in r["classes"].items())
        lines.append(
            f"{r['checkpoint']:>3} {r['phase']:<6} {_mib(r['save']):>10} {_mib(r['full']):>10} "
            f"{_mib(r['parent_only']):>12} {_mib(r['parent_delta']):>13} {red:>10}  {classes}"
        )
    for phase in ("words", "pages", None):
        sel = [r for r in rows if r["parent_only"] is not None and phase in (None, r["phase"])]
        if sel:
            po = sum(r["parent_only"] for r in sel)
            pd = sum(r["parent_delta"] for r in sel)
            lines.append(
                f"    {phase or 'all'} (checkpoints {', '.join(str(r['checkpoint']) for r in sel)}): "
                f"PARENT-only {_mib(po).strip()} MiB, PARENT+DELTA {_mib(pd).strip()} MiB, "
                f"{100 * (1 - pd / po):.2f}% less (FITDOC {FITDOC_REDUCTION:.2f}%)"
            )
    return "\n".join(lines)


def test_sizes_per_checkpoint(sizes, tmp_path_factory):
    text = render_sizes(sizes)
    print(text)
    report = tmp_path_factory.getbasetemp() / "chain-sizes.json"
    report.write_text(json.dumps(sizes, indent=2))
    print(f"(JSON: {report})")
    for r in sizes[1:]:
        assert r["parent_delta"] <= r["parent_only"] <= r["full"], r
        assert r["classes"].get("PARENT", 0) > 0 and "DELTA" not in r["parent_only_classes"], r
        # PARENT-only and PARENT+DELTA agree on which pages are unchanged
        assert r["parent_only_classes"].get("PARENT") == r["classes"].get("PARENT"), r
    words = [r for r in sizes[1:] if r["phase"] == "words"]
    assert words, "no words-phase link after the first"
    for r in words:
        # a few words in ~1000 pages: DELTA entries of tens of bytes instead of pages
        assert r["classes"].get("DELTA", 0) >= 500, r
        assert r["parent_delta"] * 2 <= r["parent_only"], r
    pages = [r for r in sizes[1:] if r["phase"] == "pages"]
    for r in pages:
        assert r["classes"].get("STORED", 0) > r["classes"].get("DELTA", 0), r
