"""Shared test configuration: hypothesis profiles, markers, shared fixtures."""

import os
import shutil

import pytest

from helpers import register_hypothesis_profiles

register_hypothesis_profiles()
os.environ.setdefault("LEANIMG_KSC_DIR", os.path.expanduser("~/.cache/leanimg/ksc"))


@pytest.fixture
def copy(chain, tmp_path):
    """A fresh copy of the module's ``chain`` ((paths, final memory)) to spoil: (paths, final memory)."""
    paths, memory = chain
    copies = []
    for path in paths:
        target = tmp_path / path.name
        target.write_bytes(path.read_bytes())
        copies.append(target)
    return copies, memory


@pytest.fixture
def small_batches(monkeypatch):
    """A chain walk's batches all of CHECK_BATCH links, the later ones too (CHECK_BATCH_LATER
    is larger), so that a test chain of 2 * CHECK_BATCH + 20 links makes three batches
    (test_chain_open.test_batches_grow_within_their_bytes checks the sizes as set)."""
    from leanimg import parents

    monkeypatch.setattr(parents, "CHECK_BATCH_LATER", parents.CHECK_BATCH)


@pytest.fixture
def fast_paths_alone(monkeypatch):
    """For a test that counts which path opened or read a link: the fast paths alone, also
    under LEANIMG_CROSS_CHECK=1 (which opens and reads each link a second time to compare)."""
    from leanimg import reader, tables_batch
    from leanimg.chain import deltas

    for module in (reader, tables_batch, deltas):
        monkeypatch.setattr(module, "CROSS_CHECK", False)


@pytest.fixture(scope="session")
def s3store(tmp_path_factory):
    """A real S3-compatible store (SeaweedFS on loopback, tests/s3store.py) for the session."""
    from s3store import SeaweedFS, require_weed

    require_weed()
    store = SeaweedFS.start(tmp_path_factory.mktemp("seaweedfs"))
    yield store
    store.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Marks a module in which a test failed (its setup included): ``module_dirs`` keeps it."""
    outcome = yield
    if outcome.get_result().failed:
        item.module.__leanimg_failed__ = True


@pytest.fixture(scope="module")
def module_dirs(request, tmp_path_factory):
    """``mktemp(name)`` for a module's shared fixtures (booted guests' saves, memory dumps,
    disks): the directories are removed when the module ends with no failure, not at the end
    of the session, so a full run holds one module's hundreds of MB to GB at a time (it peaked
    at 28 GB otherwise). A failed module keeps them, as tmp_path_retention_policy does."""
    made = []

    def mktemp(name: str):
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if not getattr(request.module, "__leanimg_failed__", False):
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
