"""Never lose an operator's data: a tier directory is tiering's only if it was empty when first
used or carries tiering's marker; nothing tiering does (wipe, replay --fresh, a layout change,
make clean) deletes a file it did not create; a layout mismatch is refused by default, reported
beforehand by config check and doctor, and inspect never writes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiering import cli
from tiering.backends.file import FileBackend
from tiering.backends.lmdb import LMDBBackend
from tiering.backends.ownership import (
    MARKER_NAME,
    ForeignDirectoryError,
    TierDirectoryError,
    UntrustedEntryError,
)
from tiering.config import build_manager, build_pool, check_tier_directories, load_config
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]

CONFIG = """\
version: 1
model:
  shape: {shape}
primary:
  capacity: 64KiB
secondary_tiers:
  - name: nvme
    type: file
    path: ./tiers/nvme
    capacity: 1MiB
{nvme_extra}  - name: db
    type: lmdb
    path: ./tiers/db
    capacity: 1MiB
    sync: false
{db_extra}"""


def write_config(
    tmp_path: Path, shape: str = "tiny", nvme_extra: str = "", db_extra: str = ""
) -> Path:
    path = tmp_path / "tiering.yaml"
    path.write_text(CONFIG.format(shape=shape, nvme_extra=nvme_extra, db_extra=db_extra))
    return path


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def populate(config_path: Path, n: int) -> None:
    """Store n blocks through a manager (write-through reaches both tiers)."""
    config = load_config(config_path)
    pool = build_pool(config)
    manager = build_manager(config, pool=pool)
    try:
        manager.wait_ready()
        for i in range(n):
            out = manager.prepare_store([key(i)])
            assert out is not None
            pool.rows_view()[int(out.store_spec.block_ids[0])].fill_(i + 1)
            manager.complete_store([key(i)])
            manager.wait_idle()
    finally:
        manager.shutdown()
        pool.close()


def tree_state(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# -- ownership ---------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("backend_class", [FileBackend, LMDBBackend], ids=["file", "lmdb"])
async def test_a_directory_with_someone_elses_files_is_refused(
    tmp_path: Path, backend_class: type[FileBackend] | type[LMDBBackend]
) -> None:
    directory = tmp_path / "photos"
    directory.mkdir()
    (directory / "holiday.jpg").write_bytes(b"precious")
    before = tree_state(tmp_path)
    backend = backend_class(
        path=directory, capacity_bytes=1 << 20, block_bytes=4096, fingerprint=bytes(16)
    )
    with pytest.raises(ForeignDirectoryError) as caught:
        await backend.open()
    assert f"refusing the {'file' if backend_class is FileBackend else 'LMDB'} backend's " in (
        str(caught.value)
    )
    assert f"{str(directory)!r}: it is not empty ('holiday.jpg')" in str(caught.value)
    assert tree_state(tmp_path) == before  # nothing created, nothing changed


@pytest.mark.asyncio
@pytest.mark.parametrize("backend_class", [FileBackend, LMDBBackend], ids=["file", "lmdb"])
async def test_an_empty_directory_is_claimed_with_a_marker(
    tmp_path: Path, backend_class: type[FileBackend] | type[LMDBBackend]
) -> None:
    directory = tmp_path / "tier"
    directory.mkdir()
    backend = backend_class(
        path=directory, capacity_bytes=1 << 20, block_bytes=4096, fingerprint=bytes(16)
    )
    async with backend:
        pass
    marker = json.loads((directory / MARKER_NAME).read_text())
    assert marker["backend"] == backend_class.name and marker["block_bytes"] == 4096
    # The other backend does not take it over.
    other_class = LMDBBackend if backend_class is FileBackend else FileBackend
    other = other_class(
        path=directory, capacity_bytes=1 << 20, block_bytes=4096, fingerprint=bytes(16)
    )
    with pytest.raises(TierDirectoryError, match=f"holds a tier of the {backend_class.name!r}"):
        await other.open()


def test_a_tier_directory_from_before_markers_is_adopted(tmp_path: Path) -> None:
    """A directory an earlier tiering wrote (its own files, no marker) is still tiering's."""
    config_path = write_config(tmp_path)
    populate(config_path, 2)
    for name in ("nvme", "db"):
        (tmp_path / "tiers" / name / MARKER_NAME).unlink()
    config = load_config(config_path)
    assert check_tier_directories(config) == []
    populate(config_path, 3)  # opens fine, and keeps what was stored
    for name in ("nvme", "db"):
        assert (tmp_path / "tiers" / name / MARKER_NAME).exists()


def test_build_manager_refuses_a_foreign_directory_before_creating_anything(
    tmp_path: Path,
) -> None:
    config_path = write_config(tmp_path)
    (tmp_path / "tiers" / "db").mkdir(parents=True)
    (tmp_path / "tiers" / "db" / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\] \('db'\): refusing .*data\.csv"):
        build_manager(load_config(config_path))
    assert sorted(os.listdir(tmp_path / "tiers")) == ["db"]  # nvme was not created either


# -- nothing deletes what tiering did not create ------------------------------------------------


def test_wipe_deletes_only_tierings_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    populate(config_path, 2)
    (tmp_path / "tiers" / "nvme" / "notes.txt").write_text("mine")
    status, out, err = run(["wipe", "--config", str(config_path)], capsys)
    assert status == 0, err
    assert "kept (not tiering's): notes.txt" in out
    # The directory keeps the operator's file, and stays tiering's (its marker), empty of data.
    assert sorted(os.listdir(tmp_path / "tiers" / "nvme")) == ["notes.txt", MARKER_NAME]
    assert not (tmp_path / "tiers" / "db").exists()  # only tiering's files: removed entirely
    assert (tmp_path / "tiers" / "nvme" / "notes.txt").read_text() == "mine"


def test_wipe_refuses_a_directory_that_is_not_tierings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    (tmp_path / "tiers" / "nvme").mkdir(parents=True)
    (tmp_path / "tiers" / "nvme" / "slots.bin").write_text("not tiering's, despite its name")
    status, _out, err = run(["wipe", "--config", str(config_path)], capsys)
    assert status == 2
    assert "refusing the tier directory" in err and "slots.bin" in err
    assert (tmp_path / "tiers" / "nvme" / "slots.bin").exists()


def link_state(root: Path) -> dict[str, str | bytes]:
    """Every entry under root with what it is: symlinks by their target (never followed)."""
    return {
        str(p.relative_to(root)): (
            f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
        )
        for p in sorted(root.rglob("*"))
    }


PLANTED: list[tuple[type[FileBackend] | type[LMDBBackend], str, str]] = [
    (FileBackend, "slots.bin", "symlink"),
    (FileBackend, "manifest.json", "symlink"),
    (FileBackend, "manifest.json.0123.tmp", "symlink"),  # named like a stale temp file
    (FileBackend, MARKER_NAME, "symlink"),
    (FileBackend, "slots.bin", "directory"),
    (LMDBBackend, "data.mdb", "symlink"),
    (LMDBBackend, "lock.mdb", "symlink"),
    (LMDBBackend, "data.mdb.damaged", "symlink"),
    (LMDBBackend, "data.mdb", "directory"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("backend_class", "name", "kind"),
    PLANTED,
    ids=[f"{cls.name}-{name}-{kind}" for cls, name, kind in PLANTED],
)
async def test_an_entry_named_like_tierings_that_is_not_a_regular_file_is_refused_untouched(
    tmp_path: Path, backend_class: type[FileBackend] | type[LMDBBackend], name: str, kind: str
) -> None:
    """A symlink or directory where tiering keeps a file was not made by tiering: the tier is
    refused naming it; the entry, its target and every other file stay as they were."""
    directory = tmp_path / "tier"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")

    def new_backend() -> FileBackend | LMDBBackend:
        return backend_class(
            path=directory, capacity_bytes=1 << 20, block_bytes=4096, fingerprint=bytes(16)
        )

    async with new_backend():
        pass  # the directory is tiering's (marked); then an entry is planted in it
    planted = directory / name
    if planted.exists():
        planted.rename(tmp_path / "moved-away")
    if kind == "symlink":
        planted.symlink_to(victim)
    else:
        planted.mkdir()
        (planted / "inside.txt").write_text("also precious")
    before = link_state(tmp_path)
    with pytest.raises(UntrustedEntryError) as caught:
        await new_backend().open()
    assert caught.value.entries == (name,)
    kind_shown = "a symlink" if kind == "symlink" else "a directory"
    assert f"{str(directory)!r}: {name!r} ({kind_shown}) is named like tiering's own file" in (
        str(caught.value)
    )
    assert "changed nothing. Move it out of the directory" in str(caught.value)
    assert link_state(tmp_path) == before
    # Once the operator moves it away, the tier opens.
    planted.rename(tmp_path / "planted-moved")
    async with new_backend():
        pass
    assert victim.read_text() == "precious"


def test_wipe_refuses_a_planted_symlink_and_removes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    populate(config_path, 2)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "tiers" / "db" / "lock.mdb").unlink()
    (tmp_path / "tiers" / "db" / "lock.mdb").symlink_to(victim)
    before = link_state(tmp_path / "tiers")
    status, _out, err = run(["wipe", "--config", str(config_path)], capsys)
    assert status == 2
    assert "'lock.mdb' (a symlink) is named like tiering's own file" in err
    assert link_state(tmp_path / "tiers") == before
    assert victim.read_text() == "precious"


@pytest.mark.slow
def test_replay_fresh_keeps_a_file_the_operator_put_in_a_tier(tmp_path: Path) -> None:
    config_path = write_config(tmp_path)
    populate(config_path, 2)
    precious = tmp_path / "tiers" / "nvme" / "keep-me.txt"
    precious.write_text("an operator's file")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiering.cli",
            "replay",
            "--config",
            str(config_path),
            "--fresh",
            "--trace",
            "chat",
            "--scale",
            "tiny",
            "--max-requests",
            "3",
            "--engine-blocks",
            "256",
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert precious.read_text() == "an operator's file"
    assert "kept keep-me.txt" in result.stderr


def test_make_clean_wipes_the_demo_tiers_and_keeps_other_files(tmp_path: Path) -> None:
    """``make clean`` runs ``tiering wipe`` on the demo config (here: a copy of the Makefile
    with a small demo config), then removes the folder if it is left empty."""
    shutil.copy(REPO_ROOT / "Makefile", tmp_path / "Makefile")
    examples = tmp_path / "examples"
    examples.mkdir()
    demo = write_config(examples)
    demo.write_text(demo.read_text().replace("./tiers/", "./demo-data/"))
    populate(demo, 2)
    assert sorted(os.listdir(examples / "demo-data")) == ["db", "nvme"]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    tiering = venv / "bin" / "tiering"
    tiering.write_text(f'#!/bin/sh\nexec {sys.executable} -m tiering.cli "$@"\n')
    tiering.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    args = ["make", "-s", "clean", f"VENV={venv}", "DEMO_CONFIG=examples/tiering.yaml"]
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (examples / "demo-data").exists()
    assert not venv.exists()
    # An operator's file in a demo tier survives it (and so does its folder).
    populate(demo, 1)
    (examples / "demo-data" / "db" / "mine.txt").write_text("mine")
    venv.mkdir()
    (venv / "bin").mkdir()
    tiering.write_text(f'#!/bin/sh\nexec {sys.executable} -m tiering.cli "$@"\n')
    tiering.chmod(0o755)
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.listdir(examples / "demo-data") == ["db"]
    assert sorted(os.listdir(examples / "demo-data" / "db")) == ["mine.txt", MARKER_NAME]


# -- layout mismatches ---------------------------------------------------------------------------


def test_a_model_change_is_refused_naming_both_layouts(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, shape="tiny")
    populate(config_path, 3)
    before = tree_state(tmp_path / "tiers")
    changed = write_config(tmp_path, shape="tiny-hybrid")
    with pytest.raises(ConfigError) as caught:
        build_manager(load_config(changed))
    message = str(caught.value)
    for index, name in ((0, "nvme"), (1, "db")):
        assert f"secondary_tiers[{index}] ({name!r})" in message
    assert "on disk: model tiny, " in message and "configured: model tiny-hybrid, " in message
    assert "differs in: " in message and "model 'tiny' on disk, 'tiny-hybrid' configured" in (
        message
    )
    assert "on_layout_mismatch: set_aside" in message and "on_layout_mismatch: wipe" in message
    assert tree_state(tmp_path / "tiers") == before  # nothing emptied, nothing written


def test_config_check_and_doctor_report_a_mismatch_beforehand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    populate(write_config(tmp_path, shape="tiny"), 2)
    before = tree_state(tmp_path / "tiers")
    changed = write_config(tmp_path, shape="tiny-hybrid")
    status, out, err = run(["config", "check", str(changed)], capsys)
    assert status == 2
    assert out.splitlines()[0] == f"{changed}: 2 error(s), on stderr"
    assert err.count("error: ") == 2 and "holds blocks written for another layout" in err
    status, out, _err = run(["doctor", "--config", str(changed)], capsys)
    assert status == 1
    lines = {line.split()[1:4][1]: line for line in out.splitlines() if " directory " in line}
    assert lines["nvme"].startswith("FAIL") and lines["db"].startswith("FAIL")
    assert "model 'tiny' on disk, 'tiny-hybrid' configured" in lines["nvme"]
    assert tree_state(tmp_path / "tiers") == before


def test_json_reports_of_config_check_and_doctor_carry_the_directory_findings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    populate(write_config(tmp_path, shape="tiny"), 2)
    (tmp_path / "tiers" / "foreign").mkdir()
    (tmp_path / "tiers" / "foreign" / "holiday.jpg").write_bytes(b"precious")
    before = tree_state(tmp_path / "tiers")
    changed = write_config(tmp_path, shape="tiny-hybrid").read_text()
    changed = changed.replace("./tiers/db", "./tiers/foreign")  # someone else's directory
    config = tmp_path / "tiering.yaml"
    config.write_text(changed)
    for argv, exit_code in ((["config", "check", "--json", str(config)], 2),
                            (["doctor", "--json", "--config", str(config)], 1)):  # fmt: skip
        status, out, _err = run(argv, capsys)
        assert status == exit_code
        document = json.loads(out)
        assert document["exit_code"] == exit_code
        directory = {c["tier"]: c for c in document["checks"] if c["name"].endswith("directory")}
        assert set(directory) == {"nvme", "db"}
        assert directory["nvme"]["name"] == "tier nvme directory"
        assert directory["nvme"]["status"] == "FAIL"
        assert "model 'tiny' on disk, 'tiny-hybrid' configured" in directory["nvme"]["message"]
        assert directory["db"]["status"] == "FAIL"
        assert "holiday.jpg" in directory["db"]["message"]
        assert document["counts"]["FAIL"] == sum(c["status"] == "FAIL" for c in document["checks"])
    assert tree_state(tmp_path / "tiers") == before


def test_set_aside_and_wipe_are_chosen_in_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    populate(write_config(tmp_path, shape="tiny"), 2)
    (tmp_path / "tiers" / "db" / "notes.txt").write_text("mine")
    changed = write_config(
        tmp_path,
        shape="tiny-hybrid",
        nvme_extra="    on_layout_mismatch: set_aside\n",
        db_extra="    on_layout_mismatch: wipe\n",
    )
    status, _out, err = run(["config", "check", str(changed)], capsys)
    assert status == 0
    assert "on_layout_mismatch: set_aside: its files will be moved" in err
    assert "on_layout_mismatch: wipe: tiering's files there will be deleted" in err
    populate(changed, 1)
    (aside,) = [p for p in (tmp_path / "tiers").iterdir() if p.name.startswith("nvme.mismatch-")]
    assert json.loads((aside / MARKER_NAME).read_text())["layout"]["model"] == "tiny"
    marker = json.loads((tmp_path / "tiers" / "db" / MARKER_NAME).read_text())
    assert marker["layout"]["model"] == "tiny-hybrid"
    assert (tmp_path / "tiers" / "db" / "notes.txt").read_text() == "mine"


def test_inspect_never_writes_and_reports_a_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    populate(write_config(tmp_path, shape="tiny"), 3)
    before = tree_state(tmp_path / "tiers")
    changed = write_config(tmp_path, shape="tiny-hybrid")
    status, out, err = run(["inspect", "--config", str(changed), "--json"], capsys)
    assert status == 1, err
    report = json.loads(out)
    for tier in report["tiers"]:
        # Verified against the layout on disk: nothing corrupt, nothing emptied.
        assert (tier["blocks"], tier["verified"], tier["corrupt"]) == (3, 3, 0), tier
        assert "model 'tiny' on disk, 'tiny-hybrid' configured" in tier["layout_mismatch"]
        assert tier["healthy"] is False
    assert tree_state(tmp_path / "tiers") == before


def test_inspect_of_a_foreign_directory_reports_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    (tmp_path / "tiers" / "nvme").mkdir(parents=True)
    (tmp_path / "tiers" / "nvme" / "thesis.tex").write_text("\\documentclass")
    before = tree_state(tmp_path)
    status, out, _err = run(["inspect", "--config", str(config_path)], capsys)
    assert status == 1
    assert "not readable: refusing the file backend's directory" in out
    assert tree_state(tmp_path) == before


def test_a_running_engines_tier_is_reported_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    populate(config_path, 1)
    config = load_config(config_path)

    async def hold() -> FileBackend:
        backend = FileBackend(
            path=tmp_path / "tiers" / "nvme",
            capacity_bytes=1 << 20,
            block_bytes=config.block_bytes(),
            fingerprint=config.fingerprint(),
        )
        await backend.open()
        return backend

    loop = asyncio.new_event_loop()
    held = loop.run_until_complete(hold())
    try:
        status, out, _err = run(["inspect", "--config", str(config_path), "--tier", "nvme"], capsys)
        assert status == 1 and "is in use" in out
    finally:
        loop.run_until_complete(held.close())
        loop.close()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _err = run(["--version"], capsys)
    assert status == 0 and out.startswith("tiering ") and out.strip() != "tiering"
