"""A forged backup is refused (docs/security.md, "Backups"). An unkeyed checksum is not enough: editing the replay
start, a body or the member list and recomputing it would pass, and restore would then resurrect consumed messages,
drop committed ones or load a forged body; and a file name in the manifest must not point outside the backup.

So the manifest carries every entry file's digest and is signed with the group's backup key (HMAC-SHA256), found
by every command through the settings resolver (here: $CFEMU_SECRETS_DIR, tests/conftest.py). Each test does what
an attacker who can write the backup directory would do, with the format docs/backup-format.md describes, to a
real backup taken by `cfbackup run` of a real group, and runs the real `cfbackup verify` and `cfrestore run`:
both refuse in one line naming the file, and the CF is left as the loss left it (nothing written)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import crc32c
import pytest
import redis

from backup.files import manifest_mac, sign_manifest
from cfemu import credentials, keys
from cfemu.private_files import private_dir
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

pytestmark = pytest.mark.slow  # tests/support/tiers.py: run after the fast tier

S = "APP1"
ROOT = Path(__file__).resolve().parents[2]
SURVIVORS = {f"msg-{i:02d}".encode() for i in range(3, 12)} | {f"late-{i:02d}".encode() for i in range(3)}


def tool(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          env=env)  # in the test's own directory: the Spark engine's log goes to its var/spark


def settings_env(url: str, logs: Path, backups: Path, **extra: str) -> dict[str, str]:
    """The group's settings as the environment gives them; the backup key is the suite's group's, found through
    $CFEMU_SECRETS_DIR (inherited) like every other command finds it."""
    return {**os.environ, "REDIS_URL": url, "CFEMU_LOG_ROOT": str(logs), "CFEMU_BACKUP_DIR": str(backups),
            "CFEMU_CLUSTER_DIR": str(logs.parent / "no-cluster"), "CFEMU_CF_DIR": str(logs.parent / "no-cf"),
            **extra}


@pytest.fixture(scope="module")
def template(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A group's logs and one backup taken by `cfbackup run` while it worked: 12 messages put, 2 consumed before
    the backup; 3 more put and 1 more consumed after it. A good restore leaves msg-03..msg-11 and late-00..02."""
    root = tmp_path_factory.mktemp("group")
    logs, backups = root / "logs", root / "backups"
    lose_cf(redis_server.client())
    url = redis_server.url
    client = define_group(url, queues=("Q1",))
    # No relogging (cpl_entries=0): a shutdown's relog pass would be a newer start than the backup, and the
    # restores below would never read the backup these attacks change.
    qm1, qm2 = (start_qm(url, logs, f"QM{i}", background=False, cpl_entries=0) for i in (1, 2))
    try:
        c1, c2 = qm1.connect(), qm2.connect()
        for i in range(12):
            c1.put("Q1", f"msg-{i:02d}".encode())
        c1.commit()
        for _ in range(2):
            c2.get("Q1")
        c2.commit()
        run = tool("backup.cli", "run", S, "--json", env=settings_env(url, logs, backups))
        assert run.returncode == 0, run.stderr
        for i in range(3):
            c1.put("Q1", f"late-{i:02d}".encode())
        c1.commit()
        assert c2.get("Q1").body == b"msg-02"
        c2.commit()
    finally:
        qm1.stop()
        qm2.stop()
        client.close()
    return root, json.loads(run.stdout)["id"]


class Group:
    """A copy of the template's files, over the session CF as the CF loss left it (empty)."""

    def __init__(self, template: tuple[Path, str], url: str, tmp: Path) -> None:
        shutil.copytree(template[0], tmp / "group", symlinks=True)
        self.logs, self.backups = tmp / "group" / "logs", tmp / "group" / "backups"
        self.id = template[1]
        self.path = self.backups / S / self.id
        self.manifest_path = self.path / "manifest.json"
        self.url = url
        self.env = settings_env(url, self.logs, self.backups)
        self.client = redis.Redis.from_url(url)

    def manifest(self) -> dict[str, Any]:
        return dict(json.loads(self.manifest_path.read_text()))

    def write_manifest(self, m: dict[str, Any]) -> None:
        self.manifest_path.write_text(json.dumps(m, sort_keys=True, indent=1))

    def cfbackup(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return tool("backup.cli", *args, env={**self.env, **extra})

    def cfrestore(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return tool("restore.cli", "run", S, *args, env={**self.env, **extra})

    def bodies(self) -> set[bytes]:
        return set(self.client.hvals(keys.data(S)))

    def refused(self, result: subprocess.CompletedProcess[str], naming: Path, *also: str) -> str:
        """One line on stderr, exit 2, naming the file; no traceback, no key."""
        err = result.stderr
        assert result.returncode == 2, (result.stdout, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert str(naming) in err, err
        for text in also:
            assert text in err, err
        key = credentials.backup_keys(Path(os.environ[credentials.ENV_SECRETS_DIR])).current
        assert key is not None and key.decode() not in err
        return err

    def nothing_restored(self) -> None:
        assert self.client.hlen(keys.entries(S)) == 0 and not self.client.exists(keys.meta(S)), \
            "a refused restore writes nothing into the CF"


@pytest.fixture
def group(template: tuple[Path, str], redis_url: str, tmp_path: Path) -> Group:
    return Group(template, redis_url, tmp_path)  # redis_url: the CF is flushed, as a CF loss leaves it


def old_checksum(m: dict[str, Any]) -> str:
    """The manifest's unkeyed checksum as the format described it: SHA-256 of the canonical JSON (sorted keys, no
    spaces, UTF-8) of every other field. Anyone can compute it."""
    body = {k: v for k, v in m.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                          .encode()).hexdigest()


def sha256_files(group: Group, m: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's file records as backups before format 3 wrote them: each file's SHA-256."""
    return [{**{k: v for k, v in f.items() if k != "blake3"},
             "sha256": hashlib.sha256((group.path / f["name"]).read_bytes()).hexdigest()} for f in m["files"]]


def group_key() -> bytes:
    key = credentials.backup_keys(Path(os.environ[credentials.ENV_SECRETS_DIR])).current
    assert key is not None
    return key


def forge(group: Group, change: dict[str, Any]) -> None:
    """Edit the manifest and recompute the checksum, as the attacker of the finding did."""
    m = {**group.manifest(), **change}
    m["checksum"] = old_checksum(m)
    group.write_manifest(m)


def check_refused(group: Group, *also: str) -> None:
    group.refused(group.cfbackup("verify", group.id), group.manifest_path, *also)
    group.refused(group.cfrestore(), group.manifest_path, *also)
    group.refused(group.cfrestore("--backup", group.id), group.manifest_path, *also)
    group.nothing_restored()


# --- the happy path -----------------------------------------------------------------------------------------------
def test_a_signed_backup_verifies_and_restores_everything(group: Group) -> None:
    m = group.manifest()
    assert m["format"] == 3 and set(m["signature"]) == {"alg", "key", "mac"} and m["signature"]["alg"] == \
        "hmac-sha256" and "checksum" not in m
    assert all(len(f["blake3"]) == 64 and "sha256" not in f for f in m["files"])
    ok = group.cfbackup("verify", group.id)
    assert ok.returncode == 0 and "its signature (key " in ok.stdout, ok.stderr
    restored = group.cfrestore("--json")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["loaded_entries"] == len(SURVIVORS)
    assert group.bodies() == SURVIVORS
    # The restore point the restore wrote is signed too: the next restore (and verify) accept it.
    point = json.loads(restored.stdout)["restore_point"]
    assert group.cfbackup("verify", point).returncode == 0


# --- editing the manifest -----------------------------------------------------------------------------------------
def test_a_moved_replay_start_is_refused(group: Group) -> None:
    """Replaying from later drops what the logs hold after the backup (the late puts) and brings back msg-02."""
    m = group.manifest()
    forge(group, {"replay_from": int(m["end_lrsn"]) + 10**12})
    check_refused(group, "the signature does not match")


def test_a_changed_member_list_is_refused(group: Group) -> None:
    forge(group, {"members": ["QM1"]})
    check_refused(group, "the signature does not match")


def test_a_forged_body_is_refused_on_both_engines(group: Group) -> None:
    """A body replaced in the entry file with a valid frame CRC, the file's digest and the checksum recomputed."""
    f = group.path / "entries-0001.bin"
    raw = bytearray(f.read_bytes())
    at = raw.index(b"msg-05")
    raw[at:at + 6] = b"EVIL05"
    offset = 9  # the first frame, after the file header
    while True:  # find the frame holding it and give it a matching CRC32C
        length = int.from_bytes(raw[offset:offset + 4], "little")
        if offset + 8 <= at < offset + 8 + length:
            raw[offset + 4:offset + 8] = crc32c.crc32c(bytes(raw[offset + 8:offset + 8 + length])).to_bytes(4, "little")
            break
        offset += 8 + length
    f.write_bytes(bytes(raw))
    m = group.manifest()
    m["files"][0]["blake3"] = blake3.blake3(bytes(raw)).hexdigest()
    forge(group, {"files": m["files"]})
    check_refused(group, "the signature does not match")
    group.refused(group.cfrestore("--engine", "spark"), group.manifest_path, "the signature does not match")
    group.nothing_restored()


def test_a_changed_entry_file_is_refused_naming_it(group: Group) -> None:
    """A byte flipped in a body (its frame's CRC fixed): the file's digest in the signed manifest catches it; and
    recomputing that digest breaks the signature. (The Spark engine reads entry files in its workers and raises
    the same error on the driver, which cfrestore refuses in the same one line: tests/restore/test_engine_spark.py
    checks that on the suite's Spark session rather than a JVM of cfrestore's own here.)"""
    f = group.path / "entries-0001.bin"
    raw = bytearray(f.read_bytes())
    length = int.from_bytes(raw[9:13], "little")
    raw[9 + 8 + length - 1] ^= 0x01  # the last byte of the first frame's body: its data
    raw[13:17] = crc32c.crc32c(bytes(raw[17:17 + length])).to_bytes(4, "little")
    f.write_bytes(bytes(raw))
    group.refused(group.cfbackup("verify", group.id), f, "blake3 does not match the manifest")
    group.refused(group.cfrestore(), f, "blake3 does not match the manifest")
    group.nothing_restored()
    m = group.manifest()
    m["files"][0]["blake3"] = blake3.blake3(bytes(raw)).hexdigest()
    forge(group, {"files": m["files"]})
    check_refused(group, "the signature does not match")


# --- file names outside the backup --------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_an_entry_file_named_outside_the_backup_is_refused_and_not_read(group: Group, where: str) -> None:
    outside = group.backups / "x"
    (group.path / "entries-0001.bin").rename(outside)
    os.utime(outside, (0, time.time()))  # read, its access time would move (relatime)
    m = group.manifest()
    m["files"][0]["name"] = "../../x" if where == "relative" else str(outside)
    forge(group, {"files": m["files"]})
    check_refused(group, repr(m["files"][0]["name"]), "refused, nothing read")
    assert outside.stat().st_atime == 0, "the file outside the backup was read"


def test_an_entry_file_that_is_a_symlink_out_of_the_backup_is_refused_and_not_read(group: Group) -> None:
    """The manifest untouched (its name, size and digest all match the file the link leads to)."""
    f = group.path / "entries-0001.bin"
    outside = group.backups / "x"
    f.rename(outside)
    f.symlink_to(outside)
    os.utime(outside, (0, time.time()))
    group.refused(group.cfbackup("verify", group.id), f, "a symbolic link")
    group.refused(group.cfrestore(), f, "a symbolic link")
    group.nothing_restored()
    assert outside.stat().st_atime == 0, "the file outside the backup was read"


# --- keys ---------------------------------------------------------------------------------------------------------
def test_a_backup_signed_with_another_groups_key_is_refused(group: Group) -> None:
    """Another group (or anyone with a key of their own) signs a forged manifest the documented way."""
    other = os.urandom(32)
    m = {k: v for k, v in group.manifest().items() if k != "signature"}
    m["replay_from"] = int(m["end_lrsn"]) + 10**12
    other_id = hashlib.sha256(b"cfemu backup key id\0" + other).hexdigest()[:16]
    mac = hmac.new(other, b"cfemu backup manifest v2\n" + json.dumps(
        m, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(), hashlib.sha256).hexdigest()
    group.write_manifest({**m, "signature": {"alg": "hmac-sha256", "key": other_id, "mac": mac}})
    check_refused(group, f"signed with a key this group does not hold (key id {other_id}")


def test_an_old_backup_copied_under_a_newer_id_is_refused(group: Group) -> None:
    """The signature holds, but the backup is not the one its directory says: restore would take it for the
    latest and start from an older view. Without the original beside it, nothing says the copy is not newer than
    every good backup: the restore is refused."""
    newer = group.id[:-6] + "ffffff"
    newer = newer.replace(newer.split("-")[1], "29991231T235959Z")
    shutil.copytree(group.path, group.backups / S / newer)
    for result in (group.cfbackup("verify", newer), group.cfrestore("--backup", newer)):
        group.refused(result, group.backups / S / newer / "manifest.json", f"the manifest is of backup {group.id}")
    shutil.rmtree(group.path)
    group.refused(group.cfrestore(), group.backups / S / newer / "manifest.json",
                  f"the manifest is of backup {group.id}")
    group.nothing_restored()


def test_a_copy_under_a_newer_id_does_not_block_a_restore_from_its_original(group: Group) -> None:
    """A backup refused for its name alone, whose signed manifest names a backup in the catalog, is that backup:
    a restore is not blocked by it, starts from the original, and names the copy it passed over."""
    newer = group.id[:-6] + "ffffff"
    newer = newer.replace(newer.split("-")[1], "29991231T235959Z")
    shutil.copytree(group.path, group.backups / S / newer)
    restored = group.cfrestore("--json")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["backup_id"] == group.id and group.bodies() == SURVIVORS
    assert f"passes over backup {newer}: a copy of backup {group.id} under a newer name" in restored.stderr


def test_no_backup_key_no_backup_and_no_restore(group: Group, tmp_path: Path) -> None:
    empty = private_dir(tmp_path / "no-key")
    define_group(group.url, queues=("Q1",))
    for result in (group.cfbackup("run", S, CFEMU_SECRETS_DIR=str(empty)),
                   group.cfbackup("verify", group.id, CFEMU_SECRETS_DIR=str(empty)),
                   group.cfrestore("--mark-failed", CFEMU_SECRETS_DIR=str(empty))):
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "no backup key" in result.stderr and "cfemu secrets init" in result.stderr, result.stderr
    assert [p.name for p in (group.backups / S).iterdir() if p.is_dir()] == [group.id], "no backup was written"
    assert group.client.hget(keys.meta(S), "state") == b"ACTIVE", "the refused restore changed nothing"


# --- backups from before signing ----------------------------------------------------------------------------------
def test_an_unsigned_backup_is_refused_unless_the_operator_accepts_it(group: Group) -> None:
    """A backup as the code before signing wrote it (format 1, an unkeyed checksum): refused, naming the file and
    the override; with --accept-unsigned it is used, and that is logged."""
    m = {k: v for k, v in group.manifest().items() if k != "signature"}
    m["format"] = 1
    m["files"] = sha256_files(group, m)
    m["checksum"] = old_checksum(m)
    group.write_manifest(m)
    check_refused(group, "not signed", "--accept-unsigned")

    ok = group.cfbackup("verify", group.id, "--accept-unsigned")
    assert ok.returncode == 0 and "UNSIGNED" in ok.stdout, ok.stderr
    assert f"backup {group.id} is unsigned" in ok.stderr and "--accept-unsigned" in ok.stderr, ok.stderr
    restored = group.cfrestore("--accept-unsigned", "--json")
    assert restored.returncode == 0, restored.stderr
    assert f"backup {group.id} is unsigned" in restored.stderr
    assert group.bodies() == SURVIVORS

    # Adopted once checked: signed with the group's key, it needs no override any more.
    assert group.cfbackup("sign", group.id).returncode == 2
    signed = group.cfbackup("sign", group.id, "--accept-unsigned")
    assert signed.returncode == 0, signed.stderr
    assert group.cfbackup("verify", group.id).returncode == 0


def test_a_signature_removed_from_a_signed_manifest_is_refused_even_with_the_override(group: Group) -> None:
    m = {k: v for k, v in group.manifest().items() if k != "signature"}
    m["replay_from"] = int(m["end_lrsn"]) + 10**12
    m["checksum"] = old_checksum(m)
    group.write_manifest(m)
    group.refused(group.cfbackup("verify", group.id, "--accept-unsigned"), group.manifest_path,
                  "without its signature (removed)")
    group.refused(group.cfrestore("--accept-unsigned"), group.manifest_path, "without its signature (removed)")
    group.nothing_restored()


# --- the digest of the entry files ----------------------------------------------------------------------------------
def test_a_backup_of_format_2_with_sha256_digests_still_verifies_restores_and_signs_again(group: Group) -> None:
    """Backups taken before format 3 carry SHA-256 digests in a format 2 manifest: read as they are; signing one
    again keeps its format and digests."""
    m = group.manifest()
    m["files"] = sha256_files(group, m)
    old = sign_manifest(m, group_key())
    assert old["format"] == 2
    group.write_manifest(old)
    ok = group.cfbackup("verify", group.id)
    assert ok.returncode == 0 and "its signature (key " in ok.stdout, ok.stderr
    assert group.cfbackup("sign", group.id).returncode == 0
    again = group.manifest()
    assert again["format"] == 2 and all("sha256" in f and "blake3" not in f for f in again["files"])
    restored = group.cfrestore("--json")
    assert restored.returncode == 0, restored.stderr
    assert group.bodies() == SURVIVORS


@pytest.mark.parametrize("fmt,digest", [(3, "sha256"), (2, "blake3")])
def test_a_manifest_whose_digests_are_not_its_formats_is_refused(group: Group, fmt: int, digest: str) -> None:
    """Signed by the group's key (an insider, or a tool's bug), a manifest whose files carry another digest than
    its format names is refused before any entry file is read, naming both."""
    m = {k: v for k, v in group.manifest().items() if k != "signature"}
    m["format"] = fmt
    if digest == "sha256":
        m["files"] = sha256_files(group, m)
    key = group_key()
    m["signature"] = {"alg": "hmac-sha256", "key": credentials.key_id(key), "mac": manifest_mac(m, key)}
    group.write_manifest(m)
    other = "blake3" if digest == "sha256" else "sha256"
    check_refused(group, f"has a {digest} digest; a format {fmt} manifest's files have {other}")


def test_a_file_record_with_two_digests_is_refused(group: Group) -> None:
    m = group.manifest()
    m["files"][0]["sha256"] = "0" * 64
    forge(group, {"files": m["files"]})
    check_refused(group, "bad digest for entries-0001.bin")
