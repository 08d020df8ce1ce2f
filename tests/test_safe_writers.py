"""Every writer goes through the atomic path, and every output folder is held by whoever writes it.

* The view pages (``HeadViews.save``, ``ShiftView.save``): a missing folder, a read-only file system, a full
  disk (a real tmpfs where one can be mounted, an injected ``ENOSPC`` otherwise) or a folder in the file's place
  end in a named :class:`FileWriteError`, and nothing is left behind.
* On a read-only file system the atomic writer's clean-up does not replace the error it cleans up after.
* The comparison's folder names for labels stay inside ``models/`` and are unique.
* ``run_study`` and ``Study.save`` called from Python refuse a folder whose lock another (real) process holds.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from filesystems import tmpfs
from synthetic import SyntheticAdapter
from test_heads import built_heads

from equivariance_probe import EquivarianceProbe
from equivariance_probe.display.shift import ShiftView
from equivariance_probe.display.views import HeadViews
from equivariance_probe.errors import CheckpointError, FileWriteError
from equivariance_probe.records.fileformat import write_text_atomically
from equivariance_probe.runs.compare import model_folders
from equivariance_probe.runs.study import Study, run_study

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX flock and tmpfs")


def _head_views():
    pattern = np.tril(np.ones((6, 6)))
    return HeadViews(tokens=list("abcdef"), heads=[(0, 0)], pattern=(pattern / pattern.sum(1, keepdims=True))[None],
                     sliding_windows=[None])


def _shift_view():
    return ShiftView(tokens=list("abcd"), head=(0, 1), offsets=(0, 9), conditional=np.zeros((2, 4, 4)),
                     centred=np.zeros((2, 4, 4)), entries=np.tril(np.ones((4, 4))))


VIEWS = pytest.mark.parametrize("build", [_head_views, _shift_view], ids=["head views", "shift view"])


@pytest.fixture
def full_disk(tmp_path):
    """64 KiB: far less than a view page (the CircuitsVis bundle alone is over 1 MB)."""
    yield from tmpfs(tmp_path / "disk", "size=64k")


@pytest.fixture
def read_only(tmp_path):
    """A read-only file system (a root user writes through any folder's permission bits, not through this)."""
    yield from tmpfs(tmp_path / "ro", "ro,size=64k")


@VIEWS
def test_a_view_page_into_a_missing_folder_or_onto_a_folder_is_a_named_error(build, tmp_path):
    view = build()
    with pytest.raises(FileWriteError, match="does not exist; create it first"):
        view.save(tmp_path / "missing" / "view.html")
    (tmp_path / "view.html").mkdir()
    with pytest.raises(FileWriteError, match="it is a folder"):
        view.save(tmp_path / "view.html")
    assert view.save(tmp_path / "ok.html").read_text().startswith("<!DOCTYPE html>")


@VIEWS
def test_a_view_page_on_a_full_disk_is_a_named_error_and_leaves_nothing(build, full_disk):
    with pytest.raises(FileWriteError, match="no space left on the device.*the file needs") as caught:
        build().save(full_disk / "view.html")
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert list(full_disk.iterdir()) == []  # no partial .html, no .tmp


@VIEWS
def test_a_view_page_on_an_injected_full_disk_leaves_nothing(build, tmp_path, monkeypatch):
    def fsync(descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(FileWriteError, match="no space left on the device"):
        build().save(tmp_path / "view.html")
    assert list(tmp_path.iterdir()) == []


@VIEWS
def test_a_view_page_on_a_read_only_file_system_names_that_not_the_clean_up(build, read_only):
    with pytest.raises(FileWriteError, match="Read-only file system") as caught:
        build().save(read_only / "view.html")
    assert caught.value.__cause__.errno == errno.EROFS


def test_the_atomic_writer_s_clean_up_never_replaces_the_first_error(tmp_path, monkeypatch):
    # Injected where no file system can be mounted: the write fails, and so does removing what it never made.
    def refuse(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "write_bytes", refuse)
    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.raises(FileWriteError, match="Read-only file system") as caught:
        write_text_atomically(tmp_path / "page.html", "<p>x</p>")
    assert caught.value.__cause__.errno == errno.EROFS


# -- the comparison's folder names --------------------------------------------------------------------------------
def test_label_folders_stay_inside_models_and_are_unique(tmp_path):
    labels = ["..", ".", "org/model", "org_model", "ORG_MODEL", "", "/", "../../etc", ".hidden", "a b"]
    folders = model_folders(labels)
    assert list(folders) == labels
    assert len({name.lower() for name in folders.values()}) == len(labels)
    models = (tmp_path / "models").resolve()
    for name in folders.values():
        assert name not in (".", "..") and not name.startswith(".") and "/" not in name
        assert (models / name).resolve().parent == models
    assert folders["org/model"] == "org_model" and folders["org_model"] == "org_model-2"


# -- the lock belongs to the function that writes the folder --------------------------------------------------------
@pytest.fixture
def held_folder(tmp_path):
    """A folder whose lock a real, separate process holds until the test ends."""
    folder = tmp_path / "out"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from equivariance_probe.runs.checkpoint import lock_output_folder; "
                               "lock = lock_output_folder(sys.argv[1]); lock.__enter__(); print('held', flush=True); "
                               "time.sleep(600)", str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "held"
    yield folder, holder.pid
    holder.kill()
    holder.wait()


def test_run_study_from_python_refuses_a_checkpoint_folder_another_process_holds(held_folder):
    folder, pid = held_folder
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    with pytest.raises(CheckpointError, match=f"in use by another equivariance-probe run \\(process {pid} "):
        run_study("tiny", loaded=(adapter, None), corpus=["never read"], checkpoint_dir=folder, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == [".equivariance-probe.lock"]  # nothing written


def test_study_save_from_python_refuses_a_folder_another_process_holds_and_holds_its_own(held_folder, tmp_path):
    folder, pid = held_folder
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    result = EquivarianceProbe(adapter).run(torch.randint(0, 1000, (2, 16)), progress=False)
    study = Study({"trained": result}, {"model": "tiny"}, {})
    with pytest.raises(CheckpointError, match=f"process {pid} "):
        study.save(folder)
    assert not (folder / "results.safetensors").exists()
    saved = study.save(tmp_path / "free")  # a free folder: written, and its lock released afterwards
    assert saved["trained"].is_file() and not (tmp_path / "free" / ".equivariance-probe.lock").exists()


def tiny_comparison(labels):
    """A comparison of the same synthetic model under each of ``labels``, trained and one baseline, on the same
    windows (what ``compare_models`` builds, without loading a model)."""
    from equivariance_probe.runs.compare import Comparison, ModelCost
    from equivariance_probe.sources.resources import estimate_memory

    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    result = EquivarianceProbe(adapter).run(tokens, progress=False)
    estimate = estimate_memory(n_parameters=1000, n_heads=4, n_layers=2, hidden_size=32, intermediate_size=64,
                               attention_width=32, mask_kinds=1, context_length=16, batch_size=2, copies=2,
                               block_memory=2**20)
    studies = {label: Study({"trained": result, "random_init": result}, {"model": label}, {}) for label in labels}
    costs = {label: ModelCost({"trained": 1.0, "random_init": 1.0}, 1.0, None, "none", estimate) for label in labels}
    return Comparison(studies, costs, {"windows_description": labels[0]})


def test_a_saved_comparison_gives_each_label_its_own_folder_inside_models(tmp_path):
    from equivariance_probe.display.comparison import save_comparison

    labels = ["org/model", "org_model", "..", "."]
    paths = save_comparison(tiny_comparison(labels), tmp_path / "out")
    folders = model_folders(labels)
    models = (tmp_path / "out" / "models").resolve()
    assert sorted(p.name for p in models.iterdir()) == sorted(folders.values())  # four folders, none shared
    for label in labels:
        assert paths[f"report {label}"].resolve().parent.parent == models
        assert (models / folders[label] / "results.safetensors").is_file()
    import json

    assert json.loads((tmp_path / "out" / "comparison.json").read_text())["folders"] == folders
