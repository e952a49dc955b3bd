"""The pure parts of workspace files, in-process: path checks, names as listings show them,
an OSError's domain error, the mount caps' arithmetic and choices, an image's argv. No
bwrap, no mounts, no root."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from sandbox_runtime.errors import (
    FileAccessError,
    FileMissingError,
    InvalidRequestError,
    LimitExceededError,
    WorkspaceDamagedError,
    WorkspaceFullError,
)
from sandbox_runtime.workspaces.fserrors import domain_error
from sandbox_runtime.workspaces.images import MOUNT_OPTIONS, mkfs_argv, mount_argv
from sandbox_runtime.workspaces.mountcaps import (
    PRINCIPAL_CAP,
    REPLICA_CAP,
    by_kind,
    count_mounted,
    over_caps,
    pick_victim,
    refusal,
)
from sandbox_runtime.workspaces.paths import (
    MAX_NAME_BYTES,
    MAX_PATH_BYTES,
    Entry,
    as_text,
    clean_path,
    display,
    is_text,
    kind_of,
)
from sandbox_runtime.workspaces.store import WorkspaceStore

pytestmark = pytest.mark.unit


# -- paths -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "parts"),
    [
        ("", ()),
        (".", ()),
        ("/workspace", ()),
        ("/workspace/", ()),
        ("a", ("a",)),
        ("a/b/c.txt", ("a", "b", "c.txt")),
        ("/workspace/a//./b/", ("a", "b")),
        ("./a/./b", ("a", "b")),
        ("...", ("...",)),
        ("a..b", ("a..b",)),
        ("caf\u00e9", ("caf\u00e9",)),
    ],
)
def test_clean_path_gives_the_components_inside_the_workspace(
    given: str, parts: tuple[str, ...]
) -> None:
    assert clean_path(given) == parts


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ("/etc/passwd", "outside the workspace"),
        ("/workspacex/a", "outside the workspace"),
        ("/", "outside the workspace"),
        ("..", "'..'"),
        ("a/../b", "'..'"),
        ("/workspace/../etc", "'..'"),
        ("a\x00b", "NUL"),
        ("a/\ud800", "valid Unicode"),
        ("a" * (MAX_PATH_BYTES + 1), "longer than 4096 bytes"),
        ("d/" + "n" * (MAX_NAME_BYTES + 1), "longer than 255 bytes"),
    ],
)
def test_clean_path_refuses_what_could_leave_or_cannot_be_a_name(given: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words.replace(".", r"\.").replace("(", r"\(")):
        clean_path(given)


def test_clean_path_refuses_what_is_not_a_string() -> None:
    with pytest.raises(InvalidRequestError, match="must be a string"):
        clean_path(b"a")  # type: ignore[arg-type]


def test_clean_path_limits_count_bytes_not_characters() -> None:
    assert clean_path("\u00e9" * (MAX_NAME_BYTES // 2)) == ("\u00e9" * (MAX_NAME_BYTES // 2),)
    with pytest.raises(InvalidRequestError, match="longer than 255 bytes"):
        clean_path("\u00e9" * (MAX_NAME_BYTES // 2 + 1))


def test_display_shows_the_root_as_a_dot() -> None:
    assert display(()) == "."
    assert display(("a", "b")) == "a/b"


def test_names_that_are_not_utf8_are_shown_with_replacement_characters() -> None:
    raw = os.fsdecode(b"caf\xe9")
    assert not is_text(raw)
    assert as_text(raw) == "caf\ufffd"
    assert is_text("caf\u00e9") and as_text("caf\u00e9") == "caf\u00e9"


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        (stat.S_IFREG | 0o644, "file"),
        (stat.S_IFDIR | 0o755, "directory"),
        (stat.S_IFLNK | 0o777, "symlink"),
        (stat.S_IFIFO | 0o600, "fifo"),
        (stat.S_IFSOCK | 0o600, "socket"),
        (stat.S_IFCHR | 0o600, "device"),
        (stat.S_IFBLK | 0o600, "device"),
    ],
)
def test_kind_of_names_every_file_type(mode: int, kind: str) -> None:
    assert kind_of(mode) == kind


def test_an_entry_on_the_wire_rounds_its_time_and_shows_a_target_only_for_a_link() -> None:
    assert Entry("a", "file", 3, 1.23456).wire() == {
        "path": "a",
        "type": "file",
        "size": 3,
        "mtime": 1.235,
    }
    assert Entry("l", "symlink", 4, 2.0, "/etc").wire()["target"] == "/etc"


# -- an OSError's domain error ---------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.EIO, errno.EROFS, errno.EUCLEAN])
def test_a_failed_filesystem_is_damage_and_is_reported(code: int) -> None:
    told: list[str] = []
    error = domain_error(OSError(code, "x"), ("a", "b"), "write", on_damage=told.append)
    assert isinstance(error, WorkspaceDamagedError)
    assert told == [f"write a/b: {os.strerror(code)}"]
    assert told[0] in str(error) and "retry" in str(error)


def test_any_failed_fsync_is_damage_even_enospc() -> None:
    told: list[str] = []
    error = domain_error(OSError(errno.ENOSPC, "x"), ("f",), "write", True, told.append)
    assert isinstance(error, WorkspaceDamagedError)
    assert told == [f"write f: {os.strerror(errno.ENOSPC)}, putting it on disk"]


def test_damage_without_a_listener_is_still_an_error() -> None:
    assert isinstance(domain_error(OSError(errno.EIO, "x"), (), "read"), WorkspaceDamagedError)


@pytest.mark.parametrize(
    ("code", "kind", "words"),
    [
        (errno.ENOSPC, WorkspaceFullError, "the workspace is full (write a)"),
        (errno.EDQUOT, WorkspaceFullError, "quota of bytes or files"),
        (errno.ENOENT, FileMissingError, "a: no such file or directory"),
        (errno.ELOOP, FileAccessError, "symbolic link or leaves the workspace"),
        (errno.EXDEV, FileAccessError, "symbolic link or leaves the workspace"),
        (errno.EMLINK, FileAccessError, "symbolic link or leaves the workspace"),
        (errno.ENOTDIR, FileAccessError, "is not a directory"),
        (errno.EISDIR, FileAccessError, "a: is a directory"),
        (errno.EEXIST, FileAccessError, "overwrite=true"),
        (errno.ENOTEMPTY, FileAccessError, "recursive=true"),
        (errno.EAGAIN, FileAccessError, "kept changing; retry"),
        (errno.EACCES, FileAccessError, "a: cannot write it: Permission denied"),
    ],
)
def test_other_errors_say_what_to_do_and_report_no_damage(
    code: int, kind: type[Exception], words: str
) -> None:
    told: list[str] = []
    error = domain_error(OSError(code, "x"), ("a",), "write", on_damage=told.append)
    assert type(error) is kind
    assert words in str(error)
    assert told == []


# -- the mount caps --------------------------------------------------------------------------

MOUNTED: dict[str, str | None] = {"s1": "alice", "s2": "alice", "s3": "bob", "slot-1": None}


def test_mounts_are_counted_all_or_by_principal_and_by_kind() -> None:
    assert count_mounted(MOUNTED) == 4
    assert count_mounted(MOUNTED, "alice") == 2
    assert count_mounted(MOUNTED, "carol") == 0
    assert by_kind(MOUNTED) == {"session": 3, "slot": 1, "blank": 0}
    assert by_kind({}) == {"session": 0, "slot": 0, "blank": 0}
    assert by_kind({**MOUNTED, "blank-0a": None}) == {"session": 3, "slot": 1, "blank": 1}


def test_the_caps_are_reached_at_their_value() -> None:
    def over(principal: str | None, host: bool, max_mounted: int, mine: int) -> tuple[bool, bool]:
        return over_caps(
            MOUNTED, principal, host=host, max_mounted=max_mounted, max_per_principal=mine
        )

    assert over("alice", True, 5, 3) == (False, False)
    assert over("alice", True, 4, 3) == (True, False)
    assert over("alice", True, 5, 2) == (False, True)
    assert over("alice", False, 4, 2) == (False, True), "the replica's cap only with `host`"
    assert over(None, True, 4, 0) == (True, False), "a warm slot has no principal's cap"
    assert over("carol", True, 5, 1) == (False, False)


def test_the_victim_is_one_without_a_sandbox_waiting_then_the_least_recently_used() -> None:
    last_used = {"a": 30.0, "b": 10.0, "c": 20.0}
    assert pick_victim(["a", "b", "c"], set(), last_used) == "b"
    assert pick_victim(["a", "b", "c"], {"b"}, last_used) == "c"
    assert pick_victim(["a", "b", "c"], {"a", "b", "c"}, last_used) == "b"
    assert pick_victim(["x", "a"], set(), last_used) == "x", "never used: first"
    assert pick_victim([], set(), last_used) is None


def test_a_refusal_names_the_cap_and_its_setting() -> None:
    mine = refusal(True, 100, 7)
    assert isinstance(mine, LimitExceededError)
    assert "maximum of 7 session workspaces" in str(mine)
    assert "SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL" in str(mine)
    replica = str(refusal(False, 100, 7))
    assert "maximum of 100 workspaces" in replica
    assert "(SANDBOX_MAX_MOUNTED_WORKSPACES)" in replica


def caps_store(
    tmp_path: Path, max_mounted: int, per_principal: int
) -> tuple[WorkspaceStore, list[str]]:
    """A store whose mounts are only its records (never started: nothing is mounted), and
    whose unmount forgets them; and the names it unmounted."""
    store = WorkspaceStore(
        tmp_path,
        size_mb=16,
        inodes=256,
        retention_seconds=3600,
        max_mounted=max_mounted,
        max_mounted_per_principal=per_principal,
    )
    unmounted: list[str] = []

    async def unmount(name: str, used_after: float | None = None) -> bool:
        store._mounted.discard(name)
        store._principals.pop(name, None)
        store._ready.pop(name, None)
        unmounted.append(name)
        return True

    store._unmount = unmount  # type: ignore[method-assign]
    return store, unmounted


def mounted(store: WorkspaceStore, name: str, principal: str | None, used: float) -> None:
    store._mounted.add(name)
    store._principals[name] = principal
    store._ready[name] = used


async def test_making_room_unmounts_the_principals_least_recently_used_idle_workspace(
    tmp_path: Path,
) -> None:
    store, unmounted = caps_store(tmp_path, max_mounted=10, per_principal=2)
    mounted(store, "a-old", "alice", 1.0)
    mounted(store, "a-new", "alice", 2.0)
    mounted(store, "b-oldest", "bob", 0.5)
    await store._make_room("alice", host=True)
    assert unmounted == ["a-old"]
    assert store.mounted_count("alice") == 1 and store.mounted_count() == 2


async def test_making_room_under_the_replicas_cap_takes_anyones_but_never_for_a_slot(
    tmp_path: Path,
) -> None:
    store, unmounted = caps_store(tmp_path, max_mounted=2, per_principal=5)
    mounted(store, "a", "alice", 2.0)
    mounted(store, "b", "bob", 1.0)
    await store._make_room("alice", host=True)
    assert unmounted == ["b"]
    refused: list[str] = []
    store.on_refused.append(refused.append)
    mounted(store, "c", "carol", 3.0)
    with pytest.raises(LimitExceededError, match="SANDBOX_MAX_MOUNTED_WORKSPACES"):
        await store._make_room(None, host=True)
    assert refused == [REPLICA_CAP]
    assert unmounted == ["b"], "a warm slot unmounted a session's workspace"


async def test_a_cap_is_refused_when_every_workspace_in_its_scope_is_in_use(
    tmp_path: Path,
) -> None:
    store, unmounted = caps_store(tmp_path, max_mounted=10, per_principal=2)
    mounted(store, "a1", "alice", 1.0)
    mounted(store, "a2", "alice", 2.0)
    mounted(store, "b1", "bob", 0.1)
    store.busy.append(lambda: {"a1"})
    held = store.hold("a2")
    held.__enter__()
    refused: list[str] = []
    store.on_refused.append(refused.append)
    with pytest.raises(LimitExceededError, match="PER_PRINCIPAL"):
        await store._make_room("alice", host=True)
    assert refused == [PRINCIPAL_CAP]
    with pytest.raises(LimitExceededError):
        await store._make_room("alice", host=True, count=False)
    assert refused == [PRINCIPAL_CAP], "an operation made ready ahead counts its own refusal"
    held.__exit__(None, None, None)
    await store._make_room("alice", host=True)
    assert unmounted == ["a2"]


async def test_a_workspace_being_locked_or_with_a_sandbox_waiting_goes_last(
    tmp_path: Path,
) -> None:
    store, _ = caps_store(tmp_path, max_mounted=10, per_principal=3)
    mounted(store, "a1", "alice", 1.0)
    mounted(store, "a2", "alice", 2.0)
    mounted(store, "a3", "alice", 3.0)
    store.standby.append(lambda: {"a2"})
    async with store._lock("a1"):
        assert store._least_recently_used("alice", set()) == "a3"
        assert not store.is_ready("a1")
    assert store._least_recently_used("alice", set()) == "a1"
    assert store._least_recently_used("alice", {"a1", "a3"}) == "a2"
    assert store._least_recently_used("bob", set()) is None
    assert store.mounted_by_kind() == {"session": 3, "slot": 0, "blank": 0}


# -- images ----------------------------------------------------------------------------------


def test_an_image_is_formatted_with_its_inode_quota_and_owned_by_the_sandbox_user() -> None:
    argv = mkfs_argv(Path("/state/w.img"), 4096, (1000, 1001))
    assert argv[0] == "mkfs.ext4" and argv[-1] == "/state/w.img"
    assert argv[argv.index("-N") + 1] == "4096"
    assert argv[argv.index("-m") + 1] == "0", "no blocks reserved for root"
    options = argv[argv.index("-E") + 1].split(",")
    assert "root_owner=1000:1001" in options and "nodiscard" in options


def test_an_image_is_mounted_as_ext4_with_the_options_given() -> None:
    assert mount_argv(Path("/s/w.img"), Path("/s/w"), MOUNT_OPTIONS) == [
        "mount",
        "-t",
        "ext4",
        "-o",
        MOUNT_OPTIONS,
        "/s/w.img",
        "/s/w",
    ]
    assert "errors=remount-ro" in MOUNT_OPTIONS.split(",")
    assert {"nosuid", "nodev"} <= set(MOUNT_OPTIONS.split(","))


def test_names_and_where_a_workspace_lives(tmp_path: Path) -> None:
    store, _ = caps_store(tmp_path, 1, 1)
    assert store.path("s-1") == tmp_path / "s-1"
    assert store.image("s-1") == tmp_path / "s-1.img"
    assert store._marker("s-1") == tmp_path / "s-1.damaged"
    for bad in ("", "a/b", "..", ".probe", "x" * 129, "a b"):
        with pytest.raises(InvalidRequestError):
            store._check(bad)
    store._check("A-z_0" * 25)
