"""Environments without builds: the Dockerfile subset, the store, and OCI import with hostile
images the tests assemble (real tars, real filesystem; no bwrap needed but for `runs`)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import os
import stat
import struct
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from environments_images import (
    BUSYBOX,
    IMAGE_CONFIG,
    bomb_layer,
    docker_save,
    hostile_layers,
    is_setuid,
    oci_layout,
    write_dir,
    write_tar,
)

from sandbox_runtime.domain.owner import Owner
from sandbox_runtime.environments.build import finish_root
from sandbox_runtime.environments.dockerfile import DockerfileError, parse
from sandbox_runtime.environments.extract import LayerError, LayerTooLargeError, extract_layer
from sandbox_runtime.environments.oci import ImageError, import_image
from sandbox_runtime.environments.run import RunStepError, run_step, user_ids
from sandbox_runtime.environments.sharing import SharedFetcher, push
from sandbox_runtime.environments.store import (
    DEFAULT,
    EnvironmentNotFoundError,
    EnvironmentStore,
)
from sandbox_runtime.errors import InvalidRequestError
from sandbox_runtime.execution.images import SessionImages
from sandbox_runtime.sandbox.image_root import build_image_root
from sandbox_runtime.sandbox.spec import ImageRoot
from sandbox_runtime.snapshots.stores import DirectoryStore

MIB = 2**20


def test_dockerfile_subset_parses_continuations_comments_and_forms() -> None:
    steps = parse(
        "# a comment\nFROM debian:bookworm\nRUN apt-get update \\\n  # inside\n && true\n"
        'ENV A=1 B="two words"\nCOPY ["a b", "/x/"]\nWORKDIR /w\nUSER 1000\nLABEL k=v\n'
    )
    assert [s.keyword for s in steps] == ["FROM", "RUN", "ENV", "COPY", "WORKDIR", "USER", "LABEL"]
    assert steps[1].args == "apt-get update && true"
    assert steps[1].line == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("FROM debian:bookworm\nEXPOSE 80\n", "Dockerfile:2: EXPOSE is not supported"),
        ('FROM debian:bookworm\nCMD ["sh"]\n', "Dockerfile:2: CMD is not supported"),
        ("FROM debian:bookworm\n\nADD x /x\n", "Dockerfile:3: ADD is not supported"),
        ("FROM debian:bookworm\nFROBNICATE\n", "Dockerfile:2: FROBNICATE is not an instruction"),
        ("RUN true\n", "the first instruction must be FROM"),
        ("FROM a\nFROM b\n", "Dockerfile:2: only one FROM"),
    ],
)
def test_unsupported_dockerfile_is_an_error_naming_instruction_and_line(
    text: str, expected: str
) -> None:
    with pytest.raises(DockerfileError) as caught:
        parse(text)
    assert expected in str(caught.value)


def test_default_is_builtin_and_unknown_names_are_none(tmp_path: Path) -> None:
    store = EnvironmentStore(tmp_path / "environments")
    assert store.get("default") is DEFAULT and DEFAULT.root is None
    assert store.get("nope") is None and store.get("../etc") is None
    assert store.list() == [DEFAULT]
    with pytest.raises(EnvironmentNotFoundError):
        asyncio.run(store.ensure("sha256:" + "0" * 64))


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A host path the hostile layers aim at (it must never appear)."""
    path = tmp_path / "victim" / "pwned"
    path.parent.mkdir()
    yield path
    assert not path.exists(), "a layer wrote outside the root"


@pytest.mark.parametrize("form", ["oci-tar", "oci-dir", "docker-save"])
def test_hostile_image_imports_and_none_of_its_entries_gives_anything(
    tmp_path: Path, outside: Path, form: str
) -> None:
    layers = hostile_layers(outside)
    if form == "docker-save":
        image = write_tar(docker_save(layers, IMAGE_CONFIG), tmp_path / "saved.tar")
    elif form == "oci-tar":
        image = write_tar(oci_layout(layers, IMAGE_CONFIG), tmp_path / "oci.tar")
    else:
        (tmp_path / "layout").mkdir()
        image = write_dir(oci_layout(layers, IMAGE_CONFIG), tmp_path / "layout")
    store = EnvironmentStore(tmp_path / "environments")
    log: list[str] = []
    env = import_image(store, "hostile", image, 64 * MIB, log.append)
    root = env.root
    assert root is not None
    assert (env.env["GREETING"], env.workdir, env.user) == ("hello", "/opt", "1000")
    assert env.description == "an image the tests assembled"
    # whiteouts
    assert (root / "etc/keep").read_text() == "kept\n"
    assert not (root / "etc/gone").exists()
    assert sorted(os.listdir(root / "opt/data")) == ["new"]
    # setuid/setgid cleared; devices and fifos never made
    assert (root / "usr/bin/suid").is_file() and not is_setuid(root / "usr/bin/suid")
    assert not (root / "dev/evil").exists() and not (root / "dev/disk").exists()
    assert not (root / "tmp/fifo").exists()
    assert not any(
        stat.S_ISCHR(p.lstat().st_mode) or stat.S_ISBLK(p.lstat().st_mode) for p in root.rglob("*")
    )
    # links out: a symlink stays a symlink (resolved in the sandbox's root, never by us),
    # hardlinks outside the tree are refused, writes through links are refused
    assert os.readlink(root / "etc/shadowlink") == "/etc/shadow"
    assert not (root / "etc/hardshadow").exists() and not (root / "etc/hardout").exists()
    assert (root / "etc/hardkeep").read_text() == "kept\n"
    assert (root / "escape").is_file() and not (root / "escape").is_symlink()
    assert (root / "abs").is_file()
    assert not any(p.name == outside.name for p in root.rglob("*"))
    assert any("refused" in line and "escapes" in line for line in log)
    assert any("through a symlink" in line for line in log)
    assert any("device, fifo or socket" in line for line in log)
    # it runs (as an unprivileged user in its own root): the link to /etc/shadow leads to
    # the environment's own /etc, where there is none
    done = subprocess.run(
        ["bwrap", "--ro-bind", str(root), "/", "--proc", "/proc", "--dev", "/dev",
         "--unshare-all", "--uid", "1000", "--gid", "1000", "/bin/sh", "-c",
         "echo ran; /bin/busybox cat /etc/shadowlink || echo no-shadow; "
         "/bin/busybox id -u"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.stdout.split() == ["ran", "no-shadow", "1000"], done


def test_tar_bomb_stops_at_the_limit_and_keeps_the_previous(tmp_path: Path, outside: Path) -> None:
    store = EnvironmentStore(tmp_path / "environments")
    good = write_tar(oci_layout(hostile_layers(outside), IMAGE_CONFIG), tmp_path / "good.tar")
    before = import_image(store, "img", good, 64 * MIB, lambda _: None)
    bomb = write_tar(oci_layout([bomb_layer(512)], IMAGE_CONFIG), tmp_path / "bomb.tar")
    assert bomb.stat().st_size < 4 * MIB
    with pytest.raises(LayerTooLargeError, match="SANDBOX_ENVIRONMENT_MAX_MB"):
        import_image(store, "img", bomb, 32 * MIB, lambda _: None)
    after = store.get("img")
    assert after is not None and after.digest == before.digest
    assert list(store.tmp.iterdir()) == []


def test_not_an_image_is_a_clear_error(tmp_path: Path) -> None:
    store = EnvironmentStore(tmp_path / "environments")
    junk = write_tar({"hello.txt": b"hi"}, tmp_path / "junk.tar")
    with pytest.raises(ImageError, match=r"no index\.json"):
        import_image(store, "junk", junk, 16 * MIB, lambda _: None)
    with pytest.raises(ImageError, match="no such file"):
        import_image(store, "junk", tmp_path / "missing.tar", 16 * MIB, lambda _: None)


def test_push_then_ensure_on_another_worker_gives_the_same_digest(
    tmp_path: Path, outside: Path
) -> None:
    here = EnvironmentStore(tmp_path / "a" / "environments")
    image = write_tar(oci_layout(hostile_layers(outside), IMAGE_CONFIG), tmp_path / "oci.tar")
    env = import_image(here, "img", image, 64 * MIB, lambda _: None)
    shared = DirectoryStore(tmp_path / "shared", timeout=30)
    asyncio.run(push(here, env, shared, lambda _: None))
    there = EnvironmentStore(tmp_path / "b" / "environments")
    assert there.by_digest(env.digest) is None
    there.fetcher = SharedFetcher(shared, 64 * MIB, lambda _: None)
    fetched = asyncio.run(there.ensure(env.digest))
    assert fetched.digest == env.digest and fetched.root_digest == env.root_digest
    assert fetched.root is not None and (fetched.root / "etc/keep").read_text() == "kept\n"
    assert list(there.tmp.iterdir()) == []


def test_cli_imports_lists_inspects_pushes_fetches_and_removes(
    tmp_path: Path, outside: Path
) -> None:
    from environments_harness import run_env_cli

    image = write_tar(docker_save(hostile_layers(outside), IMAGE_CONFIG), tmp_path / "img.tar")
    base, state = tmp_path / "environments", tmp_path / "state"
    shared = {"SANDBOX_SNAPSHOT_STORE": str(tmp_path / "shared")}
    done = run_env_cli(["import", "img", str(image)], base, state, timeout=120)
    assert done.returncode == 0, done.stderr
    digest = done.stdout.strip()
    assert "refused" in done.stderr and f"imported img {digest}" in done.stderr
    listed = json.loads(run_env_cli(["list", "--json"], base, state, timeout=60).stdout)
    assert [(e["name"], e["digest"]) for e in listed] == [("default", "default"), ("img", digest)]
    inspected = json.loads(run_env_cli(["inspect", "img"], base, state, timeout=60).stdout)
    assert inspected["env"]["GREETING"] == "hello" and inspected["root"].startswith(str(base))
    pushed = run_env_cli(["push", "img"], base, state, timeout=120, **shared)
    assert pushed.returncode == 0, pushed.stderr
    other = tmp_path / "other"
    fetched = run_env_cli(["fetch", digest, "--name", "img2"], other, state, timeout=120, **shared)
    assert fetched.returncode == 0, fetched.stderr
    assert EnvironmentStore(other).get("img2").digest == digest  # type: ignore[union-attr]
    removed = run_env_cli(["rm", "img"], base, state, timeout=60)
    assert removed.returncode == 0 and "1 unused root(s) deleted" in removed.stderr
    assert list((base / "roots").iterdir()) == []
    missing = run_env_cli(["inspect", "img"], base, state, timeout=60)
    assert missing.returncode == 1 and "env list" in missing.stderr
    unknown = run_env_cli(["frobnicate"], base, state, timeout=60)
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


def test_whiteouts_naming_dot_or_dotdot_remove_nothing_outside_their_directory(
    tmp_path: Path,
) -> None:
    # `.wh...` whites out `..`: at the top of a layer that is the directory holding the tree
    # (an import's work directory; a fetch's), one level down the tree itself.
    work = tmp_path / "work"
    tree = work / "root"
    tree.mkdir(parents=True)
    (work / "sibling").write_text("mine\n")
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for name in ("keep/", "keep/file", "keep/.wh...", "keep/.wh..", "keep/.wh.", ".wh..."):
            info = tarfile.TarInfo(name.rstrip("/"))
            info.type = tarfile.DIRTYPE if name.endswith("/") else tarfile.REGTYPE
            info.size = 0 if info.type == tarfile.DIRTYPE else 5
            tar.addfile(info, io.BytesIO(b"kept\n") if info.size else None)
    layer.seek(0)
    refused = extract_layer(layer, tree, MIB)
    assert (work / "sibling").read_text() == "mine\n"
    assert (tree / "keep" / "file").read_text() == "kept\n"
    assert refused["path escapes"] == 4


def test_a_stored_root_keeps_no_file_capability(tmp_path: Path) -> None:
    # A RUN step is root of a user namespace whose root is the host's: a capability its
    # `setcap` writes is one the host honours (rootid 0). The store must not keep it.
    store = EnvironmentStore(tmp_path / "environments")
    tree = tmp_path / "tree"
    (tree / "usr" / "bin").mkdir(parents=True)
    tool = tree / "usr" / "bin" / "tool"
    tool.write_bytes(BUSYBOX.read_bytes())
    tool.chmod(0o755)
    # vfs_cap_data revision 2, effective: cap_setuid permitted
    os.setxattr(tool, "security.capability", struct.pack("<5I", 0x02000001, 1 << 7, 0, 0, 0))
    log: list[str] = []
    digest = finish_root(store, tree, {"env": {}}, 64 * MIB, log.append)
    root = store.root_path(json.loads(store.image_path(digest).read_text())["root_digest"])
    assert "security.capability" not in os.listxattr(root / "usr" / "bin" / "tool")
    assert any("file capabilities removed: 1" in line for line in log)


def test_a_tree_under_way_is_reachable_by_root_alone(tmp_path: Path, outside: Path) -> None:
    # Until it is stored (neutralized) a tree may hold setuid-root files or capabilities (a
    # RUN step is the host's root in its namespace): no other host user may reach it.
    store = EnvironmentStore(tmp_path / "environments")
    image = write_tar(oci_layout(hostile_layers(outside), IMAGE_CONFIG), tmp_path / "oci.tar")
    modes: list[int] = []

    def log(line: str) -> None:
        if line.startswith("layer "):
            (work,) = list(store.tmp.iterdir())
            modes.extend(stat.S_IMODE(p.stat().st_mode) for p in (store.tmp, work))

    import_image(store, "img", image, 64 * MIB, log)
    assert modes and set(modes) == {0o700}, [oct(m) for m in modes]


@pytest.mark.parametrize("kind", ["pax", "gnu"])
def test_a_huge_tar_header_is_refused_before_it_is_read(tmp_path: Path, kind: str) -> None:
    # tarfile reads a pax or GNU long-name header whole into memory; the size budget counts
    # files only: 8 MiB of header (a few KiB gzipped; GiBs the same way) must stop the layer.
    layer = io.BytesIO()
    with gzip.GzipFile(fileobj=layer, mode="wb") as gz:
        fmt = tarfile.PAX_FORMAT if kind == "pax" else tarfile.GNU_FORMAT
        with tarfile.open(fileobj=gz, mode="w", format=fmt) as tar:
            info = tarfile.TarInfo("a" * (8 * MIB) if kind == "gnu" else "file")
            if kind == "pax":
                info.pax_headers = {"comment": "x" * (8 * MIB)}
            tar.addfile(info, io.BytesIO(b""))
    assert layer.tell() < MIB
    layer.seek(0)
    with pytest.raises(LayerError, match="MiB header"):
        extract_layer(layer, tmp_path, 64 * MIB)


def test_a_session_on_an_environment_taken_away_from_its_principal_stops(
    tmp_path: Path, outside: Path
) -> None:
    # ALLOW is checked when a session chooses; a session recorded before the operator took
    # the environment away (a restart with a narrower ALLOW, or a snapshot of then restored)
    # must not go on on it.
    store = EnvironmentStore(tmp_path / "environments")
    image = write_tar(oci_layout(hostile_layers(outside), IMAGE_CONFIG), tmp_path / "oci.tar")
    import_image(store, "img", image, 64 * MIB, lambda _: None)
    owner = Owner("alice", "s:one")
    records = tmp_path / "records"
    before = SessionImages(store, {"alice": {"img"}}, records)
    chosen = asyncio.run(before.for_call(owner, "img"))
    assert chosen is not None and chosen.name == "img"
    after = SessionImages(store, {"alice": {"default"}}, records)
    with pytest.raises(InvalidRequestError, match=r"no longer use.*start a new session"):
        asyncio.run(after.for_call(owner, None))
    assert asyncio.run(after.for_call(Owner("alice", "s:two"), None)) is None  # (default)


@pytest.mark.parametrize("link", ["ssl", "ssl/certs"])
def test_an_environments_etc_links_lead_nothing_of_its_root_onto_the_host(
    tmp_path: Path, link: str
) -> None:
    # The sandbox's /etc is a copy of the environment's, links kept as links; the trust
    # bundle's mount point is then made in it, on the host: never through one of them.
    victim = tmp_path / "victim"
    victim.mkdir()
    tree = tmp_path / "tree"
    (tree / "usr").mkdir(parents=True)
    (tree / "etc" / link).parent.mkdir(parents=True, exist_ok=True)
    (tree / "etc" / link).symlink_to(victim)
    image = ImageRoot("hostile", "sha256:" + "0" * 64, tree)
    build_image_root(tmp_path / "dest", image)
    assert list(victim.iterdir()) == []
    bundle = tmp_path / "dest" / "etc" / "ssl" / "certs" / "ca-certificates.crt"
    assert bundle.is_file() and not (tmp_path / "dest" / "etc" / link).is_symlink()


@pytest.mark.parametrize("link", ["etc/passwd", "etc"])
def test_a_build_reads_users_from_its_tree_never_through_a_link(tmp_path: Path, link: str) -> None:
    # USER NAME is looked up in the tree's /etc/passwd by the build, on the host: a link an
    # earlier step made must not lead there to a host file (nor a fifo, nor /dev/zero).
    host = tmp_path / "host" / "etc"
    host.mkdir(parents=True)
    (host / "passwd").write_text("intruder:x:4242:4242::/:/bin/sh\n")
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    target = tree / link
    if target.is_dir():
        target.rmdir()
    target.symlink_to(host / "passwd" if link == "etc/passwd" else host)
    with pytest.raises(RunStepError, match="no such user"):
        user_ids(tree, "intruder")
    target.unlink()
    (tree / "etc").mkdir(exist_ok=True)
    os.mkfifo(tree / "etc" / "passwd")
    with pytest.raises(RunStepError, match="no such user"):
        user_ids(tree, "intruder")  # (returns: a fifo is never opened for reading)


def test_a_run_step_makes_and_cleans_nothing_through_the_trees_links(tmp_path: Path) -> None:
    # The step's WORKDIR is made, and bwrap's mount points under /run removed, by the build
    # on the host: links an earlier step left in the tree must not lead them onto it.
    victim = tmp_path / "victim"
    (victim / "srt-copy").mkdir(parents=True)
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "sh").write_bytes(BUSYBOX.read_bytes())
    (tree / "bin" / "sh").chmod(0o755)
    (tree / "w").symlink_to(victim)
    (tree / "run").symlink_to(victim)

    async def step() -> None:
        await run_step(
            tree, ["/bin/sh", "-c", "exit 0"], env={}, workdir="/w/made", user="root",
            egress=None, allow="", step_seconds=60, max_bytes=64 * MIB, log=lambda _: None,
        )  # fmt: skip

    with contextlib.suppress(RunStepError):  # (/w/made: missing inside the sandbox too)
        asyncio.run(step())
    assert sorted(p.name for p in victim.iterdir()) == ["srt-copy"]


def test_a_fetch_takes_from_the_shared_store_only_what_the_digest_covers(
    tmp_path: Path, outside: Path
) -> None:
    # The digest pins the root, env, workdir, user and labels; an environment's kernelspecs
    # and size come from the root itself, never from the store's JSON (which anyone who may
    # write the store chooses: a kernel's argv, or a shape that breaks every lookup).
    here = EnvironmentStore(tmp_path / "a" / "environments")
    image = write_tar(oci_layout(hostile_layers(outside), IMAGE_CONFIG), tmp_path / "oci.tar")
    env = import_image(here, "img", image, 64 * MIB, lambda _: None)
    shared = DirectoryStore(tmp_path / "shared", timeout=30)
    asyncio.run(push(here, env, shared, lambda _: None))
    (key,) = (tmp_path / "shared" / "environments" / "images").iterdir()
    config = json.loads(key.read_text())
    config["kernelspecs"] = {"python": {"argv": ["/evil"]}, "r": {}}
    key.write_text(json.dumps(config))
    there = EnvironmentStore(tmp_path / "b" / "environments")
    there.fetcher = SharedFetcher(shared, 64 * MIB, lambda _: None)
    fetched = asyncio.run(there.ensure(env.digest))
    assert fetched.kernelspecs == env.kernelspecs == {}
    assert [e.name for e in there.list()] == ["default"]  # (a lookup still works)


@pytest.mark.parametrize("place", ["/tmp", "/dev/shm"])
def test_a_run_steps_memory_filesystems_are_bounded_as_its_tree(tmp_path: Path, place: str) -> None:
    # /tmp and /dev/shm of a step are tmpfs (host memory) outside the tree's size checks.
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "busybox").write_bytes(BUSYBOX.read_bytes())
    (tree / "bin" / "busybox").chmod(0o755)

    async def step() -> None:
        await run_step(
            tree, ["/bin/busybox", "dd", "if=/dev/zero", f"of={place}/big", "bs=1M", "count=24"],
            env={}, workdir="/", user="root", egress=None, allow="", step_seconds=60,
            max_bytes=8 * MIB, log=lambda _: None,
        )  # fmt: skip

    with pytest.raises(RunStepError, match="No space left"):
        asyncio.run(step())


def test_removing_a_name_with_path_characters_removes_nothing(tmp_path: Path) -> None:
    store = EnvironmentStore(tmp_path / "environments")
    store.names.mkdir(parents=True)
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    assert store.remove("../../victim") is False
    assert victim.exists()
